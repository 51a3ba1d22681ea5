"""Tiny random transformers models saved to a temp dir, and runs of them, as the outside reference."""

from __future__ import annotations

import inspect

import numpy as np
import torch
import transformers

TINY = dict(vocab_size=97)

# family -> {variant name: config}; each variant exercises a quirk of the family.
CONFIGS = {
    "gpt2": {
        "base": lambda: transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, **TINY),
        "inverse_layer_scale": lambda: transformers.GPT2Config(
            n_layer=3,
            n_embd=48,
            n_head=3,
            n_positions=64,
            scale_attn_by_inverse_layer_idx=True,
            activation_function="gelu",
            n_inner=80,
            **TINY,
        ),
    },
    "opt": {
        "pre_ln": lambda: transformers.OPTConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=64, max_position_embeddings=64, **TINY
        ),
        # opt-350m style: post-LN and project_in / project_out
        "post_ln_projected": lambda: transformers.OPTConfig(
            num_hidden_layers=3,
            hidden_size=32,
            num_attention_heads=4,
            ffn_dim=64,
            max_position_embeddings=64,
            word_embed_proj_dim=16,
            do_layer_norm_before=False,
            **TINY,
        ),
    },
    "qwen2": {
        "tied_gqa": lambda: transformers.Qwen2Config(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            tie_word_embeddings=True,
            rope_theta=1e6,
            **TINY,
        ),
        "untied_sliding": lambda: transformers.Qwen2Config(
            num_hidden_layers=3,
            hidden_size=48,
            num_attention_heads=6,
            num_key_value_heads=1,
            intermediate_size=64,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
            rms_norm_eps=1e-5,
            **TINY,
        ),
    },
    "qwen3": {
        # Qwen3-0.6B style: heads x head_dim (4 x 16) wider than hidden_size (32), GQA, tied head
        "tied_gqa_wide_heads": lambda: transformers.Qwen3Config(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
            **TINY,
        ),
        # Qwen3-8B style untied head, plus the config's other switches: biases, sliding layers (window 5 < 12)
        "untied_bias_sliding": lambda: transformers.Qwen3Config(
            num_hidden_layers=3,
            hidden_size=48,
            num_attention_heads=6,
            num_key_value_heads=6,
            head_dim=8,
            intermediate_size=64,
            tie_word_embeddings=False,
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
            rms_norm_eps=1e-5,
            **TINY,
        ),
    },
    "llama": {
        # Llama-3.2 style: llama3 RoPE scaling (short original context so every band is exercised), untied head
        "llama3_rope": lambda: transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8,
            ),
            **TINY,
        ),
        "biases_tied": lambda: transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=48,
            num_attention_heads=3,
            num_key_value_heads=3,
            intermediate_size=64,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
            head_dim=24,
            **TINY,
        ),
    },
    "gemma3": {
        # sliding window (4) shorter than the test sequence (12), 2:1 local/global, linear scaling on global
        "sliding_softcap": lambda: transformers.Gemma3TextConfig(
            num_hidden_layers=3,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            final_logit_softcapping=15.0,  # transformers ignores attn soft-cap
            rope_parameters=dict(
                full_attention=dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                sliding_attention=dict(rope_type="default", rope_theta=1e4),
            ),
            **TINY,
        ),
    },
}


def save_tiny(config, path, seed=0, dtype=torch.float32):
    """A random model of `config` saved with save_pretrained; returns the torch model (eval mode)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # random (non-zero) norms and biases, so a wrong mapping cannot hide behind init values
        for _name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.to(dtype).save_pretrained(path)
    return model


def padded_batch(vocab, seed=0):
    """ids [3, 12] and mask: a full row, a left-padded row and a right-padded row."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=(3, 12))
    mask = np.ones((3, 12), np.int64)
    mask[1, :4] = 0
    mask[2, 9:] = 0
    return ids, mask


def positions_for(mask):
    return np.maximum(np.cumsum(mask, axis=1) - 1, 0)


def full_cache(model) -> dict:
    """The keyword argument that hands `model` a cache of full layers: a DynamicCache with no config (one made from
    the config crops sliding-window layers to their window), under the name the installed transformers takes
    (`cache`, `past_key_values` in releases before it; a name it does not take is ignored, and it makes its own)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: transformers.DynamicCache()}


def run_reference(model, ids, mask):
    """logits [B, T, V] and per-layer K, V [L, B, K, T, d] from transformers (positions from the mask)."""
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions_for(mask)),
            use_cache=True,
            **full_cache(model),
        )
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    k = np.stack([layer.keys.float().numpy() for layer in cache.layers])
    v = np.stack([layer.values.float().numpy() for layer in cache.layers])
    return out.logits.float().numpy(), k, v
