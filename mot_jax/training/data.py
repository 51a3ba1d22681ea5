"""Training batches (reference §1.2-1.3): chunks of the chunk table (`mot_jax.training.chunk_table`) split into
context, prompt and labels, with the source tokenizer's ids for the same context text and the alignment between the
two.

With P = `prefix_tokens` and a chunk x of T tokens: context = x[0:P-1] (its first token replaced by the target's BOS,
if it has one), prompt = x[P-1:T-1], labels = x[P:T].

`Batches.batch(position)` is a pure function of one integer, so a checkpoint stores only the stream position.

Retrieval rows (ours, `copy_fraction`): in that share of a training batch's rows the prompt repeats a span of the
row's own context (from a random start after its first token), so its labels can only be predicted by reading the
exact tokens of the context, as an extractive answer is. Built from the corpus chunks alone, by this one rule
(`copy_spans`), which also makes the closing held-out retrieval rows from the validation chunks (`retrieval_batches`).

Question rows (ours, `question_fraction`, `fact_fraction`): a passage, a request about a span of it and that span as
the answer, labels on the answer alone (`questions.py`).
"""

from __future__ import annotations

import dataclasses
import queue
import threading

import jax
import numpy as np

from mot_jax.errors import MotJaxError
from mot_jax.training.chunk_table import DEFAULT_PREFIX_TOKENS
from mot_jax.training.questions import QuestionRows
from mot_jax.translate.align import Alignment, adapter, align_batch, register_pytree

register_pytree()  # batches (with their alignment) are stacked and placed as pytrees


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    """One batch, all numpy (a pytree, so jax.tree.map can stack micro-batches). Shapes are static per config:
    Tc = P-1, Tp = T-P, S = source_length. The masks are all True for packed chunks; they exist for callers that
    pad."""

    context: np.ndarray  # [B, Tc] int32 target ids
    context_mask: np.ndarray  # [B, Tc] bool
    prompt: np.ndarray  # [B, Tp] int32
    labels: np.ndarray  # [B, Tp] int32, the next token of each prompt position
    label_mask: np.ndarray  # [B, Tp] bool
    source_ids: np.ndarray  # [B, S] int32, right-padded with 0
    source_mask: np.ndarray  # [B, S] bool
    alignment: Alignment  # weights [B, Tc, S], target_to_source [B, Tc], source_to_target [B, S]
    features: object = None  # the rows' frozen-model outputs from the feature cache (features.Features; None: live)


def make_batch(
    rows, prefix_tokens: int, source_tokenizer, target_tokenizer, source_length: int, label_mask=None
) -> Batch:
    """The Batch of chunk rows [B, T]: the split at P, and the source ids and alignment of the context;
    `label_mask` [B, Tp] (default all True) as `copy_spans` returns it."""
    rows = np.array(rows, np.int32)
    context, prompt, labels = rows[:, : prefix_tokens - 1], rows[:, prefix_tokens - 1 : -1], rows[:, prefix_tokens:]
    # A context starts as the target reads any text, with its BOS (Gemma's) in place of the first token: evaluation
    # prefixes start with it, and a model's first position (its attention sink) is unlike the rest.
    lead = adapter(target_tokenizer).leading_specials()
    context[:, : len(lead)] = lead
    context_mask = np.ones(context.shape, bool)
    source_ids, source_mask, alignment = align_batch(
        target_tokenizer, source_tokenizer, context, context_mask, source_length
    )
    label_mask = np.ones(labels.shape, bool) if label_mask is None else np.asarray(label_mask, bool)
    return Batch(context, context_mask, prompt, labels, label_mask, source_ids, source_mask, alignment)


def copy_spans(rows, prefix_tokens: int, chosen, rng):
    """(rows, label_mask): chunk rows [B, T] with each `chosen` row's prompt and labels replaced by a span of its
    context (tokens 1..Tc-1) starting at a random token s after the first, so that prompt[:n] = context[s : s + n]
    and labels[:n] = context[s + 1 : s + n + 1], n = min(Tp, Tc - 2): the whole prompt where the context is longer
    (Tc >= Tp + 2); a shorter context is repeated as far as it goes (s = 1 for the default 63 / 64 split) and the
    labels past n, which no copy predicts, are masked out (label_mask [B, Tp] False there)."""
    rows = np.array(rows)
    context, prompt = prefix_tokens - 1, rows.shape[1] - prefix_tokens
    n = min(prompt, context - 2)
    starts = rng.integers(1, context - n, size=len(rows))  # s + n <= Tc - 1: the last label is a context token
    label_mask = np.ones((len(rows), prompt), bool)
    for i in np.flatnonzero(chosen):
        rows[i, prefix_tokens - 1 : prefix_tokens + n] = rows[i, starts[i] : starts[i] + n + 1]
        label_mask[i, n:] = False
    return rows, label_mask


def retrieval_batches(batches: list[Batch], seed: int) -> list[Batch]:
    """Every row of `batches` (chunk batches, e.g. the validation ones) made a retrieval row by `copy_spans`,
    training's `copy_fraction` rule: the same contexts and source side, the prompt and labels copied from the
    context (the draw seeded by `seed` and the batch's index)."""
    out = []
    for i, b in enumerate(batches):
        prefix_tokens = b.context.shape[1] + 1
        rows = np.concatenate([b.context, b.prompt, b.labels[:, -1:]], axis=1)  # the chunk rows (BOS first)
        chosen = np.ones(len(rows), bool)
        rows, label_mask = copy_spans(rows, prefix_tokens, chosen, np.random.default_rng([seed, i, 2]))
        out.append(
            dataclasses.replace(
                b, prompt=rows[:, prefix_tokens - 1 : -1], labels=rows[:, prefix_tokens:], label_mask=label_mask
            )
        )
    return out


def _prefix_tokens(chunks, prefix_tokens: int | None) -> int:
    return prefix_tokens or getattr(chunks, "prefix_tokens", None) or DEFAULT_PREFIX_TOKENS


class Batches:
    """The infinite training stream: epoch e walks `np.random.default_rng([seed, e]).permutation(N)` and batch p
    takes stream items p*B .. p*B+B-1 (crossing epochs), so `batch(p)` depends on p alone.

    `chunks` is a TextChunks (whose prefix_tokens is then the default) or an [N, T] array. `rows` (a slice of
    range(batch_size)) keeps only those rows of each batch: a process's share in a multi-process run. A
    `copy_fraction` of the rows (drawn per position) become retrieval rows (`copy_spans`), and the next
    `question_fraction` and `fact_fraction` of them question rows (`questions.py`).
    """

    def __init__(
        self,
        chunks,
        batch_size: int,
        seed: int,
        source_tokenizer,
        target_tokenizer,
        source_length: int,
        *,
        prefix_tokens: int | None = None,
        rows: slice = slice(None),
        copy_fraction: float = 0.0,
        question_fraction: float = 0.0,
        fact_fraction: float = 0.0,
    ):
        self.chunks = np.asarray(chunks)
        if self.chunks.ndim != 2 or not len(self.chunks):
            raise MotJaxError(f"No chunks to batch (shape {self.chunks.shape}); use a corpus with more text.")
        built = getattr(chunks, "source_length", None)
        if built is not None and source_length < built:
            raise MotJaxError(
                f"source_length={source_length} is below the {built} the chunks were filtered for; pass the same."
            )
        self.batch_size, self.seed, self.rows = batch_size, seed, rows
        self.prefix_tokens = _prefix_tokens(chunks, prefix_tokens)
        shares = (copy_fraction, question_fraction, fact_fraction)
        if min(shares) < 0 or sum(shares) > 1:
            raise MotJaxError(
                f"copy_fraction, question_fraction and fact_fraction ({', '.join(map(str, shares))}) are shares of a "
                "batch's rows; pass values of at least 0 that add up to at most 1."
            )
        if copy_fraction and self.prefix_tokens < 4:
            raise MotJaxError(
                f"Retrieval rows copy a span of the context after its first token, and a {self.prefix_tokens - 1}-"
                "token context leaves none to copy and predict; raise data.prefix_tokens or set data.copy_fraction=0."
            )
        self.copy_fraction = copy_fraction
        self.question_shares = (question_fraction, fact_fraction)
        self.questions = None
        if question_fraction or fact_fraction:
            self.questions = QuestionRows(target_tokenizer, self.prefix_tokens, self.chunks.shape[1])
        self.source_tokenizer, self.target_tokenizer = source_tokenizer, target_tokenizer
        self.source_length = source_length
        self._permutations: dict[int, np.ndarray] = {}

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def epoch_of(self, position: int) -> int:
        """The epoch of the first item of batch `position`."""
        return position * self.batch_size // self.num_chunks

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            if len(self._permutations) >= 4:
                self._permutations.pop(next(iter(self._permutations)))
            self._permutations[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_chunks)
        return self._permutations[epoch]

    def indices(self, position: int) -> np.ndarray:
        """Chunk indices of batch `position`."""
        if position < 0:
            raise MotJaxError(f"Batch position {position} is negative; positions count from 0.")
        items = np.arange(position * self.batch_size, (position + 1) * self.batch_size)
        epochs, offsets = np.divmod(items, self.num_chunks)
        return np.array([self._permutation(int(e))[o] for e, o in zip(epochs, offsets)])

    def batch(self, position: int) -> Batch:
        rows, label_mask = self.chunks[self.indices(position)], None
        rng = np.random.default_rng([self.seed, position, 1])
        draw = rng.random(len(rows))  # each row's kind: retrieval below copy_fraction, then the question shares
        if self.copy_fraction:
            rows, label_mask = copy_spans(rows, self.prefix_tokens, draw < self.copy_fraction, rng)
        if self.questions is not None:
            rows, label_mask = self._question_rows(rows, label_mask, draw, position)
        if label_mask is not None:
            label_mask = label_mask[self.rows]
        return make_batch(
            rows[self.rows],
            self.prefix_tokens,
            self.source_tokenizer,
            self.target_tokenizer,
            self.source_length,
            label_mask,
        )

    def _question_rows(self, rows, label_mask, draw, position: int):
        """The rows whose `draw` falls past the retrieval rows' share become question rows (`questions.py`): span
        rows up to question_fraction more, fact rows up to fact_fraction more."""
        rng = np.random.default_rng([self.seed, position, 3])
        rows = np.array(rows)
        if label_mask is None:
            label_mask = np.ones((len(rows), rows.shape[1] - self.prefix_tokens), bool)
        edges = np.cumsum([self.copy_fraction, *self.question_shares])
        for i in np.flatnonzero((draw >= edges[0]) & (draw < edges[2])):
            if draw[i] < edges[1]:
                rows[i], label_mask[i] = self.questions.span_row(rows[i][: self.prefix_tokens - 1], rng)
            else:
                rows[i], label_mask[i] = self.questions.fact_row(rng)
        return rows, label_mask


def validation_batches(
    chunks,
    batch_size: int,
    source_tokenizer,
    target_tokenizer,
    source_length: int,
    *,
    max_batches: int | None = None,
    prefix_tokens: int | None = None,
    rows: slice = slice(None),
) -> list[Batch]:
    """Fixed batches over the validation chunks in order (no shuffle); the last partial batch is dropped, so every
    batch is full and has the training shapes. `rows` keeps those rows of each batch (as in `Batches`)."""
    table = np.asarray(chunks)
    count = len(table) // batch_size if max_batches is None else min(len(table) // batch_size, max_batches)
    if count == 0 and max_batches != 0:
        raise MotJaxError(
            f"The validation split has {len(table)} chunks, fewer than batch_size={batch_size}; lower the batch size "
            "or use a corpus with more text."
        )
    p = _prefix_tokens(chunks, prefix_tokens)
    batches = [table[i * batch_size : (i + 1) * batch_size][rows] for i in range(count)]
    return [make_batch(b, p, source_tokenizer, target_tokenizer, source_length) for b in batches]


def prefetch(batches: Batches, start: int, count: int, depth: int = 2):
    """Yield batches.batch(p) for p in [start, start + count), computed up to `depth` ahead on a background thread
    (tokenization and alignment then overlap the device step). Errors are re-raised here; closing the generator
    stops the thread."""
    ready: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def work():
        for position in range(start, start + count):
            try:
                item = (batches.batch(position), None)
            except Exception as e:  # handed to the consumer
                item = (None, e)
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    break
                except queue.Full:
                    pass
            if stop.is_set() or item[1] is not None:
                return

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        for _ in range(count):
            batch, error = ready.get()
            if error is not None:
                raise error
            yield batch
    finally:
        stop.set()
        thread.join()
