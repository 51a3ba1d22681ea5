"""What a forward over new tokens reads (`Forward`), what it returns (`LayerRun`), and the per-layer hooks through
which callers change or observe it without the model knowing what for.

`CausalLM.run_layers(forward, cache, hooks)` offers each layer, in the order the hooks are given (after the model's
own `CausalLM.forward_hook`, where it has one):
- `layer_input(x, layer, record)`: the layer's input residual stream [B, T, D]; return the stream the layer runs on;
- `key_values(new, layer, record)`: the K/V the layer is about to write into the cache for the new tokens
  (`NewKeyValues`, with the layer's own way of making K/V from a residual stream); return what it should write
  instead (its attention then reads what was written);
- `attention(read, layer, record)`: what the layer's attention reads (`AttentionRead`: its queries, the keys and
  values after the layer wrote its own, their `Mask`); return what it should read instead.
`layer` is the layer's index (traced inside the layer scan: index per-layer arrays with it). A hook notes values in
`record` (`LayerRecord`); each name comes back stacked over the layers that ran in `LayerRun.records[name]`.
Hooks are called while tracing: they add operations to the program and hold no Python state between calls. What a
hook hands from one layer to the later ones it keeps in `record.carried` (names and starting values from
`LayerHook.carry`), which the layer loop carries along. The translator's hooks (injected K/V, sparse keys, replaced
layer inputs, the source's top-k keys, K/V mapped from one layer's state) live in `mot_jax.translate.hooks`; the
attention loss's and KVComm's probes beside their users.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from mot_jax.models.attention import Mask
from mot_jax.models.cache import KVCache


@struct.dataclass
class Forward:
    """The new tokens of one forward and how far it runs.

    - `ids` [B, T] (or None with `embeddings`, transformers' `inputs_embeds` [B, T, E], after any embedding scale);
    - `mask` [B, T] (1 = token, 0 = padding, left or right; None: all tokens); `positions` [B, T] (None: counting
      valid tokens, continuing from the cache);
    - `fresh`: the cache is empty before these tokens (as `init_cache` returns it), so a long prefill skips causally
      masked key blocks (a forward without a cache is fresh by itself);
    - `stop`: only layers `0..stop-1` run, and the hidden states are the residual stream before layer `stop`;
    - `weights`: each layer's parameters as arrays of their own (`CausalLM.layer_params`, made outside a loop over
      tokens): the layers then run one after another on them instead of as a scan over the stack.
    """

    ids: jax.Array | None
    mask: jax.Array | None = None
    positions: jax.Array | None = None
    embeddings: jax.Array | None = None
    weights: list | None = None
    fresh: bool = struct.field(pytree_node=False, default=False)
    stop: int | None = struct.field(pytree_node=False, default=None)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.ids if self.ids is not None else self.embeddings).shape[:2]


@struct.dataclass
class LayerRun:
    """`run_layers`' result: the final-normed hidden states [B, T, D] (with `Forward.stop`, the residual stream before
    that layer, not normed), the extended cache, and what the hooks recorded, each stacked over the layers that ran."""

    hidden: jax.Array
    cache: KVCache
    records: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class AttentionRead:
    """What one layer's attention reads: the new tokens' queries q [B, T, H, d], the keys and values k, v [B, K, S, d]
    it attends over (the cache layout: the whole layer cache, or the new tokens alone in a fresh prefill), which of them
    each query sees (`mask`), the scale and logit soft-cap, `offset` (the slot among k's of the first new token), and
    callbacks given the softmax weights (`attention.attend`'s `on_weights`)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    mask: Mask
    scale: Any
    softcap: float | None
    offset: Any
    on_weights: tuple[Callable, ...] = ()

    def replace(self, **changes) -> AttentionRead:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class NewKeyValues:
    """What one layer writes into the cache for the new tokens: k, v [B, T, K, d] (keys as cached: normed, rotated),
    and `project(x)`: the (k, v) this layer makes of a residual stream x [B, T, D] at the new tokens' positions (its
    own norm, K/V projections, k-norm and RoPE, as for its input)."""

    k: jax.Array
    v: jax.Array
    project: Callable

    def replace(self, **changes) -> NewKeyValues:
        return dataclasses.replace(self, **changes)


class LayerRecord:
    """What the hooks note about one layer, by name (`values`), and what they carry from layer to layer (`carried`:
    as the layer before left it; what a hook sets here the next layer's hooks read)."""

    def __init__(self, carried=None):
        self.values: dict[str, Any] = {}
        self.carried: dict[str, Any] = dict(carried or {})

    def put(self, name: str, value) -> None:
        self.values[name] = value

    def extend(self, name: str, value, axis: int) -> None:
        """Append `value` to what `name` holds along `axis` (a value noted in parts, e.g. per query block)."""
        held = self.values.get(name)
        self.values[name] = value if held is None else jnp.concatenate([held, value], axis)


class LayerHook:
    """A hook that changes nothing: subclasses override what they need (module docstring). A hook with arrays is a
    `flax.struct.dataclass` (its arrays leaves, its settings static fields), so jitted functions take it."""

    def carry(self, x) -> dict:
        """What this hook carries from layer to layer (`LayerRecord.carried`), by name, as it starts before the first
        layer (x: that layer's input [B, T, D]); each value keeps its shape and dtype through the layers."""
        return {}

    def layer_input(self, x, layer, record: LayerRecord):
        return x

    def key_values(self, new: NewKeyValues, layer, record: LayerRecord) -> NewKeyValues:
        return new

    def attention(self, read: AttentionRead, layer, record: LayerRecord) -> AttentionRead:
        return read


@struct.dataclass
class LayerInputs(LayerHook):
    """Records each layer's input residual stream [B, T, D] (after the hooks before it) as `records["inputs"]`."""

    def layer_input(self, x, layer, record):
        record.put("inputs", x)
        return x
