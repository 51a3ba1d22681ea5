"""The C2C fuser (`translator.kind="c2c"`): against an independent numpy fuser, the closed gate as the native prefill,
the reference's defaults, the switches it refuses, its PyTorch export (alone and driving transformers models), and a
tiny run that trains, resumes and evaluates."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as nr
import pytest
import torch
from flax import nnx
from helpers import (
    NEW_TOKENS,
    TEXT,
    assert_hf_cache_and_generation,
    hf_model,
    jax_greedy,
    load_config,
    perturb,
    small_config,
    whole_and_resumed,
)

from mot_jax.errors import MotJaxError
from mot_jax.evals import run
from mot_jax.export import weights
from mot_jax.export.torch_pipeline import CachePipeline
from mot_jax.export.torch_translator import KVTranslator as TorchKVTranslator
from mot_jax.jit import jit
from mot_jax.models.generation import generate_from_cache, prefill
from mot_jax.models.hooks import Forward
from mot_jax.translate import align as alignment_lib
from mot_jax.translate.config import TranslatorConfig
from mot_jax.translate.kinds import c2c
from mot_jax.translate.pipeline import CacheTranslator
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, mixture_config, translate

TINY = dict(kind="c2c", dim=16, heads=2, depth=2, mlp_ratio=2)


@jit
def fuse(fuser, receiver, sharer, mask, noise=None):
    return fuser(receiver, sharer, mask, noise)


@jit(static_argnames=("capacity",))
def translated(translator, source, target, source_cache, alignment, ids, mask, *, capacity):
    return translate(translator, source, target, source_cache, alignment, ids, mask, capacity=capacity)


def numpy_fuser(p, receiver, sharer, gate, heads, depth):
    """The reference's ResidualCacheFuser.forward (alg/c2c/train.py) written out in float64 numpy, unmasked."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    gelu, ln, lin = nr.gelu, nr.layer_norm, nr.linear
    sigmoid = lambda a: 1 / (1 + np.exp(-a))
    at = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
    block = functools.partial(nr.cross_attention_block, heads=heads)

    r = gelu(lin(ln(receiver, p["receiver_norm"]), p["receiver_proj"]))
    s = gelu(lin(ln(sharer, p["sharer_norm"]), p["sharer_proj"]))
    x = gelu(lin(ln(np.concatenate([r, s], -1), p["feature_norm"]), p["feature_proj"]))
    fused = x + lin(gelu(lin(ln(x, p["fusion_norm"]), p["fusion_fc1"])), p["fusion_fc2"])
    context = fused * sigmoid(lin(ln(fused, p["weight_norm"]), p["weight_proj"]))
    batch, length, window, _ = receiver.shape
    hidden = r[:, :, 0]
    for stage in range(depth):
        g, states = hidden, []
        for layer in range(window):
            g = block(at(p["blocks"], stage * window + layer), g, context[:, :, layer])
            states.append(g)
        hidden = g
    residual = gelu(lin(ln(np.concatenate(states, -1), p["output_norm"]), p["output_proj"]))
    return receiver + gate[:, None] * residual.reshape(batch, length, window, -1)


def test_fuser_equals_the_reference_forward_in_numpy():
    cfg = TranslatorConfig(12, 8, 3, **TINY)  # sharer width 12, receiver width 8, a window of 3 layers
    fuser = c2c.ResidualCacheFuser(cfg, rngs=nnx.Rngs(0))
    perturb(fuser, seed=1)
    receiver, sharer = (jax.random.normal(jax.random.key(i), (2, 5, 3, w)) for i, w in ((2, 8), (3, 12)))
    params = nnx.to_pure_dict(nnx.state(fuser, nnx.Param))
    for noise in (None, c2c.GateNoise(jnp.float32(0.7), jax.random.key(4))):
        got, gate = fuse(fuser, receiver, sharer, jnp.ones((2, 5), bool), noise)
        want = numpy_fuser(params, np.asarray(receiver), np.asarray(sharer), np.asarray(gate), 2, 2)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    assert 0 < float(gate.min()) and float(gate.max()) < 1  # the training gate is soft


def test_reference_shapes_and_defaults():
    cfg = TranslatorConfig(12, 8, 3, **TINY)
    fuser = c2c.ResidualCacheFuser(cfg, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(fuser.gate_logits[...], [1.5, 1.5, 1.5])  # one logit per layer, open at init
    assert fuser.receiver_proj.kernel.shape == (8, 16) and fuser.sharer_proj.kernel.shape == (12, 16)
    assert fuser.feature_proj.kernel.shape == (32, 16) and fuser.weight_proj.kernel.shape == (16, 16)
    assert fuser.blocks.in_proj.kernel.shape == (2 * 3, 16, 48)  # R x W un-shared blocks, no expert axis
    assert fuser.output_proj.kernel.shape == (3 * 16, 3 * 8)  # fused over the window, as the reference
    # temperature linear from 1.0 (first update) to 0.1 (last), as compute_gate_temperature over steps 1..N
    np.testing.assert_allclose([c2c.gate_temperature(s, 101) for s in (0, 50, 100)], [1.0, 0.55, 0.1], rtol=1e-6)
    assert float(c2c.gate_temperature(0, 1)) == pytest.approx(0.1)
    # evaluation: hard at sigmoid(logit) >= 0.5; training: P(logistic-noise gate open) = sigmoid(logit)
    np.testing.assert_array_equal(c2c.gate(jnp.array([-0.1, 0.0, 0.1]), None), [0.0, 1.0, 1.0])
    samples = jax.vmap(lambda k: c2c.gate(jnp.array([1.5, -1.0]), c2c.GateNoise(jnp.float32(0.1), k)))(
        jax.random.split(jax.random.key(0), 4000)
    )
    np.testing.assert_allclose(samples.mean(0), jax.nn.sigmoid(jnp.array([1.5, -1.0])), atol=0.03)
    # terminal alignment: the top min(Ls, Lt) layers of each, paired from the top
    deeper_source = TranslationSpec.build("direct", None, 30, 18, kind="c2c")
    assert deeper_source.source_layers == tuple(range(12, 30)) and deeper_source.target_layers == tuple(range(18))
    deeper_target = TranslationSpec.build("direct", None, 18, 30, kind="c2c")
    assert deeper_target.source_layers == tuple(range(18)) and deeper_target.target_layers == tuple(range(12, 30))


def test_closed_gate_is_the_native_prefill_and_its_generation(random_pair):
    source, target, source_tok, target_tok = random_pair
    spec = TranslationSpec.build("direct", None, source.config.num_layers, target.config.num_layers, kind="c2c")
    translator = KVTranslator(spec, mixture_config(spec, source, target, **TINY), rngs=nnx.Rngs(0))
    ids, mask = alignment_lib.encode_texts(target_tok, ["The cat sat on the mat.", "Hello world, again"])
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    source_ids, source_mask, alignment = alignment_lib.align_batch(target_tok, source_tok, ids, mask)
    source_cache = source.run_layers(Forward(jnp.asarray(source_ids), jnp.asarray(source_mask))).cache
    args = (translator, source, target, source_cache, alignment, ids, mask)
    suffix = jnp.asarray(target_tok.encode(" Question: who? Answer:").ids, jnp.int32)[None].repeat(2, 0)
    capacity = ids.shape[1] + suffix.shape[1] + 4
    _, native = prefill(target, ids, mask, capacity=capacity)
    opened, _ = translated(*args, capacity=capacity)
    assert not np.array_equal(opened.k, native.k)  # the gates start open: every layer is fused
    for fuser in (translator.key, translator.value):
        fuser.gate_logits.set_value(jnp.full_like(fuser.gate_logits[...], -30.0))
    closed, aux = translated(*args, capacity=capacity)
    np.testing.assert_array_equal(aux["gate"], 0.0)
    for a, b in zip(jax.tree.leaves(closed), jax.tree.leaves(native), strict=True):
        np.testing.assert_array_equal(a, b)
    generated = [generate_from_cache(target, c, suffix, max_new_tokens=4) for c in (closed, native)]
    np.testing.assert_array_equal(*generated)


def test_refused_switches_in_one_line():
    cfg = TranslatorConfig(8, 8, 4, **TINY)
    build = lambda mode="direct", **kw: TranslationSpec.build(mode, None, 4, 4, kind="c2c", **kw)
    from mot_jax.translate import channels

    replay = TranslationSpec.build("replay", channels.terminal(4, 4, 0.5), 4, 4)
    for spec, why in (
        (replay, "no replay"),
        (build(native_bottom=1), "native_bottom=0"),
        (build(outputs="hidden"), "outputs='kv'"),
        (build(inputs=("source", "embeddings")), "inputs='source'"),
    ):
        with pytest.raises(MotJaxError, match=f"^kind='c2c' .*{why}"):
            KVTranslator(spec, cfg, rngs=nnx.Rngs(0))
    with pytest.raises(MotJaxError, match="set linear_skip=False"):
        KVTranslator(build(), TranslatorConfig(8, 8, 4, **TINY, linear_skip=True), rngs=nnx.Rngs(0))
    for arg in ("c2c,replay", "c2c,projector"):
        with pytest.raises(MotJaxError, match="Bad config argument"):
            load_config("smollm2_gemma3.py", arg)


@pytest.mark.slow
def test_a_tiny_run_trains_resumes_and_evaluates(tmp_path, monkeypatch):
    """smollm2_gemma3.py:c2c,tiny: 4 steps at once and 4 stopped after step 2 and resumed give the same fusers (the
    training gate's noise and temperature come from the saved state); the evaluation names it C2C, beside its
    shuffled-source control, and times the receiver's own prefill in its TTFT."""
    config = load_config("smollm2_gemma3.py", "c2c,tiny", steps=4, eval_every=2, checkpoint_every=2)
    assert config.translator.kind == "c2c" and config.loss.correction_weight == 0
    whole, trained = whole_and_resumed(config, tmp_path, monkeypatch, stop_after=2)
    assert isinstance(trained[0].key, c2c.ResidualCacheFuser)
    for a, b in zip(*(jax.tree.leaves(nnx.state(t, nnx.Param)) for t in trained), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert np.isfinite(whole["final_validation"]["loss"]) and "gate" in whole["final_validation"]
    assert whole["held_out"]["translated"] != whole["held_out"]["native"]  # the gates are open: fused, not native

    evaluation = small_config(tasks="extractive_qa", methods="native", ttft_lengths="32", memory=False)
    results = run.evaluate(tmp_path / "whole", evaluation, compare=[tmp_path / "resumed"], out=tmp_path / "eval")
    rows = results["tasks"]["extractive_qa"]["methods"]
    names = ["native", "source alone", "C2C", "C2C, shuffled source", "C2C [resumed]", "C2C [resumed], shuffled source"]
    assert list(rows) == names
    assert rows["C2C"]["predictions"] == rows["C2C [resumed]"]["predictions"]
    timed = {r["method"]: r for r in results["latency"]}
    assert set(timed) == {"native", "source alone", "C2C", "C2C [resumed]"}
    stages = timed["C2C"]["stages"]  # the receiver's prefill runs in the translation stage, inside TTFT
    assert set(stages) == {"source_prefill", "translation", "answer"}
    assert timed["C2C"]["ttft_s"] == pytest.approx(stages["translation"] + stages["answer"])


def c2c_translator(source, target, seed=0):
    """A perturbed fuser pair over the terminal window, one gate closed (hard gate 0) and the others open."""
    s, t = source.config, target.config
    spec = TranslationSpec.build("direct", None, s.num_layers, t.num_layers, kind="c2c")
    translator = KVTranslator(spec, mixture_config(spec, source, target, **TINY), rngs=nnx.Rngs(seed))
    perturb(translator, seed + 1)
    for fuser in (translator.key, translator.value):
        fuser.gate_logits.set_value(fuser.gate_logits[...].at[1].set(-2.0))
    return translator


def test_torch_export_fuses_as_jax(random_pair, tmp_path):
    source, target, source_tok, target_tok = random_pair
    translator = c2c_translator(source, target)
    ids, mask = alignment_lib.encode_texts(target_tok, ["The cat sat on the mat.", "Hello world, again"])
    source_ids, source_mask, alignment = alignment_lib.align_batch(target_tok, source_tok, ids, mask)
    source_cache = source.run_layers(Forward(jnp.asarray(source_ids), jnp.asarray(source_mask))).cache
    args = (translator, source, target, source_cache, alignment, jnp.asarray(ids), jnp.asarray(mask))
    cache, _ = translated(*args, capacity=ids.shape[1])
    _, native = prefill(target, jnp.asarray(ids), jnp.asarray(mask))
    weights.export(translator, source, target, tmp_path / "exported")
    exported = TorchKVTranslator.from_pretrained(tmp_path / "exported")
    t = lambda a: torch.tensor(np.asarray(a))
    with torch.no_grad():
        k, v = exported.fuse_window(
            t(native.k), t(native.v), t(source_cache.k), t(source_cache.v), alignment.weights, t(mask)
        )
    layers = list(translator.spec.target_layers)
    valid = np.asarray(mask, bool)[None, :, None, :, None]  # padding slots: garbage on both sides, never read
    for got, want in ((k, cache.k), (v, cache.v)):
        np.testing.assert_allclose(got.numpy() * valid, np.asarray(want)[layers] * valid, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="call fuse_window"):
        exported.translate_window(t(source_cache.k), t(source_cache.v), alignment.weights)


@pytest.mark.parametrize("pair", [("random:llama", "random:gemma3"), ("random:gemma3", "random:llama")])
def test_transformers_generation_from_the_exported_fusion_equals_mot_jax(pair, tmp_path):
    (source, source_hf, source_tok), (target, target_hf, target_tok) = (hf_model(n, tmp_path) for n in pair)
    translator = c2c_translator(source, target, seed=3)
    ids = np.asarray([target_tok.encode(TEXT).ids], np.int32)
    mask = np.ones(ids.shape, bool)
    suffix = np.asarray([target_tok.encode(" Who counts ships?").ids], np.int32)
    jax_cache = CacheTranslator(source, target, source_tok, target_tok, translator).from_target_ids(
        ids, mask, capacity=ids.shape[1] + suffix.shape[1] + NEW_TOKENS
    )
    expected = jax_greedy(target, jax_cache, suffix)
    weights.export(translator, source, target, tmp_path / "exported")
    exported = TorchKVTranslator.from_pretrained(tmp_path / "exported")
    cache = CachePipeline(source_hf, target_hf, source_tok, target_tok, exported).from_target_ids(ids, mask)
    assert_hf_cache_and_generation(target_hf, cache, jax_cache, ids, suffix, expected)
