"""The KV cache: one pytree for all families, preallocated, written in place at a moving index."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """Keys and values of every layer, in the Hugging Face per-layer layout [B, kv_heads, S, head_dim].

    Keys are stored as the attention uses them: after RoPE (and after q/k norm) where the family has those,
    exactly like a transformers cache. `positions` and `valid` describe each slot, so left or right padding and
    sliding windows are masks, not special cases. Slots at `index` and beyond are free. `hidden` (optional) hides
    slots from single layers: layer l's attention skips slot s of row b where `hidden[l, b, s]` (KVComm hands over
    some layers' K/V of a context and only its first token at the others).
    """

    k: jax.Array  # [L, B, K, S, d]
    v: jax.Array  # [L, B, K, S, d]
    positions: jax.Array  # [B, S] int32, the token position held in each slot
    valid: jax.Array  # [B, S] bool, False for padding and free slots
    index: jax.Array  # int32 scalar, the next slot to write
    hidden: jax.Array | None = None  # [L, B, S] bool, True where that layer does not see that slot

    AXES = ("layers", "batch", "kv_heads", "seq", "head_dim")

    @classmethod
    def init(cls, num_layers, batch, kv_heads, capacity, head_dim, dtype):
        kv = jnp.zeros((num_layers, batch, kv_heads, capacity, head_dim), dtype)
        return cls(
            k=kv,
            v=kv,
            positions=jnp.zeros((batch, capacity), jnp.int32),
            valid=jnp.zeros((batch, capacity), bool),
            index=jnp.zeros((), jnp.int32),
        )

    @classmethod
    def logical_axes(cls):
        """The same pytree with each leaf's logical axis names, for the sharding rules."""
        return cls(k=cls.AXES, v=cls.AXES, positions=("batch", "seq"), valid=("batch", "seq"), index=())

    @property
    def capacity(self):
        return self.k.shape[3]

    def with_capacity(self, capacity: int) -> KVCache:
        """The same cache with free slots added up to `capacity` (a prefill's cache, made room for more tokens)."""
        grow = capacity - self.capacity
        pad = lambda x, axis: jnp.pad(x, [(0, grow if a == axis else 0) for a in range(x.ndim)])
        hidden = None if self.hidden is None else pad(self.hidden, 2)
        return self.replace(
            k=pad(self.k, 3),
            v=pad(self.v, 3),
            positions=pad(self.positions, 1),
            valid=pad(self.valid, 1),
            hidden=hidden,
        )

    def next_positions(self):
        """[B] the position that follows each row's last valid token (0 for an empty row)."""
        return jnp.max(jnp.where(self.valid, self.positions, -1), axis=1) + 1

    def take_rows(self, rows) -> KVCache:
        """The cache of rows `rows` [b] (indices into the batch), in that order."""
        hidden = None if self.hidden is None else jnp.take(self.hidden, rows, 1)
        return self.replace(
            k=jnp.take(self.k, rows, 1),
            v=jnp.take(self.v, rows, 1),
            positions=jnp.take(self.positions, rows, 0),
            valid=jnp.take(self.valid, rows, 0),
            hidden=hidden,
        )

    def append_slots(self, positions, mask):
        """Record the positions and validity of T new tokens at slots [index, index + T)."""
        at = (0, self.index)
        return self.replace(
            positions=jax.lax.dynamic_update_slice(self.positions, positions.astype(jnp.int32), at),
            valid=jax.lax.dynamic_update_slice(self.valid, mask.astype(bool), at),
        )


def stack_rows(caches: list[KVCache]) -> KVCache:
    """One cache holding every cache's rows in order, so that they read a suffix and decode as one batch: the next
    slot is the largest index (a shorter cache's slots up to it are free, so invalid, and its rows keep their own
    positions), the room after it the smallest any cache had (its free slots past that are dropped)."""
    index = max(int(c.index) for c in caches)
    capacity = index + min(c.capacity - int(c.index) for c in caches)
    hides = any(c.hidden is not None for c in caches)
    widest = max(capacity, *(c.capacity for c in caches))

    def fit(c: KVCache) -> KVCache:
        c = c.with_capacity(widest)
        return c.replace(hidden=jnp.zeros((c.k.shape[0], *c.valid.shape), bool)) if hides and c.hidden is None else c

    fitted = [fit(c) for c in caches]

    def rows(name, batch_axis, seq_axis):
        joined = jnp.concatenate([getattr(c, name) for c in fitted], batch_axis)
        return jax.lax.slice_in_dim(joined, 0, capacity, axis=seq_axis)

    return KVCache(
        k=rows("k", 1, 3),
        v=rows("v", 1, 3),
        positions=rows("positions", 0, 1),
        valid=rows("valid", 0, 1),
        index=jnp.asarray(index, jnp.int32),
        hidden=rows("hidden", 1, 2) if hides else None,
    )
