"""GPT-2 -> GPT-2 with the reference's current recipe (train_mot.json): depth-ratio channel search, N=2, k=1.

Hardware: one GPU (any with 16 GB) or a TPU v4/v5e host; the paper's runs used a single GPU.

    python -m mot_jax.train --config=configs/gpt2_gpt2.py --workdir=$HOME/runs/gpt2_gpt2

500 steps of 16 sequences (4 x 4 accumulation) of 128 tokens, fp32, after a proxy search of 128 steps per candidate
window (min/max ratio 0.3: 4-layer windows of 12). Time: ~15 minutes on an A100 (search included; not yet measured
on our side). Expected: the validation loss well below the untrained translator's; extractive QA with the
translated cache approaching the native context (the paper's GPT-2 numbers are in its Table 2).
`:tiny` runs the same recipe on tiny random GPT-2 models on a CPU in seconds.
"""

from mot_jax.training.config import base, gpu_step, parse_arg, tiny

# batch_size, grad_accum, data.total_tokens of a step that fills one 80 GB GPU or eight (configs/README.md)
GPU_STEPS = {"gpu1": (64, 1, 512), "gpu8": (512, 1, 512)}


def get_config(arg=None):
    c = base()
    c.source, c.target = "gpt2", "gpt2"
    c.data.corpus = "huggingface:openwebtext"  # the paper's corpus (needs network); docs_prose works offline
    arg = parse_arg(arg)
    if arg in GPU_STEPS:
        gpu_step(c, arg, *GPU_STEPS[arg])
    if arg == "tiny":
        tiny(c, "gpt2", "gpt2")
    return c
