"""The paper's translator (`kind="mot"`): a mixture of cross-layer window translators for K and one for V
(`mixture.py`, `expert.py`), written into the window layers by the window path (`window.py`)."""

from __future__ import annotations

from mot_jax.translate.kinds.registry import Kind, register
from mot_jax.translate.mixture import MixtureOfTranslators

register(
    Kind(
        name="mot",
        label=lambda cfg: f"single translator ({cfg.mode})" if cfg.num_experts == 1 else f"MoT {cfg.mode}",
        build=lambda spec, cfg, rngs, dtype: {
            part: MixtureOfTranslators(cfg, rngs=rngs, dtype=dtype) for part in ("key", "value")
        },
    )
)
