"""Real-size configs (values written here, no download): `nnx.eval_shape` gives the published parameter counts."""

import numpy as np
import pytest

from mot_jax.aot import KNOWN_CONFIGS
from mot_jax.models.registry import FAMILIES, build_model, flat_params

GPT2 = dict(model_type="gpt2", vocab_size=50257, n_positions=1024)
OPT = dict(model_type="opt", vocab_size=50272, max_position_embeddings=2048, activation_function="relu")
QWEN3 = dict(model_type="qwen3", vocab_size=151936, rope_theta=1e6, max_position_embeddings=40960, head_dim=128)

# (name, config.json fields, published parameter count)
REAL = [
    ("gpt2", dict(GPT2, n_layer=12, n_embd=768, n_head=12), 124_439_808),
    ("gpt2-medium", dict(GPT2, n_layer=24, n_embd=1024, n_head=16), 354_823_168),
    ("opt-125m", dict(OPT, num_hidden_layers=12, hidden_size=768, num_attention_heads=12, ffn_dim=3072), 125_239_296),
    (
        "opt-350m",
        dict(
            OPT,
            num_hidden_layers=24,
            hidden_size=1024,
            num_attention_heads=16,
            ffn_dim=4096,
            word_embed_proj_dim=512,
            do_layer_norm_before=False,
        ),
        331_196_416,
    ),
    (
        "opt-1.3b",
        dict(OPT, num_hidden_layers=24, hidden_size=2048, num_attention_heads=32, ffn_dim=8192),
        1_315_758_080,
    ),
    # the shapes `python -m mot_jax.compile` compiles the paper's Qwen configs in (mot_jax/aot.py)
    ("Qwen2.5-0.5B", KNOWN_CONFIGS["Qwen/Qwen2.5-0.5B"], 494_032_768),
    ("Qwen2.5-7B", KNOWN_CONFIGS["Qwen/Qwen2.5-7B"], 7_615_616_512),
    # Qwen3: heads x head_dim 2048 / 4096 / 4096 against hidden 1024 / 2560 / 4096. The counts are transformers'
    # own (Qwen3ForCausalLM of these configs on the meta device, tied embeddings counted once).
    (
        "Qwen3-0.6B",
        dict(
            QWEN3,
            num_hidden_layers=28,
            hidden_size=1024,
            num_attention_heads=16,
            num_key_value_heads=8,
            intermediate_size=3072,
            tie_word_embeddings=True,
        ),
        596_049_920,
    ),
    (
        "Qwen3-4B",
        dict(
            QWEN3,
            num_hidden_layers=36,
            hidden_size=2560,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=9728,
            tie_word_embeddings=True,
        ),
        4_022_468_096,
    ),
    (
        "Qwen3-8B",
        dict(
            QWEN3,
            num_hidden_layers=36,
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=12288,
            tie_word_embeddings=False,
        ),
        8_190_735_360,
    ),
]


@pytest.mark.parametrize("name,hf_config,published", REAL, ids=[r[0] for r in REAL])
def test_eval_shape_gives_published_parameter_count(name, hf_config, published):
    cfg = FAMILIES[hf_config["model_type"]][0].config_from_hf(hf_config)
    model = build_model(cfg, abstract=True)
    count = sum(int(np.prod(p.shape)) for p in flat_params(model).values())
    assert count == published
