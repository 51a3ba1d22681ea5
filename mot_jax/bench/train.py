"""The train part: one optimizer step of the EXPERIMENT config (time, throughput, matmul FLOPs, MFU, memory)."""

# ruff: noqa: B023  (the timing closures below run inside the loop iteration that defines them)
from __future__ import annotations

import statistics
import time

from mot_jax.bench.common import EXPERIMENT, Plan, Section, Table, load_experiment, log, median_time
from mot_jax.bench.flops import matmul_flops
from mot_jax.models.model_pair import load_pair

# bf16 dense peak FLOP/s per chip, matched (first hit) as a substring of jax.devices()[0].device_kind
PEAK_FLOPS = (
    ("H200", 989e12),
    ("H100", 989e12),  # SXM
    ("A100", 312e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),
    ("TPU v4", 275e12),
)


def xla_flops(compiled) -> float | None:
    """The flops of XLA's cost analysis of a compiled program (a dict, a list of one dict per program, or None)."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # not every backend implements it
        return None
    if isinstance(analysis, list | tuple):
        analysis = analysis[0] if analysis else None
    return (analysis or {}).get("flops")


# the steps the part times: `--train_variants` names some (default: all), as (row, translator mode, dispatch)
VARIANTS = {
    "replay-sparse": ("replay, sparse", "replay", "sparse"),
    "replay-dense": ("replay, dense", "replay", "dense"),
    "direct-sparse": ("direct, sparse", "direct", "sparse"),
}


def peak_flops(device_kind: str) -> float | None:
    return next((peak for name, peak in PEAK_FLOPS if name.lower() in device_kind.lower()), None)


def bench_train(plan: Plan) -> Section:
    """Training step of the EXPERIMENT config: replay with sparse and dense mixture, and direct, interleaved."""
    import resource

    import jax

    from mot_jax.training import setup
    from mot_jax.training.channel_search import resolve_channels
    from mot_jax.training.config import resize_step
    from mot_jax.training.trainer import Trainer, stack

    def experiment(mode):
        c = load_experiment(plan.config_arg + mode)
        if plan.train_pair:
            c.source, c.target = plan.train_pair
        c.dtype = plan.train_dtype or c.dtype
        if plan.train_step:
            resize_step(c, *plan.train_step)
        return c

    config = experiment("replay")
    mesh = setup.make_mesh(config)
    pair = load_pair(config, mesh)
    datasets = setup.make_datasets(config, pair)
    accum = config.grad_accum
    batches = [stack([datasets.train.batch(p * accum + i) for i in range(accum)]) for p in range(plan.runs + 1)]
    variants, stats = {}, {}
    for name, mode, dispatch in [VARIANTS[v] for v in plan.train_variants or VARIANTS]:
        c = experiment(mode)
        c.translator.dispatch = dispatch
        spec, tcfg = setup.translation(c, resolve_channels(c, pair, datasets, mesh, None), pair)
        trainer = Trainer(c, pair, spec, tcfg, mesh, c.steps)
        start = time.perf_counter()
        traced = trainer.trace_train_step(batches[0])
        compiled = traced.lower().compile()
        m = compiled.memory_analysis()
        stats[name] = dict(
            compile_s=time.perf_counter() - start,
            planned=m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes,
            flops=matmul_flops(traced.jaxpr.jaxpr),
            xla_flops=xla_flops(compiled),
        )

        def step(batch, trainer=trainer, compiled=compiled):  # the compiled step: no second compile
            trainer.state, metrics = compiled(trainer.state, trainer.llm_states, trainer.place(batch, micro=True))
            jax.block_until_ready((trainer.state, metrics))

        step(batches[0])  # warm-up
        variants[name] = step
        log(f"  {name}: compiled in {stats[name]['compile_s']:.0f} s")
    times = {name: [] for name in variants}
    for batch in batches[1:]:  # interleaved
        for name, step in variants.items():
            times[name].append(median_time(lambda: step(batch), 1))
    tokens = config.batch_size * accum * config.data.total_tokens
    device = jax.devices()[0]
    peak = peak_flops(device.device_kind) if jax.default_backend() != "cpu" else None
    dense = statistics.median(times["replay, dense" if "replay, dense" in times else next(iter(times))])
    rows = []
    for name in variants:
        s, seconds = stats[name], statistics.median(times[name])
        achieved = s["flops"] / seconds
        mfu = (
            f"{achieved / (peak * mesh.size):.1%}"
            if peak
            else "n/a (CPU)"
            if jax.default_backend() == "cpu"
            else "n/a (unknown peak)"
        )
        rows.append(
            (
                name,
                f"{seconds:.3g}",
                f"{tokens / seconds:.0f}",
                f"{achieved / 1e9:.3g}",
                mfu,
                f"{s['planned'] / 2**30:.2f}",
                f"{s['compile_s']:.0f}",
                f"{dense / seconds:.2f}x",
            )
        )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    mixture = f"a mixture of {config.translator.num_experts} experts, k = {config.translator.top_k}"
    intro = (
        f"`configs/{EXPERIMENT}:{plan.config_arg}replay` and `:{plan.config_arg}direct` ({config.source} -> "
        f"{config.target}, {config.dtype}; {mixture}), one optimizer step on "
        f"{config.batch_size} x {accum} sequences of {config.data.total_tokens} target tokens: both frozen forwards "
        "(source prefill, with attention top-k for replay, and the native target prefill), translation, replay, the "
        "prompt CE through the target's head, the backward pass into the translator and AdamW. Step memory is XLA's "
        "plan for the compiled step (arguments + temporaries + outputs - donated buffers). GFLOP/s: the step's "
        "matmul FLOPs (counted in its jaxpr, loops times their trip count) over the step time; MFU against the "
        "device's bf16 dense peak where it is known."
    )
    notes = []
    if {"replay, sparse", "replay, dense"} <= set(times):
        sparse = dense / statistics.median(times["replay, sparse"])
        notes.append(
            f"Replay, sparse against dense mixture: {sparse:.2f}x. With few experts and k = 1 the mixture is a small "
            "part of the step (the two LLMs dominate), so real dispatch changes it little."
        )
    notes += [
        f"The process peaked at {rss:.1f} GiB RSS (every variant and both models loaded, and whatever the parts "
        "before this one in the same run held).",
    ]
    first = next(iter(stats))
    xla = stats[first]["xla_flops"]
    if xla:
        notes.append(
            f"XLA's `cost_analysis()` of the {first} step reports {xla / 1e9:.3g} GFLOP against "
            f"{stats[first]['flops'] / 1e9:.3g} GFLOP of matmuls counted here: it counts each "
            "loop body once (the layer scan, the micro-batch scan)."
        )
    header = (
        "step",
        "step (s)",
        "target tokens/s",
        "GFLOP/s",
        "MFU",
        "step memory (GiB)",
        "jit compile (s)",
        "speed-up vs replay dense",
    )
    return Section(f"Training step: configs/{EXPERIMENT}", intro, [Table(header, rows)], notes)
