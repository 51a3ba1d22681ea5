"""`python -m mot_jax.bench eval`'s arithmetic: the FLOPs of a forward in closed form, checked by hand on a tiny
config and against the matmuls the models really trace, and the work of a batch of the evaluation."""

import pytest
from helpers import TINY_MODEL_CONFIG as TINY

from mot_jax.bench.evalrate import Work, batch_flops
from mot_jax.bench.flops import attended, forward_flops, linear_flops
from mot_jax.models.base import ModelConfig


def test_forward_flops_of_a_tiny_model_in_closed_form():
    # per token and layer: q 8x8, k and v 8x4 each, o 8x8, gate/up/down 8x16: 2 x (64 + 64 + 64 + 384) = 1,152
    assert linear_flops(TINY) == 2 * (8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16) == 1152
    # 3 tokens: 2 layers x 3 x 1,152; causal attention 1 + 2 + 3 keys x 4 (QK and PV, 2 each) x 2 heads x 4 dims
    # per layer; the last token's logits 2 x 8 x 32
    assert forward_flops(TINY, 3) == 2 * 3 * 1152 + 2 * 4 * 2 * 4 * (1 + 2 + 3) + 2 * 8 * 32 == 7808
    # 2 tokens after 5 cached ones see 6 and 7 keys; 2 logits
    assert forward_flops(TINY, 2, past=5, logits=2) == 2 * 2 * 1152 + 2 * 4 * 2 * 4 * (6 + 7) + 2 * 2 * 8 * 32
    assert forward_flops(TINY, 0) == 0
    gpt = ModelConfig(**{**TINY.__dict__, "family": "gpt2"})  # two MLP matrices, not three
    assert linear_flops(gpt) == 2 * (8 * 8 + 2 * 8 * 4 + 8 * 8 + 2 * 8 * 16)


def test_sliding_windows_cap_the_keys():
    windowed = ModelConfig(**{**TINY.__dict__, "layer_windows": (2, None)})
    assert attended(windowed, 0, 0, 4) == 1 + 2 + 2 + 2 and attended(windowed, 1, 0, 4) == 1 + 2 + 3 + 4
    assert forward_flops(windowed, 4) == forward_flops(TINY, 4) - 4 * 2 * 4 * (3 + 4 - 2 - 2)


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2", "opt", "qwen2"])
def test_forward_flops_match_the_traced_prefill(family):
    """Every dot the family's prefill traces (scan trips counted), minus its dense T x T attention, equals the
    closed form minus its causal attention: the projections and logits are counted exactly."""
    import jax
    import jax.numpy as jnp

    from mot_jax.bench.train import matmul_flops
    from mot_jax.models import tiny
    from mot_jax.models.generation import _prefill

    model = tiny.load(tiny.PREFIX + family)[0]
    cfg, t = model.config, 5
    traced = matmul_flops(jax.make_jaxpr(lambda m, i: _prefill(m, i, None, t))(model, jnp.ones((1, t), int)).jaxpr)
    dense = 4 * cfg.num_heads * cfg.head_dim * t * t * cfg.num_layers
    causal = sum(4 * cfg.num_heads * cfg.head_dim * attended(cfg, layer, 0, t) for layer in range(cfg.num_layers))
    assert traced - dense == forward_flops(cfg, t) - causal


def test_a_batch_of_the_evaluation_counts_each_rows_forwards():
    work = batch_flops(TINY, prefix=[10, 4], suffix=[3, 2], gold=[2, 1], new_tokens=3)
    row = lambda p, s, g: (  # noqa: E731
        forward_flops(TINY, p) + forward_flops(TINY, s + g, past=p, logits=g),
        forward_flops(TINY, 1, past=p + s) + forward_flops(TINY, 1, past=p + s + 1),
    )
    (p0, d0), (p1, d1) = row(10, 3, 2), row(4, 2, 1)
    assert work == Work(prefill=p0 + p1, decode=d0 + d1, rows=2)
