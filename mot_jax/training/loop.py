"""`train_and_evaluate(config, workdir)`: the training run behind `python -m mot_jax.train`.

It sets up the pair, data, mesh and translator (`setup`), picks the channel map (`channel_search`), trains with the
jitted steps of a `trainer.Trainer` and reports (`report`). The run resumes from the workdir's latest checkpoint,
holds a lock on the workdir for its whole life, stops on a non-finite loss or state, a failed save or Ctrl-C in one
line (keeping the last good checkpoint: a checkpoint is only saved once a forward on it gave a finite loss), and ends
with a short held-out comparison of the translated cache against no context, the native context and the translation
from a shuffled source, on plain held-out chunks and on the same chunks made retrieval rows.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import jax
from absl import logging
from etils import epath

from mot_jax import multihost
from mot_jax.errors import MotJaxError
from mot_jax.locks import file_lock
from mot_jax.paths import as_path, cache_root
from mot_jax.training import config as config_lib
from mot_jax.training import data
from mot_jax.training.channel_search import resolve_channels
from mot_jax.training.checkpoint import Checkpoints
from mot_jax.training.features import attach_features
from mot_jax.training.report import Logger, evaluation_table
from mot_jax.training.setup import (
    Datasets,
    Pair,
    check_identity,
    identity,
    load_pair,
    make_datasets,
    make_mesh,
    translation,
)
from mot_jax.training.trainer import NonFinite, Trainer, count_params, fit, start_linear_skip
from mot_jax.translate import channels


class Interrupted(MotJaxError):
    exit_status = 130  # the shell's status for Ctrl-C


def workdir_lock(workdir: epath.Path):
    """One run per workdir, for the run's whole life: each process of a run takes its own lock file there (process
    0 `.lock`, process i `.lock.i`), so every process of a second run is refused at once, before any of them waits
    for the others in a collective, while the processes of one run never block each other. A gs:// workdir, or a
    file system without flock, runs unlocked."""
    stack = contextlib.ExitStack()
    if "://" not in str(workdir):
        i = jax.process_index()
        path = Path(workdir) / (".lock" if i == 0 else f".lock.{i}")
        busy = f"Another training run is using {workdir}; wait for it to end, or pass a new --workdir."
        try:
            stack.enter_context(file_lock(path, busy=busy))
        except OSError as e:
            logging.warning("No lock on %s (%s): nothing stops a second run there.", workdir, e)
    return stack


def train_and_evaluate(config, workdir) -> dict:
    """Train (or resume) the config's translator in `workdir`; returns the final summary."""
    config_lib.check(config)
    mesh = make_mesh(config)
    workdir = as_path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    with workdir_lock(workdir):
        multihost.check_shared(workdir)
        with multihost.prepare_lock(cache_root()):  # processes on one host: the first builds caches, the others read
            pair = load_pair(config)
            datasets = make_datasets(config, pair, multihost.local_rows(mesh, config.batch_size))
        checkpoints = Checkpoints(workdir, config.keep_checkpoints)
        try:
            return train_in(workdir, config, mesh, pair, datasets, checkpoints)
        finally:
            checkpoints.close()  # waits for the last save and stops Orbax's threads on every way out


def train_in(workdir, config, mesh, pair: Pair, datasets: Datasets, checkpoints: Checkpoints) -> dict:
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
    if start:
        check_identity(meta["identity"], current, workdir)
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
    else:
        if tcfg.linear_skip:
            start_linear_skip(trainer, datasets.train, config.translator.skip_fit_batches)
        initial = trainer.evaluate(validation) | dict(
            held_out_ce=trainer.evaluate(held_out)["ce"], held_out_retrieval_ce=trainer.evaluate(retrieval)["ce"]
        )
        best = math.inf
        if jax.process_index() == 0:
            (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
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
            config=config.to_json_best_effort(),
            initial_validation=initial,
            best_validation_loss=best,
        )

    def on_step(step, metrics, seconds):
        nonlocal best, last_saved, last_validation, done
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
        if step % config.checkpoint_every == 0 or last:
            # this step's training loss came from the state before its update: check the state to be saved itself
            loss = (val or trainer.evaluate(validation[:1]))["loss"]
            if not math.isfinite(loss):
                raise NonFinite(step, f"The validation loss became {loss} after the update")
            checkpoints.save(step, trainer.state, meta_at(step), best=improved)
            last_saved = step

    logger = Logger(workdir, config.steps, start, tokens_per_step, config.log_every)
    try:
        fit(trainer, train, start, config.steps, on_step)
    except NonFinite as e:
        kept = f"the last good checkpoint is step {last_saved}" if last_saved else "no checkpoint was written"
        raise MotJaxError(
            f"{e} (non-finite); stopped, {kept} in {workdir}; lower --config.optim.learning_rate or use float32."
        ) from None
    except KeyboardInterrupt:
        kept = f"the last checkpoint is step {last_saved}" if last_saved else "no checkpoint was written"
        message = f"interrupted after step {done}; {kept} in {workdir}; run the same command to resume."
        raise Interrupted(message) from None
    finally:
        logger.close()
    results = trainer.baselines(held_out) | dict(untrained=initial["held_out_ce"])
    # a run resumed from a checkpoint written before the retrieval rows existed has no untrained retrieval CE
    results["retrieval"] = trainer.baselines(retrieval) | dict(untrained=initial.get("held_out_retrieval_ce"))
    summary = dict(
        steps=config.steps,
        seconds=round(time.perf_counter() - began, 1),
        final_validation=last_validation or trainer.evaluate(validation),  # the last step is always validated
        initial_validation=initial,
        held_out=results,
        channel_map=json.loads(channel_map.to_json()),
    )
    if jax.process_index() == 0:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(evaluation_table(results))
        print(
            f"done: {config.steps} steps ({config.steps - start} this run) in {summary['seconds']:.0f} s; validation "
            f"loss {summary['final_validation']['loss']:.4f} (untrained {initial['loss']:.4f}); prompt CE "
            f"translated {results['translated']:.4f}, native {results['native']:.4f}, no context "
            f"{results['no_context']:.4f}; checkpoints in {workdir / 'checkpoints'}"
        )
    return summary
