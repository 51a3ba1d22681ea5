"""The LSC baseline (`TranslatorConfig.kind="lsc"`): every source layer's K (or V) into a shared latent and out again
as every target layer's.

Reference section 7 (`lsc`), shapes checked against the MoT authors' `alg/lsc/train.py` (`LocalToSharedTranslator`,
`SharedToLocalTranslator`, `ModelLatentTranslator`; prosopher/MoT at 0e212c43 and bdf0a9d7, the same modules) and
its `CrossAttentionBlock` (`core/train_util.py`, MoT's block). Per token, with L_s source and L_t target layers, D =
`dim`, S x d = `shared_slots` x `shared_dim` (32 x 128):

    local -> shared (the source's): x [B, T, L_s, ds], every source layer's K (or V) on the target token grid
        P = GELU(Linear(LN(x)))                                  one LN and Linear shared by all layers, [B, T, L_s, D]
        chain from P_0: L_s un-shared blocks, block l attending to P_l over all tokens (MoT's chain with one stage)
        z = GELU(Linear(LN(the L_s states concatenated)))        [B, T, S * d], viewed as S slots of d
    shared -> local (the target's): z flattened [B, T, S * d]
        E = GELU(Linear(LN(z))), viewed as [B, T, L_t, D]        one projection of the whole latent to every layer
        chain from E_0: L_t un-shared blocks, block l attending to E_l
        y = GELU(Linear(LN(the L_t states concatenated)))        [B, T, L_t * dt] -> [B, T, L_t, dt]

The slots are a reshape of one per-token Linear (no learned slot queries); the chains are one stage, not MoT's R
(`depth` is unused). The reference trains one such adapter per *model* (its local -> shared and shared -> local for
K and for V), shared by every pair it takes part in; here one pair trains, so one module holds the source's local ->
shared and the target's shared -> local (`to_shared`, `from_shared`: separate submodules, so that a run over more
models could share them). K and V have their own module (`KVTranslator.key` / `.value`), as the reference's four.

Its translation spec (`kind='lsc'`: `every_layer`) reads every source layer and writes every
target layer, in `mode="direct"`; the loss is the suffix CE alone (`loss.correction_weight=0`, as
`configs/smollm2_gemma3.py:lsc`). Differences, each small: the source reads the target's text and is aligned onto the
target's tokens as for every translator here (the reference feeds one token sequence to both models); padding tokens
are hidden from the cross-attention (`causal=True` hides later tokens too); `output_activation="none"` drops the
output GELU (never the latent's); and the context's first token keeps the target's own K/V, as for the other direct
translators (`translator.py`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from mot_jax.errors import MotJaxError
from mot_jax.models.layers import LayerNorm, Linear
from mot_jax.translate.config import TranslatorConfig
from mot_jax.translate.expert import EPS, CrossAttentionBlocks, chain, gelu, output_head, torch_std
from mot_jax.translate.kinds.registry import Kind, refuse, register


class LocalToShared(nnx.Module):
    """A model's K (or V) at all its `layers` layers, [B, T, layers, width], to the latent [B, T, slots, dim]."""

    def __init__(self, cfg: TranslatorConfig, layers: int, width: int, *, rngs, dtype):
        D, latent = cfg.dim, cfg.shared_slots * cfg.shared_dim
        kw = dict(rngs=rngs, dtype=dtype)
        self.input_norm = LayerNorm(width, EPS, **kw)
        self.input_proj = Linear(width, D, (None, "embed"), **kw, std=torch_std(width))
        self.blocks = CrossAttentionBlocks(dataclasses.replace(cfg, depth=1, window=layers), **kw, experts=False)
        self.output_norm = LayerNorm(layers * D, EPS, **kw)
        self.output_proj = Linear(layers * D, latent, ("embed", None), **kw, std=torch_std(layers * D))
        self.slots = (cfg.shared_slots, cfg.shared_dim)

    def __call__(self, x, visible):
        context = gelu(self.input_proj(self.input_norm(x)))  # [B, T, layers, D]
        states = chain(self.blocks, context[:, :, 0], context, visible, 1)
        return gelu(output_head(self.output_norm, self.output_proj, states, True)).reshape(*x.shape[:2], *self.slots)


class SharedToLocal(nnx.Module):
    """The latent [B, T, slots, dim] to a model's K (or V) at all its `layers` layers, [B, T, layers, width]."""

    def __init__(self, cfg: TranslatorConfig, layers: int, width: int, *, rngs, dtype):
        D, latent = cfg.dim, cfg.shared_slots * cfg.shared_dim
        kw = dict(rngs=rngs, dtype=dtype)
        self.input_norm = LayerNorm(latent, EPS, **kw)
        self.input_proj = Linear(latent, layers * D, (None, "embed"), **kw, std=torch_std(latent))
        self.blocks = CrossAttentionBlocks(dataclasses.replace(cfg, depth=1, window=layers), **kw, experts=False)
        self.output_norm = LayerNorm(layers * D, EPS, **kw)
        self.output_proj = Linear(layers * D, layers * width, ("embed", None), **kw, std=torch_std(layers * D))
        self.layers, self.output_gelu = layers, cfg.output_activation == "gelu"

    def __call__(self, z, visible):
        b, t = z.shape[:2]
        context = gelu(self.input_proj(self.input_norm(z.reshape(b, t, -1)))).reshape(b, t, self.layers, -1)
        states = chain(self.blocks, context[:, :, 0], context, visible, 1)
        y = output_head(self.output_norm, self.output_proj, states, True)
        return (gelu(y) if self.output_gelu else y).reshape(b, t, self.layers, -1)


class LatentTranslator(nnx.Module):
    """The K or the V translator of one pair: the source's local -> shared, then the target's shared -> local (module
    docstring). Reads the widths, `window` (L_t), `dim`, `heads`, `mlp_ratio`, `shared_slots`, `shared_dim`,
    `output_activation` and `causal` of its config; `source_layers` is L_s (every source layer)."""

    def __init__(self, cfg: TranslatorConfig, source_layers: int, *, rngs, dtype=jnp.float32):
        if cfg.output_activation not in ("gelu", "none"):
            raise MotJaxError(f"output_activation={cfg.output_activation!r} is not 'gelu' or 'none'.")
        if cfg.dim % cfg.heads:
            raise MotJaxError(f"translator dim {cfg.dim} is not divisible by heads {cfg.heads}; change one of them.")
        self.causal = cfg.causal
        self.to_shared = LocalToShared(cfg, source_layers, cfg.source_width, rngs=rngs, dtype=dtype)
        self.from_shared = SharedToLocal(cfg, cfg.window, cfg.target_width, rngs=rngs, dtype=dtype)

    def __call__(self, x, token_mask=None):
        """x [B, T, L_s, ds] -> (y [B, T, L_t, dt], {}): no router, so no aux outputs."""
        b, t = x.shape[:2]
        visible = (jnp.ones((b, t), bool) if token_mask is None else token_mask.astype(bool))[:, None, :]  # [B, 1, T]
        if self.causal:
            visible = visible & (jnp.arange(t)[None, None, :] <= jnp.arange(t)[None, :, None])
        return self.from_shared(self.to_shared(x, visible), visible), {}


def check_spec(spec, cfg: TranslatorConfig):
    """Refuse the switches that mean nothing for LSC (all source layers in, all target layers out), in one line."""
    refusals = (
        (spec.mode != "direct", "writes every target layer itself (no replay); set mode='direct'"),
        (spec.native_bottom, "replaces every target layer; set native_bottom=0"),
        (spec.outputs != "kv", "writes K/V; set outputs='kv'"),
        (tuple(spec.inputs) != ("source",), "reads the source's K/V alone; set inputs='source'"),
        (cfg.linear_skip, "has no linear skip; set linear_skip=False"),
        (
            spec.source_layers != tuple(range(len(spec.source_layers))),
            "reads every source layer; build its spec with kind='lsc'",
        ),
    )
    refuse("lsc", refusals)


def every_layer(num_source: int, num_target: int):
    """LSC's window: every source layer read, every target layer written."""
    return range(num_source), range(num_target)


def build(spec, cfg: TranslatorConfig, rngs, dtype):
    layers = len(spec.source_layers)
    return {part: LatentTranslator(cfg, layers, rngs=rngs, dtype=dtype) for part in ("key", "value")}


register(
    Kind(
        name="lsc",
        label=lambda cfg: "LSC",  # always direct: every target layer from the shared latent
        build=build,
        check=check_spec,
        window=every_layer,
        fields=dict(shared_slots=32, shared_dim=128),  # the latent per token (reference: 32 slots x 128)
        counts=dict(shared_slots=1, shared_dim=1),
        torch={"key": "LatentTranslator", "value": "LatentTranslator"},
        # the reference's sizes; its loss is the suffix CE alone
        recipe={
            "translator.mode": "direct",
            "translator.dim": 512,
            "translator.heads": 16,
            "translator.mlp_ratio": 4,
            "loss.correction_weight": 0.0,
        },
    )
)
