"""AdamW with linear warmup then cosine decay and global-norm clipping (reference section 5.2)."""

from __future__ import annotations

import jax.numpy as jnp
import optax


def warmup_cosine(learning_rate: float, warmup_steps: int, total_steps: int):
    """lr of update number `count` (0-based): warmup (count+1)/warmup, then half a cosine to 0 at `total_steps`.

    The reference's scheduler runs its first update at the full rate (it rescales only after a step); here the
    first update already gets 1/warmup of it.
    """
    warmup = max(int(warmup_steps), 1)
    decay = max(int(total_steps) - warmup, 1)

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1
        progress = jnp.clip((step - warmup) / decay, 0.0, 1.0)
        return learning_rate * jnp.where(step <= warmup, step / warmup, 0.5 * (1 + jnp.cos(jnp.pi * progress)))

    return schedule


def adamw(optim, total_steps: int):
    """The optimizer of an `optim` config section (learning_rate, weight_decay, b1, b2, eps, warmup_steps,
    clip_norm) for a run of `total_steps` updates, and its schedule."""
    schedule = warmup_cosine(optim.learning_rate, optim.warmup_steps, total_steps)
    tx = optax.chain(
        optax.clip_by_global_norm(optim.clip_norm),
        optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay),
    )
    return tx, schedule
