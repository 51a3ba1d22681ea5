"""The RoPE decoder shared by Qwen2/2.5, Qwen3, Llama and Gemma-3 (each family file only reads its HF config).

Covers: GQA, q/k/v (Qwen2) or all-projection (Llama `attention_bias`) biases, MLP biases, tied or untied heads,
RoPE default / linear / llama3 scaling, per-layer sliding windows with their own (local) RoPE, and Gemma-3's
(1 + w) norms, q/k norm (also Qwen3's), sandwich norms, scaled embeddings, query_pre_attn_scalar and logit
soft-caps.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from mot_jax.errors import MotJaxError
from mot_jax.models import mapping
from mot_jax.models.base import CausalLM, ModelConfig
from mot_jax.models.layers import (
    GLOBAL_WINDOW,
    Embed,
    Linear,
    RMSNorm,
    activation,
    apply_rope,
    rope_inv_freq,
    rope_tables,
)

BASE_PREFIX = "model."
SUPPORTED_ROPE = ("default", "linear", "llama3")


def rope_from_hf(d: dict, layer_type: str | None = None, theta_key="rope_theta", default_theta=10000.0):
    """(theta, scaling items) from either the transformers 5 `rope_parameters` or the older flat keys."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        params = params[layer_type]
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", default_theta)
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = d.get(theta_key, default_theta)
        scaling = dict(d.get("rope_scaling") or {}) if theta_key == "rope_theta" else {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE:
        raise MotJaxError(f"RoPE type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE)}).")
    scaling["rope_type"] = rope_type
    return float(theta), (() if rope_type == "default" else tuple(sorted(scaling.items())))


def windows_from_layer_types(d: dict, is_sliding) -> tuple:
    """Per-layer sliding window (None = global) from `layer_types`, or from `is_sliding(i)` for older configs."""
    n, window = d["num_hidden_layers"], d.get("sliding_window")
    types = d.get("layer_types") or ["sliding_attention" if is_sliding(i) else "full_attention" for i in range(n)]
    return tuple(window if (t == "sliding_attention" and window) else None for t in types)


def base_config(d: dict, family: str, **overrides) -> ModelConfig:
    heads = d["num_attention_heads"]
    fields = dict(
        family=family,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        intermediate_size=d["intermediate_size"],
        max_positions=d.get("max_position_embeddings", 2048),
        norm_eps=d.get("rms_norm_eps", 1e-6),
        activation=d.get("hidden_act", "silu"),
        tie_embeddings=d.get("tie_word_embeddings", False),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        pad_token_id=d.get("pad_token_id"),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def rope_table(cfg: ModelConfig):
    """[L, head_dim / 2] RoPE inverse frequencies of every layer."""
    freqs, layer_rope = rope_variants(cfg)
    return freqs[layer_rope]


def rope_variants(cfg: ModelConfig):
    """(inverse frequencies [F, head_dim / 2] of the F distinct RoPEs, each layer's index into them [L]): sliding
    layers use the local RoPE."""
    sliding = [w < GLOBAL_WINDOW for w in cfg.windows]
    freqs = [rope_inv_freq(cfg.head_dim, cfg.rope_theta, dict(cfg.rope_scaling))]
    if any(sliding):
        freqs.append(rope_inv_freq(cfg.head_dim, cfg.local_rope_theta, dict(cfg.local_rope_scaling)))
    return jnp.stack(freqs), jnp.asarray(sliding, jnp.int32)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs, dtype):
        lead, D, H, K, d = (cfg.num_layers,), cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kw = dict(rngs=rngs, dtype=dtype, lead=lead)
        self.q_proj = Linear(D, H * d, ("embed", "heads"), bias=cfg.qkv_bias, **kw)
        self.k_proj = Linear(D, K * d, ("embed", "kv"), bias=cfg.qkv_bias, **kw)
        self.v_proj = Linear(D, K * d, ("embed", "kv"), bias=cfg.qkv_bias, **kw)
        self.o_proj = Linear(H * d, D, ("heads", "embed"), bias=cfg.o_bias, **kw)
        norm = dict(rngs=rngs, dtype=dtype, lead=lead, unit_offset=cfg.unit_offset_norms, names=("head_dim",))
        self.q_norm = RMSNorm(d, cfg.norm_eps, **norm) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.norm_eps, **norm) if cfg.qk_norm else None


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs, dtype):
        lead, D, F = (cfg.num_layers,), cfg.hidden_size, cfg.intermediate_size
        kw = dict(rngs=rngs, dtype=dtype, lead=lead, bias=cfg.mlp_bias)
        self.gate_proj = Linear(D, F, ("embed", "mlp"), **kw)
        self.up_proj = Linear(D, F, ("embed", "mlp"), **kw)
        self.down_proj = Linear(F, D, ("mlp", "embed"), **kw)
        self.act = activation(cfg.activation)

    def __call__(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs, dtype):
        self.cfg = cfg
        norm = lambda: RMSNorm(
            cfg.hidden_size,
            cfg.norm_eps,
            rngs=rngs,
            dtype=dtype,
            lead=(cfg.num_layers,),
            unit_offset=cfg.unit_offset_norms,
        )
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = norm()
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = MLP(cfg, rngs=rngs, dtype=dtype)

    def key_value(self, x, positions, layer, rope=None):
        """This layer's K (normed, rotated: as cached) and V [B, T, K, d] of its input residual stream x (`rope`:
        this layer's `rope_tables` at `positions`, when computed already)."""
        cfg, attn = self.cfg, self.self_attn
        b, t, _ = x.shape
        h = self.input_layernorm(x)
        k = attn.k_proj(h).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = attn.v_proj(h).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            k = attn.k_norm(k)
        return apply_rope(k, positions, rope_table(cfg)[layer], rope), v

    def __call__(self, x, positions, layer, cache):
        cfg, attn = self.cfg, self.self_attn
        b, t, _ = x.shape
        q = attn.q_proj(self.input_layernorm(x)).reshape(b, t, cfg.num_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = attn.q_norm(q)
        window, inv_freq = jnp.asarray(cfg.windows)[layer], rope_table(cfg)[layer]
        q = apply_rope(q, positions, inv_freq, cache.rope)
        k, v = self.key_value(x, positions, layer, cache.rope)
        scale = cfg.query_scale or cfg.head_dim**-0.5
        out = attn.o_proj(cache.attend(q, k, v, scale=scale, window=window, softcap=cfg.attn_softcap))
        if not cfg.sandwich_norms:
            x = x + out
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(out)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class RotaryLM(CausalLM):
    def __init__(self, cfg: ModelConfig, *, rngs, dtype=jnp.float32):
        self.config, self.param_dtype = cfg, dtype
        D = cfg.hidden_size
        self.embed_tokens = Embed(cfg.vocab_size, D, ("vocab", "embed"), rngs=rngs, dtype=dtype)
        self.layers = Block(cfg, rngs=rngs, dtype=dtype)
        self.norm = RMSNorm(D, cfg.norm_eps, rngs=rngs, dtype=dtype, unit_offset=cfg.unit_offset_norms)
        tied = cfg.tie_embeddings
        self.lm_head = (
            None if tied else Linear(D, cfg.vocab_size, ("embed", "vocab"), rngs=rngs, dtype=dtype, bias=False)
        )

    def rope_tables(self, positions):
        """See `CausalLM.rope_tables`: a table per distinct RoPE (Gemma-3's sliding layers have their own)."""
        freqs, layer_rope = rope_variants(self.config)
        tables = [rope_tables(positions, f, self.param_dtype) for f in freqs]
        return layer_rope, jnp.stack([c for c, _ in tables]), jnp.stack([s for _, s in tables])

    def rotate_keys(self, k, positions, layers):
        """See `CausalLM.rotate_keys`: each layer's own RoPE (Gemma-3's sliding layers have their own)."""
        inv_freq = rope_table(self.config)
        return jnp.stack([apply_rope(k[:, :, i], positions, inv_freq[li]) for i, li in enumerate(layers)], 2)

    def token_embeddings(self, ids):
        x = self.embed_tokens(ids)
        return x if self.config.embed_scale == 1.0 else x * jnp.asarray(self.config.embed_scale, x.dtype)

    def final_norm(self, x):
        return self.norm(x)

    def unembed(self, x):
        logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        cap = self.config.final_softcap
        return logits if cap is None else jnp.tanh(logits / cap) * cap


def hf_table(cfg: ModelConfig):
    layer = "layers.{i}."
    attn = [
        *mapping.linear(layer + "self_attn.q_proj", "layers.self_attn.q_proj", cfg.qkv_bias),
        *mapping.linear(layer + "self_attn.k_proj", "layers.self_attn.k_proj", cfg.qkv_bias),
        *mapping.linear(layer + "self_attn.v_proj", "layers.self_attn.v_proj", cfg.qkv_bias),
        *mapping.linear(layer + "self_attn.o_proj", "layers.self_attn.o_proj", cfg.o_bias),
    ]
    if cfg.qk_norm:
        attn += mapping.norm(layer + "self_attn.q_norm", "layers.self_attn.q_norm", bias=False)
        attn += mapping.norm(layer + "self_attn.k_norm", "layers.self_attn.k_norm", bias=False)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if cfg.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    rules = [
        mapping.Rule("embed_tokens.weight", "embed_tokens.embedding"),
        *attn,
        *[r for n in norms for r in mapping.norm(layer + n, "layers." + n, bias=False)],
        *[
            r
            for p in ("gate_proj", "up_proj", "down_proj")
            for r in mapping.linear(f"{layer}mlp.{p}", f"layers.mlp.{p}", cfg.mlp_bias)
        ],
        *mapping.norm("norm", "norm", bias=False),
    ]
    if not cfg.tie_embeddings:
        rules += mapping.linear("lm_head", "lm_head", bias=False)
    return rules
