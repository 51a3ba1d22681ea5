"""Llama 2/3, Llama-3.2 (llama3 RoPE scaling) and SmolLM2: the RoPE decoder with optional biases."""

from __future__ import annotations

from mot_jax.models import decoder
from mot_jax.models.decoder import hf_table  # noqa: F401

BASE_PREFIX = decoder.BASE_PREFIX


def config_from_hf(d: dict):
    theta, scaling = decoder.rope_from_hf(d)
    bias = d.get("attention_bias", False)
    return decoder.base_config(
        d,
        "llama",
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=d.get("mlp_bias", False),
        rope_theta=theta,
        rope_scaling=scaling,
        local_rope_theta=theta,
        local_rope_scaling=scaling,
        layer_windows=decoder.windows_from_layer_types(d, lambda i: False),
    )
