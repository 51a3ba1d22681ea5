"""Benchmarks that print Markdown tables (recorded in BENCHMARKS.md with the machine and command).

  python -m mot_jax.bench models                       # random-init gpt2 / opt-125m / qwen2 shapes, 512 tokens
  python -m mot_jax.bench models --models=smollm2-135m,gemma3-270m --lengths=128,512,2048 --decode_tokens=32
  python -m mot_jax.bench mixture                      # sparse against dense mixture, N = 2, 4, 8 and k = 1, 2
  python -m mot_jax.bench align                        # alignment of 2,048-token texts against the reference
  python -m mot_jax.bench ttft --lengths=128,512,2048  # native prefill / replay / direct on the offline pair
  python -m mot_jax.bench train                        # quickstart training step, sparse against dense mixture

Both sides do the same work in one process, interleaved: same weights, dtype, batch and tokens; prefill fills the
cache and computes logits for the last position only (transformers: `logits_to_keep=1`); torch uses as many
threads as XLA has cores; compile time is reported apart; each cell is the median of `--runs` timed runs.
"""

# ruff: noqa: B023  (the timing closures below run inside the loop iteration that defines them)
from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import tempfile
import time

from absl import app, flags

from mot_jax.jit import jit

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["gpt2", "opt-125m", "qwen2-160m"], "Random-init shapes (see RANDOM) or model names.")
flags.DEFINE_list("lengths", ["512"], "Prompt lengths.")
flags.DEFINE_list("batches", ["1", "8"], "Batch sizes.")
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Dtypes.")
flags.DEFINE_integer("runs", 5, "Timed runs per cell (median reported).")
flags.DEFINE_integer("decode_tokens", 0, "Also time greedy decoding of this many tokens at batch 1 (0: skip).")

# The translator sizes the benchmarks time, small enough for a CPU: replay translates a window of layers (fused
# output as the paper); direct translates every target layer, where the paper's fused W x W output projection and
# R x W full-context blocks would cost more than the target's own prefill, so it projects per layer at a lower width.
TRANSLATOR_SIZE = dict(dim=256, heads=4, depth=1, mlp_ratio=4, num_experts=2, top_k=1)
DIRECT_SIZE = dict(TRANSLATOR_SIZE, dim=128, fused_output=False)

# Random-init stand-ins with the real shapes (Qwen2 at 12 layers of Qwen2.5-0.5B so a CPU run stays short).
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


def median_time(fn, runs):
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def random_checkpoint(name, path):
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**RANDOM[name])
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def load_pair(name, dtype, tmp):
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


def bench_models():
    import numpy as np
    import torch

    torch.set_num_threads(os.cpu_count())
    rows, decode_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in FLAGS.models:
            for dtype in FLAGS.dtypes:
                ours, theirs = load_pair(name, dtype, tmp)
                for length in map(int, FLAGS.lengths):
                    for batch in map(int, FLAGS.batches):
                        ids = np.random.default_rng(0).integers(0, ours.config.vocab_size, size=(batch, length))
                        mo, mt, compile_s = bench_prefill(ours, theirs, ids)
                        rows.append((name, dtype, length, batch, mo, mt, compile_s))
                        print(f"  {name} {dtype} T={length} B={batch}: mot_jax {mo * 1e3:.0f} ms, "
                              f"transformers {mt * 1e3:.0f} ms (compile {compile_s:.1f} s)", flush=True)  # fmt: skip
                if FLAGS.decode_tokens:
                    decode_rows.append((name, dtype, *bench_decode(ours, theirs)))
    print_tables(rows, decode_rows)


def bench_prefill(ours, theirs, ids):
    """(mot_jax seconds, transformers seconds, jit compile seconds) for one prefill of `ids`, interleaved."""
    import jax
    import jax.numpy as jnp
    import torch

    prefill = jit(lambda model, ids: model(ids, logits_to_keep=1)[0])
    jids, tids = jnp.asarray(ids), torch.tensor(ids)

    def run_ours():
        jax.block_until_ready(prefill(ours, jids))

    def run_theirs():
        with torch.no_grad():
            theirs(tids, logits_to_keep=1, use_cache=True)

    compile_s = median_time(run_ours, 1)
    run_theirs()  # warm-up
    pairs = [(median_time(run_ours, 1), median_time(run_theirs, 1)) for _ in range(FLAGS.runs)]
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs), compile_s


def bench_decode(ours, theirs):
    """Greedy tokens per second after a 128-token prompt at batch 1 (generate N minus generate 1)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from mot_jax.models.base import generate

    n = FLAGS.decode_tokens
    ids = np.random.default_rng(1).integers(0, ours.config.vocab_size, size=(1, 128))

    def ours_fn(k):
        return lambda: jax.block_until_ready(generate(ours, jnp.asarray(ids), max_new_tokens=k, eos_ids=()))

    def theirs_fn(k):
        def run():
            with torch.no_grad():
                theirs.generate(torch.tensor(ids), max_new_tokens=k, min_new_tokens=k, do_sample=False)

        return run

    for k in (1, n):
        ours_fn(k)(), theirs_fn(k)()  # compile / warm up
    runs = max(3, FLAGS.runs // 2)
    ours_rate = (n - 1) / (median_time(ours_fn(n), runs) - median_time(ours_fn(1), runs))
    theirs_rate = (n - 1) / (median_time(theirs_fn(n), runs) - median_time(theirs_fn(1), runs))
    print(f"  decode: mot_jax {ours_rate:.1f} tok/s, transformers {theirs_rate:.1f} tok/s", flush=True)
    return ours_rate, theirs_rate


def machine_line():
    import jax

    versions = f"jax {jax.__version__} ({jax.default_backend()})"
    try:
        import torch
        import transformers

        versions += f", torch {torch.__version__}, transformers {transformers.__version__}"
    except ImportError:
        pass
    return f"machine: {platform.machine()}, {os.cpu_count()} cores; {versions}; median of {FLAGS.runs} runs"


def print_tables(rows, decode_rows):
    print()
    print("| model | dtype | tokens | batch | mot_jax (ms) | transformers (ms) | speed-up | jit compile (s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, dtype, length, batch, mo, mt, compile_s in rows:
        cells = (
            name,
            dtype,
            length,
            batch,
            f"{mo * 1e3:.0f}",
            f"{mt * 1e3:.0f}",
            f"{mt / mo:.2f}x",
            f"{compile_s:.1f}",
        )
        print("| " + " | ".join(map(str, cells)) + " |")
    if decode_rows:
        print(f"\nGreedy decode, batch 1, 128-token prompt, {FLAGS.decode_tokens} new tokens (tokens/s):\n")
        print("| model | dtype | mot_jax | transformers | speed-up |")
        print("|---|---|---:|---:|---:|")
        for name, dtype, ours, theirs in decode_rows:
            print(f"| {name} | {dtype} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |")


def bench_mixture():
    """Forward time of one mixture (the offline pair's replay window) at 512 tokens, sparse against dense."""
    import jax
    import numpy as np
    from flax import nnx

    from mot_jax.translate.expert import TranslatorConfig
    from mot_jax.translate.mixture import MixtureOfTranslators

    base = TranslatorConfig(source_width=192, target_width=256, window=5, **TRANSLATOR_SIZE)
    x = jax.random.normal(jax.random.key(0), (1, 512, base.window, base.source_width))
    forward = jit(lambda m, x: m(x))
    print("\n| experts N | top-k | dense (ms) | sparse (ms) | speed-up | tokens over capacity |")
    print("|---:|---:|---:|---:|---:|---:|")
    for experts in (2, 4, 8):
        for k in (1, 2):
            times, dropped = {}, 0
            for dispatch in ("dense", "sparse"):
                cfg = dataclasses.replace(base, num_experts=experts, top_k=k, dispatch=dispatch)
                model = MixtureOfTranslators(cfg, rngs=nnx.Rngs(0))
                run = lambda: jax.block_until_ready(forward(model, x))  # noqa: E731
                run()
                times[dispatch] = median_time(run, FLAGS.runs)
                dropped = int(np.asarray(forward(model, x)[1]["stats"]["dropped"]))
            ratio = times["dense"] / times["sparse"]
            cells = (experts, k, f"{times['dense'] * 1e3:.0f}", f"{times['sparse'] * 1e3:.0f}", f"{ratio:.2f}x",
                     f"{dropped} / {512 * k}")  # fmt: skip
            print("| " + " | ".join(map(str, cells)) + " |", flush=True)


def bench_align():
    from mot_jax.models.gguf import load_tokenizer
    from mot_jax.translate.align_reference import benchmark_alignment

    target, source = load_tokenizer("gemma3-270m"), load_tokenizer("smollm2-135m")
    print("\n| batch | ids | rows on the prefix fallback | mot_jax (ms) | per-token reference (ms) | speed-up |")
    print("|---:|---|---:|---:|---:|---:|")
    for canonical in (True, False):
        for batch in (1, 8):
            r = benchmark_alignment(target, source, length=2048, batch=batch, canonical=canonical, runs=FLAGS.runs)
            kind = "re-encodable" if canonical else "not re-encodable"
            cells = (batch, kind, r["fallback_rows"], f"{r['ours_s'] * 1e3:.1f}", f"{r['reference_s'] * 1e3:.0f}",
                     f"{r['speedup']:.0f}x")  # fmt: skip
            print("| " + " | ".join(map(str, cells)) + " |", flush=True)


def bench_ttft():
    """Time to first token on the offline pair (source smollm2-135m, target gemma3-270m), untrained translators."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from mot_jax.models.base import prefill
    from mot_jax.models.gguf import load_tokenizer
    from mot_jax.models.loading import load_model
    from mot_jax.translate import align, channels
    from mot_jax.translate.align_reference import synthetic_text
    from mot_jax.translate.translator import (
        KVTranslator,
        TranslationSpec,
        _translate_jit,
        mixture_config,
        source_prefill,
    )

    source, target = load_model("smollm2-135m")[0], load_model("gemma3-270m")[0]
    source_tok, target_tok = load_tokenizer("smollm2-135m"), load_tokenizer("gemma3-270m")
    suffix = jnp.asarray(np.random.default_rng(0).integers(1000, 5000, size=(1, 16)), jnp.int32)
    first_token = jit(lambda model, ids, cache: model(ids, cache=cache, logits_to_keep=1)[0])
    print("\n| context tokens | native prefill (ms) | replay (ms) | direct (ms) | + source prefill (ms) | "
          "direct / native |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    for length in map(int, FLAGS.lengths):
        ids = jnp.asarray([target_tok.encode(synthetic_text(8 * length, 0)).ids[:length]], jnp.int32)
        mask = jnp.ones(ids.shape, bool)
        source_ids, source_mask, alignment = align.align_batch(
            target_tok, source_tok, np.asarray(ids), np.asarray(mask)
        )
        source_ids, source_mask = jnp.asarray(source_ids), jnp.asarray(source_mask)
        full = jnp.concatenate([ids, suffix], axis=1)
        times = {"native": median_time(lambda: jax.block_until_ready(prefill(target, full)), 1)}  # compile
        times["native"] = median_time(lambda: jax.block_until_ready(prefill(target, full)), FLAGS.runs)
        for mode in ("replay", "direct"):
            spec = TranslationSpec.build(mode, channels.terminal(30, 18, 0.3), 30, 18)
            size = DIRECT_SIZE if mode == "direct" else TRANSLATOR_SIZE
            translator = KVTranslator(spec, mixture_config(spec, source, target, **size), rngs=nnx.Rngs(0))
            topk = spec.k_attn if mode == "replay" else 0
            source_cache, source_topk = source_prefill(source, source_ids, source_mask, topk=topk)

            def ttft():
                cache, _ = _translate_jit(translator, source, target, source_cache, alignment, ids, mask, source_topk,
                                       capacity=length + 16)  # fmt: skip
                return jax.block_until_ready(first_token(target, suffix, cache))

            ttft()
            times[mode] = median_time(ttft, FLAGS.runs)
        times["source"] = median_time(
            lambda: jax.block_until_ready(source_prefill(source, source_ids, source_mask)), FLAGS.runs
        )
        cells = (length, *(f"{times[m] * 1e3:.0f}" for m in ("native", "replay", "direct", "source")),
                 f"{times['direct'] / times['native']:.2f}")  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)


def bench_train():
    """Training step of the quickstart config (smollm2-135m -> gemma3-270m, 4 x 128 tokens), sparse against dense
    mixture, interleaved; memory is XLA's plan for the compiled step (arguments + temporaries + outputs - aliased)."""
    import importlib.util
    import resource
    from pathlib import Path

    import jax

    from mot_jax.training import loop

    path = Path(__file__).resolve().parents[1] / "configs" / "quickstart.py"
    spec = importlib.util.spec_from_file_location("quickstart", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    pair = loop.load_pair(config)
    datasets = loop.make_datasets(config, pair)
    channel_map = loop.resolve_channels(config, pair, datasets, loop.make_mesh(config), None)
    batches = [loop.stack([datasets.train.batch(p)]) for p in range(FLAGS.runs + 1)]
    trainers, planned, compile_s = {}, {}, {}
    for dispatch in ("sparse", "dense"):
        config.translator.dispatch = dispatch
        spec_, tcfg = loop.translation(config, channel_map, pair)
        trainer = loop.Trainer(config, pair, spec_, tcfg, loop.make_mesh(config), config.steps)
        placed = trainer.place(batches[0], micro=True)
        start = time.perf_counter()
        compiled = trainer._train.lower(trainer.state, trainer.llm_states, placed).compile()
        compile_s[dispatch] = time.perf_counter() - start
        m = compiled.memory_analysis()
        planned[dispatch] = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
        planned[dispatch] -= m.alias_size_in_bytes
        jax.block_until_ready(trainer.train_step(batches[0]))  # warm-up
        trainers[dispatch] = trainer
    times = {d: [] for d in trainers}
    for batch in batches[1:]:  # interleaved
        for dispatch, trainer in trainers.items():
            start = time.perf_counter()
            jax.block_until_ready(trainer.train_step(batch))
            times[dispatch].append(time.perf_counter() - start)
    tokens = config.batch_size * config.grad_accum * config.data.total_tokens
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(f"\nquickstart step: batch {config.batch_size} x accum {config.grad_accum} x {config.data.total_tokens} "
          f"target tokens, {config.dtype}; process peak RSS {rss:.1f} GiB\n")  # fmt: skip
    print("| mixture | step (s) | target tokens/s | step memory (GiB) | jit compile (s) | speed-up vs dense |")
    print("|---|---:|---:|---:|---:|---:|")
    dense = statistics.median(times["dense"])
    for dispatch in trainers:
        step = statistics.median(times[dispatch])
        cells = (dispatch, f"{step:.2f}", f"{tokens / step:.0f}", f"{planned[dispatch] / 2**30:.2f}",
                 f"{compile_s[dispatch]:.0f}", f"{dense / step:.2f}x")  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)


BENCHMARKS = {
    "models": bench_models,
    "mixture": bench_mixture,
    "align": bench_align,
    "ttft": bench_ttft,
    "train": bench_train,
}


def main(argv):
    if len(argv) != 2 or argv[1] not in BENCHMARKS:
        raise app.UsageError(f"usage: python -m mot_jax.bench {{{'|'.join(BENCHMARKS)}}} [--flags]")
    print(machine_line(), flush=True)
    BENCHMARKS[argv[1]]()


if __name__ == "__main__":
    app.run(main)
