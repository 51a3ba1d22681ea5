"""The dial's window and the window path: which target layers a translator writes above the target's own bottom
layers, and how the window's K/V are read from the source, translated and written in the target's cache layout.

`check_native_bottom` is the one place the dial's `native_bottom` is validated (`TranslationSpec.build`, training and
export call it). The window path (`translate_window`) is what `translator.translate` runs for every kind without a
path of its own; the kinds' own paths (`kinds/`) reuse its pieces.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from mot_jax.errors import MotJaxError
from mot_jax.models.base import CausalLM, first_valid_index, positions_from_mask
from mot_jax.translate import align as alignment_lib

alignment_lib.register_pytree()  # alignments enter jitted code here


def check_native_bottom(native_bottom, num_target_layers, mode="direct", inputs=("source",), translates=False):
    """Refuse, in one line, a `native_bottom` the dial cannot run: outside 0..L (L: the target's layers), set in
    replay, or 0 with the 'hidden' input (the residual stream after the native bottom). `translates`: the caller
    needs layers to translate (training, export), so B = L (native context, nothing written) is refused too."""
    if native_bottom and mode != "direct":
        raise MotJaxError("native_bottom applies to mode='direct' only; set it to 0 for replay.")
    if not 0 <= native_bottom <= num_target_layers:
        raise MotJaxError(
            f"native_bottom={native_bottom} is outside 0..{num_target_layers} (the target's layers); pass one in "
            "that range."
        )
    if translates and native_bottom == num_target_layers:
        raise MotJaxError(
            f"native_bottom={native_bottom} leaves none of the target's {num_target_layers} layers to translate "
            "(that is native context); pass a smaller native_bottom."
        )
    if "hidden" in inputs and not native_bottom:
        raise MotJaxError(
            "The 'hidden' input is the target's residual stream after its native bottom layers; "
            "set native_bottom > 0 or drop it."
        )


def unrotated(spec, source: CausalLM, target: CausalLM) -> bool:
    """Whether keys are translated un-rotated: the spec asks for it (`spec.rotary`) and both models rotate keys."""
    return spec.rotary and source.config.rotary and target.config.rotary


def window_block(cache_kv, layers, rotated_by: CausalLM | None = None, positions=None):
    """[L, B, K, S, d] -> the window layers as [B, S, W, K * d]; keys un-rotated from `positions` [B, S] when
    `rotated_by`, the model whose cache it is, is given."""
    x = cache_kv[jnp.asarray(layers)].transpose(1, 3, 0, 2, 4)  # [B, S, W, K, d]
    if rotated_by is not None:
        x = rotated_by.rotate_keys(x, -positions, layers)
    return x.reshape(*x.shape[:3], -1)


def rms_normalized(x):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6)


def target_features(spec, target: CausalLM, target_ids, mask, hidden):
    """The target-side features the translator reads ([B, T, F]; None when it reads the source alone), from the
    residual stream after the native bottom (`CausalLM.run_bottom`'s)."""
    features = []
    if "embeddings" in spec.inputs:
        features.append(rms_normalized(target.embed(target_ids, positions_from_mask(mask))))
    if "hidden" in spec.inputs:
        features.append(rms_normalized(hidden))
    return jnp.concatenate(features, -1) if features else None


def run_native_bottom(spec, target: CausalLM, target_ids, mask):
    """The target's own layers `0..native_bottom-1` over the context into a cache of its length, and the
    target-side features the translator reads ([B, T, F], None when it reads the source alone)."""
    cache, hidden = target.run_bottom(target_ids, mask, spec.native_bottom, target_ids.shape[1])
    return cache, target_features(spec, target, target_ids, mask, hidden)


def window_parts(spec, source: CausalLM, target: CausalLM, source_cache, alignment, features=None):
    """The translator's inputs in parts: each window layer's own, the source K (un-rotated for rotary specs) and V on
    the target grid [B, T, W, ds] (width 0 unless `spec.reads_source`), and the target-side `features` [B, T, Ft] that
    every window layer reads alike (or None)."""
    if spec.reads_source:
        rotated_by = source if unrotated(spec, source, target) else None
        k = window_block(source_cache.k, spec.source_layers, rotated_by, source_cache.positions)
        v = window_block(source_cache.v, spec.source_layers)
        k, v = alignment_lib.resample(k, alignment.weights), alignment_lib.resample(v, alignment.weights)
    else:  # the features alone
        k = v = jnp.zeros((*features.shape[:2], len(spec.target_layers), 0), features.dtype)
    shared = None if features is None else features.astype(k.dtype)
    return k, v, shared


def join_shared(x, shared):
    """A window layer's own inputs [B, T, W, ds] followed by the inputs all layers share [B, T, F] (None: none)."""
    if shared is None:
        return x
    return jnp.concatenate([x, jnp.broadcast_to(shared[:, :, None], (*x.shape[:3], shared.shape[-1]))], -1)


def window_inputs(spec, source: CausalLM, target: CausalLM, source_cache, alignment, features=None):
    """The translator's inputs joined, each [B, T, W, F]: `window_parts`' own inputs of each layer, then the shared
    features (what the mixtures read)."""
    k, v, shared = window_parts(spec, source, target, source_cache, alignment, features)
    return join_shared(k, shared), join_shared(v, shared)


def translate_window(translator, source: CausalLM, target: CausalLM, source_cache, alignment, mask, features=None):
    """The translated window K/V, each [W, B, Kt, T, dt], and the mixtures' aux outputs {"key": .., "value": ..}."""
    spec, target_cfg = translator.spec, target.config
    k, v, shared = window_parts(spec, source, target, source_cache, alignment, features)
    k, v, aux = translator(k, v, mask, shared)
    pos = positions_from_mask(mask)
    if spec.kv_from_hidden:  # layer inputs: the target's own projections, k-norm and RoPE make the K/V
        k, v = target.layer_key_values(spec.target_layers, k, v, pos)  # [B, T, W, Kt, dt]
        return to_cache(k, target), to_cache(v, target), aux
    heads = lambda y: y.reshape(*y.shape[:3], target_cfg.num_kv_heads, target_cfg.head_dim)
    k, v = heads(k), heads(v)  # [B, T, W, Kt, dt]
    if unrotated(spec, source, target):
        k = target.rotate_keys(k, pos, spec.target_layers)
    return to_cache(k, target), to_cache(v, target), aux


def to_cache(y, target: CausalLM):
    """[B, T, W, K, d] -> the cache layout [W, B, K, T, d] in the target's dtype."""
    return y.transpose(2, 0, 3, 1, 4).astype(target.param_dtype)


@struct.dataclass
class TargetSide:
    """What `translate` reads from the frozen target over a context, whatever the translator (`target_side`): the
    feature cache (training/features.py) stores it per chunk so that training skips those forwards."""

    bottom_k: jax.Array | None  # direct, native_bottom = B > 0: the native K/V of layers 0..B-1, [B, b, Kt, T, dt]
    bottom_v: jax.Array | None
    features: jax.Array | None  # direct: the target-side inputs the translator reads, [b, T, F] (None: source only)
    first_k: jax.Array | None  # the first token's own K/V at the window layers, [W, b, Kt, 1, dt] (None: no window)
    first_v: jax.Array | None


def target_side(spec, target: CausalLM, target_ids, mask, capacity: int, bottom=None) -> TargetSide:
    """The `TargetSide` of the context `target_ids` [b, T] (padding per `mask`), as `translate` computes it into a
    cache of `capacity` slots; `bottom`: `CausalLM.run_bottom`'s (cache, hidden) of this context, when the caller
    has them."""
    length = target_ids.shape[1]
    mask = mask.astype(bool)
    bottom_k = bottom_v = features = first_k = first_v = None
    if spec.mode == "direct":
        if bottom is None:
            bottom = target.run_bottom(target_ids, mask, spec.native_bottom, capacity)
        cache, hidden = bottom
        features = target_features(spec, target, target_ids, mask, hidden)
        if spec.native_bottom:
            bottom_k, bottom_v = (kv[: spec.native_bottom, :, :, :length] for kv in (cache.k, cache.v))
    if spec.target_layers:  # the first token attends only to itself: its own K/V are exact, not translated
        first_k, first_v = target.lone_key_values(target_ids, first_valid_index(mask), spec.target_layers)
    return TargetSide(bottom_k, bottom_v, features, first_k, first_v)
