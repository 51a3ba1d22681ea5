"""Qwen2.5-7B -> Qwen2.5-7B at the paper's headline scale (51.0% closed-set QA accuracy, extractive F1 0.43).

Hardware: a TPU v4-32 / v5e-32 slice or 8 x 80 GB GPUs: the frozen 7B models are FSDP-split over `data`, the
experts over `expert` (2), bf16. Multi-host runs start one process per host (see launch/).

    python -m mot_jax.train --config=configs/qwen2_5_7b.py --workdir=gs://BUCKET/runs/qwen7b

500 steps of 16 sequences of 128 tokens with the paper's translator (dim 1024, 16 heads, depth 2, N=2, k=1).
Time: ~3 hours on a v4-32 (not yet measured on our side). Expected: the paper's Qwen2.5-7B numbers above. The
target's layer scan is rematerialised (`remat="dots"`: its backward pass recomputes all but the projections' outputs).
`:tiny` runs the same recipe on tiny random Qwen2 models on a CPU in seconds.
"""

from mot_jax.training.config import base, gpu_step, parse_arg, tiny

# batch_size, grad_accum, data.total_tokens of a step that fills one 80 GB GPU or eight (configs/README.md)
GPU_STEPS = {"gpu1": (4, 4, 1024), "gpu8": (32, 1, 1024)}


def get_config(arg=None):
    c = base()
    c.source, c.target = "Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B"
    c.dtype = "bfloat16"
    c.data.corpus = "huggingface:openwebtext"
    c.mesh.expert, c.mesh.fsdp = 2, True
    c.remat = "dots"  # the backward through the 7B target's replay keeps its projections' outputs, recomputes the rest
    c.batch_size, c.grad_accum = 16, 1
    arg = parse_arg(arg)
    if arg in GPU_STEPS:
        gpu_step(c, arg, *GPU_STEPS[arg])
    if arg == "tiny":
        tiny(c, "qwen2", "qwen2")
        c.mesh.expert, c.batch_size = 1, 2
    return c
