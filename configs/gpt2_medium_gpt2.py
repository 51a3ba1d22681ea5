"""GPT-2-medium (24 layers) -> GPT-2 (12 layers), the reference's earlier recipe: terminal window of 6, N=4, k=2.

Hardware: one GPU with 24 GB (or a TPU v4/v5e host).

    python -m mot_jax.train --config=configs/gpt2_medium_gpt2.py --workdir=$HOME/runs/gpt2m_gpt2

10,000 steps of 16 sequences (batch 1 x 16 accumulation; here 4 x 4, the same 16 per step) of 128 tokens, fp32,
warmup 500. Time: ~6 hours on an A100 (the reference's scale; not yet measured on our side). Expected: a
cross-depth translator whose cache brings extractive-QA F1 close to the native context's.
`:tiny` runs the same recipe on tiny random GPT-2 models on a CPU in seconds.
"""

from mot_jax.training.config import base, gpu_step, parse_arg, tiny

# batch_size, grad_accum, data.total_tokens of a step that fills one 80 GB GPU or eight (configs/README.md)
GPU_STEPS = {"gpu1": (64, 1, 512), "gpu8": (512, 1, 512)}


def get_config(arg=None):
    c = base()
    c.source, c.target = "gpt2-medium", "gpt2"
    c.data.corpus = "huggingface:openwebtext"
    c.translator.channels.mode = "terminal"
    c.translator.channels.ratio = 0.5  # 6 of 12 target layers, from the source's top 6
    c.translator.update(num_experts=4, top_k=2)
    c.steps, c.optim.warmup_steps = 10_000, 500
    c.eval_every, c.checkpoint_every = 500, 500
    arg = parse_arg(arg)
    if arg in GPU_STEPS:
        gpu_step(c, arg, *GPU_STEPS[arg])
    if arg == "tiny":
        tiny(c, "gpt2", "gpt2")
    return c
