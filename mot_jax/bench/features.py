"""The features part: K/V-space training steps per second with the frozen forwards live against read from the
feature cache (`data.feature_cache`, training/features.py), side by side in one process."""

# ruff: noqa: B023  (the timing closures below run inside the loop iteration that defines them)
from __future__ import annotations

import statistics
import time

from mot_jax.bench.common import EXPERIMENT, Plan, Section, Table, load_experiment, log, median_time
from mot_jax.models.model_pair import load_pair

# the B=8 linear dial on the K/V MSE alone (tiny models: B=1), the fast loop's case
DIAL = dict(kind="linear", linear_skip=True, native_bottom=8, inputs="source,embeddings,hidden")


def bench_features(plan: Plan):
    """One training step of the K/V-MSE objective (no prompt CE) with the frozen forwards live, and from the feature
    cache of the same chunks: the same trainer, batches and compiled shapes, interleaved."""
    import jax

    from mot_jax.training import features, setup
    from mot_jax.training.channel_search import resolve_channels
    from mot_jax.training.trainer import Trainer, stack

    config = load_experiment(plan.config_arg + "direct")
    config.translator.update(DIAL | (dict(native_bottom=1) if plan.quick else {}))
    config.loss.ce_weight = 0.0
    accum, steps = config.grad_accum, plan.runs + 1
    config.data.update(feature_cache=True, train_chunks=config.batch_size * accum * steps)
    mesh = setup.make_mesh(config)
    pair = load_pair(config, mesh)
    datasets = setup.make_datasets(config, pair)
    spec, tcfg = setup.translation(config, resolve_channels(config, pair, datasets, mesh, None), pair)
    trainer = Trainer(config, pair, spec, tcfg, mesh, config.steps)
    began = time.perf_counter()
    cached_stream, _ = features.attach_features(config, pair, spec, tcfg.kind, datasets.train, [])
    ready_s = time.perf_counter() - began  # building the cache (or finding it) for the table
    table = cached_stream.table
    disk = sum(x.nbytes for x in table.leaves)
    streams = dict(live=datasets.train, cached=cached_stream)
    read_s = median_time(lambda: cached_stream.batch(0), 3) - median_time(lambda: datasets.train.batch(0), 3)
    batches = {
        name: [stack([s.batch(p * accum + i) for i in range(accum)]) for p in range(steps)]
        for name, s in streams.items()
    }
    compile_s = {}
    for name in streams:
        start = time.perf_counter()
        jax.block_until_ready(trainer.train_step(batches[name][0]))  # compiles (and warms up)
        compile_s[name] = time.perf_counter() - start
        log(f"  {name}: compiled in {compile_s[name]:.0f} s")
    times = {name: [] for name in streams}
    for p in range(1, steps):  # interleaved
        for name in streams:
            times[name].append(median_time(lambda: jax.block_until_ready(trainer.train_step(batches[name][p])), 1))
    live, cached = (statistics.median(times[n]) for n in streams)
    rows = [
        ("frozen forwards live", f"{live:.3g}", f"{1 / live:.3g}", f"{compile_s['live']:.0f}", "1.00x"),
        ("feature cache", f"{cached:.3g}", f"{1 / cached:.3g}", f"{compile_s['cached']:.0f}", f"{live / cached:.2f}x"),
    ]
    settings = config.translator
    intro = (
        f"`configs/{EXPERIMENT}:{plan.config_arg}direct` ({config.source} -> {config.target}, {config.dtype}) with "
        f"`translator.kind={settings.kind}`, `native_bottom={settings.native_bottom}`, `inputs={settings.inputs}` "
        f"and the K/V MSE alone (`loss.ce_weight=0`): one optimizer step on {config.batch_size} x {accum} sequences of "
        f"{config.data.total_tokens} target tokens, with the frozen forwards (the source prefill, the target's native "
        "prefill, its bottom layers and embeddings) run in the step, and with their outputs read from the feature "
        f"cache (`data.feature_cache=True`) of the same {table.count} chunks; the same trainer, batches and shapes, "
        "interleaved, the median step time over runs. The step time counts the device step alone: reading a batch's "
        "features from disk happens on the batch-preparing thread, beside the step."
    )
    notes = [
        f"From the feature cache: **{live / cached:.2f}x** the live steps per second.",
        f"The cache of {table.count} chunks takes {disk / 2**20:.0f} MiB on disk ({disk / table.count / 2**20:.1f} "
        f"MiB per chunk, float32 as computed); building or finding it took {ready_s:.0f} s here, and reading one "
        f"batch's features adds {max(read_s, 0) * 1e3:.0f} ms to preparing it.",
    ]
    header = ("step", "step (s)", "steps/s", "jit compile (s)", "speed-up vs live")
    title = f"Feature cache: K/V-space training steps, configs/{EXPERIMENT}"
    return Section(title, intro, [Table(header, rows)], notes)
