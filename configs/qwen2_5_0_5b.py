"""Qwen2.5-0.5B -> Qwen2.5-0.5B in bf16, the pair of the reference's long-context experiments (HotpotQA, LongBench).

Hardware: one GPU with 40 GB+ (A100/H100) or a TPU v4-8 / v5e-8 host (batch over `data`, experts over `expert`).

    python -m mot_jax.train --config=configs/qwen2_5_0_5b.py --workdir=$HOME/runs/qwen05

500 steps of 16 sequences of 128 tokens, bf16 models and compute, depth-ratio search. Time: ~30 minutes on an H100
(not yet measured on our side). Expected: long-context F1 with the translated cache near the native context's
(the reference stores F1 0.21 for MoT against 0.215-0.22 native on HotpotQA at 8k-24k budgets).
`:tiny` runs the same recipe on tiny random Qwen2 models on a CPU in seconds.
"""

from mot_jax.training.config import base, gpu_step, parse_arg, tiny

# batch_size, grad_accum, data.total_tokens of a step that fills one 80 GB GPU or eight (configs/README.md)
GPU_STEPS = {"gpu1": (16, 2, 1024), "gpu8": (128, 1, 1024)}


def get_config(arg=None):
    c = base()
    c.source, c.target = "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B"
    c.dtype = "bfloat16"
    c.data.corpus = "huggingface:openwebtext"
    c.translator.k_attn = 128
    arg = parse_arg(arg)
    if arg in GPU_STEPS:
        gpu_step(c, arg, *GPU_STEPS[arg])
    if arg == "tiny":
        tiny(c, "qwen2", "qwen2")
    return c
