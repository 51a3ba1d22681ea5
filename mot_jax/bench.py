"""Benchmarks: every part in one run writes the benchmark page; one part prints its section.

  python -m mot_jax.bench                       # every part -> BENCHMARKS.md + benchmarks_ttft.png (here, or --out)
  python -m mot_jax.bench models                # prefill (and decode) against transformers: random-init shapes at
                                                # 512 tokens, and the offline pair at 128 / 512 / 2,048 tokens
  python -m mot_jax.bench mixture               # sparse against dense mixture, N = 2, 4, 8 and k = 1, 2
  python -m mot_jax.bench align                 # alignment of 2,048-token texts against the per-token reference
  python -m mot_jax.bench ttft                  # native / replay / direct time to first token (evals.latency)
  python -m mot_jax.bench ttft --workdirs=DIR   # ... of trained translators (training workdirs) instead of untrained
  python -m mot_jax.bench train                 # the training step of configs/smollm2_gemma3.py (replay and direct)
  python -m mot_jax.bench --quick --out=/tmp/bench/BENCHMARKS.md   # every part on tiny random models

Time: the whole page takes about 15 minutes on a 2-core CPU with the default `--runs=3` (models ~7, ttft ~2, train
~2, align ~1, mixture ~0.5), after the offline models are converted and the corpus prepared. `--quick` runs every
part on tiny random models with tiny sizes and one run per cell (it ignores the size flags) in 1-1.5 minutes, most
of it compiling: it checks that the page builds, its numbers mean nothing; without --out it writes no page. Parts
named on the command line are printed (each section's Markdown on stdout, progress on stderr); with --out they also
make a page of their own. The page is written (atomically, with its plot) only after every part has succeeded.

Both sides of a comparison do the same work in one process, interleaved: same weights, dtype, batch and tokens;
prefill fills the cache and computes logits for the last position only (transformers: `logits_to_keep=1`); torch
uses as many threads as XLA has cores; compile time is reported apart; each cell is the median of `--runs` runs.
"""

# ruff: noqa: B023  (the timing closures below run inside the loop iteration that defines them)
from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import importlib.util
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from mot_jax.models import tiny

PAGE, PLOT = "BENCHMARKS.md", "benchmarks_ttft.png"
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
EXPERIMENT = "smollm2_gemma3.py"  # the config whose translators the ttft and train parts time

# Random-init stand-ins with the real shapes (Qwen2 at 12 layers of Qwen2.5-0.5B so a CPU run stays short), and the
# tiny random families of `mot_jax.models.tiny` for --quick.
RANDOM = {
    "gpt2": dict(model_type="gpt2", n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=2048),
    "opt-125m": dict(
        model_type="opt", num_hidden_layers=12, hidden_size=768, num_attention_heads=12, ffn_dim=3072,
        vocab_size=50272, max_position_embeddings=2048,
    ),
    "qwen2-160m": dict(
        model_type="qwen2", num_hidden_layers=12, hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
    ),
}  # fmt: skip
RANDOM |= {
    f"tiny-{family}": tiny.hf_config(tiny.PREFIX + family) for family in ("gpt2", "opt", "qwen2", "llama", "gemma3")
}

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


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the parts measure: the flags' values, or tiny ones for --quick."""

    runs: int
    models: tuple  # random-init shapes (RANDOM) or model names: prefill at `tokens`, every batch and dtype
    tokens: int
    batches: tuple
    dtypes: tuple
    pair: tuple  # real models: prefill at every length (batch 1, float32) and greedy decode
    lengths: tuple  # the pair's prefill lengths and the ttft context lengths
    decode_tokens: int
    decode_prompt: int
    mixture: dict  # tokens, widths, window and translator size of the mixture part
    align: dict  # target and source tokenizers, text length, batches
    config_arg: str  # prefix of the EXPERIMENT config argument ("tiny," for tiny random models)
    workdirs: tuple = ()
    quick: bool = False


DEFAULT_MIXTURE = dict(tokens=512, source_width=192, target_width=256, window=5, dim=256, heads=4, depth=1,
                       mlp_ratio=4, experts=(2, 4, 8), top_k=(1, 2))  # fmt: skip
QUICK = Plan(
    runs=1, models=("tiny-gpt2", "tiny-qwen2"), tokens=64, batches=(1, 2), dtypes=("float32", "bfloat16"),
    pair=("tiny-llama", "tiny-gemma3"), lengths=(32, 64), decode_tokens=8, decode_prompt=16,
    mixture=dict(tokens=64, source_width=32, target_width=32, window=2, dim=32, heads=2, depth=1, mlp_ratio=2,
                 experts=(2, 8), top_k=(1,)),
    align=dict(target="random:gemma3", source="random:llama", length=128, batches=(1, 2)), config_arg="tiny,",
    quick=True,
)  # fmt: skip
# --quick compiles with XLA's cheap CPU pipeline (it halves the compile time; the numbers mean nothing anyway)
QUICK_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


# ---------------------------------------------------------------------------------------------------- sections


@dataclasses.dataclass
class Table:
    header: tuple
    rows: list  # rows of cells (str() is applied)
    left: int = 1  # the first `left` columns are names (left-aligned); the others are numbers

    def markdown(self) -> str:
        align = ["---"] * self.left + ["---:"] * (len(self.header) - self.left)
        rows = [self.header, align, *self.rows]
        return "\n".join("| " + " | ".join(map(str, row)) + " |" for row in rows)


@dataclasses.dataclass
class Section:
    """One part's result: what it measures, its tables (and paragraphs between them), notes computed from the
    numbers, and optionally a plot that the page writer draws into a file (`plot(path)`)."""

    title: str
    intro: str
    body: list  # Tables and paragraphs (str), in order
    notes: list = dataclasses.field(default_factory=list)
    plot: Callable | None = None
    part: str = ""  # set by run_parts, with the seconds the part took
    seconds: float = 0.0

    def markdown(self, image: str | None = None) -> str:
        blocks = [f"## {self.title}", self.intro]
        blocks += [b.markdown() if isinstance(b, Table) else b for b in self.body]
        if image:
            blocks.append(f"![{self.title}]({image})")
        blocks += self.notes
        return "\n\n".join(blocks) + "\n"


def goal_note(goal: str, value: float, threshold: float, higher_is_better: bool, fmt: str = "{:.2f}") -> str:
    """The note 'Goal (GOAL): **met, VALUE**.' (or 'not met'): `value` against `threshold`."""
    met = value >= threshold if higher_is_better else value <= threshold
    return f"Goal ({goal}): **{'met' if met else 'not met'}, {fmt.format(value)}**."


def ms(seconds: float) -> str:
    """Milliseconds with the digits that matter (tiny models run in well under a millisecond)."""
    value = seconds * 1e3
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 1 else f"{value:.3f}"


def span(values, fmt="{:.2f}x") -> str:
    low, high = min(values), max(values)
    return fmt.format(low) if fmt.format(low) == fmt.format(high) else f"{fmt.format(low)}-{fmt.format(high)}"


def log(message: str):
    print(message, file=sys.stderr, flush=True)


def median_time(fn, runs):
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def load_experiment(arg: str):
    """The EXPERIMENT training config (configs/ is not a package: loaded from its file)."""
    spec = importlib.util.spec_from_file_location(EXPERIMENT.removesuffix(".py"), CONFIGS / EXPERIMENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


# ---------------------------------------------------------------------------------------------------- models


def random_checkpoint(name, path):
    import torch
    import transformers

    if not os.path.isdir(path):  # one checkpoint per model, whatever the dtypes
        config = transformers.AutoConfig.for_model(**RANDOM[name])
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def load_both(name, dtype, tmp):
    """(our model, the transformers model) with the same weights."""
    import torch
    import transformers

    from mot_jax.models import gguf
    from mot_jax.models.loading import load_model

    if name in RANDOM:
        path = random_checkpoint(name, os.path.join(tmp, name))
    elif gguf.resolve_gguf(name):  # transformers reads our converted cache: the same de-quantized weights
        _, _, path = gguf.convert(gguf.resolve_gguf(name), name if name in gguf.EMBEDDED else None, load=False)
    else:
        path = name
    ours, _ = load_model(path, dtype=dtype)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    return ours, theirs


def bench_prefill(ours, theirs, ids, runs):
    """(mot_jax seconds, transformers seconds, jit compile seconds) for one prefill of `ids`, interleaved."""
    import jax
    import jax.numpy as jnp
    import torch

    from mot_jax.jit import jit

    prefill = jit(lambda model, ids: model(ids, logits_to_keep=1)[0])
    jids, tids = jnp.asarray(ids), torch.tensor(ids)

    def run_ours():
        jax.block_until_ready(prefill(ours, jids))

    def run_theirs():
        with torch.no_grad():
            theirs(tids, logits_to_keep=1, use_cache=True)

    compile_s = median_time(run_ours, 1)
    run_theirs()  # warm-up
    pairs = [(median_time(run_ours, 1), median_time(run_theirs, 1)) for _ in range(runs)]
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs), compile_s


def bench_decode(ours, theirs, new_tokens, prompt, runs):
    """Greedy tokens per second after a `prompt`-token prompt at batch 1 (generate N minus generate 1); None where
    the difference is not positive (noise on tiny models)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from mot_jax.models.base import generate

    ids = np.random.default_rng(1).integers(0, ours.config.vocab_size, size=(1, prompt))

    def ours_fn(k):
        return lambda: jax.block_until_ready(generate(ours, jnp.asarray(ids), max_new_tokens=k, eos_ids=()))

    def theirs_fn(k):
        def run():
            with torch.no_grad():
                theirs.generate(torch.tensor(ids), max_new_tokens=k, min_new_tokens=k, do_sample=False)

        return run

    for k in (1, new_tokens):
        ours_fn(k)(), theirs_fn(k)()  # compile / warm up
    rates = []
    for fn in (ours_fn, theirs_fn):
        extra = median_time(fn(new_tokens), runs) - median_time(fn(1), runs)
        rates.append((new_tokens - 1) / extra if extra > 0 else None)
    return tuple(rates)


def compare_models(names, dtypes, lengths, batches, plan, tmp, decode=False):
    """Prefill rows (name, dtype, tokens, batch, ours s, theirs s, compile s) and decode rows (name, dtype, ours
    tokens/s, theirs tokens/s)."""
    import numpy as np

    prefill_rows, decode_rows = [], []
    for name in names:
        for dtype in dtypes:
            ours, theirs = load_both(name, dtype, tmp)
            for length in lengths:
                for batch in batches:
                    ids = np.random.default_rng(0).integers(0, ours.config.vocab_size, size=(batch, length))
                    mo, mt, compile_s = bench_prefill(ours, theirs, ids, plan.runs)
                    prefill_rows.append((name, dtype, length, batch, mo, mt, compile_s))
                    log(f"  {name} {dtype} T={length} B={batch}: mot_jax {ms(mo)} ms, transformers {ms(mt)} ms "
                        f"(compile {compile_s:.1f} s)")  # fmt: skip
            if decode and plan.decode_tokens > 1:
                rates = bench_decode(ours, theirs, plan.decode_tokens, plan.decode_prompt, plan.runs)
                decode_rows.append((name, dtype, *rates))
                log(f"  {name} {dtype} decode (tokens/s): mot_jax {rate(rates[0])}, transformers {rate(rates[1])}")
    return prefill_rows, decode_rows


def prefill_table(rows) -> Table:
    header = ("model", "dtype", "tokens", "batch", "mot_jax (ms)", "transformers (ms)", "speed-up", "jit compile (s)")
    cells = [(name, dtype, length, batch, ms(mo), ms(mt), f"{mt / mo:.2f}x", f"{compile_s:.1f}")
             for name, dtype, length, batch, mo, mt, compile_s in rows]  # fmt: skip
    return Table(header, cells, left=2)


def rate(tokens_per_s) -> str:
    return "n/a" if tokens_per_s is None else f"{tokens_per_s:.1f}"


def decode_table(rows) -> Table:
    cells = [(name, dtype, rate(ours), rate(theirs), f"{ours / theirs:.2f}x" if ours and theirs else "n/a")
             for name, dtype, ours, theirs in rows]  # fmt: skip
    return Table(("model", "dtype", "mot_jax (tokens/s)", "transformers (tokens/s)", "speed-up"), cells, left=2)


BF16_ON_CPU = (
    "PyTorch's CPU bf16 matmuls go through oneDNN's native bf16 kernels, while XLA's CPU backend does not reach "
    "that speed. These XLA flags made no difference to bf16 (SmolLM2-135M, 512 tokens): `--xla_cpu_use_onednn=true`, "
    "`--xla_cpu_experimental_onednn_custom_call=true`, `--xla_cpu_use_xnnpack=true`, "
    "`--xla_cpu_experimental_xnn_fusion_type=dot`, `--xla_cpu_experimental_onednn_fusion_type=dot`. Use float32 on "
    "CPU; bfloat16 is for accelerators."
)


def weights(names) -> str:
    if all(name in RANDOM for name in names):
        return ("random weights, `RANDOM` in `mot_jax/bench.py`: gpt2 and opt-125m at full size, Qwen2.5-0.5B's layer "
                "shape at 12 layers, `tiny-*` the tiny random families")  # fmt: skip
    return "de-quantized GGUF weights for the embedded models: transformers reads our converted cache of the same file"


def speedups(rows, dtype):
    return [mt / mo for _, d, _, _, mo, mt, _ in rows if d == dtype]


def bench_models(plan: Plan) -> Section:
    import jax
    import torch
    import transformers

    torch.set_num_threads(1 if plan.quick else os.cpu_count())  # quick: no threads spinning on a busy machine
    transformers.utils.logging.disable_progress_bar()
    body = []
    with tempfile.TemporaryDirectory() as tmp:
        if plan.models:
            rows, _ = compare_models(plan.models, plan.dtypes, (plan.tokens,), plan.batches, plan, tmp)
            body += [
                "### Random-init shapes",
                f"{', '.join(plan.models)} ({weights(plan.models)}) at {plan.tokens} tokens.",
                prefill_table(rows),
            ]
            fp32, bf16 = speedups(rows, "float32"), speedups(rows, "bfloat16")
            notes = []
            if fp32:
                notes.append(f"float32: mot_jax prefill runs at {span(fp32)} transformers' speed.")
            if bf16:
                notes.append(f"bfloat16: {span(bf16)}.")
                if jax.default_backend() == "cpu" and statistics.median(bf16) < 1:
                    notes.append(f"mot_jax is slower in bfloat16 on XLA:CPU: {BF16_ON_CPU}")
            body.append(" ".join(notes))
        if plan.pair:
            rows, decode = compare_models(plan.pair, ("float32",), plan.lengths, (1,), plan, tmp, decode=True)
            body += [
                "### The offline pair",
                f"{' and '.join(plan.pair)} ({weights(plan.pair)}), float32, batch 1, at "
                f"{', '.join(map(str, plan.lengths))} tokens. A fresh prefill attends in causal query blocks of 512, "
                "skipping the keys after each block.",
                prefill_table(rows),
            ]
            notes = [goal_note("float32 prefill faster than transformers in every cell", min(speedups(rows, "float32")),
                               1.0, True, "{:.2f}x at the least")]  # fmt: skip
            if decode:
                body += [
                    f"Greedy decode after a {plan.decode_prompt}-token prompt, batch 1: a jitted step into a "
                    "preallocated cache (mot_jax: the whole loop is one `lax.scan`) against transformers `generate` "
                    f"(its dynamic cache); rate = {plan.decode_tokens - 1} tokens / (time for {plan.decode_tokens} "
                    "new tokens - time for 1).",
                    decode_table(decode),
                ]
                rates = [ours / theirs for _, _, ours, theirs in decode if ours and theirs]
                if rates:
                    notes.append(goal_note("float32 greedy decode faster than transformers", min(rates), 1.0, True,
                                           "{:.2f}x at the least"))  # fmt: skip
            body.append(" ".join(notes))
    intro = (
        "Prefill of random token ids: both sides fill the KV cache and compute logits for the last position only "
        "(`logits_to_keep=1` in transformers) with the same weights (transformers reads the checkpoint mot_jax "
        "loads), dtype, batch and tokens. The jit compile column is mot_jax's first call (compile and one run), "
        "never timed. Speed-up = transformers time / mot_jax time (above 1: mot_jax is faster)."
    )
    return Section("Model prefill and decode: mot_jax against transformers", intro, body)


# ---------------------------------------------------------------------------------------------------- mixture


def bench_mixture(plan: Plan) -> Section:
    """Forward time of one mixture (the offline pair's replay window) sparse against dense."""
    import jax
    import numpy as np
    from flax import nnx

    from mot_jax.jit import jit
    from mot_jax.translate.expert import TranslatorConfig
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
                run = lambda: jax.block_until_ready(forward(model, x))  # noqa: E731
                run()
                times[dispatch] = median_time(run, plan.runs)
                slots = int(np.asarray(forward(model, x)[1]["stats"]["capacity"]))
            ratios[experts, k] = times["dense"] / times["sparse"]
            rows.append((experts, k, ms(times["dense"]), ms(times["sparse"]), f"{ratios[experts, k]:.2f}x",
                         f"{slots} / {tokens}"))  # fmt: skip
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
    return Section("Mixture: sparse dispatch against the dense (reference) path", intro, [Table(header, rows, 0)],
                   notes)  # fmt: skip


# ---------------------------------------------------------------------------------------------------- align


def bench_align(plan: Plan) -> Section:
    from mot_jax.models.loading import load_tokenizer
    from mot_jax.translate.align_reference import benchmark_alignment

    a = plan.align
    target, source = load_tokenizer(a["target"]), load_tokenizer(a["source"])
    rows, fast, fallback = [], [], []
    for canonical in (True, False):
        for batch in a["batches"]:
            r = benchmark_alignment(target, source, length=a["length"], batch=batch, canonical=canonical,
                                    runs=plan.runs)  # fmt: skip
            (fast if canonical else fallback).append(r["speedup"])
            kind = "re-encodable" if canonical else "not re-encodable"
            rows.append((kind, batch, r["fallback_rows"], ms(r["ours_s"]), ms(r["reference_s"]),
                         f"{r['speedup']:.0f}x"))  # fmt: skip
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


# ---------------------------------------------------------------------------------------------------- ttft


def ttft_methods(plan: Plan):
    """(model pair, [Native, translated methods], what the translators are): untrained translators of the
    EXPERIMENT config (replay, direct), or the trained translators of `plan.workdirs`."""
    import ml_collections
    from flax import nnx

    from mot_jax.evals.methods import Native, Translated
    from mot_jax.training import loop
    from mot_jax.translate.translator import KVTranslator

    if plan.workdirs:
        from mot_jax.evals.run import trained_methods

        translated, config = trained_methods(plan.workdirs, "last")
        pair = loop.load_pair(ml_collections.ConfigDict(dict(source=config.source, target=config.target,
                                                              dtype=config.dtype)))  # fmt: skip
        what = f"{config.source} -> {config.target}, trained translators ("
        what += ", ".join(f"`{m.workdir}` step {m.step}" for m in translated) + ")"
        return pair, [Native(), *translated], what
    pair, methods = None, [Native()]
    for mode in ("replay", "direct"):
        config = load_experiment(plan.config_arg + mode)
        pair = pair or loop.load_pair(config)
        channel_map = loop.resolve_channels(config, pair, None, None, None)  # terminal: no search, no data
        spec, tcfg = loop.translation(config, channel_map, pair)
        translator = KVTranslator(spec, tcfg, rngs=nnx.Rngs(config.seed))
        methods.append(Translated(mode, translator, "untrained", 0))
    what = (
        f"{config.source} -> {config.target}, untrained translators of `configs/{EXPERIMENT}:{plan.config_arg}replay`"
    )
    return pair, methods, f"{what} and `:{plan.config_arg}direct` (timing does not depend on the weights)"


def describe(method, target) -> str:
    spec, cfg = method.translator.spec, method.translator.cfg
    name = method.name if spec.mode in method.name else f"{method.name} ({spec.mode})"
    text = (f"{name}: {len(spec.target_layers)} of the target's {target.config.num_layers} "
            f"layers, translator dim {cfg.dim}, {cfg.num_experts} experts (k = {cfg.top_k})")  # fmt: skip
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
    mib = lambda n: f"{n / 2**20:.2f}"  # noqa: E731
    header = ("context tokens", *(f"{m.name} TTFT (ms)" for m in methods), "source prefill (ms)",
              *(f"{m.name} / native" for m in translated), "target KV (MiB)",
              *(f"{m.name} handed over (MiB)" for m in translated))  # fmt: skip
    indices = range(len(lengths))
    ratios = {m.name: [at[m.name, i]["ttft_s"] / at[native.name, i]["ttft_s"] for i in indices] for m in translated}
    table_rows = [
        (at[native.name, i]["context_tokens"], *(ms(at[m.name, i]["ttft_s"]) for m in methods),
         ms(at[reference.name, i]["ttft_with_source_s"] - at[reference.name, i]["ttft_s"]),
         *(f"{ratios[m.name][i]:.2f}" for m in translated), mib(at[native.name, i]["target_kv_bytes"]),
         *(mib(at[m.name, i]["handed_bytes"]) for m in translated))
        for i in indices
    ]  # fmt: skip
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
            notes.append("The translator's cross-attention over the whole context is O(T^2) in every block, like "
                         "the target's own attention; a causal, blocked translator attention or a local window is "
                         "the next step.")  # fmt: skip
    for m in translated:
        if m.translator.spec.mode == "replay":
            notes.append(f"{m.name} / native: {span(ratios[m.name])}; replay re-reads the context through the target "
                         "after the translation, so it costs more than native prefill by design.")  # fmt: skip
    return Section("Time to first token: native, replay and direct", intro, [Table(header, table_rows, 0)], notes,
                   plot=lambda path: ttft_plot(tokens, series, path))  # fmt: skip


# ---------------------------------------------------------------------------------------------------- train


def matmul_flops(jaxpr) -> float:
    """2*M*N*K of every dot_general in a jaxpr, loop bodies times their trip count (scan; a while loop's body
    counts once). XLA's `cost_analysis()` counts every loop body once, and the models run their layers in a scan."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
        inner = [matmul_flops(j) for value in eqn.params.values() for j in _jaxprs(value)]
        if inner:
            trips = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
            total += trips * (max(inner) if eqn.primitive.name == "cond" else sum(inner))
    return total


def _jaxprs(value):
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(getattr(value, "jaxpr", None), "eqns"):  # a closed jaxpr
        yield value.jaxpr
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _jaxprs(v)


def xla_flops(compiled) -> float | None:
    """The flops of XLA's cost analysis of a compiled program (a dict, a list of one dict per program, or None)."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # not every backend implements it
        return None
    if isinstance(analysis, list | tuple):
        analysis = analysis[0] if analysis else None
    return (analysis or {}).get("flops")


def peak_flops(device_kind: str) -> float | None:
    return next((peak for name, peak in PEAK_FLOPS if name.lower() in device_kind.lower()), None)


def bench_train(plan: Plan) -> Section:
    """Training step of the EXPERIMENT config: replay with sparse and dense mixture, and direct, interleaved."""
    import resource

    import jax

    from mot_jax.training import loop

    config = load_experiment(plan.config_arg + "replay")
    pair = loop.load_pair(config)
    datasets = loop.make_datasets(config, pair)
    mesh = loop.make_mesh(config)
    accum = config.grad_accum
    batches = [loop.stack([datasets.train.batch(p * accum + i) for i in range(accum)]) for p in range(plan.runs + 1)]
    variants, stats = {}, {}
    for name, mode, dispatch in (("replay, sparse", "replay", "sparse"), ("replay, dense", "replay", "dense"),
                                 ("direct, sparse", "direct", "sparse")):  # fmt: skip
        c = load_experiment(plan.config_arg + mode)
        c.translator.dispatch = dispatch
        spec, tcfg = loop.translation(c, loop.resolve_channels(c, pair, datasets, mesh, None), pair)
        trainer = loop.Trainer(c, pair, spec, tcfg, mesh, c.steps)
        start = time.perf_counter()
        traced = trainer._train.trace(trainer.state, trainer.llm_states, trainer.place(batches[0], micro=True))
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
    dense = statistics.median(times["replay, dense"])
    rows = []
    for name in variants:
        s, seconds = stats[name], statistics.median(times[name])
        achieved = s["flops"] / seconds
        mfu = (f"{achieved / (peak * mesh.size):.1%}" if peak else
               "n/a (CPU)" if jax.default_backend() == "cpu" else "n/a (unknown peak)")  # fmt: skip
        rows.append((name, f"{seconds:.3g}", f"{tokens / seconds:.0f}", f"{achieved / 1e9:.3g}", mfu,
                     f"{s['planned'] / 2**30:.2f}", f"{s['compile_s']:.0f}", f"{dense / seconds:.2f}x"))  # fmt: skip
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    t = config.translator
    intro = (
        f"`configs/{EXPERIMENT}:{plan.config_arg}replay` and `:{plan.config_arg}direct` ({config.source} -> "
        f"{config.target}, {config.dtype}; a mixture of {t.num_experts} experts, k = {t.top_k}), one optimizer step on "
        f"{config.batch_size} x {accum} sequences of {config.data.total_tokens} target tokens: both frozen forwards "
        "(source prefill, with attention top-k for replay, and the native target prefill), translation, replay, the "
        "prompt CE through the target's head, the backward pass into the translator and AdamW. Step memory is XLA's "
        "plan for the compiled step (arguments + temporaries + outputs - donated buffers). GFLOP/s: the step's "
        "matmul FLOPs (counted in its jaxpr, loops times their trip count) over the step time; MFU against the "
        "device's bf16 dense peak where it is known."
    )
    sparse = dense / statistics.median(times["replay, sparse"])
    notes = [
        f"Replay, sparse against dense mixture: {sparse:.2f}x. With few experts and k = 1 the mixture is a small part "
        "of the step (the two LLMs dominate), so real dispatch changes it little.",
        f"The process peaked at {rss:.1f} GiB RSS (every variant and both models loaded, and whatever the parts "
        "before this one in the same run held).",
    ]
    xla = stats["replay, sparse"]["xla_flops"]
    if xla:
        notes.append(f"XLA's `cost_analysis()` of the replay step reports {xla / 1e9:.3g} GFLOP against "
                     f"{stats['replay, sparse']['flops'] / 1e9:.3g} GFLOP of matmuls counted here: it counts each "
                     "loop body once (the layer scan, the micro-batch scan).")  # fmt: skip
    header = ("step", "step (s)", "target tokens/s", "GFLOP/s", "MFU", "step memory (GiB)", "jit compile (s)",
              "speed-up vs replay dense")  # fmt: skip
    return Section(f"Training step: configs/{EXPERIMENT}", intro, [Table(header, rows)], notes)


# ---------------------------------------------------------------------------------------------------- the page

PARTS = {
    "models": bench_models,
    "mixture": bench_mixture,
    "align": bench_align,
    "ttft": bench_ttft,
    "train": bench_train,
}


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict:
    import jax

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        memory = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB memory"
    except (ValueError, OSError, AttributeError):
        memory = ""
    device = jax.devices()[0]
    return dict(
        machine=f"{platform.machine()}, {os.cpu_count()} cores{f' ({cpu})' if cpu else ''}{memory}",
        backend=f"jax backend {jax.default_backend()}, {jax.device_count()} x {device.device_kind}",
        versions=", ".join(f"{p} {version(p)}" for p in ("jax", "jaxlib", "flax", "torch", "transformers")),
    )


def command_line() -> str:
    return shlex.join(["python", "-m", "mot_jax.bench", *sys.argv[1:]])


def page(sections: list[Section], images: dict, plan: Plan) -> str:
    info = machine()
    total = sum(s.seconds for s in sections)
    times = ", ".join(f"{s.part} {s.seconds:.0f} s" for s in sections)
    head = [
        "# Benchmarks",
        "Generated by `python -m mot_jax.bench`; do not edit by hand, run the command again.",
        "\n".join(
            [
                f"- Command: `{command_line()}`",
                f"- Machine: {info['machine']}; {info['backend']}",
                f"- Versions: {info['versions']}",
                f"- Date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
                f"- Time: {total:.0f} s ({times})",
            ]
        ),
        "How it is measured: both sides of each comparison run in this one process, interleaved run by run, with the "
        "same weights, dtype, batch and tokens; torch uses as many threads as there are cores; the first call of "
        "each program compiles and is reported apart (jit compile), never timed; each cell is the median of "
        f"{plan.runs} timed run{'s' if plan.runs > 1 else ''} (`--runs`). These machines are shared and noisy: read "
        "the ratios (speed-up, direct / native), not the absolute times.",
    ]
    if plan.quick:
        head.append(
            "**Quick run (`--quick`): tiny random models and sizes, one run per cell, one torch thread, XLA's cheap "
            "CPU compile pipeline. It checks that the page builds; its numbers mean nothing.**"
        )
    return "\n\n".join(head) + "\n\n" + "\n".join(s.markdown(images.get(s.title)) for s in sections)


def write_page(path: str, sections: list[Section], plan: Plan):
    """The page (and its plot, next to it), each written to a temporary file and moved into place."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    staged, images = [], {}

    def temporary(name):
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
        os.close(fd)
        staged.append((tmp, os.path.join(folder, name)))
        return tmp

    try:
        for section in sections:
            if section.plot:
                section.plot(temporary(PLOT))
                images[section.title] = PLOT
        with open(temporary(os.path.basename(path)), "w") as f:
            f.write(page(sections, images, plan))
        for tmp, final in staged:
            os.replace(tmp, final)
    finally:
        for tmp, _ in staged:
            if os.path.exists(tmp):
                os.remove(tmp)


def run_parts(parts: list[str], plan: Plan, out: str | None):
    import gc

    import jax

    sections, began = [], time.perf_counter()
    for part in parts:
        log(f"bench: {part} ...")
        start = time.perf_counter()
        section = PARTS[part](plan)
        section.part, section.seconds = part, time.perf_counter() - start
        log(f"bench: {part} done in {section.seconds:.0f} s ({time.perf_counter() - began:.0f} s in all)")
        print(section.markdown(), flush=True)
        sections.append(section)
        jax.clear_caches()  # each part's compiled programs and their memory go
        gc.collect()
    if out:
        write_page(out, sections, plan)
        log(f"bench: wrote {out}" + (f" and {PLOT}" if any(s.plot for s in sections) else ""))


# ---------------------------------------------------------------------------------------------------- main


def define_flags():
    from absl import flags

    flags.DEFINE_integer("runs", 3, "Timed runs per cell (the median is reported).")
    models = "models: random-init shapes (RANDOM) or model names, prefill at --tokens ('' skips)."
    flags.DEFINE_list("models", ["gpt2", "opt-125m", "qwen2-160m"], models)
    flags.DEFINE_integer("tokens", 512, "models: prompt length of --models.")
    flags.DEFINE_list("batches", ["1", "8"], "models: batch sizes of --models.")
    flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "models: dtypes of --models.")
    pair = "models: real models, prefill at every --lengths (batch 1, float32) and greedy decode ('' skips)."
    flags.DEFINE_list("pair", ["smollm2-135m", "gemma3-270m"], pair)
    flags.DEFINE_list("lengths", ["128", "512", "2048"], "Prompt lengths of --pair and context lengths of ttft.")
    flags.DEFINE_integer("decode_tokens", 32, "models: greedy tokens decoded by --pair (0: skip).")
    flags.DEFINE_list("workdirs", [], "ttft: training workdirs (one model pair) to time instead of untrained ones.")
    flags.DEFINE_string("out", None, f"Page to write (default {PAGE} when every part runs; the plot goes beside it).")
    flags.DEFINE_bool(
        "quick", False, "Every size tiny (random models, one run): checks the page builds (1-1.5 minutes)."
    )


def make_plan(fail) -> Plan:
    from absl import flags

    f = flags.FLAGS
    if f.quick:
        return dataclasses.replace(QUICK, workdirs=tuple(f.workdirs))
    try:
        ints = lambda values: tuple(int(v) for v in values)  # noqa: E731
        batches, lengths = ints(f.batches), ints(f.lengths)
    except ValueError:
        fail("--batches and --lengths take comma lists of integers.")
    if f.runs < 1:
        fail("--runs must be at least 1.")
    if set(f.dtypes) - {"float32", "bfloat16"}:
        fail(f"--dtypes takes float32 and/or bfloat16, not {','.join(f.dtypes)}.")
    return Plan(
        runs=f.runs, models=tuple(f.models), tokens=f.tokens, batches=batches, dtypes=tuple(f.dtypes),
        pair=tuple(f.pair), lengths=lengths, decode_tokens=f.decode_tokens, decode_prompt=128,
        mixture=DEFAULT_MIXTURE, align=dict(target="gemma3-270m", source="smollm2-135m", length=2048, batches=(1, 8)),
        config_arg="", workdirs=tuple(f.workdirs),
    )  # fmt: skip


def main(argv):
    from absl import flags

    from mot_jax.cli import fail, run_or_exit

    parts = argv[1:] or list(PARTS)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        fail(f"unknown part {unknown[0]!r}; name some of {', '.join(PARTS)}, or none for all of them and the page.")
    quick = flags.FLAGS.quick
    if quick:  # before jax starts its backend, which reads the flags
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {QUICK_XLA_FLAGS}".strip()
    out = flags.FLAGS.out or (PAGE if not argv[1:] and not quick else None)
    plan = make_plan(fail)
    log(f"bench: {', '.join(parts)}{' (quick)' if quick else ''}; {machine()['machine']}")
    run_or_exit(run_parts, parts, plan, out)


if __name__ == "__main__":
    from absl import app

    define_flags()
    app.run(main)
