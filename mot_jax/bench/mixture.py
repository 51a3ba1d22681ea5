"""The mixture part: one mixture of translators with sparse dispatch against the dense (reference) path."""

# ruff: noqa: B023  (the timing closures below run inside the loop iteration that defines them)
from __future__ import annotations

import dataclasses

from mot_jax.bench.common import Plan, Section, Table, goal_note, log, median_time, ms


def bench_mixture(plan: Plan) -> Section:
    """Forward time of one mixture (the offline pair's replay window) sparse against dense."""
    import jax
    import numpy as np
    from flax import nnx

    from mot_jax.jit import jit
    from mot_jax.translate.config import TranslatorConfig
    from mot_jax.translate.mixture import MixtureOfTranslators

    m = plan.mixture
    size = {k: m[k] for k in ("dim", "heads", "depth", "mlp_ratio")}
    base = TranslatorConfig(source_width=m["source_width"], target_width=m["target_width"], window=m["window"], **size)
    tokens = m["tokens"]
    x = jax.random.normal(jax.random.key(0), (1, tokens, base.window, base.source_width))
    forward = jit(lambda model, x: model(x))
    rows, ratios = [], {}
    for experts in m["experts"]:
        for k in m["top_k"]:
            times, slots = {}, 0
            for dispatch in ("dense", "sparse"):
                cfg = dataclasses.replace(base, num_experts=experts, top_k=k, dispatch=dispatch)
                model = MixtureOfTranslators(cfg, rngs=nnx.Rngs(0))
                run = lambda: jax.block_until_ready(forward(model, x))
                run()
                times[dispatch] = median_time(run, plan.runs)
                slots = int(np.asarray(forward(model, x)[1]["stats"]["capacity"]))
            ratios[experts, k] = times["dense"] / times["sparse"]
            rows.append(
                (
                    experts,
                    k,
                    ms(times["dense"]),
                    ms(times["sparse"]),
                    f"{ratios[experts, k]:.2f}x",
                    f"{slots} / {tokens}",
                )
            )
            log(f"  N={experts} k={k}: dense {ms(times['dense'])} ms, sparse {ms(times['sparse'])} ms")
    intro = (
        f"One K (or V) mixture of the offline pair's replay window (W = {base.window}, source width "
        f"{base.source_width}, target width {base.target_width}), translator dim {base.dim}, {base.heads} heads, depth "
        f"{base.depth}, {tokens} tokens, batch 1: the dense reference path (every expert on every token) against "
        f"dropless sparse dispatch (each expert only on its routed tokens, in the smallest of "
        f"{base.capacity_factor} x k x T / N or twice that query slots per expert that holds its queue, else the "
        "dense path), with an untrained router."
    )
    notes = [
        "Each expert still computes its attention context for every token (the input projection of the W window "
        "layers and the key/value projection in every block), a fixed part of its dense cost that bounds the gain."
    ]
    if (8, 1) in ratios:
        notes.insert(
            0, goal_note("N = 8, k = 1 sparse at least 3x faster than dense", ratios[8, 1], 3.0, True, "{:.2f}x")
        )
    if (2, 2) in ratios:
        notes.append(
            f"At N = 2, k = 2 every token goes to both experts and sparse does the dense work ({ratios[2, 2]:.2f}x)."
        )
    header = ("experts N", "top-k", "dense (ms)", "sparse (ms)", "speed-up", "query slots per expert")
    return Section(
        "Mixture: sparse dispatch against the dense (reference) path", intro, [Table(header, rows, 0)], notes
    )
