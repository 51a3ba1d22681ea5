"""Selective recomputation (CacheBlend's lever): above the dial's exact bottom, the target reruns its own
layers for a few percent of the context's tokens over the translated cache, and their K/V replace the translated ones,
restoring at those tokens the cross-attention a translation cannot reproduce.

Which tokens: those whose translated K/V at the first translated layer (`start`, the dial's B) are furthest from the
target's own. The target's residual stream before that layer is exact (its bottom layers ran natively), so its own K/V
there cost two projections for every token; relative to each side's mean square, so K and V weigh alike.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mot_jax.errors import MotJaxError
from mot_jax.jit import jit
from mot_jax.models.base import CausalLM, positions_from_mask
from mot_jax.models.cache import KVCache
from mot_jax.translate import kinds


def on_window_path(translator) -> bool:
    """Whether a translator is direct on the dial's window path (no translation path of its own): what
    recomputation, and the dial's exact bottom, apply to."""
    return translator.spec.mode == "direct" and not kinds.get(translator.cfg.kind).translate


def check_share(translator, share: float, name: str) -> None:
    """Refuse, in one line, recomputing `share` of `name`'s tokens unless it is in (0, 1] and the translator is
    direct on the dial's window path."""
    if not (0 < share <= 1 and on_window_path(translator)):
        raise MotJaxError(
            f"Recomputing {share} of {name}'s tokens needs a share in (0, 1] and a direct translator on the dial's "
            "window path; pass no recomputation for it."
        )


def recompute_count(fraction: float, length: int) -> int:
    """Tokens recomputed per row of a `length`-token context at `fraction` (at least one for a positive one)."""
    return min(length, math.ceil(fraction * length))


def deviation(target: CausalLM, cache: KVCache, hidden, mask, start: int):
    """[B, T] how far the cache's K/V of each context token at layer `start` are from the target's own, computed from
    `hidden` [B, T, D], its residual stream before that layer (context slots [0, T), right after its first)."""
    length = mask.shape[1]
    k, v = target.layer_key_values([start], hidden[:, :, None], hidden[:, :, None], positions_from_mask(mask))
    own = (k[:, :, 0].astype(jnp.float32), v[:, :, 0].astype(jnp.float32))  # [B, T, K, d]
    held = (cache.k[start, :, :, :length], cache.v[start, :, :, :length])  # [B, K, T, d]
    valid = mask.astype(bool)

    def relative(mine, theirs):
        error = jnp.sum(jnp.square(mine - theirs.transpose(0, 2, 1, 3).astype(jnp.float32)), (2, 3))
        scale = jnp.sum(jnp.where(valid, jnp.sum(jnp.square(mine), (2, 3)), 0.0)) / jnp.maximum(valid.sum(), 1)
        return error / jnp.maximum(scale, 1e-12)

    return jnp.where(valid, relative(own[0], held[0]) + relative(own[1], held[1]), -jnp.inf)


def chosen_slots(scores, count: int, capacity: int):
    """[B, count] the slots of each row's `count` highest `scores` [B, T] (-inf: not a token; such picks become
    `capacity`, which `rerun_slots` ignores)."""
    top, slots = jax.lax.top_k(scores, count)
    return jnp.where(jnp.isfinite(top), slots, capacity)


@jit(static_argnames=("fraction", "start"))
def recompute(target: CausalLM, cache: KVCache, hidden, target_ids, mask, *, fraction: float, start: int):
    """`cache` (the context in slots [0, T), layers `start..` translated) with the target's own layers `start..L-1`
    rerun for the `fraction` of each row's tokens the translation got most wrong (`deviation`). `hidden` [B, T, D]:
    the residual stream before layer `start` (None: start = 0, the embeddings)."""
    if hidden is None:
        hidden = target.embed(target_ids, positions_from_mask(mask))
    count = recompute_count(fraction, mask.shape[1])
    slots = chosen_slots(deviation(target, cache, hidden, mask, start), count, cache.capacity)
    picked = jnp.take_along_axis(hidden, jnp.minimum(slots, mask.shape[1] - 1)[..., None], 1)
    return target.rerun_slots(picked, slots, cache, start)
