"""Qwen2 / Qwen2.5: the RoPE decoder with q/k/v biases, GQA, RoPE theta from the config, optional sliding layers."""

from __future__ import annotations

from mot_jax.models import decoder
from mot_jax.models.decoder import hf_table  # noqa: F401

BASE_PREFIX = decoder.BASE_PREFIX


def config_from_hf(d: dict):
    theta, scaling = decoder.rope_from_hf(d)
    use_sliding, first_sliding = d.get("use_sliding_window", False), d.get("max_window_layers", 0)
    return decoder.base_config(
        d,
        "qwen2",
        qkv_bias=True,
        rope_theta=theta,
        rope_scaling=scaling,
        local_rope_theta=theta,
        local_rope_scaling=scaling,
        layer_windows=decoder.windows_from_layer_types(d, lambda i: use_sliding and i >= first_sliding),
    )
