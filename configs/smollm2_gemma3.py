"""SmolLM2-135M <-> Gemma-3-270M, offline on a CPU: the runs behind RESULTS.md.

The argument picks the run, as a comma list: `replay` (default) or `direct`; `single` (one translator, N=1) or
any other registered translator kind (`mot_jax/translate/kinds/`) in place of the mixture, at its reference's
settings (`Kind.recipe`): `projector` (the C2C-Project baseline), `linear` (the linear skip alone), `c2c` (the C2C
fuser: the target prefills its context and adds gated residuals from the source's K/V at its layers; direct, suffix
CE only), `lsc` (the LSC baseline: every source layer's K/V through a shared latent into every target layer's, at
the reference's sizes; direct, suffix CE only), `mot_h` (MoT-h: the mixture translates the source's window layers'
input residual streams into the target's, which replace its own in a dense forward over the context; replay, MoT's
loss) or `interlat` (the Interlat baseline: the source's last-layer hidden states through the reference's adapter
are the target's input embeddings, whose forward builds its cache; direct, the suffix CE plus the reference's
plan-similarity and random-contrast terms); `skip` for a
least-squares-started linear skip beside the mixtures (with keys translated un-rotated and no output GELU);
`reverse` for Gemma-3 -> SmolLM2; `tiny` to run it on tiny random models in seconds.

    python -m mot_jax.train --config=configs/smollm2_gemma3.py:replay --workdir=$HOME/runs/s2g_replay
    python -m mot_jax.train --config=configs/smollm2_gemma3.py:direct,reverse --workdir=$HOME/runs/g2s_direct
    python -m mot_jax.train --config=configs/smollm2_gemma3.py:c2c --workdir=$HOME/runs/s2g_c2c  # time unmeasured
    python -m mot_jax.train --config=configs/smollm2_gemma3.py:lsc --workdir=$HOME/runs/s2g_lsc  # time unmeasured
    python -m mot_jax.train --config=configs/smollm2_gemma3.py:mot_h --workdir=$HOME/runs/s2g_mot_h  # unmeasured
    python -m mot_jax.train --config=configs/smollm2_gemma3.py:interlat --workdir=$HOME/runs/s2g_interlat  # unmeasured

Contexts of 191 target tokens (BOS first) like the evaluation passages (~190 tokens with the instruction), a
64-token prompt, 4 sequences per step; a mixture of 2 experts (k=1, one block per layer) over the top 30% of the
target's layers (`replay`, dim 256) or over all of them (`direct`, dim 96). Time on a shared 2-core CPU, 200 steps:
replay ~20 minutes, direct ~12 (the first run also converts both models and prepares the corpus). `lsc` at the
reference's sizes (translator dim 512, 16 heads, ratio 4, 32 x 128 latent) has 589M trainable parameters (K and V;
AdamW's state alone ~7 GB in fp32): far slower, unmeasured. `mot_h` has replay's mixture sizes and window (the
top 30%; per layer a 576-wide SmolLM2 stream in, a 640-wide Gemma-3 stream out, through the reference's output GELU)
and a dense target forward in place of the sparse replay; its time and result are unmeasured. `interlat`'s adapter
(576 -> 640, 8 attention heads over the context: 2.8M parameters) is small, but each step runs the target three times
over the prompt (after the translated, the native and a mismatched cache) and twice over the context's latents; its
time and result are unmeasured. Measured results and the evaluation commands: RESULTS.md.
"""

from mot_jax.errors import MotJaxError
from mot_jax.training.config import base, tiny
from mot_jax.translate import kinds

KINDS = ("single", *(k for k in kinds.names() if k != "mot"))  # at most one: what replaces the mixture
CHOICES = ("replay", "direct", *KINDS, "skip", "reverse", "tiny")


def get_config(arg=None):
    parts = [p for p in (arg or "").split(",") if p]
    unknown = [p for p in parts if p not in CHOICES]
    chosen = [p for p in parts if p in KINDS]
    recipe = kinds.get(chosen[0]).recipe if chosen and chosen[0] != "single" else {}
    forced = recipe.get("translator.mode")  # a kind that runs in one mode only (its reference's)
    direct = "direct" in parts or forced == "direct"
    if unknown or ("replay" in parts and direct) or len(chosen) > 1 or (forced == "replay" and "direct" in parts):
        raise MotJaxError(
            f"Bad config argument {arg!r}; pass a comma list of {', '.join(CHOICES)} with at most one of "
            f"replay/direct and one of {'/'.join(KINDS)} (each in its reference's mode where it has one)."
        )
    c = base()
    c.source, c.target = "smollm2-135m", "gemma3-270m"
    if "reverse" in parts:
        c.source, c.target = c.target, c.source
    c.translator.mode = "direct" if direct else "replay"
    c.translator.channels.mode = "terminal"
    c.translator.channels.ratio = 0.3  # replay: the top 30% of the target's layers; direct translates every layer
    c.translator.update(dim=256, heads=4, depth=1, mlp_ratio=2, num_experts=2, top_k=1)
    if c.translator.mode == "direct":
        # every target layer, so one block per layer: narrower, and one output projection per layer (the paper's
        # fused W x W projection would cost more than the target's own prefill)
        c.translator.update(dim=96, heads=2, mlp_ratio=4, fused_output=False)
    if "single" in parts:
        c.translator.num_experts = 1
    elif chosen:  # the kind and its reference's settings (sizes, loss; `Kind.recipe`)
        kinds.apply_recipe(c, chosen[0])
    if "skip" in parts:
        c.translator.update(linear_skip=True, rotary=True, output_activation="none")
    c.data.total_tokens, c.data.prefix_tokens, c.data.source_length = 256, 192, 256
    c.steps, c.batch_size, c.grad_accum = 200, 4, 1
    c.optim.learning_rate, c.optim.warmup_steps = 1e-3, 20
    c.log_every, c.eval_every, c.checkpoint_every = 10, 50, 50
    c.eval_batches, c.final_eval_batches = 4, 8
    if "tiny" in parts:
        families = ("llama", "gemma3")
        tiny(c, *(reversed(families) if "reverse" in parts else families))
        if "lsc" in parts:
            c.translator.update(shared_slots=4, shared_dim=8)
    return c
