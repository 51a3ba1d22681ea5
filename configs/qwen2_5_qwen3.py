"""Qwen2.5-0.5B-Instruct -> Qwen3-0.6B: the pair C2C trains (its sharer and receiver; thu-nics/C2C's
recipe/train_recipe/C2C_v3_hidden_0.6+0.5_2gpu.json), across two Qwen generations: depth 24 -> 28, width 896 ->
1024, K/V heads 2 x 64 -> 8 x 128 (Qwen3's q/k norm), tokenizers that share one BPE.

Hardware: one GPU with 40 GB+ (A100/H100) or a TPU v4-8 / v5e-8 host (batch over `data`, experts over `expert`).

    python -m mot_jax.train --config=configs/qwen2_5_qwen3.py --workdir=$HOME/runs/qwen25_qwen3

500 steps of 16 sequences of 128 Qwen3 tokens, bf16 models and compute, depth-ratio search (MoT's recipe, not
C2C's). C2C trains on OpenHermes-2.5 chats (500k, 1 epoch); our corpus reader takes a "text" field, which those
records lack, so this reads OpenWebText as the other reproduction configs do (a local .jsonl of OpenHermes turns
with a "text" field per line can be passed as --config.data.corpus=PATH). Time: ~40 minutes on an H100
(unmeasured: an estimate from qwen2_5_0_5b.py's, which is itself not yet measured). Expected: the validation loss
well below the untrained translator's. `:tiny` runs the same recipe on tiny random Qwen2 -> Qwen3 models on a CPU
in seconds.
"""

from mot_jax.training.config import base, gpu_step, parse_arg, tiny

# batch_size, grad_accum, data.total_tokens of a step that fills one 80 GB GPU or eight (configs/README.md)
GPU_STEPS = {"gpu1": (16, 2, 1024), "gpu8": (128, 1, 1024)}


def get_config(arg=None):
    c = base()
    c.source, c.target = "Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen3-0.6B"
    c.dtype = "bfloat16"
    c.data.corpus = "huggingface:openwebtext"
    arg = parse_arg(arg)
    if arg in GPU_STEPS:
        gpu_step(c, arg, *GPU_STEPS[arg])
    if arg == "tiny":
        tiny(c, "qwen2", "qwen3")
    return c
