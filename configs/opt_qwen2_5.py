"""OPT-1.3B -> Qwen2.5-0.5B: a heterogeneous pair (other family, depth 24 -> 24, width, heads and tokenizer).

Hardware: one GPU with 40 GB (A100) or a TPU v4-8 / v5e-8 host.

    python -m mot_jax.train --config=configs/opt_qwen2_5.py --workdir=$HOME/runs/opt_qwen

500 steps of 16 sequences of 128 Qwen tokens, fp32, depth-ratio search; the OPT context is re-tokenized from the
decoded Qwen text and aligned by character spans. Time: ~1 hour on an A100 (not yet measured on our side).
Expected: the validation loss well below the untrained translator's; the paper's OPT -> Qwen2.5 rows give the QA
scale (its Table 2). `:tiny` runs the same recipe on tiny random OPT and Qwen2 models on a CPU in seconds.
"""

from mot_jax.training.config import base, gpu_step, parse_arg, tiny

# batch_size, grad_accum, data.total_tokens of a step that fills one 80 GB GPU or eight (configs/README.md)
GPU_STEPS = {"gpu1": (16, 2, 1024), "gpu8": (128, 1, 1024)}


def get_config(arg=None):
    c = base()
    c.source, c.target = "facebook/opt-1.3b", "Qwen/Qwen2.5-0.5B"
    c.data.corpus = "huggingface:openwebtext"
    c.data.source_length = 160
    arg = parse_arg(arg)
    if arg in GPU_STEPS:
        gpu_step(c, arg, *GPU_STEPS[arg])
    if arg == "tiny":
        tiny(c, "opt", "qwen2")
    return c
