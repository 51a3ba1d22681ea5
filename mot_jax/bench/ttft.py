"""The ttft part: time to first token of every method the project has, side by side in one run (the evaluation's
measurement, `mot_jax.evals.latency.latency`): native prefill, the text relay, untrained translators of every kind
(or the trained translators of `plan.workdirs`, with the source answering alone) and KVComm on the two homogeneous
pairs it allows."""

from __future__ import annotations

import dataclasses

from mot_jax.bench.common import EXPERIMENT, Plan, Section, Table, goal_note, load_experiment, log, ms, span
from mot_jax.evals.methods import SOURCE_ALONE
from mot_jax.translate import kinds

# Every untrained translator the part times: (EXPERIMENT config argument, translator overrides). TTFT does not
# depend on the weights, so the untrained translators of these configs time what their trained ones would.
TRANSLATORS = (
    ("replay", {}),  # MoT replay, sparse attention
    ("replay", dict(sparse_attention=False)),  # MoT replay, dense attention
    ("direct", {}),  # MoT direct
    # the dial between direct and native at several B (the target's own bottom layers; the source-free control
    # costs the same less the source's share of a linear map)
    ("direct,skip", dict(kind="linear", native_bottom=0, inputs="source,embeddings")),
    *(("direct,skip", dict(kind="linear", native_bottom=b, inputs="source,embeddings,hidden")) for b in (4, 8, 12)),
    ("single", {}),  # single translator
    # every other registered kind at its reference's settings (`Kind.recipe`; C2C's, MoT-h's and Interlat's
    # translations include a target forward over the context); `linear` is the dial above
    *((name, {}) for name in kinds.names() if name not in ("mot", "linear")),
)


@dataclasses.dataclass
class Group:
    """Methods timed on one model pair (one `latency` call); their ratios are to the native prefill of `target`."""

    models: object
    names: tuple  # (source, target) model names
    methods: list


def untrained(plan: Plan, pair=None) -> tuple:
    """(model pair, [(Translated, what it is)], (source, target) names): the untrained TRANSLATORS."""
    import jax
    from flax import nnx

    from mot_jax.evals.methods import Translated, method_name
    from mot_jax.evals.run import attention_name
    from mot_jax.models.model_pair import load_pair
    from mot_jax.training import setup
    from mot_jax.training.channel_search import resolve_channels
    from mot_jax.translate.translator import KVTranslator

    methods = []
    for arg, overrides in TRANSLATORS:
        if plan.quick and "native_bottom" in overrides:  # the tiny target has 4 layers: one dial point, B=2
            if overrides["native_bottom"] != 8:
                continue
            overrides = dict(overrides, native_bottom=2)
        config = load_experiment(plan.config_arg + arg)
        config.translator.update(overrides)
        pair = pair or load_pair(config)
        channel_map = resolve_channels(config, pair)  # terminal: no search, no data
        spec, tcfg = setup.translation(config, channel_map, pair)
        name = method_name(config)
        if "sparse_attention" in overrides:
            name = f"{name}, {attention_name(spec)}"
        if not wanted(plan, name):  # before the translator is built (LSC's has 589M parameters)
            continue
        translator = KVTranslator(spec, tcfg, rngs=nnx.Rngs(config.seed))
        params = sum(x.size for x in jax.tree.leaves(nnx.state(translator, nnx.Param)))
        setting = "".join(f", {k}={v}" for k, v in overrides.items())
        what = (
            f"{name}: `:{arg}`{setting}; {len(spec.target_layers)} of the target's {pair.target.config.num_layers} "
            f"layers, {params / 1e6:.3g}M parameters"
        )
        methods.append((Translated(name, translator, "untrained", 0), what))
    return pair, methods, (config.source, config.target)


BARS = ("native", SOURCE_ALONE)  # kept whatever --only says: every ratio is to native, the source alone is a bar


def wanted(plan: Plan, name: str) -> bool:
    """Whether --only keeps a method: the BARS always, else a name holding one of its strings."""
    return not plan.only or name in BARS or any(part in name for part in plan.only)


def groups(plan: Plan) -> tuple[list[Group], str]:
    """The model pairs and their methods, and a sentence on what the translators are."""
    from mot_jax.evals.config import defaults
    from mot_jax.evals.kvcomm import KVComm
    from mot_jax.evals.methods import Native, SourceAlone, TextRelay
    from mot_jax.evals.prompts import target_chat
    from mot_jax.models.model_pair import ModelPair, load_pair

    if plan.workdirs:
        import ml_collections

        from mot_jax.evals.run import trained_methods, with_recomputation

        translated, config = trained_methods(plan.workdirs, "last")
        translated = with_recomputation(translated, plan.recompute)
        names = (config.source, config.target)
        models = load_pair(ml_collections.ConfigDict(dict(source=names[0], target=names[1], dtype=config.dtype)))
        what = "trained translators (" + ", ".join(f"`{m.workdir}` step {m.step}" for m in translated) + ")"
    else:
        models, described, names = untrained(plan)
        translated = [m for m, _ in described]
        what = (
            f"untrained translators of `configs/{EXPERIMENT}` (timing does not depend on the weights; "
            + "; ".join(d for _, d in described)
            + ")"
        )
    relay_tokens = defaults().relay_tokens
    source, target = models.source, models.target
    # beside trained translators, the source answering alone (in its own chat format, as the evaluation's row)
    alone = [SourceAlone(target_chat("auto", names[0], models.source_tokenizer))] if plan.workdirs else []
    timed = [m for m in (Native(), *alone, TextRelay(relay_tokens), *translated) if wanted(plan, m.name)]
    with_kvcomm = wanted(plan, "KVComm")
    if all(m.name in BARS for m in timed) and not with_kvcomm:
        from mot_jax.errors import MotJaxError

        raise MotJaxError(
            f"--only {' '.join(plan.only)} names no method; pass part of a method's name (BENCHMARKS.md lists them)."
        )
    found = [Group(models, names, timed)]
    # KVComm hands the source's raw K/V to the target: one architecture and depth, so the homogeneous pairs only
    sides = {names[1]: (target, models.target_tokenizer), names[0]: (source, models.source_tokenizer)}
    for name, (model, tokenizer) in sides.items() if with_kvcomm else ():  # one pair when both are the same model
        homogeneous = ModelPair(model, model, tokenizer, tokenizer)
        kvcomm = KVComm(names=(name, name))
        kvcomm.prepare(homogeneous)  # calibrates its layers on the target's attention (the evaluation's default)
        natives = [] if name == names[1] else [Native()]  # the target's native prefill is already timed
        found.append(Group(homogeneous, (name, name), [*natives, kvcomm]))
    return found, f"{names[0]} -> {names[1]}, {what}"


def ttft_plot(lengths, series: dict, path):
    """TTFT (s) against context length, one line per series; dashed lines include the source's prefill."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    fig = Figure(figsize=(7, 5))
    ax = fig.add_subplot()
    colors = colormaps["tab20"].colors
    for i, (label, seconds) in enumerate(series.items()):
        style = "--" if "+" in label else "-"
        ax.plot(lengths, seconds, marker="o", linestyle=style, color=colors[i % len(colors)], label=label)
    ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="time to first token (s)", title="Batch 1")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)


def pair_name(row) -> str:
    return row["target"] if row["method"] == "native" else f"{row['source']} -> {row['target']}"


def ttft_tables(rows: list) -> tuple[list[Table], dict]:
    """The part's tables from `latency` rows (each with its pair's `source` and `target` names added): every method
    at the longest length with its stages, then every length; ratios to the native prefill of the row's target at
    the same length. Returns the tables and {(method, target): [TTFT / native per length]} (ascending lengths)."""
    native = {(r["target"], r["context_tokens"]): r["ttft_s"] for r in rows if r["method"] == "native"}
    lengths = sorted({r["context_tokens"] for r in rows if r["method"] == "native"})
    keys = list(dict.fromkeys((r["method"], r["source"], r["target"]) for r in rows))  # run order
    at = {(r["method"], r["source"], r["target"], r["context_tokens"]): r for r in rows}
    ratio = lambda r, key: r[key] / native[r["target"], r["context_tokens"]]
    mib = lambda n: f"{n / 2**20:.2f}"
    longest = lengths[-1]
    detail = Table(
        (
            "method",
            "source -> target",
            "TTFT (ms)",
            "/ native",
            "TTFT incl. source prefill (ms)",
            "/ native",
            "stages (ms)",
            "handed over (MiB)",
            "target KV (MiB)",
        ),
        [
            (
                r["method"],
                pair_name(r),
                ms(r["ttft_s"]),
                f"{ratio(r, 'ttft_s'):.2f}",
                ms(r["ttft_with_source_s"]),
                f"{ratio(r, 'ttft_with_source_s'):.2f}",
                ", ".join(f"{stage} {ms(s)}" for stage, s in r["stages"].items()),
                mib(r["handed_bytes"]),
                mib(r["target_kv_bytes"]),
            )
            for r in (at[(*k, longest)] for k in keys)
        ],
        2,
    )
    header = ["method", "source -> target"]
    for n in lengths:
        header += [f"{n}: TTFT (ms)", f"{n}: / native", f"{n}: incl. source / native"]
    every = []
    for key in keys:
        row = list(key[:1]) + [pair_name(at[(*key, lengths[0])])]
        for n in lengths:
            r = at[(*key, n)]
            row += [ms(r["ttft_s"]), f"{ratio(r, 'ttft_s'):.2f}", f"{ratio(r, 'ttft_with_source_s'):.2f}"]
        every.append(row)
    ratios = {(k[0], k[2]): [ratio(at[(*k, n)], "ttft_s") for n in lengths] for k in keys}
    every_length = "Every length (ratios to the native prefill of the row's target at that length):"
    return [detail, every_length, Table(header, every, 2)], ratios


def bench_ttft(plan: Plan) -> Section:
    from mot_jax.errors import MotJaxError
    from mot_jax.evals.config import defaults
    from mot_jax.evals.latency import latency, ttft_setup
    from mot_jax.evals.prompts import Settings

    found, what = groups(plan)
    settings = Settings(batch_size=1)
    rows = []
    wanted = plan.lengths[-1:] if plan.quick else plan.lengths  # quick: one length, half the compiles
    for group in found:
        ttft = ttft_setup(group.models, wanted, settings.max_new_tokens, seed=0)
        if not ttft.lengths:
            raise MotJaxError(f"No ttft length fits the target model (at most {ttft.limit} tokens); lower --lengths.")
        if len(ttft.lengths) < len(wanted):
            log(f"  ttft: lengths above {ttft.limit} do not fit {group.names[1]}; skipped")
        log(f"  ttft: {group.names[0]} -> {group.names[1]}: {', '.join(m.name for m in group.methods)}")
        timed = latency(group.models, group.methods, ttft.example, ttft.lengths, settings, plan.runs, memory=False)
        rows += [dict(r, source=group.names[0], target=group.names[1]) for r in timed]
    body, ratios = ttft_tables(rows)
    main = found[0]
    target = main.names[1]
    lengths = sorted({r["context_tokens"] for r in rows if r["target"] == target})
    label = lambda r: r["method"] if r["target"] == target else f"{r['method']} ({pair_name(r)})"
    series = {}
    for r in sorted(rows, key=lambda r: r["context_tokens"]):  # stable: run order within a length
        series.setdefault(label(r), []).append(r["ttft_s"])
    translated = [m for m in main.methods if hasattr(m, "translator")]
    spec = lambda m: m.translator.spec
    direct = next((m for m in translated if spec(m).mode == "direct" and not spec(m).native_bottom), None)
    if direct:
        with_source = [r for r in rows if r["method"] == direct.name and r["target"] == target]
        series[f"{direct.name} + source prefill"] = [r["ttft_with_source_s"] for r in with_source]
    series = {k: v for k, v in series.items() if len(v) == len(lengths)}  # a pair whose target fits fewer lengths
    kvcomm = (
        "; KVComm (no translator: the source's raw K/V at the layers its calibration picks, "
        "`mot_jax/evals/kvcomm.py`) on the homogeneous pairs it allows, with the native prefill of its own target"
    )
    only = f" (`--only {' '.join(plan.only)}`: native and the methods it names)" if plan.only else ""
    intro = (
        f"{what}{kvcomm if len(found) > 1 else ''}. "
        f"Batch 1, every method{only} in this one run, measured by `mot_jax.evals.latency.latency` (the evaluation's "
        "TTFT, median of the runs after one that compiles): a synthetic long-context passage cut to each length in "
        "target tokens, then the question suffix and the first answer token. Native: the target prefills the context "
        "itself. Source alone (beside trained translators): the source prefills the context and answers itself (the "
        "bar a translation into a bigger target must beat). Text relay: the source writes a summary of the context "
        "(up to "
        f"{defaults().relay_tokens} tokens, greedy), which the target prefills; it has no source cache to reuse, "
        "so both columns hold all of it. Translated and KVComm: TTFT is the work from an existing source cache (the "
        "translation, which for replay, C2C, MoT-h and Interlat includes the target's own pass over the context, "
        "the dial's own bottom layers, or KVComm's handover), then the suffix and the first token; the second "
        "column adds "
        "the source's own prefill of the context (with the alignment), for when the source cache does not exist "
        "yet. Stages: the seconds of each step at the longest length (source_prefill, target_bottom: the target's "
        "own bottom layers under a direct translator, alignment: a source-free translator's token alignment, "
        "translation, handover, "
        "prefill, source_summary, answer: the suffix and the first token). Handed over: what the target gets from "
        "the source (K/V the translator reads, the summary's bytes, the passage's for native); target KV: the cache "
        "the target holds for the context."
    )
    notes = []
    if direct and 2048 in lengths:
        ratio = ratios[direct.name, target][lengths.index(2048)]
        notes.append(goal_note("direct at most half of native prefill at 2,048 tokens", ratio, 0.5, False))
    replays = [m.name for m in translated if m.translator.spec.replays_kv]
    if replays:  # MoT-h runs one dense forward with its inputs replaced, not a replay after the translation
        spans = ", ".join(f"{name} {span(ratios[name, target])}" for name in replays)
        notes.append(
            f"Replay / native: {spans}; replay re-reads the context through the target after the translation, so it "
            "costs more than native prefill by design."
        )
    return Section(
        "Time to first token: every method",
        intro,
        body,
        notes,
        plot=lambda path: ttft_plot(lengths, series, path),
    )
