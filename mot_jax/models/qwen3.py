"""Qwen3 (dense): the RoPE decoder with per-head q/k RMSNorm (over head_dim, before RoPE), an explicit head_dim
(heads x head_dim may differ from hidden_size), GQA, no biases unless `attention_bias`, optional sliding layers."""

from __future__ import annotations

from mot_jax.models import decoder
from mot_jax.models.decoder import hf_table  # noqa: F401

BASE_PREFIX = decoder.BASE_PREFIX
DEFAULT_HEAD_DIM = 128  # transformers' Qwen3Config default, used when config.json has no head_dim


def config_from_hf(d: dict):
    theta, scaling = decoder.rope_from_hf(d)
    bias = d.get("attention_bias", False)
    use_sliding, first_sliding = d.get("use_sliding_window", False), d.get("max_window_layers", 28)
    return decoder.base_config(
        d,
        "qwen3",
        head_dim=d.get("head_dim") or DEFAULT_HEAD_DIM,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        rope_theta=theta,
        rope_scaling=scaling,
        local_rope_theta=theta,
        local_rope_scaling=scaling,
        layer_windows=decoder.windows_from_layer_types(d, lambda i: use_sliding and i >= first_sliding),
    )
