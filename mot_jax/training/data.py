"""Training chunks and batches (reference §1.2-1.3): packed target-token chunks, split into context, prompt and
labels, with the source tokenizer's ids for the same context text and the alignment between the two.

Documents are tokenized with the target tokenizer (no special tokens); empty documents and documents under 8 tokens
are skipped; the kept documents' tokens, each followed by the target's EOS id, form one stream cut into chunks of
`total_tokens` T. With P = `prefix_tokens`: context = x[0:P-1] (its first token replaced by the target's BOS, if it
has one), prompt = x[P-1:T-1], labels = x[P:T]. The chunk table of a split is computed once and cached as .npy,
keyed by everything it depends on.

`Batches.batch(position)` is a pure function of one integer, so a checkpoint stores only the stream position.

Retrieval rows (ours, `copy_fraction`): in that share of a training batch's rows the prompt repeats a span of the
row's own context (from a random start after its first token), so its labels can only be predicted by reading the
exact tokens of the context, as an extractive answer is. Built from the corpus chunks alone, by this one rule
(`copy_spans`), which also makes the closing held-out retrieval rows from the validation chunks (`retrieval_batches`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import queue
import sys
import threading
from pathlib import Path

import jax
import numpy as np

from mot_jax.errors import MotJaxError
from mot_jax.files import atomic_file
from mot_jax.paths import cache_lock, cache_root
from mot_jax.progress import Progress
from mot_jax.translate.align import Alignment, adapter, align_batch, register_pytree

register_pytree()  # batches (with their alignment) are stacked and placed as pytrees

MIN_DOCUMENT_TOKENS = 8
DEFAULT_TOTAL_TOKENS, DEFAULT_PREFIX_TOKENS = 128, 64
CHUNK_FORMAT = 1  # bump when the chunk layout changes: old cache files are then ignored
_BATCH_TEXTS = 2048  # texts per encode_batch / decode_batch call


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's serialized form (vocabulary, merges, normalizer, added tokens)."""
    return hashlib.sha256(adapter(tokenizer).backend.to_str().encode()).hexdigest()


def _documents_fingerprint(documents) -> str:
    """The corpus's own fingerprint (corpus.Documents), else a hash of the texts (e.g. a plain list)."""
    fingerprint = getattr(documents, "fingerprint", None)
    if fingerprint:
        return fingerprint
    digest = hashlib.sha256()
    for text in documents:
        digest.update(f"{len(text)}:".encode() + text.encode())
    return digest.hexdigest()


def _eos_id(tokenizer, eos_id) -> int:
    eos_id = getattr(tokenizer, "eos_token_id", None) if eos_id is None else eos_id
    if eos_id is None:
        raise MotJaxError(f"{type(tokenizer).__name__} has no eos_token_id; pass the target's EOS id as eos_id.")
    return int(eos_id)


class TextChunks:
    """The [N, T] int32 chunk table of one split of documents, for one target (and source) tokenizer.

    Chunks whose context re-encodes to more than `source_length` source tokens (or to none) are dropped here, so
    a batch never fails; without a source tokenizer (or with the target's own) nothing is dropped. The table and
    its statistics (`stats`) are cached under `cache_dir` (default: the corpus's data dir / "chunks").
    """

    def __init__(
        self,
        documents,
        target_tokenizer,
        *,
        eos_id: int | None = None,
        total_tokens: int = DEFAULT_TOTAL_TOKENS,
        prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
        source_tokenizer=None,
        source_length: int | None = None,
        cache_dir=None,
    ):
        if not 2 <= prefix_tokens < total_tokens:
            raise MotJaxError(
                f"prefix_tokens={prefix_tokens} does not fit total_tokens={total_tokens}; pass 2 <= prefix_tokens "
                "< total_tokens."
            )
        if source_tokenizer is target_tokenizer:
            source_tokenizer = None  # the identity: the source reads the target's own ids
            if source_length is not None and source_length < prefix_tokens - 1:
                raise MotJaxError(
                    f"source_length={source_length} is shorter than the {prefix_tokens - 1}-token context of the "
                    f"same tokenizer; pass source_length >= {prefix_tokens - 1}."
                )
        self.total_tokens, self.prefix_tokens, self.source_length = total_tokens, prefix_tokens, source_length
        self.eos_id = _eos_id(target_tokenizer, eos_id)
        filtered = source_tokenizer is not None and source_length is not None
        key = dict(
            format=CHUNK_FORMAT,
            documents=_documents_fingerprint(documents),
            target=tokenizer_fingerprint(target_tokenizer),
            eos_id=self.eos_id,
            total_tokens=total_tokens,
            prefix_tokens=prefix_tokens,
            min_document_tokens=MIN_DOCUMENT_TOKENS,
            source=tokenizer_fingerprint(source_tokenizer) if filtered else None,
            source_length=source_length if filtered else None,
        )
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        if cache_dir is None:
            cache_dir = Path(getattr(documents, "data_dir", cache_root())) / "chunks"
        self.path = Path(cache_dir) / f"{name}.npy"
        if self._read():
            return
        with cache_lock(self.path):  # another process may be building this table: wait, then look again
            if not self._read():
                self._write(documents, target_tokenizer, source_tokenizer if filtered else None, key)

    def _read(self) -> bool:
        """Whether the cached table is complete (both files: each is renamed into place whole), then loaded."""
        stats_path = self.path.with_suffix(".json")
        if not (self.path.is_file() and stats_path.is_file()):
            return False
        self.chunks, self.stats = np.load(self.path), json.loads(stats_path.read_text())
        return True

    def _write(self, documents, target_tokenizer, source, key):
        total_tokens, prefix_tokens, source_length = self.total_tokens, self.prefix_tokens, self.source_length
        filtered = source is not None
        chunks, self.stats = _build(
            documents, target_tokenizer, self.eos_id, total_tokens, prefix_tokens, source, source_length
        )
        self.stats["key"] = key
        message = f"Chunk table {self.path}: {len(chunks)} chunks of {total_tokens} tokens"
        if filtered:
            message += (
                f"; dropped {self.stats['dropped']} whose {prefix_tokens - 1}-token context re-encodes to over "
                f"{source_length} source tokens (longest {self.stats['source_length_max']})"
            )
        print(message, file=sys.stderr)
        self.chunks = chunks
        with atomic_file(self.path) as partial, open(partial, "wb") as f:  # a file object: np.save adds no ".npy"
            np.save(f, self.chunks)
        with atomic_file(self.path.with_suffix(".json")) as partial:
            partial.write_bytes(json.dumps(self.stats, indent=1).encode())

    def __len__(self) -> int:
        return len(self.chunks)

    def __array__(self, dtype=None, copy=None):
        return self.chunks if dtype is None else self.chunks.astype(dtype)


def _build(documents, tokenizer, eos_id, total_tokens, prefix_tokens, source_tokenizer, source_length):
    """(chunks [N, T], stats): the packed stream cut into chunks, less those whose context is too long for the
    source (when `source_tokenizer` is given)."""
    stream, stats = _token_stream(documents, tokenizer, eos_id)
    count = len(stream) // total_tokens
    chunks = stream[: count * total_tokens].reshape(count, total_tokens)
    stats["chunks"] = count
    if source_tokenizer is not None:
        lengths = _source_lengths(chunks[:, : prefix_tokens - 1], tokenizer, source_tokenizer)
        keep = (lengths >= 1) & (lengths <= source_length)
        chunks = chunks[keep]
        stats.update(
            dropped=int((~keep).sum()),
            source_length_max=int(lengths.max(initial=0)),
            source_length_p999=float(np.percentile(lengths, 99.9)) if lengths.size else 0.0,
        )
    return np.ascontiguousarray(chunks, np.int32), stats


def _token_stream(documents, tokenizer, eos_id: int) -> tuple[np.ndarray, dict]:
    """The target-token stream: each kept document's ids followed by EOS, and counts of what was kept."""
    tok = adapter(tokenizer)
    pieces, stats = [], dict(documents=len(documents), kept_documents=0, tokens=0)
    with Progress("Tokenizing the chunk table", "doc", total=len(documents)) as progress:
        for start in range(0, len(documents), _BATCH_TEXTS):
            batch = documents[start : start + _BATCH_TEXTS]
            for ids, _ in tok.encode_batch([t for t in batch if t.strip()]):
                if len(ids) >= MIN_DOCUMENT_TOKENS:
                    pieces.append(np.asarray(ids + [eos_id], np.int32))
            progress.update(len(batch))
    stats.update(kept_documents=len(pieces), tokens=int(sum(map(len, pieces))))
    return (np.concatenate(pieces) if pieces else np.zeros(0, np.int32)), stats


def _source_lengths(contexts: np.ndarray, target_tokenizer, source_tokenizer) -> np.ndarray:
    """How many source tokens each target context re-encodes to (decode with the target, encode with the source)."""
    target, source = adapter(target_tokenizer), adapter(source_tokenizer)
    lengths = []
    with Progress("Source lengths of the chunks", "chunk", total=len(contexts)) as progress:
        for start in range(0, len(contexts), _BATCH_TEXTS):
            texts = target.decode_batch(contexts[start : start + _BATCH_TEXTS].tolist())
            lengths += [len(ids) for ids, _ in source.encode_batch(texts)]
            progress.update(len(texts))
    return np.asarray(lengths, np.int64)


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
    `copy_fraction` of the rows (drawn per position) become retrieval rows (`copy_spans`).
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
        if not 0.0 <= copy_fraction <= 1.0:
            raise MotJaxError(f"copy_fraction={copy_fraction} is not a fraction; pass a value in [0, 1].")
        if copy_fraction and self.prefix_tokens < 4:
            raise MotJaxError(
                f"Retrieval rows copy a span of the context after its first token, and a {self.prefix_tokens - 1}-"
                "token context leaves none to copy and predict; raise data.prefix_tokens or set data.copy_fraction=0."
            )
        self.copy_fraction = copy_fraction
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
        if self.copy_fraction:
            rng = np.random.default_rng([self.seed, position, 1])
            rows, label_mask = copy_spans(rows, self.prefix_tokens, rng.random(len(rows)) < self.copy_fraction, rng)
            label_mask = label_mask[self.rows]
        return make_batch(
            rows[self.rows],
            self.prefix_tokens,
            self.source_tokenizer,
            self.target_tokenizer,
            self.source_length,
            label_mask,
        )


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
