"""The C2C-Project baseline: a per-layer, per-token MLP from source K (or V) to target K (or V).

The evaluation compares MoT with this projector (reference section 7, `c2c-pr`): for each window layer its own
LayerNorm -> Linear(ds -> hidden) -> GELU -> Linear(hidden -> dt), hidden = max(dim, dt) as the reference's
max(1024, d_t). No cross-token attention and no router, so it isolates what MoT's window attention and experts add.
It takes the mixture's place in `KVTranslator` (`TranslatorConfig.kind="projector"`) with the same call signature,
so training, both injection modes, checkpoints and export treat it like a mixture.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from mot_jax.errors import MotJaxError
from mot_jax.models.layers import LayerNorm, Linear, einsum
from mot_jax.translate.config import TranslatorConfig
from mot_jax.translate.expert import EPS, gelu, torch_std
from mot_jax.translate.kinds.registry import Kind, register


def projector_hidden(cfg: TranslatorConfig) -> int:
    return max(cfg.dim, cfg.target_width)


class Projector(nnx.Module):
    """W independent MLPs (parameters with a leading [layers] axis), one per window layer, applied to every token."""

    def __init__(self, cfg: TranslatorConfig, *, rngs, dtype=jnp.float32):
        if cfg.output_activation not in ("gelu", "none"):
            raise MotJaxError(f"output_activation={cfg.output_activation!r} is not 'gelu' or 'none'.")
        self.cfg = cfg
        ds, hidden, dt = cfg.source_width, projector_hidden(cfg), cfg.target_width
        kw = dict(rngs=rngs, dtype=dtype, lead=(cfg.window,), lead_names=("layers",))
        self.norm = LayerNorm(ds, EPS, **kw)
        self.hidden = Linear(ds, hidden, (None, "mlp"), **kw, std=torch_std(ds))
        self.out = Linear(hidden, dt, ("mlp", None), **kw, std=torch_std(hidden))

    def __call__(self, x, token_mask=None):
        """x [B, T, W, ds] -> (y [B, T, W, dt], {}): the aux dict of a mixture without routing (no router losses).

        Every token is projected, padding included (as a one-expert mixture); `token_mask` is accepted for the
        mixture's interface and unused, since no token reads another.
        """
        per_layer = lambda a, m: einsum("btwi,wio->btwo", a, m.kernel[...]) + m.bias[...]
        y = per_layer(gelu(per_layer(self.norm(x), self.hidden)), self.out)
        return (gelu(y) if self.cfg.output_activation == "gelu" else y), {}


register(
    Kind(
        name="projector",
        label=lambda cfg: f"C2C-Project ({cfg.mode})",
        build=lambda spec, cfg, rngs, dtype: {
            part: Projector(cfg, rngs=rngs, dtype=dtype) for part in ("key", "value")
        },
        torch={"key": "Projector", "value": "Projector"},
    )
)
