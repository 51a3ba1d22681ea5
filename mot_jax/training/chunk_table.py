"""The chunk table of a split (reference §1.2-1.3): target-tokenized documents packed into chunks.

Documents are tokenized with the target tokenizer (no special tokens); empty documents and documents under 8 tokens
are skipped; the kept documents' tokens, each followed by the target's EOS id, form one stream cut into chunks of
`total_tokens` T. Given a source tokenizer, chunks whose P-1-token context (P = `prefix_tokens`) re-encodes to more
than `source_length` source tokens (or to none) are dropped. The chunk table of a split is computed once and
cached as .npy, keyed by everything it depends on (`TextChunks`). `mot_jax.training.data` cuts the chunks into
batches.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from mot_jax.errors import MotJaxError
from mot_jax.files import atomic_file
from mot_jax.paths import cache_lock, cache_root
from mot_jax.progress import Progress
from mot_jax.translate.align import adapter

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
        """Whether the cached table is complete (both files: each is renamed into place whole), then loaded: mapped
        into memory, so a process reads only the chunks its batches take (a table of a large corpus is gigabytes)."""
        stats_path = self.path.with_suffix(".json")
        if not (self.path.is_file() and stats_path.is_file()):
            return False
        self.chunks, self.stats = np.load(self.path, mmap_mode="r"), json.loads(stats_path.read_text())
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
