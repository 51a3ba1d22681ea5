"""Tiny random models of every family with small local tokenizers: `random:FAMILY` model names.

They make any config runnable in seconds on a CPU (the `:tiny` config argument) with no download: the weights are
random (seeded) and the tokenizer is a byte-level BPE trained here on the Python documentation that ships with
every Python. Each family gets its own vocabulary size, so two tiny families tokenize differently and the
cross-tokenizer alignment is exercised as with real pairs; `qwen2` and `qwen2-large` share one, as a real
same-family pair does.

`random:DIR` takes the shapes (config.json) and tokenizer of a checkpoint directory DIR with random weights: a
real-size model where its weights are not at hand (e.g. timing on a machine the weights cannot be copied to).
"""

from __future__ import annotations

import functools
from pathlib import Path

from mot_jax import sharding
from mot_jax.errors import MotJaxError
from mot_jax.models import registry
from mot_jax.models.registry import FAMILIES, FAMILY_BY_NAME, build_model, resolve_dtype

PREFIX = "random:"
_LAYERS = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, intermediate_size=128)
_ROTARY = dict(_LAYERS, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
# family -> (HF config dict without vocab / special ids, tokenizer vocabulary size)
HF_CONFIGS = {
    "gpt2": (dict(model_type="gpt2", n_layer=4, n_embd=64, n_head=4, n_positions=512), 320),
    "opt": (
        dict(model_type="opt", num_hidden_layers=4, hidden_size=64, num_attention_heads=4, ffn_dim=128)
        | dict(max_position_embeddings=512, word_embed_proj_dim=64, do_layer_norm_before=True),
        352,
    ),
    "qwen2": (dict(model_type="qwen2", tie_word_embeddings=True, **_ROTARY), 384),
    # a deeper, wider qwen2 with an untied head and qwen2's tokenizer: the tiny same-family small -> big pair
    "qwen2-large": (
        dict(model_type="qwen2", tie_word_embeddings=False, **_ROTARY)
        | dict(num_hidden_layers=6, hidden_size=96, num_attention_heads=6, intermediate_size=192),
        384,
    ),
    # heads x head_dim (4 x 32) wider than hidden_size (64), as in Qwen3-0.6B (16 x 128 over 1024)
    "qwen3": (dict(model_type="qwen3", tie_word_embeddings=True, head_dim=32, **_ROTARY), 480),
    "llama": (dict(model_type="llama", tie_word_embeddings=False, **_ROTARY), 416),
    "gemma3": (
        dict(model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=16, sliding_window=32, **_ROTARY)
        | dict(sliding_window_pattern=2),
        448,
    ),
}
SPECIALS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2


def is_random(name: str) -> bool:
    return str(name).startswith(PREFIX)


@functools.cache
def tokenizer(vocab_size: int):
    """A byte-level BPE of `vocab_size` trained on `pydoc_data.topics` (deterministic, ~1 s)."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([topics[k] for k in sorted(topics)], trainer)
    return tok


def _shapes_dir(name: str) -> Path | None:
    """`random:DIR`: a checkpoint directory whose shapes (config.json) and tokenizer a random model takes."""
    path = Path(name[len(PREFIX) :]).expanduser()
    return path if path.is_dir() else None


def hf_config(name: str) -> dict:
    if folder := _shapes_dir(name):
        return registry.read_config(folder)[0]
    family = name[len(PREFIX) :]
    if family not in HF_CONFIGS:
        raise MotJaxError(
            f"Unknown tiny model {name!r}; use {PREFIX}FAMILY with FAMILY in {', '.join(HF_CONFIGS)}, or "
            f"{PREFIX}DIR with a checkpoint directory DIR (its config.json) for random weights of its shapes."
        )
    config, vocab = HF_CONFIGS[family]
    return dict(config, vocab_size=vocab, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def load_tokenizer(name: str):
    if folder := _shapes_dir(name):
        from mot_jax.models import tokenizers

        return tokenizers.from_folder(folder)
    return tokenizer(hf_config(name)["vocab_size"])


def load(name: str, dtype="float32", seed: int = 0, mesh=None, rules=sharding.RULES):
    """(model, HF config dict, tokenizer) of a random model; the weights depend on the family and `seed` (on `mesh`
    by `rules` when given: see `build_model`)."""
    config = hf_config(name)
    cfg = FAMILIES[config["model_type"]][0].config_from_hf(config)
    seed += sorted(FAMILY_BY_NAME).index(cfg.family)
    model = build_model(cfg, resolve_dtype(dtype), seed=seed, mesh=mesh, rules=rules)
    return model, config, load_tokenizer(name)
