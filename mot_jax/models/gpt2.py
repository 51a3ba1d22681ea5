"""GPT-2: learned positions, Conv1D weights stored [in, out] (used as is), tied head."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from mot_jax.models import mapping
from mot_jax.models.base import CausalLM, ModelConfig
from mot_jax.models.layers import Embed, LayerNorm, Linear, activation

BASE_PREFIX = "transformer."


def config_from_hf(d: dict) -> ModelConfig:
    hidden, heads = d["n_embd"], d["n_head"]
    return ModelConfig(
        family="gpt2",
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        num_layers=d["n_layer"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=d.get("n_inner") or 4 * hidden,
        max_positions=d["n_positions"],
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        activation=d.get("activation_function", "gelu_new"),
        query_scale=1.0 if not d.get("scale_attn_weights", True) else 0.0,
        scale_attn_by_inverse_layer_idx=d.get("scale_attn_by_inverse_layer_idx", False),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
    )


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs, dtype):
        lead, D = (cfg.num_layers,), cfg.hidden_size
        self.c_attn = Linear(D, 3 * D, ("embed", "qkv"), rngs=rngs, dtype=dtype, lead=lead)
        self.c_proj = Linear(D, D, ("heads", "embed"), rngs=rngs, dtype=dtype, lead=lead)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs, dtype):
        lead, D, F = (cfg.num_layers,), cfg.hidden_size, cfg.intermediate_size
        self.c_fc = Linear(D, F, ("embed", "mlp"), rngs=rngs, dtype=dtype, lead=lead)
        self.c_proj = Linear(F, D, ("mlp", "embed"), rngs=rngs, dtype=dtype, lead=lead)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs, dtype):
        lead = (cfg.num_layers,)
        self.cfg = cfg
        self.ln_1 = LayerNorm(cfg.hidden_size, cfg.norm_eps, rngs=rngs, dtype=dtype, lead=lead)
        self.attn = Attention(cfg, rngs=rngs, dtype=dtype)
        self.ln_2 = LayerNorm(cfg.hidden_size, cfg.norm_eps, rngs=rngs, dtype=dtype, lead=lead)
        self.mlp = MLP(cfg, rngs=rngs, dtype=dtype)

    def key_value(self, x, positions, layer):
        """This layer's K and V [B, T, H, d] of its input residual stream x."""
        _, k, v = self.qkv(x)
        return k, v

    def qkv(self, x):
        b, t, _ = x.shape
        heads = lambda y: y.reshape(b, t, self.cfg.num_heads, self.cfg.head_dim)
        return tuple(heads(y) for y in jnp.split(self.attn.c_attn(self.ln_1(x)), 3, axis=-1))

    def __call__(self, x, positions, layer, cache):
        cfg = self.cfg
        q, k, v = self.qkv(x)
        scale = cfg.query_scale or cfg.head_dim**-0.5
        if cfg.scale_attn_by_inverse_layer_idx:
            scale = scale / (layer + 1).astype(jnp.float32)
        x = x + self.attn.c_proj(cache.attend(q, k, v, scale=scale))
        return x + self.mlp.c_proj(activation(cfg.activation)(self.mlp.c_fc(self.ln_2(x))))


class GPT2(CausalLM):
    def __init__(self, cfg: ModelConfig, *, rngs, dtype=jnp.float32):
        self.config, self.param_dtype = cfg, dtype
        self.wte = Embed(cfg.vocab_size, cfg.hidden_size, ("vocab", "embed"), rngs=rngs, dtype=dtype)
        self.wpe = Embed(cfg.max_positions, cfg.hidden_size, (None, "embed"), rngs=rngs, dtype=dtype)
        self.h = Block(cfg, rngs=rngs, dtype=dtype)
        self.ln_f = LayerNorm(cfg.hidden_size, cfg.norm_eps, rngs=rngs, dtype=dtype)

    @property
    def layers(self):
        return self.h

    def token_embeddings(self, ids):
        return self.wte(ids)

    def input_embeddings(self, x, positions):
        return x + self.wpe(positions)

    def final_norm(self, x):
        return self.ln_f(x)

    def unembed(self, x):
        return self.wte.attend(x)


def hf_table(cfg: ModelConfig):
    layer = "h.{i}."
    return [
        mapping.Rule("wte.weight", "wte.embedding"),
        mapping.Rule("wpe.weight", "wpe.embedding"),
        *mapping.norm(layer + "ln_1", "h.ln_1"),
        *mapping.linear(layer + "attn.c_attn", "h.attn.c_attn", transform="identity"),
        *mapping.linear(layer + "attn.c_proj", "h.attn.c_proj", transform="identity"),
        *mapping.norm(layer + "ln_2", "h.ln_2"),
        *mapping.linear(layer + "mlp.c_fc", "h.mlp.c_fc", transform="identity"),
        *mapping.linear(layer + "mlp.c_proj", "h.mlp.c_proj", transform="identity"),
        *mapping.norm("ln_f", "ln_f"),
    ]
