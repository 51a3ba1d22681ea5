"""Ours (`kind="linear"`): the least-squares-started linear skip alone, no mixture beside it: the cheapest
translator, and the dial's default (`linear_skip.py` fits it; `KVTranslator` holds it)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from mot_jax.errors import MotJaxError
from mot_jax.translate.kinds.registry import Kind, register


class NoMixture(nnx.Module):
    """Nothing beside the linear skip: zeros of the target width, so that the skip's output is the translation."""

    def __init__(self, cfg, *, rngs, dtype=jnp.float32):
        self.width = cfg.target_width

    def __call__(self, x, mask):
        return jnp.zeros((*x.shape[:-1], self.width), x.dtype), {}


def check(spec, cfg):
    if not cfg.linear_skip:
        raise MotJaxError("kind='linear' is the linear skip alone; set linear_skip=True.")


def build(spec, cfg, rngs, dtype):
    """A `NoMixture` for K and one for V: the linear skips beside them are the translation."""
    return {part: NoMixture(cfg, rngs=rngs, dtype=dtype) for part in ("key", "value")}


register(
    Kind(
        name="linear",
        label=lambda cfg: f"linear translator ({cfg.mode})",
        build=build,
        check=check,
        recipe={"translator.linear_skip": True},
        torch={"key": "NoMixture", "value": "NoMixture"},
    )
)
