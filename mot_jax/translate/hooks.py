"""The translator's per-layer hooks on the target's and the source's forwards (`mot_jax.models.hooks`).

- `InjectKV`: MoT's replay: a window layer computes and caches its own K/V, but its attention reads the translated
  K/V for the new tokens instead.
- `SparseKeys`: the reference's sparse replay: each query of a sparse layer attends only to its chosen keys.
- `ReplaceLayerInputs`: MoT-h: a window layer's input residual stream is replaced by its translation and the layer
  runs on it as usual.
- `TopKeys`: the source's side of sparse replay: each layer's most-attended keys per query (head-averaged weights).
- `MappedKeyValues`: SwiftKV's single input for the tokens read after a self-prediction cache: the upper layers'
  K/V of each new token from its own state below them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from mot_jax.models.hooks import LayerHook
from mot_jax.translate.window import rms_normalized


def _at_layer(per_layer, layer):
    """Row `layer` (traced inside the layer scan) of an array with a leading layer axis."""
    return jax.lax.dynamic_index_in_dim(per_layer, layer, keepdims=False)


@struct.dataclass
class InjectKV(LayerHook):
    """Layers with `slot[l] >= 0` (`slot` [L]) attend over `k[slot[l]]`, `v[slot[l]]` [W, B, K, T, d] at the new
    tokens' slots."""

    k: jax.Array
    v: jax.Array
    slot: jax.Array

    def attention(self, read, layer, record):
        layer_slot = _at_layer(self.slot, layer)
        use = layer_slot >= 0
        at = (0, 0, read.offset, 0)

        def inject(cached, injected):
            injected = _at_layer(injected, jnp.maximum(layer_slot, 0)).astype(cached.dtype)
            return jnp.where(use, jax.lax.dynamic_update_slice(cached, injected, at), cached)

        return read.replace(k=inject(read.k, self.k), v=inject(read.v, self.v))


@struct.dataclass
class SparseKeys(LayerHook):
    """In layers with `sparse[l]`, each query attends only to the keys `index[l]` [L, B, T, k] lists (token indices
    into the new tokens; out-of-range entries are ignored); the other layers attend densely."""

    index: jax.Array
    sparse: jax.Array  # [L] bool

    def attention(self, read, layer, record):
        b, length, capacity = read.q.shape[0], read.q.shape[1], read.k.shape[2]
        index = _at_layer(self.index, layer)  # [B, T, k]
        slots = jnp.where((index >= 0) & (index < length), index + read.offset, capacity)
        rows = jnp.arange(b)[:, None, None]
        chosen = (
            jnp.zeros((b, length, capacity), bool)
            .at[rows, jnp.arange(length)[None, :, None], slots]
            .set(True, mode="drop")
        )
        return read.replace(mask=read.mask.replace(allowed=chosen | ~_at_layer(self.sparse, layer)))


@struct.dataclass
class ReplaceLayerInputs(LayerHook):
    """Layers with `slot[l] >= 0` (`slot` [L]) run on `hidden[slot[l]]` [W, B, T, D] as their input residual stream."""

    hidden: jax.Array
    slot: jax.Array

    def layer_input(self, x, layer, record):
        layer_slot = _at_layer(self.slot, layer)
        replaced = _at_layer(self.hidden, jnp.maximum(layer_slot, 0))
        return jnp.where(layer_slot >= 0, replaced.astype(x.dtype), x)


@struct.dataclass
class TopKeys(LayerHook):
    """Records each layer's `k` most-attended keys per query (softmax weights averaged over heads) as slot indices
    [B, T, k] in `records["topk"]` (at most the query block's size: `attention.attend`'s blocks)."""

    k: int = struct.field(pytree_node=False)

    def attention(self, read, layer, record):
        def top(probs, start, block):
            count = min(self.k, block)
            record.extend("topk", jax.lax.top_k(probs.mean(axis=(1, 2)), count)[1].astype(jnp.int32), axis=1)

        return read.replace(on_weights=(*read.on_weights, top))


class MappedKeyValues(nnx.Module, LayerHook):
    """SwiftKV's single input for new tokens: layers `first..L-1` write every new token's K/V from that token's own
    residual stream before layer `first`, RMS-normalised as the translator reads it (`window.rms_normalized`): layer
    l's key and value inputs are `key_map`'s and `value_map`'s maps for it (`LinearSkip`s over the written layers, of
    that state alone), which the layer's own norm, K/V projections, k-norm and RoPE at the token's position make its
    K/V; its attention then reads them. An `nnx.Module` sharing the translator's maps, so that a model carries it
    (`CausalLM.forward_hook`) into jitted functions and gradients reach the maps."""

    CARRIED = "mapped_from"  # the state of the layer `first`, carried up the layers

    def __init__(self, key_map, value_map, first: int):
        self.key_map, self.value_map, self.first = key_map, value_map, first

    def carry(self, x):
        return {self.CARRIED: jnp.zeros(x.shape, jnp.float32)}

    def layer_input(self, x, layer, record):
        held = record.carried[self.CARRIED]
        record.carried[self.CARRIED] = jnp.where(layer == self.first, rms_normalized(x), held)
        return x

    def key_values(self, new, layer, record):
        slot, state = jnp.maximum(layer - self.first, 0), record.carried[self.CARRIED]

        def mapped():
            k = new.project(self.key_map.layer(state, slot))[0].astype(new.k.dtype)
            return k, new.project(self.value_map.layer(state, slot))[1].astype(new.v.dtype)

        # a cond, not a select: inside the layer scan the layers below `first` skip the maps and projections
        k, v = jax.lax.cond(layer >= self.first, mapped, lambda: (new.k, new.v))
        return new.replace(k=k, v=v)
