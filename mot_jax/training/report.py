"""What a training run reports: progress while it trains (absl logs, TensorBoard, a progress bar) and the closing
held-out table."""

from __future__ import annotations

import math
import sys
import time

import jax
from absl import logging
from etils import epath

from mot_jax.outputs import markdown_table


class Events:
    """TensorBoard scalars in tensorboardX's event file format, written in the caller's thread (tensorboardX's
    `SummaryWriter` writes from a thread of its own and flushes again at exit, so a full disk printed two tracebacks
    after the run's own one-line error). A write that fails stops the curves with one warning; the run goes on, and
    its checkpoints report the disk themselves."""

    def __init__(self, folder: epath.Path):
        from tensorboardX.event_file_writer import EventsWriter, directory_check
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar

        self.event, self.scalar, self.writer = Event, scalar, None
        try:
            directory_check(str(folder))
            self.writer = EventsWriter(str(folder / "events"))
        except OSError as e:
            self._stop(None, e)

    def scalars(self, step: int, values: dict, prefix: str, flush: bool):
        if self.writer is None:
            return
        try:
            for k, v in values.items():
                summary = self.scalar(f"{prefix}/{k}", v)
                self.writer.write_event(self.event(wall_time=time.time(), step=step, summary=summary))
            if flush:
                self.writer.flush()
        except OSError as e:
            self._stop(step, e)

    def close(self):
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError as e:
                self._stop(None, e)

    def _stop(self, step, error: OSError):
        where = "" if step is None else f" at step {step}"
        logging.warning("TensorBoard curves stopped%s (%s); the run goes on without them.", where, error)
        writer, self.writer = self.writer, None
        try:  # the file alone (tensorboardX's record writer): its buffer cannot be flushed, so no `writer.close()`
            getattr(writer, "_py_recordio_writer", None) and writer._py_recordio_writer.close()
        except OSError:
            pass


class Logger:
    """absl logs (with tokens/s and ETA), TensorBoard event files (`Events`) and, on a terminal, a progress bar;
    process 0 only."""

    def __init__(self, workdir: epath.Path, total: int, start: int, tokens_per_step: int, log_every: int):
        self.main = jax.process_index() == 0
        self.tokens_per_step, self.log_every, self.total, self.start = tokens_per_step, log_every, total, start
        self.began = time.perf_counter()
        self.writer = self.bar = None
        if self.main:
            from tqdm import tqdm

            self.writer = Events(workdir / "tensorboard")
            self.bar = tqdm(
                total=total, initial=start, unit="step", dynamic_ncols=True, disable=not sys.stderr.isatty()
            )

    def scalars(self, step: int, values: dict, prefix: str):
        if self.main:
            flush = prefix != "train" or step % self.log_every == 0
            self.writer.scalars(step, {k: float(v) for k, v in values.items()}, prefix, flush)

    def step(self, step: int, metrics: dict, seconds: float, learning_rate: float):
        if not self.main:
            return
        tokens_per_second = self.tokens_per_step / max(seconds, 1e-9)
        values = {k: float(v) for k, v in metrics.items()} | dict(learning_rate=learning_rate)
        self.scalars(step, values | dict(tokens_per_second=tokens_per_second), "train")
        shown = {k: f"{values[k]:.3f}" for k in ("loss", "ce") if k in values}  # no ce: a KV-space objective
        self.bar.set_postfix(**shown, tok_s=f"{tokens_per_second:.0f}")
        self.bar.update(1)
        if step % self.log_every == 0:
            shown = " ".join(f"{k}={v:.4g}" for k, v in values.items())
            eta = (time.perf_counter() - self.began) / (step - self.start) * (self.total - step)
            logging.info("step %d/%d: %s tokens/s=%.0f eta=%.0fs", step, self.total, shown, tokens_per_second, eta)

    def close(self):
        if self.main:
            self.bar.close()
            self.writer.close()


ROWS = (
    ("no context", "no_context"),
    ("native context", "native"),
    ("translated (untrained)", "untrained"),
    ("translated (trained)", "translated"),
    ("translated (shuffled source)", "shuffled"),  # only for a translator that reads the source
)


def evaluation_table(results: dict) -> str:
    """The closing held-out table: prompt CE and perplexity per method on the plain held-out chunks and on the same
    chunks made retrieval rows (`results["retrieval"]`); a cell the run did not measure shows "-"."""
    retrieval = results.get("retrieval", {})

    def cells(ce):
        return ("-", "-") if ce is None else (f"{ce:.4f}", f"{math.exp(min(ce, 50)):.2f}")

    rows = [
        (name, *cells(results.get(key)), *cells(retrieval.get(key)))
        for name, key in ROWS
        if results.get(key) is not None or retrieval.get(key) is not None
    ]
    return markdown_table(("method", "prompt CE", "perplexity", "retrieval CE", "retrieval perplexity"), rows)


# the table's CE is the teacher-forced measure `python -m mot_jax.evaluate` reports as gold log-prob, sign turned: every
# row of a batch scores as many labels (all of a chunk's prompt, or the copied span of a retrieval row), so the mean
# over tokens is the mean over rows of each row's mean log-probability per token (test_closing_table)
CE_IS_LOG_PROB = (
    "prompt CE = minus the mean log-probability per token of the prompt's labels, teacher-forced: evaluate's gold "
    "log-prob measure with its sign turned (on the retrieval rows the copied span is the gold answer)"
)


def closing_report(summary: dict, workdir, start: int) -> str:
    """What a finished run prints: the held-out table, naming the checkpoint it describes (the last step's, which
    need not be best/'s) and saying when the untrained translator's validation loss was lower still, what its CE
    is, and a line of totals."""
    steps, results, best, initial = (
        summary["steps"],
        summary["held_out"],
        summary["best"],
        summary["initial_validation"],
    )
    lowest = "the lowest"
    if best["validation_loss"] > initial["loss"]:  # best/ holds trained steps only
        lowest += f" of its validated steps, above the untrained translator's {initial['loss']:.4f}"
    if best["step"] == steps:
        which = f"step {steps}, in checkpoints/ and best/: its validation loss is {lowest}"
    else:
        which = (
            f"step {steps}, in checkpoints/; best/ keeps step {best['step']}, whose validation loss "
            f"{best['validation_loss']:.4f} is {lowest}"
        )
    return "\n".join(
        [
            f"Held-out prompt CE of the translator at the last step ({which}):",
            evaluation_table(results),
            f"({CE_IS_LOG_PROB}.)",
            f"done: {steps} steps ({steps - start} this run) in {summary['seconds']:.0f} s; validation loss "
            f"{summary['final_validation']['loss']:.4f} (untrained {initial['loss']:.4f}); prompt CE translated "
            f"{results['translated']:.4f}, native {results['native']:.4f}, no context {results['no_context']:.4f}; "
            f"checkpoints in {workdir}/checkpoints",
        ]
    )
