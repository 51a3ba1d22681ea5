"""Gemma-3 text: (1 + w) RMSNorm, sqrt(hidden) embedding scale, q/k norm, sandwich norms, GeGLU (tanh GELU),
alternating sliding-window (local RoPE base) and global layers, query_pre_attn_scalar, optional soft-caps."""

from __future__ import annotations

from mot_jax.models import decoder
from mot_jax.models.decoder import hf_table  # noqa: F401

BASE_PREFIX = decoder.BASE_PREFIX


def config_from_hf(d: dict):
    theta, scaling = decoder.rope_from_hf(d, "full_attention", default_theta=1_000_000.0)
    local_theta, local_scaling = decoder.rope_from_hf(d, "sliding_attention", theta_key="rope_local_base_freq")
    pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
    return decoder.base_config(
        d,
        "gemma3",
        activation=d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
        tie_embeddings=d.get("tie_word_embeddings", True),
        qkv_bias=d.get("attention_bias", False),
        o_bias=d.get("attention_bias", False),
        qk_norm=True,
        sandwich_norms=True,
        unit_offset_norms=True,
        embed_scale=d["hidden_size"] ** 0.5,
        query_scale=d.get("query_pre_attn_scalar", d.get("head_dim", 256)) ** -0.5,
        attn_softcap=d.get("attn_logit_softcapping"),
        final_softcap=d.get("final_logit_softcapping"),
        rope_theta=theta,
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        layer_windows=decoder.windows_from_layer_types(d, lambda i: (i + 1) % pattern != 0),
    )
