"""Benchmarks that print Markdown tables (recorded in BENCHMARKS.md with the machine and command).

  python -m mot_jax.bench models                       # random-init gpt2 / opt-125m / qwen2 shapes, 512 tokens
  python -m mot_jax.bench models --models=smollm2-135m,gemma3-270m --lengths=128,512,2048 --decode_tokens=32

Both sides do the same work in one process, interleaved: same weights, dtype, batch and tokens; prefill fills the
cache and computes logits for the last position only (transformers: `logits_to_keep=1`); torch uses as many
threads as XLA has cores; compile time is reported apart; each cell is the median of `--runs` timed runs.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["gpt2", "opt-125m", "qwen2-160m"], "Random-init shapes (see RANDOM) or model names.")
flags.DEFINE_list("lengths", ["512"], "Prompt lengths.")
flags.DEFINE_list("batches", ["1", "8"], "Batch sizes.")
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Dtypes.")
flags.DEFINE_integer("runs", 5, "Timed runs per cell (median reported).")
flags.DEFINE_integer("decode_tokens", 0, "Also time greedy decoding of this many tokens at batch 1 (0: skip).")

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
    from flax import nnx

    prefill = nnx.jit(lambda model, ids: model(ids, logits_to_keep=1)[0])
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


def print_tables(rows, decode_rows):
    import jax
    import torch
    import transformers

    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}, "
          f"transformers {transformers.__version__}; median of {FLAGS.runs}\n")  # fmt: skip
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


def main(argv):
    if argv[1:] != ["models"]:
        raise app.UsageError("usage: python -m mot_jax.bench models [--flags]")
    bench_models()


if __name__ == "__main__":
    app.run(main)
