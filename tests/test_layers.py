"""Shared layers against closed forms and transformers' own helpers."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from mot_jax import kernels
from mot_jax.models import attention, generation, tiny
from mot_jax.models.attention import Mask, attend
from mot_jax.models.layers import param, rope_inv_freq
from mot_jax.models.registry import FAMILIES, build_model


def naive_attention(q, k, v, q_pos, k_pos, k_valid, scale, window, softcap):
    """Loop-per-query reference: softmax over the visible keys only (GQA by repeating K/V heads)."""
    b, t, h, d = q.shape
    group = h // k.shape[1]
    out = np.zeros((b, t, h, d))
    for bi in range(b):
        for ti in range(t):
            visible = k_valid[bi] & (k_pos[bi] <= q_pos[bi, ti]) & (q_pos[bi, ti] - k_pos[bi] < window)
            for hi in range(h):
                logits = (k[bi, hi // group][visible] @ q[bi, ti, hi]) * scale
                if softcap:
                    logits = np.tanh(logits / softcap) * softcap
                p = np.exp(logits - logits.max())
                out[bi, ti, hi] = (p / p.sum()) @ v[bi, hi // group][visible]
    return out.reshape(b, t, h * d)


def test_attention_matches_closed_form_with_window_softcap_gqa_and_padding():
    rng = np.random.default_rng(0)
    b, t, s, h, kv, d = 2, 4, 9, 4, 2, 8
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    k, v = (rng.normal(size=(b, kv, s, d)).astype(np.float32) for _ in range(2))
    k_pos = np.tile(np.arange(s), (b, 1))
    k_valid = np.ones((b, s), bool)
    k_valid[1, :3] = False  # left padding in row 1
    q_pos = k_pos[:, -t:]
    mask = Mask(jnp.asarray(q_pos), jnp.asarray(k_pos), jnp.asarray(k_valid), window=3)
    got = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, scale=0.3, softcap=2.0)
    want = naive_attention(q, k, v, q_pos, k_pos, k_valid, 0.3, 3, 2.0)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def test_query_with_no_visible_key_is_finite():
    q = jnp.ones((1, 1, 2, 4))
    k = v = jnp.ones((1, 2, 3, 4))
    out = attend(q, k, v, Mask(jnp.zeros((1, 1), int), jnp.zeros((1, 3), int), jnp.zeros((1, 3), bool)), scale=1.0)
    assert bool(jnp.isfinite(out).all())


def test_llama3_and_linear_rope_frequencies_match_transformers():
    scaling = dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    config = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_theta=500000.0, rope_scaling=scaling)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    np.testing.assert_allclose(np.asarray(rope_inv_freq(128, 500000.0, scaling)), want.numpy(), rtol=1e-6)
    base = rope_inv_freq(128, 1e4)
    np.testing.assert_allclose(np.asarray(rope_inv_freq(128, 1e4, dict(rope_type="linear", factor=4.0))), base / 4)


def test_param_init_equals_jax_random_normal_eagerly_and_under_eval_shape():
    """The eager init reads a power-of-two draw as numpy (one compile per size class): the same values as
    `std * jax.random.normal(key, shape)` in every dtype, and the traced path under eval_shape gives the shapes."""
    for dtype in (jnp.float32, jnp.bfloat16):
        for shape in [(), (3,), (7, 5), (2, 48, 96)]:
            key = nnx.Rngs(4).params()
            got = param(key, shape, (None,) * len(shape), dtype, std=0.05)[...]
            want = (0.05 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
            for init, fill in (("ones", 1), ("zeros", 0)):
                const = param(None, shape, (None,) * len(shape), dtype, init)[...]
                assert const.dtype == dtype and const.shape == shape and (np.asarray(const) == fill).all()
    traced = nnx.eval_shape(lambda: param(nnx.Rngs(0).params(), (4, 6), (None, None), jnp.bfloat16))
    assert traced.get_value().shape == (4, 6) and traced.get_value().dtype == jnp.bfloat16


def dots_of(hlo: str):
    """(result dtype, lhs dtype, rhs dtype) of every dot in HLO text (operands looked up by name: names are unique)."""
    dtypes = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    dots = re.findall(r"= (\w+)\[[^\n]*? dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
    return [(out, dtypes[lhs], dtypes[rhs]) for out, lhs, rhs in dots]


@pytest.mark.parametrize("family", ["gpt2", "opt", "qwen2", "gemma3"])
def test_bfloat16_prefill_compiles_every_dot_on_bf16_operands_into_f32(family, monkeypatch):
    """The compiled bf16 prefill (XLA's blocked attention included: the fused kernel off) has no dot whose operands
    were converted to f32 first (XLA:CPU's slow bf16 path) nor a bf16 -> bf16 dot: each takes bf16 and accumulates in
    f32 (layers.einsum). And it runs, with decoding after it (XLA:CPU has no fallback for a bf16 x bf16 -> f32 dot its
    fast kernel refuses)."""
    config = tiny.hf_config(f"random:{family}")
    model = build_model(FAMILIES[config["model_type"]][0].config_from_hf(config), jnp.bfloat16)
    monkeypatch.setattr(attention, "PREFILL_BLOCK", 8)  # 16 tokens: two causal query blocks
    monkeypatch.setattr(kernels, "available", lambda: False)
    jax.clear_caches()
    ids = jnp.ones((2, 16), jnp.int32)
    hlo = generation.prefill.lower(model, ids).compile().as_text()
    assert "mot_jax_attention" not in hlo
    dots = dots_of(hlo)
    # per layer q, k, v (or GPT-2's one packed projection), out, 2 or 3 MLP, 2 blocks x (scores, values); the head
    assert len(dots) >= 9, dots
    assert set(dots) == {("f32", "bf16", "bf16")}, dots
    tokens = generation.generate(model, ids, max_new_tokens=3)
    assert tokens.shape == (2, 3) and bool((tokens >= 0).all())
    jax.clear_caches()  # later tests trace with the kernel again


def f32_copies(hlo: str, shapes) -> list[str]:
    """Instructions outside fusion bodies (whose elements XLA computes where they are read) that make an f32 array
    of one of `shapes`: a weight, table or cache copied to f32 whole."""
    wanted = {",".join(map(str, shape)) for shape in shapes}
    found = []
    for computation in computations(hlo).values():
        found += [m[0] for m in re.findall(r"(%[\w.\-]+ = f32\[([\d,]*)\])", computation) if m[1] in wanted]
    return found


def named_computations(hlo: str) -> dict[str, str]:
    """Each computation of HLO text by name."""
    named = ((re.match(r"(?:ENTRY )?%([\w.\-]+)", c), c) for c in re.split(r"\n(?=\S)", hlo))
    return {m.group(1): c for m, c in named if m}


def computations(hlo: str) -> dict[str, str]:
    """Each computation of HLO text by name, but fusion bodies (computed where their elements are read)."""
    bodies = set(re.findall(r"calls=%([\w.\-]+)", hlo))
    return {name: c for name, c in named_computations(hlo).items() if name not in bodies}


@pytest.mark.parametrize("kernel", [True, False], ids=["row kernel", "XLA"])
@pytest.mark.parametrize("family", ["gpt2", "opt", "qwen2", "gemma3"])
def test_bfloat16_single_row_prefill_and_decode_copy_no_weight_to_f32(family, kernel, monkeypatch):
    """One sequence in bf16 (the last position's logits, a decode step): no weight, stack of layer weights, embedding
    table or cache is converted to f32 whole (XLA:CPU does that for a single-row dot and for slicing a bf16 stack in
    the layer loop, once a call), and every dot takes bf16 into f32. With the CPU kernels the single-row products are
    the row kernel's; without them XLA's dots on a row padded to two."""
    if not kernel:
        monkeypatch.setattr(kernels, "available", lambda: False)
    jax.clear_caches()
    config = tiny.hf_config(f"random:{family}")
    model = build_model(FAMILIES[config["model_type"]][0].config_from_hf(config), jnp.bfloat16)
    ids = jnp.ones((1, 24), jnp.int32)
    _, cache = generation.prefill(model, ids, capacity=40)
    weights = [x.shape for x in jax.tree.leaves(nnx.state(model)) if x.dtype == jnp.bfloat16]
    matrices = [shape for shape in weights + [shape[1:] for shape in weights] if len(shape) >= 2]
    shapes = matrices + [cache.k.shape, cache.k.shape[1:]]
    for compiled in (
        jax.jit(lambda model, ids: model(ids, logits_to_keep=1)[0]).lower(model, ids).compile(),
        generation.decode_step.lower(model, jnp.ones((1,), jnp.int32), cache).compile(),
    ):
        hlo = compiled.as_text()
        assert set(dots_of(hlo)) <= {("f32", "bf16", "bf16")}, dots_of(hlo)
        assert (kernels.ROWS_TARGET in hlo) == kernels.available() and (dots_of(hlo) or kernels.available())
        assert not f32_copies(hlo, shapes), f32_copies(hlo, shapes)
    jax.clear_caches()  # later tests trace with the kernels again


def arrays_made(hlo: str, shapes, in_loops_only=False) -> list[str]:
    """Instructions (outside fusion bodies; only in the bodies of while loops if `in_loops_only`) that write an array
    of one of `shapes` (a copy, a slice, a fusion: not a view such as a tuple element or a bitcast)."""
    loops = set(re.findall(r"body=%([\w.\-]+)", hlo))
    wanted = {",".join(map(str, shape)) for shape in shapes}
    views = ("get-tuple-element", "bitcast", "parameter")
    found = []
    for name, computation in computations(hlo).items():
        if name in loops or not in_loops_only:
            made = re.findall(r"(%[\w.\-]+ = \w+\[([\d,]*)\]\S* ([\w\-]+)\()", computation)
            found += [m[0] for m in made if m[1] in wanted and m[2] not in views]
    return found


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_greedy_decoding_reads_each_layers_weights_where_they_lie(family, dtype):
    """Decoding after a cache (`generate_from_cache`, as the evaluation's answers: the question's read and every step
    through `greedy_continue`) makes no copy of a layer's weights in its loop: a scan over the stacked layers slices
    each layer's weights out of the stack on every pass, so a single-sequence decode step moved the model's weights
    twice more than it read them. The tokens equal those of step-by-step decoding through the scan."""
    config = tiny.hf_config(f"random:{family}")
    model = build_model(FAMILIES[config["model_type"]][0].config_from_hf(config), dtype)
    layer_matrices = [x.shape[1:] for x in jax.tree.leaves(nnx.state(model.layers)) if x.ndim >= 3]
    rng = np.random.default_rng(0)
    ids, question = (jnp.asarray(rng.integers(3, config["vocab_size"], size=(1, n))) for n in (12, 3))
    _, cache = generation.prefill(model, ids, capacity=20)
    decode = dict(max_new_tokens=5, eos_ids=())
    hlo = generation.generate_from_cache_jit.lower(model, cache, question, **decode).compile().as_text()
    in_loops = arrays_made(hlo, layer_matrices, in_loops_only=True)
    assert layer_matrices and not in_loops, in_loops
    tokens = generation.generate_from_cache(model, cache, question, **decode)
    logits, cache = model(question, cache=cache)
    steps, token = [], jnp.argmax(logits[:, -1], -1)
    for _ in range(5):
        steps.append(token)
        logits, cache = generation.decode_step(model, token, cache)
        token = jnp.argmax(logits, -1)
    np.testing.assert_array_equal(np.asarray(tokens)[0], np.concatenate(steps))


@pytest.mark.parametrize("family", ["gpt2", "gemma3"])
def test_bfloat16_decoding_multiplies_the_tied_head_against_the_table_as_stored(family):
    """Greedy decoding with a tied head in bf16 makes no transposed [D, V] copy of the embedding table: XLA:CPU hoists
    one out of the decoding loop (once a call: the whole vocabulary) and its product against it is slower."""
    config = tiny.hf_config(f"random:{family}")
    model = build_model(FAMILIES[config["model_type"]][0].config_from_hf(config), jnp.bfloat16)
    (table,) = [x.shape for x in jax.tree.leaves(nnx.state(model)) if x.shape[0] == config["vocab_size"]]
    hlo = generation.generate.lower(model, jnp.ones((1, 8), jnp.int32), max_new_tokens=4, eos_ids=()).compile()
    copies = arrays_made(hlo.as_text(), [table[::-1]])
    assert not copies, copies


def reachable(hlo: str, name: str) -> str:
    """The text of computation `name` and of every computation it calls (fusions, loops, branches), transitively."""
    named = named_computations(hlo)
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen or current not in named:
            continue
        seen.add(current)
        todo += re.findall(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%([\w.\-]+)", named[current])
    return "\n".join(named[n] for n in seen)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_prefill_computes_rope_sin_and_cos_outside_the_layer_loop(family):
    """XLA:CPU evaluates sin and cos element by element: the layer scan reads RoPE tables computed once before it
    (one per distinct RoPE: Gemma-3's sliding layers have their own) instead of recomputing them in every layer."""
    config = tiny.hf_config(f"random:{family}")
    model = build_model(FAMILIES[config["model_type"]][0].config_from_hf(config), jnp.float32)
    hlo = generation.prefill.lower(model, jnp.ones((1, 16), jnp.int32)).compile().as_text()
    loops = set(re.findall(r"body=%([\w.\-]+)", hlo))
    in_loops = "\n".join(reachable(hlo, loop) for loop in loops)
    assert loops and "sine(" in hlo and "cosine(" in hlo
    assert "sine(" not in in_loops and "cosine(" not in in_loops
