"""`train_and_evaluate(config, workdir)`: the training run behind `python -m mot_jax.train`.

It sets up the pair, data, mesh and translator (`setup`), picks the channel map (`channel_search`), trains with the
jitted steps of a `trainer.Trainer` and reports (`report`). The run resumes from the workdir's latest checkpoint, holds
a lock on the workdir for its whole life, stops on a non-finite loss or state, a failed save, Ctrl-C or SIGTERM in one
line (keeping the last good checkpoint: a checkpoint is only saved with every array finite and a finite loss; Ctrl-C and
SIGTERM stop after the step in flight and first checkpoint the steps done since the last one), and ends with a short
held-out comparison of the translated cache against no context, the native context and the translation from a
shuffled source, on plain held-out chunks and on the same chunks made retrieval rows.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from pathlib import Path

import jax
import numpy as np
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from mot_jax import multihost
from mot_jax.errors import Interrupted, MotJaxError, Terminated, cause
from mot_jax.files import strict_json
from mot_jax.locks import file_lock
from mot_jax.models.model_pair import ModelPair, load_pair
from mot_jax.paths import as_path, cache_root
from mot_jax.training import config as config_lib
from mot_jax.training import data
from mot_jax.training.channel_search import resolve_channels
from mot_jax.training.checkpoint import Checkpoints, all_finite
from mot_jax.training.features import attach_features
from mot_jax.training.report import Logger, closing_report
from mot_jax.training.setup import (
    Datasets,
    check_identity,
    config_changes,
    identity,
    make_datasets,
    make_mesh,
    translation,
)
from mot_jax.training.trainer import NonFinite, Trainer, count_params, fit, start_linear_skip
from mot_jax.translate import channels


def lock_name(process: int) -> str:
    return ".lock" if process == 0 else f".lock.{process}"


def workdir_lock(workdir: epath.Path):
    """One run per workdir, for the run's whole life: each process of a run takes its own lock file there (process
    0 `.lock`, process i `.lock.i`), so every process of a second run is refused at once, before any of them waits
    for the others in a collective, while the processes of one run never block each other. A gs:// workdir, or a
    file system without flock, runs unlocked."""
    stack = contextlib.ExitStack()
    if "://" not in str(workdir):
        i = jax.process_index()
        path = Path(workdir) / lock_name(i)
        busy = f"Another training run is using {workdir}; wait for it to end, or pass a new --workdir."
        try:
            stack.enter_context(file_lock(path, busy=busy))
        except OSError as e:
            logging.warning("No lock on %s (%s): nothing stops a second run there.", workdir, e)
    return stack


@contextlib.contextmanager
def removed_on_failure_if_empty(workdir: epath.Path, made: bool):
    """A workdir this run made is removed again when the run fails before writing anything there but its lock and
    empty folders (a refusal leaves no empty shell behind). Runs inside the lock: the lock file goes first, then the
    empty folders (rmdir: never a file another process has written since)."""
    try:
        yield
    except BaseException:
        root = Path(workdir)
        if made and "://" not in str(workdir):
            paths = sorted(root.rglob("*"), key=lambda p: -len(p.parts))  # the deepest first
            if all(p.is_dir() or (p.parent == root and p.name.startswith(".lock")) for p in paths):
                with contextlib.suppress(OSError):
                    (root / lock_name(jax.process_index())).unlink(missing_ok=True)
                    for p in [*(p for p in paths if p.is_dir()), root]:
                        p.rmdir()
        raise


class StopRequests:
    """SIGTERM and Ctrl-C while the steps run (a `with` block): the handler only records the signal, and the loop
    stops after a step that every process agrees on (`__call__(step)`, true from that step on), with the state of a
    completed step in hand to save, never one lost with a step in flight. One process agrees at once, after the step
    in flight; several share what they received every `every` steps (an all-gather where the loop reads its metrics
    back anyway; Python's handler replaces the one of JAX's preemption sync point). A second signal stops at once,
    as outside the steps (Terminated, KeyboardInterrupt)."""

    def __init__(self, every: int):
        self.every, self.received, self.signal = every, 0, 0  # signal: the agreed one, 0 until then

    def _handle(self, signum, frame):
        if self.received:
            raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt
        self.received = signum

    def __enter__(self):
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # only it may set a signal handler
            for signum in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(signum) is not signal.SIG_IGN:  # a background process ignores Ctrl-C
                    self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def __call__(self, step: int, final: bool = False) -> bool:
        if not self.signal and jax.process_count() == 1:
            self.signal = self.received
        elif not self.signal and (final or step % self.every == 0):
            self.signal = int(multihost_utils.process_allgather(np.int32(self.received)).max())
        return bool(self.signal)


def savable(trainer: Trainer, batches) -> bool:
    """Whether the state of a run that stops early can be checkpointed: it is finite and gives a finite loss, and the
    run is one process (the processes of a run may stop at different steps, and saving is collective)."""
    return jax.process_count() == 1 and all_finite(trainer.state) and math.isfinite(trainer.evaluate(batches)["loss"])


def train_and_evaluate(config, workdir) -> dict:
    """Train (or resume) the config's translator in `workdir`; returns the final summary."""
    config_lib.check(config)
    if not str(workdir or "").strip():  # as_path("") is the current directory
        raise MotJaxError("--workdir is empty; pass --workdir=DIR, the folder for the run's checkpoints and logs.")
    mesh = make_mesh(config)
    workdir = as_path(workdir)
    made = not workdir.exists()
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file of that name, a read-only disk
        raise MotJaxError(f"Cannot make the workdir {workdir} ({cause(e)}); pass a folder for --workdir.") from None
    with workdir_lock(workdir), removed_on_failure_if_empty(workdir, made):
        multihost.check_shared(workdir)
        with multihost.prepare_lock(cache_root()):  # processes on one host: the first builds caches, the others read
            pair = load_pair(config, mesh)
            datasets = make_datasets(config, pair, multihost.local_rows(mesh, config.batch_size))
        checkpoints = Checkpoints(workdir, config.keep_checkpoints)
        try:
            return train_in(workdir, config, mesh, pair, datasets, checkpoints)
        finally:
            checkpoints.close()  # waits for the last save and stops Orbax's threads on every way out


def train_in(workdir, config, mesh, pair: ModelPair, datasets: Datasets, checkpoints: Checkpoints) -> dict:
    """train_and_evaluate once the workdir is locked and the models and data are loaded."""
    start = checkpoints.latest_step() or 0
    if config.steps < start:
        raise MotJaxError(
            f"{workdir} is at step {start}, past --config.steps={config.steps}; pass --config.steps above {start} "
            "to train on, or a new --workdir."
        )
    meta = checkpoints.read_meta(start) if start else {}
    if start:
        channel_map = channels.ChannelMap.from_json(meta["channel_map"])
    else:
        channel_map = resolve_channels(config, pair, datasets, mesh, workdir)
    spec, tcfg = translation(config, channel_map, pair)
    current = identity(config, spec, tcfg, pair)
    changes = meta.get("config_changes", [])  # [{step, changes: {key: [before, after]}}], oldest first
    if start:
        check_identity(meta["identity"], current, workdir)
        changed = config_changes(meta["config"], config, workdir, start)
        if changed:
            changes = [*changes, dict(step=start, changes=changed)]
            logging.info(
                "Resumed at step %d with %s", start, ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changed.items())
            )
    trainer = Trainer(config, pair, spec, tcfg, mesh, config.steps)
    validation = datasets.validation[: config.eval_batches]
    held_out = datasets.validation[config.eval_batches :][: config.final_eval_batches] or validation
    retrieval = data.retrieval_batches(held_out, config.seed)  # the same chunks, their prompts copied from the context
    train = datasets.train
    if config.data.feature_cache:  # the training stream and validation loss read the frozen outputs from disk
        train, validation = attach_features(config, pair, spec, tcfg.kind, train, validation)
    if start:
        trainer.state = checkpoints.restore(trainer.state, start)
        logging.info("Resumed from step %d in %s", start, workdir)
        initial, best = meta["initial_validation"], meta["best_validation_loss"]
        best = math.inf if best is None else best  # saved before the first validation (JSON has no Infinity)
        best_step = checkpoints.best.latest_step()
    else:
        if tcfg.linear_skip:
            settings = config.translator
            start_linear_skip(trainer, datasets.train, settings.skip_fit_batches, settings.skip_ridge_held_out)
        initial = trainer.evaluate(validation, progress="Validation loss, untrained") | dict(
            held_out_ce=trainer.evaluate(held_out, progress="Held-out CE, untrained")["ce"],
            held_out_retrieval_ce=trainer.evaluate(retrieval, progress="Held-out retrieval CE, untrained")["ce"],
        )
        best, best_step = math.inf, None
    if jax.process_index() == 0:  # the config the run trains on now (a resume may have changed safe keys)
        (workdir / "config.json").write_text(config_lib.to_json(config, indent=2))
    logging.info("Translator: %d parameters; channel map %s", count_params(trainer.state["params"]), channel_map)
    accum = config.grad_accum
    tokens_per_step = config.batch_size * accum * config.data.total_tokens
    began, last_saved, last_validation, done = time.perf_counter(), start, None, start

    def meta_at(step):
        return dict(
            step=step,
            data_position=step * accum,
            channel_map=channel_map.to_json(),
            identity=current,
            config=config_lib.to_json(config),
            initial_validation=initial,
            best_validation_loss=best,
            config_changes=changes,
        )

    def on_step(step, metrics, seconds):
        nonlocal best, best_step, last_saved, last_validation, done
        done = step
        logger.step(step, metrics, seconds, float(trainer.schedule(step - 1)))
        checkpoints.check()  # a background save that failed stops the run at once
        last = step == config.steps
        val, improved = None, False
        if step % config.eval_every == 0 or last:
            val = trainer.evaluate(validation)
            logger.scalars(step, val, "validation")
            logging.info("step %d: validation loss %.4f (ce %.4f)", step, val["loss"], val["ce"])
            improved, best, last_validation = val["loss"] < best, min(best, val["loss"]), val
            best_step = step if improved else best_step
        if step % config.checkpoint_every == 0 or last:
            # this step's training loss came from the state before its update: check the state to be saved itself
            loss = (val or trainer.evaluate(validation[:1]))["loss"]
            if not math.isfinite(loss):
                raise NonFinite(step, f"The validation loss became {loss} after the update")
            checkpoints.save(step, trainer.state, meta_at(step), best=improved)
            last_saved = step

    def interrupted(stopped: KeyboardInterrupt, kept: str):
        raise Interrupted(f"after step {done}; {kept} in {workdir}; run the same command to resume.", stopped) from None

    def host_work(step):  # the steps whose metrics on_step needs checked before it validates or saves
        return step % config.eval_every == 0 or step % config.checkpoint_every == 0

    logger = Logger(workdir, config.steps, start, tokens_per_step, config.log_every)
    try:
        with StopRequests(config.log_every) as requested:
            fit(trainer, train, start, config.steps, on_step, read_at=host_work, stop=requested)
            requested(done, final=True)  # one that came while the last step ran
        if requested.signal:  # every process stops after step `done`, read back and checked
            if done > last_saved and math.isfinite(trainer.evaluate(validation[:1])["loss"]):
                checkpoints.save(done, trainer.state, meta_at(done))
                last_saved = done
                kept = f"checkpointed step {done}"
            else:
                kept = f"the last checkpoint is step {last_saved}" if last_saved else "no checkpoint was written"
            interrupted(Terminated() if requested.signal == signal.SIGTERM else KeyboardInterrupt(), kept)
    except NonFinite as e:
        kept = f"the last good checkpoint is step {last_saved}" if last_saved else "no checkpoint was written"
        raise MotJaxError(
            f"{e} (non-finite); stopped, {kept} in {workdir}; lower --config.optim.learning_rate or use float32."
        ) from None
    except KeyboardInterrupt as e:  # a second Ctrl-C or SIGTERM, or one outside the steps (cli.run_or_exit)
        held = trainer.steps_done()  # None: the state was lost with the step in flight
        done = done if held is None else held
        if held is not None and held > last_saved and savable(trainer, validation[:1]):
            checkpoints.save(done, trainer.state, meta_at(done))
            kept = f"checkpointed step {done}"
        else:
            kept = f"the last checkpoint is step {last_saved}" if last_saved else "no checkpoint was written"
        interrupted(e, kept)
    finally:
        logger.close()
    results = trainer.baselines(held_out, "Closing table, held-out") | dict(untrained=initial["held_out_ce"])
    retrieval_ce = trainer.baselines(retrieval, "Closing table, retrieval rows")
    results["retrieval"] = retrieval_ce | dict(untrained=initial["held_out_retrieval_ce"])
    summary = dict(
        steps=config.steps,
        seconds=round(time.perf_counter() - began, 1),
        final_validation=last_validation or trainer.evaluate(validation),  # the last step is always validated
        initial_validation=initial,
        held_out=results,
        best=dict(step=best_step, validation_loss=best),  # the checkpoint in best/; the table is the last step's
        config_changes=changes,
        channel_map=json.loads(channel_map.to_json()),
    )
    if jax.process_index() == 0:
        (workdir / "summary.json").write_text(strict_json(summary, indent=2))
        print(closing_report(summary, workdir, start))
    return summary
