"""The ttft part: time to first token of native prefill and of the translators (the evaluation's measurement)."""

from __future__ import annotations

from mot_jax.bench.common import EXPERIMENT, Plan, Section, Table, goal_note, load_experiment, log, ms, span


def ttft_methods(plan: Plan):
    """(model pair, [Native, translated methods], what the translators are): untrained translators of the
    EXPERIMENT config (replay, direct), or the trained translators of `plan.workdirs`."""
    import ml_collections
    from flax import nnx

    from mot_jax.evals.methods import Native, Translated
    from mot_jax.training import setup
    from mot_jax.training.channel_search import resolve_channels
    from mot_jax.translate.translator import KVTranslator

    if plan.workdirs:
        from mot_jax.evals.run import trained_methods

        translated, config = trained_methods(plan.workdirs, "last")
        pair = setup.load_pair(
            ml_collections.ConfigDict(dict(source=config.source, target=config.target, dtype=config.dtype))
        )
        what = f"{config.source} -> {config.target}, trained translators ("
        what += ", ".join(f"`{m.workdir}` step {m.step}" for m in translated) + ")"
        return pair, [Native(), *translated], what
    pair, methods = None, [Native()]
    for mode in ("replay", "direct"):
        config = load_experiment(plan.config_arg + mode)
        pair = pair or setup.load_pair(config)
        channel_map = resolve_channels(config, pair)  # terminal: no search, no data
        spec, tcfg = setup.translation(config, channel_map, pair)
        translator = KVTranslator(spec, tcfg, rngs=nnx.Rngs(config.seed))
        methods.append(Translated(mode, translator, "untrained", 0))
    what = (
        f"{config.source} -> {config.target}, untrained translators of `configs/{EXPERIMENT}:{plan.config_arg}replay`"
    )
    return pair, methods, f"{what} and `:{plan.config_arg}direct` (timing does not depend on the weights)"


def describe(method, target) -> str:
    spec, cfg = method.translator.spec, method.translator.cfg
    name = method.name if spec.mode in method.name else f"{method.name} ({spec.mode})"
    text = (
        f"{name}: {len(spec.target_layers)} of the target's {target.config.num_layers} "
        f"layers, translator dim {cfg.dim}, {cfg.num_experts} experts (k = {cfg.top_k})"
    )
    if spec.attention_topk:
        text += f", sparse top-{spec.attention_topk} attention from the source's attention"
    return text + ("" if cfg.fused_output else ", one output projection per layer")


def ttft_plot(lengths, series: dict, path):
    """TTFT (s) against context length, one line per series; dashed lines include the source's prefill."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    for label, seconds in series.items():
        ax.plot(lengths, seconds, marker="o", linestyle="--" if "+" in label else "-", label=label)
    ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="time to first token (s)", title="Batch 1")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)


def bench_ttft(plan: Plan) -> Section:
    from mot_jax.errors import MotJaxError
    from mot_jax.evals.latency import latency, ttft_setup
    from mot_jax.evals.prompts import Settings

    models, methods, what = ttft_methods(plan)
    settings = Settings(batch_size=1)
    ttft = ttft_setup(models, plan.lengths, settings.max_new_tokens, seed=0)
    lengths = ttft.lengths
    if not lengths:
        raise MotJaxError(f"No ttft length fits the target model (at most {ttft.limit} tokens); lower --lengths.")
    if len(lengths) < len(plan.lengths):
        log(f"  ttft: lengths above {ttft.limit} do not fit the target model; skipped")
    rows = latency(models, methods, ttft.example, lengths, settings, plan.runs, memory=False)
    at = {(r["method"], i // len(methods)): r for i, r in enumerate(rows)}  # (method, length index) -> its row
    native, translated = methods[0], methods[1:]
    direct = next((m for m in translated if m.translator.spec.mode == "direct"), None)
    reference = direct or translated[0]  # whose source prefill the table shows
    mib = lambda n: f"{n / 2**20:.2f}"
    header = (
        "context tokens",
        *(f"{m.name} TTFT (ms)" for m in methods),
        "source prefill (ms)",
        *(f"{m.name} / native" for m in translated),
        "target KV (MiB)",
        *(f"{m.name} handed over (MiB)" for m in translated),
    )
    indices = range(len(lengths))
    ratios = {m.name: [at[m.name, i]["ttft_s"] / at[native.name, i]["ttft_s"] for i in indices] for m in translated}
    table_rows = [
        (
            at[native.name, i]["context_tokens"],
            *(ms(at[m.name, i]["ttft_s"]) for m in methods),
            ms(at[reference.name, i]["ttft_with_source_s"] - at[reference.name, i]["ttft_s"]),
            *(f"{ratios[m.name][i]:.2f}" for m in translated),
            mib(at[native.name, i]["target_kv_bytes"]),
            *(mib(at[m.name, i]["handed_bytes"]) for m in translated),
        )
        for i in indices
    ]
    tokens = [at[native.name, i]["context_tokens"] for i in indices]
    series = {m.name: [at[m.name, i]["ttft_s"] for i in indices] for m in methods}
    series[f"{reference.name} + source prefill"] = [at[reference.name, i]["ttft_with_source_s"] for i in indices]
    intro = (
        f"{what} ({'; '.join(describe(m, models.target) for m in translated)}); batch 1, measured by "
        "`mot_jax.evals.latency.latency` (the evaluation's TTFT, median of the runs after one that compiles): a "
        "synthetic long-context passage cut to each length in target tokens, then the question suffix and the first "
        "answer token. Native: the target prefills the context itself. Translated: the translation from an "
        "existing source cache, then the suffix and the first token; source prefill is the source's own prefill of "
        f"the context (with the alignment, from the {reference.name} row), to add when the source cache does not "
        "exist yet. Target KV: the cache the target holds for the context; handed over: the source K/V the "
        "translator reads."
    )
    notes = []
    if direct and 2048 in tokens:
        ratio = ratios[direct.name][tokens.index(2048)]
        notes.append(goal_note("direct at most half of native prefill at 2,048 tokens", ratio, 0.5, False))
        if ratio > 0.5:
            notes.append(
                "The translator's cross-attention over the whole context is O(T^2) in every block, like "
                "the target's own attention; a causal, blocked translator attention or a local window is "
                "the next step."
            )
    for m in translated:
        if m.translator.spec.mode == "replay":
            notes.append(
                f"{m.name} / native: {span(ratios[m.name])}; replay re-reads the context through the target "
                "after the translation, so it costs more than native prefill by design."
            )
    return Section(
        "Time to first token: native, replay and direct",
        intro,
        [Table(header, table_rows, 0)],
        notes,
        plot=lambda path: ttft_plot(tokens, series, path),
    )
