"""MoT-h (`translator.kind="mot_h"`): the reference's shapes, defaults and refusals, the injection against transformers
with the reference's forward pre-hooks, the native residual stream as the native cache and generation, and a tiny run
that trains, resumes and evaluates."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import hf_model, load_config, small_config, whole_and_resumed

from mot_jax.errors import MotJaxError
from mot_jax.evals import run
from mot_jax.evals.methods import method_name
from mot_jax.jit import jit
from mot_jax.models import tiny
from mot_jax.models.generation import generate_from_cache, prefill
from mot_jax.models.hooks import Forward
from mot_jax.translate import channels, kinds
from mot_jax.translate.align import encode_texts, identity_alignment
from mot_jax.translate.config import TranslatorConfig
from mot_jax.translate.hooks import ReplaceLayerInputs
from mot_jax.translate.mixture import MixtureOfTranslators
from mot_jax.translate.pipeline import source_prefill, translate_jit
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, mixture_config

TINY = dict(kind="mot_h", dim=16, heads=2, depth=1, mlp_ratio=2)


def spec_for(ls, lt, **kw):
    """A MoT-h spec over the top half of the target's layers (terminal channel map), dense attention."""
    kw = dict(sparse_attention=False) | kw
    return TranslationSpec.build("replay", channels.terminal(ls, lt, 0.5), ls, lt, kind="mot_h", **kw)


def test_reference_shapes_defaults_and_refusals():
    model = lambda hidden: SimpleNamespace(config=SimpleNamespace(num_kv_heads=1, head_dim=8, hidden_size=hidden))
    source, target = model(24), model(40)
    spec = spec_for(6, 4)
    assert spec.source_reads is kinds.LAYER_INPUTS and spec.outputs == "residual" and spec.target_layers == (2, 3)
    cfg = mixture_config(spec, source, target, **TINY)
    # per window layer a source residual stream in and a target residual stream out (not K/V widths)
    assert (cfg.source_width, cfg.target_width, cfg.window) == (24, 40, 2)
    defaults = mixture_config(spec, source, target, kind="mot_h")  # MoT's sizes and routing
    assert (defaults.dim, defaults.heads, defaults.depth, defaults.mlp_ratio) == (1024, 16, 2, 4)
    assert (defaults.num_experts, defaults.top_k, defaults.output_activation) == (2, 1, "gelu")
    translator = KVTranslator(spec, cfg, rngs=nnx.Rngs(0))
    assert isinstance(translator.hidden, MixtureOfTranslators)  # one mixture, not one per K and V
    assert not hasattr(translator, "key") and not hasattr(translator, "value")
    experts = translator.hidden.experts
    assert experts.input_proj.kernel.shape == (2, 24, 16) and experts.output_proj.kernel.shape == (2, 2 * 16, 2 * 40)
    named = load_config("smollm2_gemma3.py", "mot_h")
    t = named.translator
    assert (t.kind, t.mode, t.sparse_attention, named.loss.correction_weight) == ("mot_h", "replay", False, 1.0)
    assert method_name(named) == "MoT-h"
    named.translator.num_experts = 1
    assert method_name(named) == "single translator (MoT-h)"

    for bad, why in (
        (spec_for(6, 4, sparse_attention=True), "set sparse_attention=False"),
        (TranslationSpec.build("direct", None, 6, 4, kind="mot_h"), "set mode='replay'"),
        (spec_for(6, 4, rotary=True), "set rotary=False"),
        (spec_for(6, 4, inputs=("source", "embeddings")), "set inputs='source'"),
        (TranslationSpec.build("replay", channels.terminal(6, 4, 0.5), 6, 4, sparse_attention=False), "residual"),
    ):
        with pytest.raises(MotJaxError, match=f"^kind='mot_h' .*{why}.*\\.$"):
            KVTranslator(bad, cfg, rngs=nnx.Rngs(0))
    with pytest.raises(MotJaxError, match="^kind='mot_h' has no linear skip"):
        KVTranslator(spec, TranslatorConfig(24, 40, 2, **TINY, linear_skip=True), rngs=nnx.Rngs(0))
    with pytest.raises(MotJaxError, match="^kind='mot_h' writes the window layers' input residual streams"):
        spec_for(6, 4, outputs="hidden")
    with pytest.raises(MotJaxError, match="set kind='mot_h'"):
        KVTranslator(spec, TranslatorConfig(24, 40, 2, dim=16, heads=2), rngs=nnx.Rngs(0))
    for arg in ("mot_h,direct", "mot_h,c2c"):
        with pytest.raises(MotJaxError, match="Bad config argument"):
            load_config("smollm2_gemma3.py", arg)


@jit
def injected_cache(model, ids, hidden, slot):
    return model.run_layers(Forward(ids), hooks=[ReplaceLayerInputs(hidden, slot)]).cache


@pytest.mark.parametrize("name", ["random:llama", "random:gemma3"])
def test_replaced_inputs_equal_transformers_forward_pre_hooks(name, tmp_path):
    """The reference's injection: forward pre-hooks hand the target's window layers other input hidden states inside
    an ordinary transformers forward; every layer's cache equals mot_jax's `ReplaceLayerInputs` hook's within 1e-4."""
    model, hf, _ = hf_model(name, tmp_path)
    layers = model.config.num_layers
    window = (1, layers - 1)
    ids = np.asarray(jax.random.randint(jax.random.key(0), (1, 12), 3, model.config.vocab_size), np.int32)
    hidden = np.asarray(jax.random.normal(jax.random.key(1), (2, 1, 12, model.config.hidden_size)), np.float32)
    slot = np.full(layers, -1, np.int32)
    slot[list(window)] = [0, 1]
    cache = injected_cache(model, jnp.asarray(ids), jnp.asarray(hidden), jnp.asarray(slot))

    def hook(i):
        def replace(module, args, kwargs):
            if args:
                return (torch.tensor(hidden[i]), *args[1:]), kwargs
            return args, kwargs | dict(hidden_states=torch.tensor(hidden[i]))

        return replace

    decoder_layers = hf.model.layers
    handles = [
        decoder_layers[layer].register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(window)
    ]
    try:
        with torch.no_grad():
            out = hf(input_ids=torch.tensor(ids, dtype=torch.long), use_cache=True)
    finally:
        for handle in handles:
            handle.remove()
    theirs = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    for layer, hf_layer in enumerate(theirs.layers):  # Gemma-3's sliding layers keep their window's last slots
        kept = slice(12 - hf_layer.keys.shape[2], 12)
        np.testing.assert_allclose(hf_layer.keys.numpy(), np.asarray(cache.k[layer, :, :, kept]), atol=1e-4)
        np.testing.assert_allclose(hf_layer.values.numpy(), np.asarray(cache.v[layer, :, :, kept]), atol=1e-4)
    _, native = prefill(model, jnp.asarray(ids))
    assert not np.allclose(native.k[window[0]], cache.k[window[0]], atol=1e-3)  # the replacement did something
    np.testing.assert_array_equal(native.k[0], cache.k[0])  # below the window: native


class Same(nnx.Module):
    """An identity mixture: the residual streams it reads are the ones it writes."""

    def __call__(self, x, mask):
        return x, {}


def test_the_native_residual_stream_gives_the_native_cache_and_generation():
    """Source = target (gemma3), the same tokens and an identity mixture: the translated window inputs are the
    target's own native residual stream, so its cache and greedy continuation are native's exactly; the untrained
    mixture changes the window's layers and leaves those below it native."""
    model, _, tokenizer = tiny.load("random:gemma3")
    layers = model.config.num_layers
    ids, mask = encode_texts(tokenizer, ["The cat sat on the mat by the door.", "Hello world, again"])
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    suffix = jnp.asarray(tokenizer.encode(" Question: who? Answer:", add_special_tokens=False).ids)[None].repeat(2, 0)
    capacity = ids.shape[1] + suffix.shape[1] + 4
    spec = spec_for(layers, layers)
    translator = KVTranslator(spec, mixture_config(spec, model, model, **TINY), rngs=nnx.Rngs(0))
    streams, _ = source_prefill(model, ids, mask, layer_inputs=True)  # what the source hands over: [L, B, 1, T, D]
    assert streams.k.shape == (layers, 2, 1, ids.shape[1], model.config.hidden_size) and streams.v.shape[-1] == 0
    args = (model, model, streams, identity_alignment(*ids.shape, np.asarray(mask)), ids, mask, None)
    _, native = prefill(model, ids, mask, capacity=capacity)

    untrained, aux = translate_jit(translator, *args, capacity=capacity)
    assert set(aux) == {"hidden"} and "load_balance_loss" in aux["hidden"]
    bottom = min(spec.target_layers)
    np.testing.assert_array_equal(untrained.k[:bottom], native.k[:bottom])
    assert not np.allclose(untrained.k[bottom], native.k[bottom], atol=1e-3)

    translator.hidden = Same()
    same, _ = translate_jit(translator, *args, capacity=capacity)
    for a, b in ((same.positions, native.positions), (same.valid, native.valid), (same.index, native.index)):
        np.testing.assert_array_equal(a, b)
    valid = np.asarray(native.valid)[None, :, None, :, None]  # padding slots: never read, garbage on both sides
    for a, b in ((same.k, native.k), (same.v, native.v)):
        np.testing.assert_array_equal(np.where(valid, a, 0), np.where(valid, b, 0))
    generated = [generate_from_cache(model, c, suffix, max_new_tokens=4) for c in (same, native)]
    np.testing.assert_array_equal(*generated)


@pytest.mark.slow
def test_a_tiny_run_trains_resumes_and_evaluates(tmp_path, monkeypatch):
    """smollm2_gemma3.py:mot_h,tiny: 3 steps at once and 3 stopped after step 1 and resumed give the same mixture;
    the evaluation names it MoT-h, beside its shuffled-source control, and times the target's forward over the context
    in its TTFT."""
    config = load_config("smollm2_gemma3.py", "mot_h,tiny", steps=3, checkpoint_every=1)
    whole, trained = whole_and_resumed(config, tmp_path, monkeypatch, stop_after=1)
    assert isinstance(trained[0].hidden, MixtureOfTranslators) and trained[0].spec.source_reads is kinds.LAYER_INPUTS
    for a, b in zip(*(jax.tree.leaves(nnx.state(t, nnx.Param)) for t in trained), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert np.isfinite(whole["final_validation"]["loss"]) and "load_cv2" in whole["final_validation"]

    evaluation = small_config(tasks="extractive_qa", methods="native", ttft_lengths="32", memory=False)
    results = run.evaluate(tmp_path / "whole", evaluation, compare=[tmp_path / "resumed"], out=tmp_path / "eval")
    rows = results["tasks"]["extractive_qa"]["methods"]
    names = [
        "native",
        "source alone",
        "MoT-h",
        "MoT-h, shuffled source",
        "MoT-h [resumed]",
        "MoT-h [resumed], shuffled source",
    ]
    assert list(rows) == names
    assert rows["MoT-h"]["predictions"] == rows["MoT-h [resumed]"]["predictions"]
    timed = {r["method"]: r for r in results["latency"]}
    assert set(timed["MoT-h"]["stages"]) == {"source_prefill", "translation", "answer"}
    assert set(results["routing"]["MoT-h"]) == {"hidden"}
