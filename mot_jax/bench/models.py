"""The models part: prefill (and greedy decode) of mot_jax against transformers with the same weights."""

from __future__ import annotations

import os
import statistics
import tempfile

from mot_jax.bench.common import Plan, Section, Table, goal_note, log, median_time, ms, span
from mot_jax.bench.flops import matmul_rate, prefill_flops, rate_size
from mot_jax.models import tiny

# Random-init stand-ins with the real shapes (Qwen2 at 12 layers of Qwen2.5-0.5B so a CPU run stays short), and the
# tiny random families of `mot_jax.models.tiny` for --quick.
RANDOM = {
    "gpt2": dict(model_type="gpt2", n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=2048),
    "opt-125m": dict(
        model_type="opt",
        num_hidden_layers=12,
        hidden_size=768,
        num_attention_heads=12,
        ffn_dim=3072,
        vocab_size=50272,
        max_position_embeddings=2048,
    ),
    "qwen2-160m": dict(
        model_type="qwen2",
        num_hidden_layers=12,
        hidden_size=896,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}
RANDOM |= {
    f"tiny-{family}": tiny.hf_config(tiny.PREFIX + family) for family in ("gpt2", "opt", "qwen2", "llama", "gemma3")
}


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
    return ours, theirs.to(torch_device())


def torch_device() -> str:
    """Where transformers runs: on the GPU when JAX runs on one (both sides on the same chip), else the CPU."""
    import jax
    import torch

    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def synchronized(run):
    """`run`, then a wait for the GPU's queued work (torch launches asynchronously), so that a timer sees it all."""
    import torch

    def timed():
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    return timed


# transformers slower than this many times mot_jax is timed by its warm-up run alone (bf16 on a CPU without bf16
# instructions: minutes a prefill, and the ratio is not in doubt)
ONE_RUN = 10


def bench_prefill(ours, theirs, ids, runs):
    """(mot_jax seconds, transformers seconds, jit compile seconds, mot_jax seconds with XLA's attention instead of
    the fused kernel or None where the kernel does not run) for one prefill of `ids`, interleaved (transformers: its
    first run alone where that is over ONE_RUN times mot_jax's)."""
    import jax
    import jax.numpy as jnp
    import torch

    from mot_jax import kernels
    from mot_jax.jit import jit

    prefill = jit(lambda model, ids: model(ids, logits_to_keep=1)[0])
    prefill_xla = jit(lambda model, ids: model(ids, logits_to_keep=1)[0])
    jids, tids = jnp.asarray(ids), torch.tensor(ids, device=theirs.device)

    def run_ours():
        jax.block_until_ready(prefill(ours, jids))

    def run_xla():
        jax.block_until_ready(prefill_xla(ours, jids))

    @synchronized
    def run_theirs():
        with torch.no_grad():
            theirs(tids, logits_to_keep=1, use_cache=True)

    compile_s = median_time(run_ours, 1)
    fused = jax.default_backend() == "cpu" and kernels.TARGET in prefill.lower(ours, jids).as_text()
    if fused:
        with kernels.xla_attention():
            run_xla()  # traced and compiled here
    theirs_once = median_time(run_theirs, 1)  # warm-up
    once = theirs_once > ONE_RUN * median_time(run_ours, 1)
    timings = [
        (
            median_time(run_ours, 1),
            theirs_once if once else median_time(run_theirs, 1),
            median_time(run_xla, 1) if fused else None,
        )
        for _ in range(runs)
    ]
    ours_s, theirs_s, xla_s = (statistics.median(t[i] for t in timings) if timings[0][i] else None for i in range(3))
    return ours_s, theirs_s, compile_s, xla_s


def bench_decode(ours, theirs, new_tokens, prompt, runs):
    """Greedy tokens per second after a `prompt`-token prompt at batch 1 (generate N minus generate 1); None where
    the difference is not positive (noise on tiny models)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from mot_jax.models.generation import generate

    ids = np.random.default_rng(1).integers(0, ours.config.vocab_size, size=(1, prompt))

    def ours_fn(k):
        return lambda: jax.block_until_ready(generate(ours, jnp.asarray(ids), max_new_tokens=k, eos_ids=()))

    def theirs_fn(k):
        @synchronized
        def run():
            with torch.no_grad():
                prompt_ids = torch.tensor(ids, device=theirs.device)
                theirs.generate(prompt_ids, max_new_tokens=k, min_new_tokens=k, do_sample=False)

        return run

    for k in (1, new_tokens):
        ours_fn(k)(), theirs_fn(k)()  # compile / warm up
    rates = []
    for fn in (ours_fn, theirs_fn):
        extra = median_time(fn(new_tokens), runs) - median_time(fn(1), runs)
        rates.append((new_tokens - 1) / extra if extra > 0 else None)
    return tuple(rates)


def compare_models(names, dtypes, lengths, batches, plan, tmp, decode=False):
    """Prefill rows (name, dtype, tokens, batch, ours s, theirs s, compile s, FLOPs, ours s with XLA's attention or
    None) and decode rows (name, dtype, ours tokens/s, theirs tokens/s)."""
    import numpy as np

    prefill_rows, decode_rows = [], []
    for name in names:
        for dtype in dtypes:
            ours, theirs = load_both(name, dtype, tmp)
            for length in lengths:
                for batch in batches:
                    ids = np.random.default_rng(0).integers(0, ours.config.vocab_size, size=(batch, length))
                    mo, mt, compile_s, mx = bench_prefill(ours, theirs, ids, plan.runs)
                    flops = prefill_flops(ours.config, length, batch)
                    prefill_rows.append((name, dtype, length, batch, mo, mt, compile_s, flops, mx))
                    xla = f", mot_jax with XLA's attention {ms(mx)} ms" if mx else ""
                    log(
                        f"  {name} {dtype} T={length} B={batch}: mot_jax {ms(mo)} ms, transformers {ms(mt)} ms{xla} "
                        f"(compile {compile_s:.1f} s)"
                    )
            if decode and plan.decode_tokens > 1:
                rates = bench_decode(ours, theirs, plan.decode_tokens, plan.decode_prompt, plan.runs)
                decode_rows.append((name, dtype, *rates))
                log(f"  {name} {dtype} decode (tokens/s): mot_jax {rate(rates[0])}, transformers {rate(rates[1])}")
    return prefill_rows, decode_rows


def prefill_table(rows, rates) -> Table:
    """The prefill rows with each side's achieved GFLOP/s (the cell's closed-form FLOPs over its time) and its share
    of the machine's matmul rate in the row's dtype (`rates`, FLOP/s by dtype)."""
    header = (
        "model",
        "dtype",
        "tokens",
        "batch",
        "mot_jax (ms)",
        "transformers (ms)",
        "speed-up",
        "mot_jax GFLOP/s",
        "transformers GFLOP/s",
        "mot_jax / matmul rate",
        "transformers / matmul rate",
        "jit compile (s)",
        "mot_jax, XLA's attention (ms)",
        "fused kernel's speed-up",
    )
    cells = [
        (
            name,
            dtype,
            length,
            batch,
            ms(mo),
            ms(mt),
            f"{mt / mo:.2f}x",
            f"{flops / mo / 1e9:.1f}",
            f"{flops / mt / 1e9:.1f}",
            f"{100 * flops / mo / rates[dtype]:.0f}%",
            f"{100 * flops / mt / rates[dtype]:.0f}%",
            f"{compile_s:.1f}",
            ms(mx) if mx else "n/a",
            f"{mx / mo:.2f}x" if mx else "n/a",
        )
        for name, dtype, length, batch, mo, mt, compile_s, flops, mx in rows
    ]
    return Table(header, cells, left=2)


def shares(rows, rates, tokens):
    """mot_jax's shares of the matmul rate in the cells of `tokens` tokens."""
    return [flops / mo / rates[dtype] for _, dtype, length, _, mo, _, _, flops, _ in rows if length == tokens]


def rate(tokens_per_s) -> str:
    return "n/a" if tokens_per_s is None else f"{tokens_per_s:.1f}"


def decode_table(rows) -> Table:
    cells = [
        (name, dtype, rate(ours), rate(theirs), f"{ours / theirs:.2f}x" if ours and theirs else "n/a")
        for name, dtype, ours, theirs in rows
    ]
    return Table(("model", "dtype", "mot_jax (tokens/s)", "transformers (tokens/s)", "speed-up"), cells, left=2)


BF16_ON_CPU = (
    "every dot takes XLA:CPU's bf16 x bf16 -> f32 kernel (YNNPACK), which reaches a lower rate than the oneDNN bf16 "
    "kernels behind PyTorch's CPU matmuls. These XLA flags made no difference to bf16 (SmolLM2-135M, 512 tokens): "
    "`--xla_cpu_use_onednn=true`, `--xla_cpu_experimental_onednn_custom_call=true`, `--xla_cpu_use_xnnpack=true`, "
    "`--xla_cpu_experimental_xnn_fusion_type=dot`, `--xla_cpu_experimental_onednn_fusion_type=dot`."
)


def weights(names) -> str:
    if all(name in RANDOM for name in names):
        return (
            "random weights, `RANDOM` in `mot_jax/bench/models.py`: gpt2 and opt-125m at full size, Qwen2.5-0.5B's "
            "layer shape at 12 layers, `tiny-*` the tiny random families"
        )
    return "de-quantized GGUF weights for the embedded models: transformers reads our converted cache of the same file"


def speedups(rows, dtype):
    return [mt / mo for _, d, _, _, mo, mt, *_ in rows if d == dtype]


def speed_goals(rows, dtypes) -> list[str]:
    """A goal note per dtype: prefill faster than transformers in every cell."""
    return [
        goal_note(
            f"{dtype} prefill faster than transformers in every cell", min(found), 1.0, True, "{:.2f}x at the least"
        )
        for dtype in dtypes
        if (found := speedups(rows, dtype))
    ]


def bench_models(plan: Plan) -> Section:
    import jax
    import torch
    import transformers

    torch.set_num_threads(1 if plan.quick else os.cpu_count())  # quick: no threads spinning on a busy machine
    transformers.utils.logging.disable_progress_bar()
    size, runs = rate_size(plan), max(plan.runs, 3)
    rates = {dtype: matmul_rate(size, dtype, runs) for dtype in plan.dtypes}
    log("  matmul rate: " + ", ".join(f"{dtype} {rate / 1e9:.1f} GFLOP/s" for dtype, rate in rates.items()))
    body = []
    with tempfile.TemporaryDirectory() as tmp:
        if plan.models:
            rows, _ = compare_models(plan.models, plan.dtypes, (plan.tokens,), plan.batches, plan, tmp)
            body += [
                "### Random-init shapes",
                f"{', '.join(plan.models)} ({weights(plan.models)}) at {plan.tokens} tokens.",
                prefill_table(rows, rates),
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
            rows, decode = compare_models(plan.pair, plan.dtypes, plan.lengths, (1,), plan, tmp, decode=True)
            longest = max(plan.lengths)
            body += [
                "### The offline pair",
                f"{' and '.join(plan.pair)} ({weights(plan.pair)}), {' and '.join(plan.dtypes)}, batch 1, at "
                f"{', '.join(map(str, plan.lengths))} tokens.",
                prefill_table(rows, rates),
            ]
            notes = speed_goals(rows, plan.dtypes)
            notes.append(
                goal_note(
                    f"at least 70% of the matmul rate at {longest} tokens",
                    100 * min(shares(rows, rates, longest)),
                    70,
                    True,
                    "{:.0f}% at the least",
                )
            )
            if decode:
                body += [
                    f"Greedy decode after a {plan.decode_prompt}-token prompt, batch 1: a jitted step into a "
                    "preallocated cache (mot_jax: the whole loop is one program, its steps over each layer's weights "
                    "sliced from the stack once) against transformers `generate` "
                    f"(its dynamic cache); rate = {plan.decode_tokens - 1} tokens / (time for {plan.decode_tokens} "
                    "new tokens - time for 1).",
                    decode_table(decode),
                ]
                ratios = [ours / theirs for _, _, ours, theirs in decode if ours and theirs]
                if ratios:
                    notes.append(
                        goal_note(
                            "greedy decode faster than transformers", min(ratios), 1.0, True, "{:.2f}x at the least"
                        )
                    )
            body.append(" ".join(notes))
    described = ", ".join(f"{dtype} **{rate / 1e9:.1f} GFLOP/s**" for dtype, rate in rates.items())
    intro = (
        "Prefill of random token ids: both sides fill the KV cache and compute logits for the last position only "
        "(`logits_to_keep=1` in transformers) with the same weights (transformers reads the checkpoint mot_jax "
        "loads), dtype, batch and tokens. The jit compile column is mot_jax's first call (compile and one run), "
        "never timed. Speed-up = transformers time / mot_jax time (above 1: mot_jax is faster). GFLOP/s: the cell's "
        "matmul FLOPs in closed form (`mot_jax/bench/flops.py`: projections, causal attention scores and values, the "
        "last position's logits; 2 per multiply-add) over each side's time; the share is that over the machine's "
        f"matmul rate measured in this run on a [{size}]^2 @ [{size}]^2 matmul in the cell's dtype (accumulated in "
        f"float32, median of {runs}): {described}. mot_jax, XLA's attention: the same prefill with attention "
        "through XLA instead of the fused CPU kernel (`mot_jax/kernels`), in the same interleaved runs; the fused "
        "kernel's speed-up is that time over mot_jax's (n/a where the kernel does not run). Where transformers is "
        f"over {ONE_RUN}x slower than mot_jax, its time is that of its first run alone."
    )
    return Section("Model prefill and decode: mot_jax against transformers", intro, body)
