"""The reference's per-token alignment in plain Python loops (reference §1.3, §1.5), and the alignment benchmark.

Slow on purpose: it is the oracle the tests compare `align_batch` against and the baseline of the benchmark.
"""

from __future__ import annotations

import random
import statistics
import time

import numpy as np

from mot_jax.translate.align import adapter, align_batch


def reference_token_spans(tokenizer, text: str, ids: list[int]) -> list[tuple[int, int]]:
    """Offsets when re-encoding `text` reproduces `ids`, else the prefix-decoding rule, one prefix at a time."""
    tok = adapter(tokenizer)
    ids = [int(i) for i in ids]
    encoded, offsets = tok.encode(text)
    if encoded == ids:
        return [(int(b), int(e)) for b, e in offsets]
    spans, previous = [], 0
    for i in range(1, len(ids) + 1):
        prefix = tok.decode(ids[:i])
        common = 0
        while common < min(len(text), len(prefix)) and text[common] == prefix[common]:
            common += 1
        end = max(previous, min(len(text), common))
        spans.append((previous, end))
        previous = end
    if spans:
        spans[-1] = (spans[-1][0], len(text))
    return spans


def _nearest(span, spans) -> int:
    centre, best, best_distance = (span[0] + span[1]) / 2, 0, float("inf")
    for j, (b, e) in enumerate(spans):
        distance = abs((b + e) / 2 - centre)
        if distance < best_distance:
            best, best_distance = j, distance
    return best


def reference_overlap(target_spans, source_spans):
    """(weights [T][S], target_to_source [T], source_to_target [S]) from the character overlap, loop by loop."""
    overlap = [[max(0, min(te, se) - max(tb, sb)) for sb, se in source_spans] for tb, te in target_spans]
    for t, row in enumerate(overlap):
        if sum(row) == 0:
            row[_nearest(target_spans[t], source_spans)] = 1
    weights = []
    for row in overlap:
        total = max(sum(row), 1)
        weights.append([o / total for o in row])
    target_to_source = [max(range(len(row)), key=lambda s, row=row: (row[s], -s)) for row in overlap]
    source_to_target = []
    for s in range(len(source_spans)):
        column = [row[s] for row in overlap]
        if max(column) == 0:
            source_to_target.append(_nearest(source_spans[s], target_spans))
        else:
            source_to_target.append(max(range(len(column)), key=lambda t, c=column: (c[t], -t)))
    return weights, target_to_source, source_to_target


def reference_alignment(target_tokenizer, source_tokenizer, target_ids):
    """One unpadded row, as the reference does it: (source_ids, weights [T][S], target_to_source, source_to_target)."""
    target_ids = [int(i) for i in target_ids]
    text = adapter(target_tokenizer).decode(target_ids)
    source_ids = adapter(source_tokenizer).encode(text)[0]
    target_spans = reference_token_spans(target_tokenizer, text, target_ids)
    source_spans = reference_token_spans(source_tokenizer, text, source_ids)
    return (source_ids, *reference_overlap(target_spans, source_spans))


_WORDS = (
    "the of and to in is was for that on with as by at from his an were are which this be has had it not or "
    "translation cache layer token model source target attention résumé naïve café Zürich São Paulo façade "
    "über straße 東京 日本語 翻訳 中文 模型 한국어 😀 🚀 👍🏽 — … “quoted” (paren) 42 3.14 1,000 e-mail"
).split()


def synthetic_text(num_chars: int, seed: int = 0) -> str:
    """Deterministic mixed text (accents, CJK, emoji, digits, whitespace runs and newlines) of about num_chars."""
    rng, parts, size = random.Random(seed), [], 0
    while size < num_chars:
        word = rng.choice(_WORDS)
        gap = rng.choices([" ", "  ", "\n", "\n\n", ", ", ". ", "\t"], [70, 5, 5, 3, 8, 8, 1])[0]
        parts.append(word + gap)
        size += len(word) + len(gap)
    return "".join(parts)


def benchmark_inputs(target_tokenizer, length: int, batch: int, canonical: bool = True, seed: int = 0):
    """(target_ids [B, length] int32, mask) from synthetic texts; rows after the first are up to 10% shorter and
    left-padded. canonical=False encodes the text in 97-character pieces, so the ids do not survive a decode and
    re-encode and the target spans take the prefix-decoding fallback."""
    tok, rng = adapter(target_tokenizer), random.Random(seed)
    ids, mask = np.zeros((batch, length), np.int32), np.zeros((batch, length), bool)
    for b in range(batch):
        n = length - rng.randrange(length // 10 + 1) if b else length
        row, part = [], 0
        while len(row) < n:
            text = synthetic_text(4 * length, seed + b + 1000 * part)
            step = len(text) if canonical else 97
            row += [i for k in range(0, len(text), step) for i in tok.encode(text[k : k + step])[0]]
            part += 1
        ids[b, length - n :], mask[b, length - n :] = row[:n], True
    return ids, mask


def benchmark_alignment(
    target_tokenizer, source_tokenizer, length: int = 2048, batch: int = 1, canonical: bool = True, runs: int = 3
) -> dict:
    """Seconds for `align_batch` (median of `runs`) and for the reference, row by row (one run), on one batch.

    `fallback_rows` counts the rows whose target ids do not survive decode + re-encode (prefix-decoding spans).
    """
    ids, mask = benchmark_inputs(target_tokenizer, length, batch, canonical)
    tok = adapter(target_tokenizer)
    rows = [row[keep].tolist() for row, keep in zip(ids, mask)]
    fallback_rows = sum(tok.encode(tok.decode(row))[0] != row for row in rows)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        align_batch(target_tokenizer, source_tokenizer, ids, mask)
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    for row in rows:
        reference_alignment(target_tokenizer, source_tokenizer, row)
    reference = time.perf_counter() - start
    ours = statistics.median(times)
    return dict(
        batch=batch,
        length=length,
        canonical=canonical,
        fallback_rows=fallback_rows,
        ours_s=ours,
        reference_s=reference,
        speedup=reference / ours,
    )
