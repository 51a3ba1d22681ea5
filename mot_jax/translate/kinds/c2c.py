"""The C2C baseline (`TranslatorConfig.kind="c2c"`): the receiver's own cache plus a gated residual from the sharer's.

Reference section 7 (`c2c`), formulas checked against the MoT authors' `alg/c2c/train.py` (`ResidualCacheFuser`,
`compute_gate_temperature`; prosopher/MoT at 0e212c43), their re-implementation of thu-nics/C2C. The receiver
(target) prefills its context itself; the window is C2C's terminal alignment, the top min(Ls, Lt) layers of each
model paired from the top (all target layers when the target is the shallower). Per window layer, a fuser for K and
one for V read the receiver's K (or V) of that layer, r [B, T, W, dt], and the sharer's (source's) on the target
token grid, s [B, T, W, ds]:

    R = GELU(Linear(LN(r))), S = GELU(Linear(LN(s)))          receiver and sharer branches, [B, T, W, D]
    P = GELU(Linear(LN([R, S])));  F = P + MLP(P)              fusion; MLP = LN, Linear D -> rD, GELU, Linear rD -> D
    C = F * sigmoid(Linear(LN(F)))                             the dynamic weight, per channel
    chain from R_0 (the receiver branch at window layer 0): R stages of W un-shared cross-attention blocks, block
      (r, l) attending to C_l over all tokens (MoT's chain, `expert.chain`)
    residual = GELU(Linear(LN(the last stage's W states)))    [B, T, W, dt]
    output = r + gate * residual,  gate [W]: one per layer

Gate logits start at 1.5. In training the gate is a logistic-noise ("Gumbel") sigmoid, sigmoid((logit + log u -
log(1 - u)) / tau), one u ~ U(0, 1) per layer and forward (shared by every row and token), tau annealed linearly
from 1.0 at the first step to 0.1 at the last; in evaluation (and the validation loss) the gate is hard,
1[sigmoid(logit) >= 0.5]: a layer is fused or left native. Every token is fused, the first too (the other
translators' first-token rule does not apply: the receiver's own K/V are there). The reference's loss is the suffix
CE alone: `configs/smollm2_gemma3.py:c2c` sets `loss.correction_weight=0`; pass it with `kind=c2c` elsewhere.

Differences, each small: the source reads the target's text and is aligned onto the target's tokens as for every
translator here (the stored reference feeds one token sequence to both models, which assumes a shared tokenizer);
padding tokens are hidden from the cross-attention (the reference trains on unpadded chunks, where that changes
nothing); `output_activation="none"` drops the residual's GELU and `fused_output=False` (as `smollm2_gemma3.py:c2c`,
for cost) projects per layer (the reference: GELU, fused).

`python -m mot_jax.export` exports it (`export/torch_translator.py`: `Fuser`, `KVTranslator.fuse_window`, the hard
gate; `torch_pipeline.CachePipeline` runs the target's own prefill with transformers).

This is the MoT authors' C2C, which the paper's comparison ran, not thu-nics/C2C's own code: its projectors
(`rosetta/model/projector.py`, read at 04b1d509) are per-layer modules with other gate granularities and defaults
(e.g. `gate_init_value=0.0`, a temperature annealed to 0.01), not checked against this module.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mot_jax.errors import MotJaxError
from mot_jax.models.hooks import Forward
from mot_jax.models.layers import LayerNorm, Linear
from mot_jax.translate import channels
from mot_jax.translate.config import TranslatorConfig
from mot_jax.translate.expert import EPS, CrossAttentionBlocks, chain, gelu, output_head, torch_std
from mot_jax.translate.kinds.registry import Kind, refuse, register
from mot_jax.translate.window import to_cache, window_block, window_inputs

GATE_INIT = 1.5  # the gate logits at init: sigmoid(1.5) = 0.82, every layer's gate open (reference)
TEMPERATURE = (1.0, 0.1)  # the training gate's temperature at the first and the last step (reference)


@dataclasses.dataclass(frozen=True)
class GateNoise:
    """The training gate of one forward: its temperature and the random key of its logistic noise. A pytree, so
    it passes into jitted code; evaluation passes None (the hard gate)."""

    temperature: jax.Array
    key: jax.Array

    def split(self) -> tuple[GateNoise, GateNoise]:
        """Two gates of the same temperature with independent noise (the K and the V fuser's)."""
        return tuple(GateNoise(self.temperature, key) for key in jax.random.split(self.key))


jax.tree_util.register_dataclass(GateNoise, data_fields=["temperature", "key"], meta_fields=[])


def gate_temperature(step, total_steps: int):
    """The training gate's temperature at update `step` (0-based) of `total_steps`: linear from 1.0 to 0.1 (the
    reference's (1 - p) * start + p * end, p = step / (total_steps - 1), at least 1e-4)."""
    start, end = TEMPERATURE
    if total_steps <= 1:
        return jnp.asarray(end, jnp.float32)
    progress = jnp.asarray(step, jnp.float32) / (total_steps - 1)
    return jnp.maximum((1 - progress) * start + progress * end, 1e-4)


def gate(logits, noise: GateNoise | None):
    """[W] gate values: the hard gate (noise None) or the training gate."""
    if noise is None:
        return (jax.nn.sigmoid(logits) >= 0.5).astype(logits.dtype)
    u = jax.random.uniform(noise.key, logits.shape, jnp.float32, 1e-6, 1 - 1e-6)
    return jax.nn.sigmoid((logits + jnp.log(u) - jnp.log1p(-u)) / noise.temperature).astype(logits.dtype)


class ResidualCacheFuser(nnx.Module):
    """The K or the V fuser of one model pair over a window of W layers (module docstring). Reads only `dim`,
    `heads`, `depth`, `mlp_ratio`, `output_activation`, `fused_output` and the widths of its config."""

    def __init__(self, cfg: TranslatorConfig, *, rngs, dtype=jnp.float32):
        if cfg.output_activation not in ("gelu", "none"):
            raise MotJaxError(f"output_activation={cfg.output_activation!r} is not 'gelu' or 'none'.")
        self.cfg = cfg
        D, W, dr, ds = cfg.dim, cfg.window, cfg.target_width, cfg.source_width
        kw = dict(rngs=rngs, dtype=dtype)
        self.receiver_norm = LayerNorm(dr, EPS, **kw)
        self.receiver_proj = Linear(dr, D, (None, "embed"), **kw, std=torch_std(dr))
        self.sharer_norm = LayerNorm(ds, EPS, **kw)
        self.sharer_proj = Linear(ds, D, (None, "embed"), **kw, std=torch_std(ds))
        self.feature_norm = LayerNorm(2 * D, EPS, **kw)
        self.feature_proj = Linear(2 * D, D, (None, "embed"), **kw, std=torch_std(2 * D))
        self.fusion_norm = LayerNorm(D, EPS, **kw)
        self.fusion_fc1 = Linear(D, cfg.mlp_ratio * D, ("embed", "mlp"), **kw, std=torch_std(D))
        self.fusion_fc2 = Linear(cfg.mlp_ratio * D, D, ("mlp", "embed"), **kw, std=torch_std(cfg.mlp_ratio * D))
        self.weight_norm = LayerNorm(D, EPS, **kw)
        self.weight_proj = Linear(D, D, ("embed", None), **kw, std=torch_std(D))
        self.blocks = CrossAttentionBlocks(cfg, **kw, experts=False)
        if cfg.fused_output:
            self.output_norm = LayerNorm(W * D, EPS, **kw)
            self.output_proj = Linear(W * D, W * dr, ("embed", None), **kw, std=torch_std(W * D))
        else:  # one per window layer
            per_layer = dict(kw, lead=(W,), lead_names=("layers",))
            self.output_norm = LayerNorm(D, EPS, **per_layer)
            self.output_proj = Linear(D, dr, ("embed", None), **per_layer, std=torch_std(D))
        self.gate_logits = nnx.Param(jnp.full((W,), GATE_INIT, dtype), out_sharding=("layers",), eager_sharding=False)

    def __call__(self, receiver, sharer, token_mask, noise: GateNoise | None = None):
        """receiver [B, T, W, dt], sharer [B, T, W, ds], token_mask [B, T] -> (fused [B, T, W, dt], the gate [W])."""
        cfg = self.cfg
        b, t, w, _ = receiver.shape
        r = gelu(self.receiver_proj(self.receiver_norm(receiver)))
        s = gelu(self.sharer_proj(self.sharer_norm(sharer)))
        p = gelu(self.feature_proj(self.feature_norm(jnp.concatenate([r, s], -1))))
        fused = p + self.fusion_fc2(gelu(self.fusion_fc1(self.fusion_norm(p))))
        context = fused * jax.nn.sigmoid(self.weight_proj(self.weight_norm(fused)))
        last_stage = chain(self.blocks, r[:, :, 0], context, token_mask[:, None, :], cfg.depth)
        residual = output_head(self.output_norm, self.output_proj, last_stage, cfg.fused_output)
        residual = (gelu(residual) if cfg.output_activation == "gelu" else residual).reshape(b, t, w, -1)
        g = gate(self.gate_logits[...], noise)
        return receiver + g[:, None] * residual.astype(receiver.dtype), g


def check_fusable(spec, cfg: TranslatorConfig):
    """Refuse the switches that mean nothing for C2C (it fuses into the receiver's own prefill), each in one line."""
    refusals = (
        (spec.mode != "direct", "hands on the receiver's own cache plus residuals (no replay); set mode='direct'"),
        (spec.native_bottom, "has the receiver read its whole context itself; set native_bottom=0"),
        (spec.outputs != "kv", "adds residuals to the receiver's K/V; set outputs='kv'"),
        (tuple(spec.inputs) != ("source",), "reads the source's K/V beside the receiver's own; set inputs='source'"),
        (spec.rotary, "adds residuals to the receiver's rotated keys; set rotary=False"),
        (cfg.linear_skip, "has no linear skip; set linear_skip=False"),
    )
    refuse("c2c", refusals)


def fuse(translator, own_k, own_v, k, v, mask, noise=None):
    """The receiver's window K/V own_k, own_v [B, T, W, dt] fused with the aligned source's k, v [B, T, W, ds] by the
    translator's K and V fusers -> fused k, v [B, T, W, dt] and the aux outputs, with "gate": the K and V gates
    [2, W]; `noise` a `GateNoise` in training (split: K and V draw their own), None for the hard gate."""
    k_noise, v_noise = (None, None) if noise is None else noise.split()
    k_out, gate_k = translator.key(own_k, k, mask, k_noise)
    v_out, gate_v = translator.value(own_v, v, mask, v_noise)
    return k_out, v_out, {"key": {}, "value": {}, "gate": jnp.stack([gate_k, gate_v])}


def fuse_receiver(translator, source, target, source_cache, alignment, target_ids, mask, capacity, receiver, noise):
    """kind='c2c': the target's own prefill of its context (`receiver`, or run here) with its window layers' K/V
    fused with the source's (`fuse`), in a cache of `capacity` slots; and the aux outputs."""
    spec, target_cfg = translator.spec, target.config
    batch, length = target_ids.shape
    if receiver is None:
        receiver = target.run_layers(Forward(target_ids, mask, fresh=True), target.init_cache(batch, capacity)).cache
    cache = receiver.with_capacity(capacity)
    own = lambda kv: window_block(kv[..., :length, :], spec.target_layers)  # [B, T, W, Kt * dt]
    k, v, aux = fuse(
        translator,
        own(cache.k),
        own(cache.v),
        *window_inputs(spec, source, target, source_cache, alignment),
        mask,
        noise,
    )
    heads = lambda y: to_cache(y.reshape(*y.shape[:3], target_cfg.num_kv_heads, target_cfg.head_dim), target)
    layers = jnp.asarray(spec.target_layers)
    return cache.replace(
        k=cache.k.at[layers, :, :, :length].set(heads(k)), v=cache.v.at[layers, :, :, :length].set(heads(v))
    ), aux


def gate_noises(key, step, total_steps: int, micro_batches: int) -> GateNoise:
    """Each micro-batch's training gate: the temperature at this update and its own noise."""
    temperature = jnp.full(micro_batches, gate_temperature(step, total_steps))
    return GateNoise(temperature, jax.random.split(key, micro_batches))


def top_layers(num_source: int, num_target: int):
    """C2C's terminal alignment: the top min(Ls, Lt) layers of each side, paired from the top."""
    top = channels.terminal(num_source, num_target, 1.0)
    return top.source, top.target


register(
    Kind(
        name="c2c",
        label=lambda cfg: "C2C",  # its target reads the context itself: its TTFT (translation) holds that prefill
        build=lambda spec, cfg, rngs, dtype: {
            part: ResidualCacheFuser(cfg, rngs=rngs, dtype=dtype) for part in ("key", "value")
        },
        translate=fuse_receiver,
        check=check_fusable,
        window=top_layers,
        receiver=True,
        recipe={"translator.mode": "direct", "loss.correction_weight": 0.0},  # the reference's loss: the suffix CE
        noise=gate_noises,
        torch={"key": "Fuser", "value": "Fuser"},
        torch_call="fuse_window",  # with the target's own cache of the context
    )
)
