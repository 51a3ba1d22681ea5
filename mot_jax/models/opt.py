"""OPT: learned positions with the +2 offset, optional project_in/out, pre-LN or post-LN (opt-350m), ReLU."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from mot_jax.errors import MotJaxError
from mot_jax.models import mapping
from mot_jax.models.base import CausalLM, ModelConfig
from mot_jax.models.layers import Embed, LayerNorm, Linear, activation

BASE_PREFIX = "model."
POSITION_OFFSET = 2  # OPT's learned position table starts at row 2


def config_from_hf(d: dict) -> ModelConfig:
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    if not d.get("layer_norm_elementwise_affine", True):
        raise MotJaxError("OPT with layer_norm_elementwise_affine=False is not supported; use an affine checkpoint.")
    return ModelConfig(
        family="opt",
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=d["ffn_dim"],
        max_positions=d["max_position_embeddings"],
        norm_eps=1e-5,
        activation=d.get("activation_function", "relu"),
        bias=d.get("enable_bias", True),
        pre_norm=d.get("do_layer_norm_before", True),
        final_norm=d.get("do_layer_norm_before", True) and not d.get("_remove_final_layer_norm", False),
        word_embed_proj_dim=d.get("word_embed_proj_dim") or hidden,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        pad_token_id=d.get("pad_token_id"),
    )


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs, dtype):
        lead, D, b = (cfg.num_layers,), cfg.hidden_size, cfg.bias
        self.q_proj = Linear(D, D, ("embed", "heads"), rngs=rngs, dtype=dtype, lead=lead, bias=b)
        self.k_proj = Linear(D, D, ("embed", "kv"), rngs=rngs, dtype=dtype, lead=lead, bias=b)
        self.v_proj = Linear(D, D, ("embed", "kv"), rngs=rngs, dtype=dtype, lead=lead, bias=b)
        self.out_proj = Linear(D, D, ("heads", "embed"), rngs=rngs, dtype=dtype, lead=lead, bias=b)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs, dtype):
        lead, D, F, b = (cfg.num_layers,), cfg.hidden_size, cfg.intermediate_size, cfg.bias
        self.cfg = cfg
        self.self_attn = Attention(cfg, rngs=rngs, dtype=dtype)
        self.self_attn_layer_norm = LayerNorm(D, cfg.norm_eps, rngs=rngs, dtype=dtype, lead=lead)
        self.fc1 = Linear(D, F, ("embed", "mlp"), rngs=rngs, dtype=dtype, lead=lead, bias=b)
        self.fc2 = Linear(F, D, ("mlp", "embed"), rngs=rngs, dtype=dtype, lead=lead, bias=b)
        self.final_layer_norm = LayerNorm(D, cfg.norm_eps, rngs=rngs, dtype=dtype, lead=lead)

    def attention_input(self, x):
        return self.self_attn_layer_norm(x) if self.cfg.pre_norm else x

    def key_value(self, x, positions, layer):
        """This layer's K and V [B, T, H, d] of its input residual stream x."""
        h, heads = self.attention_input(x), lambda y: y.reshape(*x.shape[:2], self.cfg.num_heads, self.cfg.head_dim)
        return heads(self.self_attn.k_proj(h)), heads(self.self_attn.v_proj(h))

    def __call__(self, x, positions, layer, cache):
        cfg, attn = self.cfg, self.self_attn
        q = attn.q_proj(self.attention_input(x)).reshape(*x.shape[:2], cfg.num_heads, cfg.head_dim)
        k, v = self.key_value(x, positions, layer)
        x = x + attn.out_proj(cache.attend(q, k, v, scale=cfg.head_dim**-0.5))
        if not cfg.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if cfg.pre_norm else x
        x = x + self.fc2(activation(cfg.activation)(self.fc1(h)))
        return x if cfg.pre_norm else self.final_layer_norm(x)


class OPT(CausalLM):
    def __init__(self, cfg: ModelConfig, *, rngs, dtype=jnp.float32):
        self.config, self.param_dtype = cfg, dtype
        D, E = cfg.hidden_size, cfg.word_embed_proj_dim
        self.embed_tokens = Embed(cfg.vocab_size, E, ("vocab", "embed"), rngs=rngs, dtype=dtype)
        self.embed_positions = Embed(cfg.max_positions + POSITION_OFFSET, D, (None, "embed"), rngs=rngs, dtype=dtype)
        projected = E != D
        self.project_in = Linear(E, D, (None, "embed"), rngs=rngs, dtype=dtype, bias=False) if projected else None
        self.project_out = Linear(D, E, ("embed", None), rngs=rngs, dtype=dtype, bias=False) if projected else None
        self.layers = Block(cfg, rngs=rngs, dtype=dtype)
        self.final_layer_norm = LayerNorm(D, cfg.norm_eps, rngs=rngs, dtype=dtype) if cfg.final_norm else None

    def token_embeddings(self, ids):
        return self.embed_tokens(ids)

    def input_embeddings(self, x, positions):
        if self.project_in is not None:
            x = self.project_in(x)
        return x + self.embed_positions(positions + POSITION_OFFSET)

    def final_norm(self, x):
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        return x if self.project_out is None else self.project_out(x)

    def unembed(self, x):
        return self.embed_tokens.attend(x)


def hf_table(cfg: ModelConfig):
    layer, b = "decoder.layers.{i}.", cfg.bias
    rules = [
        mapping.Rule("decoder.embed_tokens.weight", "embed_tokens.embedding"),
        mapping.Rule("decoder.embed_positions.weight", "embed_positions.embedding"),
        *mapping.linear(layer + "self_attn.q_proj", "layers.self_attn.q_proj", b),
        *mapping.linear(layer + "self_attn.k_proj", "layers.self_attn.k_proj", b),
        *mapping.linear(layer + "self_attn.v_proj", "layers.self_attn.v_proj", b),
        *mapping.linear(layer + "self_attn.out_proj", "layers.self_attn.out_proj", b),
        *mapping.norm(layer + "self_attn_layer_norm", "layers.self_attn_layer_norm"),
        *mapping.linear(layer + "fc1", "layers.fc1", b),
        *mapping.linear(layer + "fc2", "layers.fc2", b),
        *mapping.norm(layer + "final_layer_norm", "layers.final_layer_norm"),
    ]
    if cfg.word_embed_proj_dim != cfg.hidden_size:
        rules += mapping.linear("decoder.project_in", "project_in", bias=False)
        rules += mapping.linear("decoder.project_out", "project_out", bias=False)
    if cfg.final_norm:
        rules += mapping.norm("decoder.final_layer_norm", "final_layer_norm")
    return rules
