"""`python -m mot_jax.train` as users run it: configs, resume after SIGKILL, checkpoints and errors."""

import json
import shutil
import signal
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import ROOT, load_config, run_cli

from mot_jax.errors import MotJaxError
from mot_jax.training import config as config_lib
from mot_jax.training import loop

CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.py"))


def final_params(workdir, step):
    state = ocp.StandardCheckpointer().restore(Path(workdir) / "checkpoints" / str(step) / "state")
    return jax.tree.leaves(state["params"])


@pytest.mark.slow
def test_sigkill_mid_training_then_restart_equals_uninterrupted_run(tmp_path):
    flags = ["--config.steps=6", "--config.checkpoint_every=2", "--config.eval_every=2"]
    whole = run_cli(tmp_path / "whole", *flags)
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = run_cli(tmp_path / "resumed", *flags, kill_at_step=5)
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "resumed" / "checkpoints" / "6").exists()
    resumed = run_cli(tmp_path / "resumed", *flags)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resumed from step" in resumed.stderr
    for a, b in zip(final_params(tmp_path / "whole", 6), final_params(tmp_path / "resumed", 6), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["steps"] == 6 and (tmp_path / "resumed" / "tensorboard").is_dir()


# every config at :tiny, the quickstart's replay run, and the other runs of the results config (direct, reverse, the
# baselines)
RUNS = [(n, "tiny") for n in CONFIGS] + [
    ("quickstart.py", "replay,tiny"),
    ("smollm2_gemma3.py", "direct,reverse,tiny"),
    ("smollm2_gemma3.py", "single,tiny"),
    ("smollm2_gemma3.py", "direct,projector,tiny"),
    ("smollm2_gemma3.py", "direct,skip,tiny"),
    ("qwen_coder.py", "reverse,tiny"),
    ("qwen_coder.py", "questions,tiny"),
]


@pytest.mark.parametrize(
    "name,arg", [pytest.param(*r, marks=() if r[0] == "quickstart.py" else pytest.mark.slow) for r in RUNS]
)
def test_every_config_runs_two_tiny_steps(name, arg, tmp_path, request):
    config = load_config(name, arg, steps=2, eval_every=2, checkpoint_every=2)
    if (name, arg) == ("quickstart.py", "replay,tiny"):  # the session's shared run (conftest.tiny_run) is this run
        assert config == load_config(steps=2)
        workdir, summary = request.getfixturevalue("tiny_run")
    else:
        workdir, summary = tmp_path, loop.train_and_evaluate(config, tmp_path)
    assert summary["steps"] == 2 and np.isfinite(summary["final_validation"]["loss"])
    assert (workdir / "checkpoints" / "2").is_dir() and (workdir / "best" / "2").is_dir()
    if config.translator.channels.mode == "depth_ratio" and config.translator.mode == "replay":
        search = json.loads((workdir / "channel_search.json").read_text())
        assert search["scores"] and search["chosen"]["target"]


def test_bad_config_key_or_file_fails_in_one_line(tmp_path):
    result = run_cli(tmp_path, "--config.no_such_key=1")
    assert result.returncode == 2 and "error: the config has no key no_such_key" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_config_argument_and_model_name(tmp_path):
    with pytest.raises(MotJaxError, match="Unknown config argument"):
        load_config(arg="huge")
    with pytest.raises(MotJaxError, match="Bad config argument 'replay,direct'"):
        load_config("smollm2_gemma3.py", arg="replay,direct")
    config = load_config("smollm2_gemma3.py", arg="direct,reverse,single")
    assert (config.source, config.target, config.translator.mode) == ("gemma3-270m", "smollm2-135m", "direct")
    assert config.translator.num_experts == 1
    with pytest.raises(MotJaxError, match="Unknown tiny model"):
        loop.train_and_evaluate(load_config(source="random:nope"), tmp_path)
    with pytest.raises(MotJaxError, match="neither a local directory nor downloadable"):
        loop.train_and_evaluate(load_config(target="no-such-org/no-such-model"), tmp_path)


def test_workdir_of_another_experiment_is_refused(tiny_run, tmp_path):
    workdir = shutil.copytree(tiny_run[0], tmp_path / "run")  # load_config(steps=2) trained there
    with pytest.raises(MotJaxError, match=r"another experiment \(it differs in: translator\)"):
        loop.train_and_evaluate(load_config(steps=4, **{"translator.dim": 48}), workdir)
    with pytest.raises(
        MotJaxError, match=f"^{workdir} is at step 2, past --config.steps=1; pass --config.steps above 2"
    ):
        loop.train_and_evaluate(load_config(steps=1), workdir)
    meta_file = workdir / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta["identity"]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(MotJaxError, match=r"step 2 .* cannot be read \(its meta has no identity: written by another"):
        loop.train_and_evaluate(load_config(steps=4), workdir)


def test_corrupt_checkpoint_is_refused(tiny_run, tmp_path):
    workdir = shutil.copytree(tiny_run[0], tmp_path / "run")  # load_config(steps=2) trained there
    for f in (workdir / "checkpoints" / "2" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    with pytest.raises(MotJaxError, match="cannot be read"):
        loop.train_and_evaluate(load_config(steps=4), workdir)


GPU_CONFIGS = [n for n in CONFIGS if "GPU_STEPS" in (ROOT / "configs" / n).read_text()]


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_sized_steps_are_valid_and_stated_in_the_readme(name):
    readme = (ROOT / "configs" / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith(f"| `{name}` |") and " x " in line)
    for arg in ("gpu1", "gpu8"):
        c = load_config(name, arg)
        config_lib.check(c)
        assert c.dtype == "bfloat16" and c.data.prefix_tokens < c.data.total_tokens
        devices = 1 if arg == "gpu1" else 8
        assert c.batch_size % (devices // c.mesh.expert) == 0  # the data axis splits the batch
        tokens = c.batch_size * c.grad_accum * c.data.total_tokens
        assert f"{c.batch_size} x {c.grad_accum} x {c.data.total_tokens:,}" in row and f"{tokens:,}" in row, row
