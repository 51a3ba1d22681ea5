"""KV Prediction (`kind="kv_prediction"`; Horton et al., arXiv 2410.08391, apple/corenet): a small auxiliary model's
cache is mapped per layer by a learned linear predictor to the base model's cache, from which the base model decodes.

Here the auxiliary model is the source and the base model the target (small -> big: `configs/qwen_coder.py:kvp`):

- the predictor: per target layer, one linear map of the aligned source K and one of its V, from the source layer
  the direct mode's full-depth layer map reads (the reference's aux-layer-to-base-layer map), started at the least-
  squares fit of the native K/V (`linear_skip`, fitted before step 1) and trained from there; the modules are
  `kind="linear"`'s (its `NoMixture` beside the skip), so `inputs` may add the target's token embeddings (and, with
  `native_bottom`, its hidden states) to what the maps read;
- the loss: the target's prompt CE after the translated cache plus, per written layer, the L1 distance of the
  translated K and V to the target's native ones (mean |translated - native| over the valid context tokens' elements
  of that layer, averaged over the layers; logged as `l1_k`, `l1_v`), weight `l1_weight` (its own field,
  `--config.translator.l1_weight`, 1 by default); the K/V MSE is off
  (`loss.correction_weight=0`: the L1 replaces it);
- keys: with `rotary=True` (the recipe) source keys are un-rotated, mapped and re-rotated at the target's positions,
  as the reference predicts keys before the base model's RoPE.

Differences: the reference also trains the auxiliary model (here the source is frozen, only the maps train); it
predicts keys before the base model's k-norm and applies the norm after (here the maps write the cache, so for a
target with a k-norm, Qwen3 or Gemma-3, they write post-norm keys and the L1 compares post-norm keys; Qwen2 has
none).
"""

from __future__ import annotations

import jax.numpy as jnp

from mot_jax.errors import MotJaxError
from mot_jax.translate.kinds.linear import build as linear_build
from mot_jax.translate.kinds.registry import Kind, register


def layer_l1(got, want, mask):
    """[L] mean |got - want| per layer over the [L, B, K, T, d] elements whose token (mask [B, T]) is valid."""
    weight = mask[None, :, None, :, None].astype(jnp.float32)
    diff = jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)) * weight
    return diff.sum((1, 2, 3, 4)) / jnp.maximum(weight.sum() * got.shape[2] * got.shape[4], 1.0)


def l1_terms(cache, native, first, context_mask):
    """{"l1_k", "l1_v"}: each the per-layer L1 (`layer_l1`) of the translated cache's context slots against the
    native cache of the context, over layers `first..L-1`, averaged over those layers (0 where there are none)."""
    length = context_mask.shape[1]
    terms = {}
    for name, got, want in (("k", cache.k, native.k), ("v", cache.v, native.v)):
        per_layer = layer_l1(got[first:, :, :, :length], want[first:, :, :, :length], context_mask)
        terms[f"l1_{name}"] = per_layer.mean() if per_layer.size else jnp.zeros(())
    return terms


def extra_loss(*, cfg, cache, native, first, batch, **_):
    """The per-layer L1 on K and V (`l1_terms`) at `cfg.l1_weight`; (loss, metrics)."""
    terms = l1_terms(cache, native, first, batch.context_mask)
    return cfg.l1_weight * (terms["l1_k"] + terms["l1_v"]), terms


def check(spec, cfg):
    if spec.mode != "direct":
        raise MotJaxError(
            "kind='kv_prediction' writes the target's cache from the maps (no replay); set mode='direct'."
        )
    if not cfg.linear_skip:
        raise MotJaxError("kind='kv_prediction' is a linear map per layer (the linear skip); set linear_skip=True.")
    if not 0 <= cfg.l1_weight < float("inf"):
        raise MotJaxError(f"l1_weight={cfg.l1_weight!r} must be a finite number of at least 0; pass one.")


register(
    Kind(
        name="kv_prediction",
        label=lambda cfg: f"KV Prediction ({cfg.mode})",
        build=linear_build,  # the linear kind's modules: the least-squares-started maps are the translation
        check=check,
        # the reference: the base model never reads the context; linear maps from the aux K/V (keys before RoPE),
        # trained on the base model's CE plus per-layer L1 on K and V, no MSE
        recipe={
            "translator.mode": "direct",
            "translator.linear_skip": True,
            "translator.rotary": True,
            "translator.output_activation": "none",
            "translator.native_bottom": 0,
            "translator.inputs": "source",
            "loss.ce_weight": 1.0,
            "loss.correction_weight": 0.0,
        },
        extra_loss=extra_loss,
        fields=dict(l1_weight=1.0),  # on l1_k + l1_v, beside the prompt CE at loss.ce_weight
        # its maps are kind linear's (`torch={"key": "NoMixture", ...}` would build them), not yet checked there
        no_export="its PyTorch side is not yet checked against its JAX outputs",
    )
)
