"""Multi-process training on localhost: two processes of 4 CPU devices each (gloo collectives through
jax.distributed) train exactly as one process of 8 devices, and checkpoints move between the two layouts."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import CHEAP_COMPILE_FLAGS
from flax import nnx

from mot_jax import multihost
from mot_jax.errors import MotJaxError
from mot_jax.models import tiny
from mot_jax.paths import as_path
from mot_jax.training import data
from mot_jax.training.checkpoint import Checkpoints
from mot_jax.training.trained import load_trained

ROOT = Path(__file__).resolve().parents[1]
# The tiny quickstart over all 8 devices (a batch row each); validation and a checkpoint at the last step only.
# Adam's first steps are lr * g / |g|: for a gradient that is ~0 the all-reduce's summation order (gloo across
# processes, XLA within one) decides the sign; a large eps makes the update ~ lr * g (as test_trainer.py does).
FLAGS = [
    "--config=configs/quickstart.py:replay,tiny",
    "--config.mesh.data=-1",
    "--config.batch_size=8",
    "--config.grad_accum=1",
    "--config.eval_batches=1",
    "--config.final_eval_batches=1",
    "--config.eval_every=100",
    "--config.checkpoint_every=100",
    "--config.optim.learning_rate=0.1",
    "--config.optim.eps=1.0",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run(processes: int, workdirs: list, steps: int, cache: Path) -> tuple[list[int], list[str]]:
    """`python -m mot_jax.train` as `processes` processes sharing 8 CPU devices, process i in `workdirs[i]`; returns
    their exit codes and outputs."""
    env = os.environ | dict(
        # the cheaper XLA compiles of conftest.py (both layouts compile alike)
        XLA_FLAGS=" ".join((f"--xla_force_host_platform_device_count={8 // processes}", *CHEAP_COMPILE_FLAGS)),
        JAX_PLATFORMS="cpu",
        JAX_DEFAULT_MATMUL_PRECISION="highest",  # as conftest.py
        JAX_COMPILATION_CACHE_DIR=str(cache),  # the resumed runs reuse the first runs' programs
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    coordinator = [f"--coordinator_address=localhost:{free_port()}", f"--num_processes={processes}"]
    commands = [
        [sys.executable, "-m", "mot_jax.train", *FLAGS, f"--workdir={workdirs[i]}", f"--config.steps={steps}"]
        + (coordinator + [f"--process_id={i}"] if processes > 1 else [])
        for i in range(processes)
    ]
    logs = [Path(f"{workdirs[i]}.{steps}.{processes}.{i}.log") for i in range(processes)]
    return run_together(commands, env, logs, timeout=900)


def run_together(commands: list, env: dict, logs: list, timeout: float) -> tuple[list[int], list[str]]:
    """Start the commands at once, each writing its output to its log file (a file: no pipe fills up), and wait for
    all; returns their exit codes and outputs. One still running after `timeout` seconds fails the test (and is
    killed, like any left running)."""
    runs = []
    try:
        for command, path in zip(commands, logs, strict=True):
            with open(path, "w") as log:
                runs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [r.wait(timeout=timeout) for r in runs]
    finally:
        for r in runs:
            if r.poll() is None:
                r.kill()
    return codes, [Path(path).read_text() for path in logs]


def before_dump(log: str) -> str:
    """A failed process's output up to the thread dump that a fatal signal prints (where the cause is): the dump's
    header line, and the output before it."""
    head, fatal, _ = log.partition("Fatal Python error")
    return head[-2500:] + (fatal + _.splitlines()[0] if fatal else "")


def train(workdir, steps: int, processes: int, cache: Path) -> list[str]:
    codes, logs = run(processes, [workdir] * processes, steps, cache)
    # every process's output: one process's fault aborts the others, whose own output then holds only their dumps
    report = "\n".join(
        f"--- process {i}, exit {code}:\n{before_dump(log)}" for i, (code, log) in enumerate(zip(codes, logs))
    )
    assert codes == [0] * processes, report
    return logs


def params(workdir) -> list[np.ndarray]:
    """The translator parameters of the latest checkpoint, read as export and evaluation read them."""
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(load_trained(workdir).translator, nnx.Param))]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_two_processes_train_as_one_and_checkpoints_move_between_them(tmp_path):
    pair, single, cache = tmp_path / "pair", tmp_path / "single", tmp_path / "jax_cache"
    logs = train(pair, 3, processes=2, cache=cache)
    train(single, 3, processes=1, cache=cache)
    assert "step 3/3" in logs[0] and "step 3/3" not in logs[1]  # process 0 logs for both
    assert len(list((pair / "tensorboard").iterdir())) == 1 and (pair / "summary.json").is_file()
    pair_3 = params(pair)
    assert_same(pair_3, params(single))

    # two more steps (the last step of a schedule has learning rate 0), each workdir resumed by the other layout
    assert "Resumed from step 3" in train(pair, 5, processes=1, cache=cache)[0]
    assert "Resumed from step 3" in train(single, 5, processes=2, cache=cache)[0]
    assert_same(params(pair), params(single))
    assert not all(np.array_equal(x, y) for x, y in zip(pair_3, params(pair)))


# Each process saves its rows of a sharded array to the last and the best checkpoint of the same steps at once.
SAVE_BOTH = """
import sys, jax, numpy as np
from etils import epath
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
from mot_jax.training.checkpoint import Checkpoints
sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(jax.devices(), ("data",)), jax.sharding.PartitionSpec("data"))
checkpoints = Checkpoints(epath.Path(sys.argv[3]), 2)
for step in (1, 2, 3):
    w = jax.make_array_from_callback((8, 16), sharding, lambda i: np.arange(128.0).reshape(8, 16)[i] * step)
    checkpoints.save(step, dict(w=w), dict.fromkeys(("channel_map", "identity", "config"), 0), best=True)
checkpoints.close()
"""


def test_two_processes_save_the_last_and_the_best_checkpoint_of_a_step_at_once(tmp_path):
    env = os.environ | dict(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    address = f"localhost:{free_port()}"
    commands = [[sys.executable, "-c", SAVE_BOTH, address, str(i), str(tmp_path / "run")] for i in range(2)]
    # the processes hung in Orbax's barriers before (until JAX's 300 s shutdown timeout)
    codes, outputs = run_together(commands, env, [tmp_path / f"{i}.log" for i in range(2)], timeout=120)
    assert codes == [0, 0], "\n".join(before_dump(o) for o in outputs)
    checkpoints = Checkpoints(as_path(tmp_path / "run"), 2, create=False)
    state = dict(w=jax.numpy.zeros((8, 16)))
    for which in ("last", "best"):
        restored = checkpoints.restore(state, 3, which)["w"]
        np.testing.assert_array_equal(np.asarray(restored), np.arange(128.0).reshape(8, 16) * 3)
    checkpoints.close()


def test_processes_that_see_different_workdirs_stop_with_the_reason(tmp_path):
    """As hosts whose workdir is on their own local disk: Orbax could not write one checkpoint there."""
    codes, logs = run(2, [tmp_path / "host0", tmp_path / "host1"], 3, tmp_path / "jax_cache")
    assert codes == [2, 2], logs
    assert "Processes [1] do not see the workdir" in logs[0] and "shared file system or a gs://" in logs[1]


def test_a_single_process_stays_single_and_bad_coordinates_are_explained(monkeypatch):
    for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES"):
        monkeypatch.delenv(name, raising=False)
    assert multihost.initialize() is False and multihost.initialize(num_processes=1) is False
    assert multihost.initialize(coordinator_address="localhost:1", force=False) is False
    with pytest.raises(MotJaxError, match="Could not join the multi-process run .* --num_processes=N"):
        multihost.initialize(coordinator_address="localhost:1")  # no process count, and no cluster to ask
    slurm = dict.fromkeys(multihost.SLURM_VARS, "0") | dict(SLURM_NTASKS="4")
    assert multihost.detected_cluster(slurm) == "slurm"
    assert multihost.detected_cluster(slurm | dict(SLURM_NTASKS="1")) is None
    assert multihost.detected_cluster(dict(OMPI_COMM_WORLD_SIZE="2")) == "openmpi"


@pytest.mark.devices(8)
def test_local_rows_of_one_process_are_the_whole_batch():
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "expert"))
    assert multihost.local_rows(mesh, 8) == slice(0, 8)


def test_a_process_builds_exactly_its_rows_of_each_global_batch():
    target, source = tiny.tokenizer(448), tiny.tokenizer(416)  # two tiny families: a real alignment
    chunks = np.random.default_rng(0).integers(3, 448, (20, 16), dtype=np.int32)
    kwargs = dict(source_tokenizer=source, target_tokenizer=target, source_length=200, prefix_tokens=8)
    whole, mine = (data.Batches(chunks, 8, 0, **kwargs, rows=rows) for rows in (slice(None), slice(4, 8)))
    for position in (0, 2):  # batch 2 crosses into the second epoch
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[4:8], b), whole.batch(position), mine.batch(position))
    whole, mine = (data.validation_batches(chunks, 8, **kwargs, rows=rows) for rows in (slice(None), slice(4, 8)))
    assert len(whole) == len(mine) == 2
    for a, b in zip(whole, mine):
        jax.tree.map(lambda x, y: np.testing.assert_array_equal(x[4:8], y), a, b)
