"""The align part: the vectorised token alignment against the authors' per-token reference."""

from __future__ import annotations

from mot_jax.bench.common import Plan, Section, Table, goal_note, log, ms, span


def bench_align(plan: Plan) -> Section:
    from mot_jax.models.loading import load_tokenizer
    from mot_jax.translate.align_reference import benchmark_alignment

    a = plan.align
    target, source = load_tokenizer(a["target"]), load_tokenizer(a["source"])
    rows, fast, fallback = [], [], []
    for canonical in (True, False):
        for batch in a["batches"]:
            r = benchmark_alignment(
                target, source, length=a["length"], batch=batch, canonical=canonical, runs=plan.runs
            )
            (fast if canonical else fallback).append(r["speedup"])
            kind = "re-encodable" if canonical else "not re-encodable"
            rows.append(
                (kind, batch, r["fallback_rows"], ms(r["ours_s"]), ms(r["reference_s"]), f"{r['speedup']:.0f}x")
            )
            log(f"  batch {batch} {kind}: {r['speedup']:.0f}x")
    intro = (
        f"{a['length']}-token {a['target']} texts (accents, CJK, emoji, whitespace runs, newlines) aligned to "
        f"{a['source']}'s tokenization; the reference is the authors' algorithm in Python loops "
        "(`mot_jax/translate/align_reference.py`), one row at a time, timed once (mot_jax: the median of the runs). "
        "Re-encodable ids survive decode + re-encode (the normal case); the others (encoded in 97-character pieces, "
        "chunk boundaries that split a multi-token sequence) take the prefix-decoding fallback."
    )
    notes = [
        goal_note("at least 50x when the ids are re-encodable", min(fast), 50, True, "{:.0f}x"),
        f"Ids that are not re-encodable need the reference's prefix-decoding spans, which are quadratic by "
        f"definition; batched in Rust they are {span(fallback, '{:.0f}x')} faster than the reference.",
    ]
    header = ("ids", "batch", "rows on the prefix fallback", "mot_jax (ms)", "per-token reference (ms)", "speed-up")
    table = Table(header, rows)
    return Section("Alignment: vectorised against the per-token reference", intro, [table], notes)
