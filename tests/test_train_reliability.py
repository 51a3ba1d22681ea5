"""Training runs that go wrong: bad counts, a busy workdir, a diverging run, a full disk, Ctrl-C; each stops in one
line and keeps only checkpoints that are good."""

import collections
import errno
import gc
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from helpers import (
    ROOT,
    TINY_FLAGS,
    load_config,
    one_device_command_env,
    run_cli,
    sharing_jitted_steps,
    whole_and_resumed,
)
from orbax.checkpoint._src.handlers import json_checkpoint_handler

from mot_jax.cli import run_or_exit
from mot_jax.errors import Interrupted, MotJaxError
from mot_jax.locks import file_lock
from mot_jax.paths import as_path
from mot_jax.training import config as config_lib
from mot_jax.training import loop, optim
from mot_jax.training.checkpoint import Checkpoints
from mot_jax.training.report import Logger

FAST = {"translator.channels.mode": "terminal"}  # no channel search: one trainer per run


@pytest.mark.parametrize(
    "key,value,least",
    [
        ("batch_size", -2, 1),
        ("batch_size", 0, 1),
        ("grad_accum", 0, 1),
        ("steps", -5, 1),
        ("checkpoint_every", 0, 1),
        ("data.train_chunks", -1, 0),  # would drop the table's last chunk
        ("translator.heads", 0, 1),  # these three divided by zero
        ("translator.dim", 0, 1),
        ("translator.shared_slots", 0, 1),
        ("translator.receiver_rank", -1, 0),  # was refused only once both models had loaded
        ("data.source_length", 0, 1),
        ("optim.warmup_steps", -1, 0),
    ],
)
def test_bad_counts_are_refused_before_anything_is_written(tmp_path, key, value, least):
    with pytest.raises(MotJaxError, match=rf"^{key}={value} must be a whole number of at least {least}; pass "):
        loop.train_and_evaluate(load_config(**{key: value}), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_another_kinds_field_is_refused_before_anything_is_written(tmp_path):
    """LSC's shared_slots means nothing for a linear translator: one line naming the field and its kind, not a run
    that silently ignores it."""
    config = load_config(**{"translator.kind": "linear", "translator.linear_skip": True, "translator.shared_slots": 64})
    with pytest.raises(MotJaxError, match=r"^translator.shared_slots=64 is kind='lsc''s and means nothing for "):
        loop.train_and_evaluate(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["loss.ce_weight", "loss.distill_weight", "loss.attention_weight"])
def test_negative_loss_weights_are_refused(tmp_path, key):
    # a negative weight trains the translator to make that term larger
    with pytest.raises(MotJaxError, match=rf"^{key}=-0.5 must be a finite number of at least 0; pass --config.{key}="):
        loop.train_and_evaluate(load_config(**{key: -0.5}), tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "key,value,needs",
    [
        ("optim.learning_rate", math.inf, "a finite number of at least 0"),  # config.json held a bare Infinity
        ("optim.learning_rate", math.nan, "a finite number of at least 0"),
        ("optim.learning_rate", -1e-4, "a finite number of at least 0"),  # would climb the loss
        ("optim.weight_decay", -0.01, "a finite number of at least 0"),
        ("optim.weight_decay", math.inf, "a finite number of at least 0"),
        ("optim.b1", 1.0, "at least 0 and below 1"),  # Adam's bias correction divides by 1 - b^t
        ("optim.b2", -0.5, "at least 0 and below 1"),
        ("optim.eps", 0.0, "above 0 and finite"),  # a parameter with no gradient divides 0 by 0
        ("optim.clip_norm", 0.0, "above 0 and finite (a large norm clips nothing)"),  # every update scaled to 0
        ("optim.clip_norm", math.nan, "above 0 and finite (a large norm clips nothing)"),
        ("data.question_fraction", 1.5, "a share from 0 to 1"),
        ("data.copy_fraction", -0.1, "a share from 0 to 1"),
        ("translator.channels.ratio", 0.0, "a share of the layers above 0 and at most 1"),
        ("translator.channels.max_ratio", 2.0, "a share of the layers above 0 and at most 1"),
        ("translator.capacity_factor", math.inf, "above 0 and finite"),  # the dispatch's OverflowError
        ("translator.capacity_factor", 0.0, "above 0 and finite"),
    ],
)
def test_values_out_of_their_range_are_refused_before_anything_is_written(tmp_path, key, value, needs):
    default = config_lib.lookup(config_lib.base(), key)
    message = f"{key}={value!r} must be {needs}; pass --config.{key}=X, e.g. the default {default!r}."
    with pytest.raises(MotJaxError, match=f"^{re.escape(message)}$"):
        loop.train_and_evaluate(load_config(**{key: value}), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_holding_out_every_fit_batch_is_refused(tmp_path):
    config = load_config(**{"translator.skip_fit_batches": 4, "translator.skip_ridge_held_out": 4})
    with pytest.raises(MotJaxError, match=r"^translator.skip_ridge_held_out=4 leaves none of .*skip_fit_batches=4 "):
        loop.train_and_evaluate(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_chunks_that_do_not_fit_the_models_are_refused_before_anything_is_written(tmp_path):
    """gpt2's learned position table (512 rows in the tiny model) was read past its end, silently."""
    longer = {"data.total_tokens": 1024, "data.prefix_tokens": 512, "data.source_length": 512}
    with pytest.raises(MotJaxError, match=r"^data.total_tokens=1024 is more than the target's 512 positions; pass "):
        loop.train_and_evaluate(load_config("gpt2_gpt2.py", "tiny", **longer), tmp_path / "run")
    with pytest.raises(MotJaxError, match=r"^data.prefix_tokens=32 does not fit data.total_tokens=32; pass 2 <= "):
        loop.train_and_evaluate(load_config(**{"data.prefix_tokens": 32}), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_an_empty_workdir_is_refused_not_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for workdir in ("", " "):
        with pytest.raises(MotJaxError, match="^--workdir is empty; pass --workdir=DIR"):
            loop.train_and_evaluate(load_config(), workdir)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "flags,reason",
    [
        (["--config.batch_size=-2"], "batch_size=-2 must be a whole number of at least 1"),
        (["--config.grad_accum=0"], "grad_accum=0 must be a whole number of at least 1"),
        (["--config.optim.learning_rate=inf"], "optim.learning_rate=inf must be a finite number of at least 0"),
        (["--config=configs/nope.py"], "the config file configs/nope.py does not exist"),
        (["foo"], "unexpected argument 'foo'; pass options as --name=value (--help lists them)."),  # absl's usage
    ],
)
def test_bad_input_on_the_command_line_is_one_line(tmp_path, flags, reason):
    result = run_cli(tmp_path / "run", *flags)  # a later --config replaces the tiny one
    # absl's error lines start with E and the date; the one line we print starts with "error: "
    errors = [line for line in result.stderr.splitlines() if line.startswith(("E", "error"))]
    assert result.returncode == 2 and len(errors) == 1 and errors[0].startswith(f"error: {reason}"), errors
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "command,said",
    [
        (["mot_jax.export", "--workdir=w"], "flag --out=None: Flag --out must have a value other than None."),
        (["mot_jax.convert"], "--model is required: an embedded model name, a .gguf file, a hub id or a directory"),
    ],
)
def test_a_missing_flag_of_export_or_convert_is_one_line(tmp_path, command, said):
    """absl printed a FATAL line and a pointer to the help (export), or the whole usage (convert), and exited 1."""
    result = subprocess.run([sys.executable, "-m", *command], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {said}"), lines
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "returned,arg,overrides,said",
    [
        ("5", ":tiny", ["--config.steps=3"], "get_config('tiny') of the config file {file} returned int 5, not an "),
        ("None", "", [], "get_config() of the config file {file} returned None, not an ml_collections.ConfigDict; "),
        ("dict(steps=3)", "", [], "get_config() of the config file {file} returned dict {{'steps': 3}}, not an "),
    ],
)
def test_a_config_file_whose_get_config_returns_no_config_is_one_line(tmp_path, returned, arg, overrides, said):
    """It said the config has no key "int object has no attribute to_dict" (or that --config was not given, after
    ml_collections' warning)."""
    file = tmp_path / "mine.py"
    file.write_text(f"def get_config(arg=None):\n    return {returned}\n")
    result = run_cli(tmp_path / "run", f"--config={file}{arg}", *overrides)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {said.format(file=file)}"), lines
    assert (
        lines[0].endswith(
            "return the config (the files in configs/ start it from base() in mot_jax/training/config.py)."
        )
        and not (tmp_path / "run").exists()
    )


@pytest.mark.parametrize(
    "variable,value,reason",
    [
        ("JAX_NUM_PROCESSES", "abc", "JAX_NUM_PROCESSES='abc' is not a whole number"),
        ("OMPI_COMM_WORLD_SIZE", "abc", "OMPI_COMM_WORLD_SIZE='abc' is not a whole number"),
        ("HOME", "{file}/home", "Cannot write the lock file {file}/home/.cache/mot_jax/"),  # an empty MOT_JAX_CACHE
        (None, None, "Cannot make the workdir {file}"),  # --workdir naming a file
    ],
)
def test_a_bad_environment_or_workdir_is_one_line_not_a_traceback(tmp_path, monkeypatch, variable, value, reason):
    """Each gave a traceback (FileExistsError, an OSError from the cache's lock, ValueError from int())."""
    file = tmp_path / "file"
    file.write_text("data")
    monkeypatch.setenv("MOT_JAX_CACHE", "")
    if variable:
        monkeypatch.setenv(variable, value.format(file=file))
    result = run_cli(tmp_path / "run" if variable else file)
    errors = [line for line in result.stderr.splitlines() if line.startswith(("E", "error"))]
    assert result.returncode == 2 and errors == [line for line in errors if line.startswith("error: ")], errors
    assert len(errors) == 1 and errors[0].startswith(f"error: {reason.format(file=file)}"), errors
    assert "Traceback" not in result.stderr and file.read_text() == "data" and not (tmp_path / "run").exists()


def test_a_busy_workdir_is_refused(tmp_path, monkeypatch):
    with file_lock(tmp_path / ".lock"):  # as another run holds it
        with pytest.raises(MotJaxError, match=f"^Another training run is using {tmp_path};"):
            loop.train_and_evaluate(load_config(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]
    # the processes of one multi-process run each hold their own lock: they never refuse each other
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with loop.workdir_lock(as_path(tmp_path)), pytest.raises(MotJaxError, match="Another training run"):
        with loop.workdir_lock(as_path(tmp_path)):
            pass
    with file_lock(tmp_path / ".lock", busy="process 0's lock is taken"), loop.workdir_lock(as_path(tmp_path)):
        pass


def checkpoint_losses(trainer, workdir, validation) -> dict:
    """The validation loss of every checkpoint kept in `workdir`, recomputed from its restored state."""
    checkpoints = Checkpoints(as_path(workdir), 3)
    losses = {}
    for step in checkpoints.last.all_steps():
        trainer.state = checkpoints.restore(trainer.state, step)
        losses[step] = trainer.evaluate(validation)["loss"]
    checkpoints.close()
    return losses


def recording(monkeypatch):
    """Keeps the run's trainer and validation batches for the test to check its checkpoints with."""
    seen = {}

    class Recorded(loop.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen["trainer"] = self

    make_datasets = loop.make_datasets
    monkeypatch.setattr(loop, "Trainer", Recorded)
    monkeypatch.setattr(loop, "make_datasets", lambda *a: seen.setdefault("datasets", make_datasets(*a)))
    return seen


@pytest.mark.parametrize(
    "every,bad",
    [
        (dict(checkpoint_every=1), "validation loss became nan after the update at step 3"),
        # the metrics read back every 4 steps: the saves at step 2 and 4 read them first
        (dict(checkpoint_every=2, eval_every=4, log_every=4), "loss became nan at step 4"),
    ],
)
def test_a_diverging_run_keeps_only_finite_checkpoints_and_names_the_last(tmp_path, monkeypatch, every, bad):
    # a sane rate for two updates, then a huge one: the loss of step 3 is still finite (it is computed before the
    # update), the parameters after it are not usable
    monkeypatch.setattr(optim, "warmup_cosine", lambda *a: lambda count: jnp.where(count < 2, 1e-3, 1e30))
    seen = recording(monkeypatch)
    config = load_config(steps=4, **every, **FAST)
    with pytest.raises(
        MotJaxError, match=rf"{bad} \(non-finite\); stopped, the last good checkpoint is step (\d)"
    ) as e:
        loop.train_and_evaluate(config, tmp_path)
    named = int(str(e.value).split("last good checkpoint is step ")[1].split(" ")[0])
    losses = checkpoint_losses(seen["trainer"], tmp_path, seen["datasets"].validation[: config.eval_batches])
    assert losses and all(math.isfinite(v) for v in losses.values()), losses
    assert named == max(losses) == 2, (str(e.value), losses)


def test_an_interrupt_never_checkpoints_a_non_finite_state(tmp_path, monkeypatch):
    """Ctrl-C while the loop logs a step read back before the later steps' finiteness is checked: a state whose
    optimizer moments overflowed (squared gradients past float32's range) still gives a finite loss, so checking
    the loss alone saved it, and a resume from it fails at once. The state itself is checked before any save."""
    seen = recording(monkeypatch)
    logged = loop.Logger.step

    def overflowed_then_interrupted(self, step, *args):
        logged(self, step, *args)
        trainer = seen["trainer"]
        overflow = lambda x: x * jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else x
        trainer.state = dict(trainer.state, opt_state=jax.tree.map(overflow, trainer.state["opt_state"]))
        raise KeyboardInterrupt

    monkeypatch.setattr(loop.Logger, "step", overflowed_then_interrupted)
    with pytest.raises(Interrupted, match="after step 1; no checkpoint was written"):
        loop.train_and_evaluate(load_config(steps=2, **FAST), tmp_path)
    assert Checkpoints(as_path(tmp_path), 3, create=False).latest_step() is None


def disk_full_after(saves: int, monkeypatch, calls: dict):
    """Orbax's JSON writes (every checkpoint's meta) fail with ENOSPC after the first `saves`."""
    save = json_checkpoint_handler.JsonCheckpointHandler._save_fn

    async def failing(self, x, directory):
        calls["save"] = calls.get("save", 0) + 1
        if calls["save"] > saves:
            raise OSError(errno.ENOSPC, "No space left on device")
        return await save(self, x, directory)

    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", failing)


DISK_FULL = r"failed \(OSError: \[Errno 28\] No space left on device\); stopped, the last checkpoint is step 1"


def test_a_failed_background_save_is_one_error_naming_the_last_checkpoint(tmp_path, monkeypatch):
    disk_full_after(1, monkeypatch, {})
    checkpoints = Checkpoints(as_path(tmp_path), 3)
    state = dict(w=jnp.ones(3))
    checkpoints.save(1, state, dict(step=1))
    checkpoints.save(2, state, dict(step=2))  # fails in the background
    with pytest.raises(MotJaxError, match=DISK_FULL):
        checkpoints.close()
    assert Checkpoints(as_path(tmp_path), 3).latest_step() == 1


def tensorboard_scalars(folder) -> list:
    """(tag, step, value) of every scalar in the event files under `folder`, read record by record (length, its CRC,
    the Event proto, its CRC) with tensorboardX's proto alone."""
    from tensorboardX.proto.event_pb2 import Event

    found = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            length = int.from_bytes(data[at : at + 8], "little")
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            found += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return found


def test_tensorboard_curves_are_written_and_a_failing_disk_stops_them_with_one_warning(tmp_path, monkeypatch, caplog):
    from tensorboardX import record_writer

    logger = Logger(as_path(tmp_path), total=9, start=0, tokens_per_step=8, log_every=2)
    for step in (1, 2):
        logger.scalars(step, dict(loss=10.0 / step), "train")
    logger.scalars(2, dict(loss=4.5), "validation")
    assert tensorboard_scalars(tmp_path / "tensorboard") == [
        ("train/loss", 1, 10.0),
        ("train/loss", 2, 5.0),
        ("validation/loss", 2, 4.5),
    ]
    write = record_writer.RecordWriter.write
    monkeypatch.setattr(record_writer.RecordWriter, "write", lambda *a: os_error(errno.ENOSPC))
    threads = threading.active_count()
    for step in (3, 4):
        logger.scalars(step, dict(loss=1.0), "train")
    logger.close()
    monkeypatch.setattr(record_writer.RecordWriter, "write", write)
    stopped = [r.getMessage() for r in caplog.records if "TensorBoard" in r.getMessage()]
    assert stopped == [
        "TensorBoard curves stopped at step 3 ([Errno 28] No space left on device); the run goes on without them."
    ]
    assert threading.active_count() == threads  # nothing left writing in the background


def os_error(number):
    raise OSError(number, os.strerror(number))


def test_a_truncated_checkpoint_array_is_one_line_naming_the_storage_error(tmp_path, monkeypatch):
    """The line quotes TensorStore's cause (not Orbax's wrapper, whose text ends in a pybind repr), and the reads of
    the other arrays, failing alike as they are collected, print nothing."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    checkpoints = Checkpoints(as_path(tmp_path), 3)
    state = {f"w{i}": jnp.arange(4096.0) + i for i in range(8)}
    checkpoints.save(1, state, dict(step=1))
    checkpoints.close()
    data = max((p for p in (tmp_path / "checkpoints" / "1" / "state").rglob("*") if p.is_file()), key=os.path.getsize)
    os.truncate(data, 100)
    with pytest.raises(MotJaxError) as raised:
        Checkpoints(as_path(tmp_path), 3).restore(state)
    assert re.fullmatch(
        r"The checkpoint of step 1 in \S+ cannot be read \(ValueError: OUT_OF_RANGE: .* is not valid for value of size "
        r"100\); delete that step's folder to fall back to an earlier one, or use a new --workdir.",
        str(raised.value),
    )
    del raised
    gc.collect()
    assert not [u for u in unraisable if "_read_array" in getattr(u.object, "__qualname__", "")]


def test_a_failed_save_of_the_last_and_the_best_checkpoint_is_one_line_error(tmp_path, monkeypatch):
    """Both managers' background saves fail (a step that is also the best so far): closing says so in one line, and
    Orbax raising a save's OSError again as its threads stop stays silent (it used to replace the error)."""
    disk_full_after(2, monkeypatch, {})
    checkpoints = Checkpoints(as_path(tmp_path), 3)
    state = dict(w=jnp.ones(3))
    checkpoints.save(1, state, dict(step=1), best=True)
    checkpoints.save(2, state, dict(step=2), best=True)  # both fail in the background
    with pytest.raises(MotJaxError, match=DISK_FULL):
        checkpoints.close()


@pytest.mark.slow
def test_a_failed_save_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    calls, step = {"step": 0}, loop.Trainer.train_step
    disk_full_after(1, monkeypatch, calls)

    def counted(self, batches):
        calls["step"] += 1
        return step(self, batches)

    monkeypatch.setattr(loop.Trainer, "train_step", counted)
    config = load_config(steps=6, checkpoint_every=1, eval_every=6, **FAST)
    with pytest.raises(MotJaxError, match=DISK_FULL):
        loop.train_and_evaluate(config, tmp_path)
    assert calls["step"] <= 3  # the save of step 2 fails while step 3 runs, at the latest
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [1]
    checkpoints = Checkpoints(as_path(tmp_path), 3)
    assert checkpoints.read_meta(1)["step"] == 1
    checkpoints.close()


def saved_state(workdir, step: int):
    return ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "state")


def signalled_run(workdir, signum: int, at_call: int):
    """The tiny run of 6 steps (checkpoints every 2) that sends itself `signum` as its `at_call`-th step starts."""
    # Ctrl-C's handler as a terminal gives it: a process started in the background (nohup CMD &, as a CI runner may
    # start the tests) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it
    script = (
        "import os, signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from mot_jax.training import loop; step = loop.Trainer.train_step\n"
        "def interrupting(self, batches, calls=[0]):\n"
        "    calls[0] += 1\n"
        f"    if calls[0] == {at_call}: os.kill(os.getpid(), {signum})\n"
        "    return step(self, batches)\n"
        "loop.Trainer.train_step = interrupting\n"
        "from mot_jax import train; train.run()"
    )
    command = [
        sys.executable,
        "-c",
        script,
        *TINY_FLAGS,
        f"--workdir={workdir}",
        "--config.steps=6",
        "--config.checkpoint_every=2",
        "--config.translator.channels.mode=terminal",
    ]
    result = subprocess.run(
        command, cwd=ROOT, env=one_device_command_env(), capture_output=True, text=True, timeout=300
    )
    assert "Traceback" not in result.stderr and "cannot schedule" not in result.stderr, result.stderr[-2000:]
    return result, [line for line in result.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_ctrl_c_stops_in_one_line_and_exits(tmp_path):
    result, errors = signalled_run(tmp_path, signal.SIGINT, at_call=3)  # as step 3 starts: it ends and is saved
    assert result.returncode == 128 + signal.SIGINT, result.stderr[-2000:]
    assert errors == [
        f"error: interrupted after step 3; checkpointed step 3 in {tmp_path}; run the same command to resume."
    ], result.stderr[-2000:]
    assert np.isfinite(Checkpoints(as_path(tmp_path), 3).read_meta(3)["best_validation_loss"])


@pytest.mark.slow
def test_sigterm_checkpoints_where_it_stopped_says_so_and_exits(tmp_path):
    # what SLURM and TPU preemption send: like Ctrl-C, and the steps done since the last checkpoint are saved
    result, errors = signalled_run(tmp_path, signal.SIGTERM, at_call=3)  # as step 3 starts: it ends and is saved
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-2000:]
    assert errors == [
        f"error: terminated (SIGTERM) after step 3; checkpointed step 3 in {tmp_path}; run the same command to resume."
    ], result.stderr[-2000:]
    checkpoints = Checkpoints(as_path(tmp_path), 3)
    meta = checkpoints.read_meta(3)
    assert meta["data_position"] == 3 * json.loads(meta["config"])["grad_accum"]  # resumes at step 4's batches
    state = saved_state(tmp_path, 3)
    assert int(optax.tree_utils.tree_get_all_with_path(state["opt_state"], "count")[0][1]) == 3  # 3 updates
    checkpoints.close()


def sigterm_at(monkeypatch, where: str, call: int):
    """Patches that send this process SIGTERM at the `call`-th time the run reaches `where`: "compile" (as a step is
    dispatched: the first compiles), "step" (while a step holds the state it was handed), "validation" or "save"
    (as a validation or a save during the steps begins)."""
    counts, training = collections.Counter(), []

    def at(name):
        counts[name] += 1
        if name == where and counts[name] == call:
            os.kill(os.getpid(), signal.SIGTERM)

    step, init, evaluate, save = loop.Trainer.train_step, loop.Trainer.__init__, loop.Trainer.evaluate, Checkpoints.save

    def dispatch(self, batches):
        training.append(1)
        at("compile")
        return step(self, batches)

    def built(self, *args, **kwargs):
        init(self, *args, **kwargs)
        train = self._train

        def in_flight(*args):  # the state is donated to the step: a Python-level interrupt here loses it
            out = train(*args)
            at("step")
            return out

        self._train = in_flight

    def validating(self, *args, **kwargs):
        if training:
            at("validation")
        return evaluate(self, *args, **kwargs)

    def saving(self, *args, **kwargs):
        at("save")
        return save(self, *args, **kwargs)

    for cls, name, fn in [
        (loop.Trainer, "train_step", dispatch),
        (loop.Trainer, "__init__", built),
        (loop.Trainer, "evaluate", validating),
        (Checkpoints, "save", saving),
    ]:
        monkeypatch.setattr(cls, name, fn)


def check_preempted_then_resumed(workdir, config, reference, capsys, where: str, call: int):
    """The run of `config` SIGTERMed at `where`'s `call`-th time exits 143 naming the step it kept, that checkpoint
    holds that many finite updates, and running again ends on the parameters of the uninterrupted run `reference`."""
    with pytest.MonkeyPatch.context() as patch:
        sigterm_at(patch, where, call)
        with pytest.raises(SystemExit) as stopped:
            run_or_exit(loop.train_and_evaluate, config, workdir)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert stopped.value.code == 128 + signal.SIGTERM and len(errors) == 1, (where, call, errors)
    named = re.fullmatch(
        rf"error: terminated \(SIGTERM\) after step (\d+); (?:checkpointed step|the last checkpoint is step) (\d+) "
        rf"in {workdir}; run the same command to resume.",
        errors[0],
    )
    assert named and named[1] == named[2], (where, call, errors)
    kept = saved_state(workdir, int(named[1]))
    assert int(optax.tree_utils.tree_get_all_with_path(kept["opt_state"], "count")[0][1]) == int(named[1])
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(kept) if np.issubdtype(x.dtype, np.floating))
    loop.train_and_evaluate(config, workdir)
    resumed, whole = (saved_state(w, config.steps)["params"] for w in (workdir, reference))
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(whole), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    return int(named[1])


def test_sigterm_while_a_step_holds_the_state_checkpoints_that_step(tmp_path, tiny_run, capsys, monkeypatch):
    # what SLURM, spot VMs and TPU maintenance send, and it lands in a step nearly always: the step ends, is saved
    reference, _ = tiny_run  # load_config(steps=2), uninterrupted
    sharing_jitted_steps(monkeypatch)  # the stopped run's and the resumed run's Trainers
    assert check_preempted_then_resumed(tmp_path, load_config(steps=2), reference, capsys, "step", 1) == 1


@pytest.mark.slow
def test_sigterm_at_every_moment_keeps_the_last_completed_step(tmp_path, capsys, monkeypatch):
    """SIGTERM at each of the 12 moments a 4-step run passes through (each compile, step, validation and save), once
    each: random moments drawn from these would repeat some and miss others."""
    sharing_jitted_steps(monkeypatch)
    config = load_config(steps=4, eval_every=2, checkpoint_every=2)
    loop.train_and_evaluate(config, tmp_path / "whole")
    calls = dict(compile=4, step=4, validation=2, save=2)  # how often a 4-step run reaches each
    for where, count in calls.items():
        for call in range(1, count + 1):
            workdir = tmp_path / f"{where}{call}"
            check_preempted_then_resumed(workdir, config, tmp_path / "whole", capsys, where, call)


def test_a_refusal_after_the_workdir_was_made_leaves_no_empty_shell(tmp_path):
    with pytest.raises(MotJaxError, match="Unknown tiny model"):  # refused once the workdir is made and locked
        loop.train_and_evaluate(load_config(source="random:nope"), tmp_path / "new" / "run")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["new"]  # the folder above was there to hold it
    (tmp_path / "mine").mkdir()  # a folder the user made stays, even empty
    with pytest.raises(MotJaxError, match="Unknown tiny model"):
        loop.train_and_evaluate(load_config(source="random:nope"), tmp_path / "mine")
    assert (tmp_path / "mine").is_dir()


def test_help_exits_0():
    result = subprocess.run(
        [sys.executable, "-m", "mot_jax.train", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "--workdir" in result.stdout, result.stderr[-2000:]


def test_a_resume_refuses_changes_to_what_a_step_computes_and_records_the_rest(tiny_run, tmp_path):
    workdir = shutil.copytree(tiny_run[0], tmp_path / "run")  # load_config(steps=2) trained there
    changed = load_config(steps=3, seed=1, **{"optim.learning_rate": 0.5})
    with pytest.raises(
        MotJaxError,
        match=rf"^{workdir} was trained to step 2 with optim.learning_rate=\S+ \(now 0.5\), seed=42 \(now 1\); "
        "resume with the values it was started with, or pass a new --workdir.$",
    ):
        loop.train_and_evaluate(changed, workdir)
    summary = loop.train_and_evaluate(load_config(steps=3, eval_every=3), workdir)  # more steps: recorded
    changes = [dict(step=2, changes=dict(eval_every=[2, 3], steps=[2, 3]))]
    assert summary["config_changes"] == changes
    assert json.loads((workdir / "config.json").read_text())["steps"] == 3  # the config trained on now
    checkpoints = Checkpoints(as_path(workdir), 3)
    assert checkpoints.read_meta(3)["config_changes"] == changes
    checkpoints.close()


def strict_json_files(folder) -> list:
    """The JSON files under `folder` (checkpoints' meta included) that a strict parser refuses: a bare NaN or
    Infinity, which Python's json writes and reads but JSON does not allow."""

    def refuse(constant):
        raise ValueError(constant)

    bad = []
    for path in folder.rglob("*"):
        try:
            text = path.read_text()
            json.loads(text)
        except (UnicodeDecodeError, ValueError, IsADirectoryError):
            continue  # not a JSON file
        try:
            json.loads(text, parse_constant=refuse)
        except ValueError:
            bad.append(str(path.relative_to(folder)))
    return bad


def test_a_config_is_written_as_strict_json():
    """config.json and the checkpoints' meta hold the config as `to_json` writes it: a non-finite value that no check
    refuses (the mixture's capacity factor here) was written as a bare Infinity, which JSON does not allow."""
    config = load_config(**{"translator.capacity_factor": math.inf})
    saved = json.loads(config_lib.to_json(config), parse_constant=lambda constant: pytest.fail(constant))
    assert saved["translator"]["capacity_factor"] is None
    assert saved["translator"]["dim"] == config.translator.dim and saved["optim"] == config.optim.to_dict()


def test_a_checkpoint_before_any_validation_is_strict_json_and_resumes(tmp_path, monkeypatch):
    """Step 1 is saved before the first validation (step 3): its meta held best_validation_loss=Infinity."""
    config = load_config(**FAST, steps=3, eval_every=3, checkpoint_every=1)
    whole, trained = whole_and_resumed(config, tmp_path, monkeypatch, stop_after=1)
    assert strict_json_files(tmp_path) == []
    assert (tmp_path / "resumed" / "checkpoints" / "1").is_dir()  # the resume started from that checkpoint
    resumed = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert resumed["best"] == whole["best"] and resumed["best"]["step"] == 3  # read back as no validation yet
    for a, b in zip(jax.tree.leaves(nnx.state(trained[0])), jax.tree.leaves(nnx.state(trained[1]))):
        np.testing.assert_array_equal(a, b)
