"""The dial between direct and native (`native_bottom`) and the translator's target-side inputs (`inputs`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_reference import padded_batch, positions_for, run_reference
from tolerances import assert_float32_close

from mot_jax.errors import MotJaxError
from mot_jax.models.generation import prefill
from mot_jax.models.hooks import Forward
from mot_jax.translate import channels
from mot_jax.translate.align import align_batch, identity_alignment
from mot_jax.translate.pipeline import source_prefill, translate_jit
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, mixture_config
from mot_jax.translate.window import run_native_bottom, window_inputs


def make(source, target, native_bottom, inputs=("source",), **cfg):
    ls, lt = source.config.num_layers, target.config.num_layers
    spec = TranslationSpec.build("direct", None, ls, lt, native_bottom=native_bottom, inputs=inputs)
    cfg = dict(dim=16, heads=2, depth=1, num_experts=2) | cfg
    return KVTranslator(spec, mixture_config(spec, source, target, **cfg), rngs=nnx.Rngs(0))


def run(translator, source, target, ids, mask, source_ids=None):
    source_ids = ids if source_ids is None else source_ids
    source_cache, _ = source_prefill(source, source_ids, mask)
    alignment = identity_alignment(*ids.shape, np.asarray(mask))
    return translate_jit(
        translator, source, target, source_cache, alignment, ids, mask, None, capacity=ids.shape[1] + 4
    )[0]


@pytest.fixture(scope="module")
def batch(hf_pair):
    ids, mask = padded_batch(hf_pair[0].config.vocab_size)
    return jnp.asarray(ids), jnp.asarray(mask, bool)


def test_all_layers_native_is_the_native_cache(hf_pair, batch):
    """B = L: the cache equals the target's own prefill of the context, bit for bit, and so does the reading of the
    next tokens."""
    source, target, _ = hf_pair
    ids, mask = batch
    cache = run(make(source, target, target.config.num_layers, ("source",)), source, target, ids, mask)
    _, native = prefill(target, ids, mask, capacity=ids.shape[1] + 4)  # what native context evaluates
    for got, want in ((cache.k, native.k), (cache.v, native.v), (cache.positions, native.positions)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    suffix = jnp.asarray([[5, 6], [7, 8], [9, 10]])
    np.testing.assert_array_equal(
        np.asarray(target(suffix, cache=cache)[0]), np.asarray(target(suffix, cache=native)[0])
    )


def test_bottom_layers_are_native_and_the_rest_translated(hf_pair, batch, bottom=2):
    """Layers below B hold the target's own K/V (transformers' cache), layers from B the translator's output; the
    'hidden' input is the target's residual stream before layer B (transformers' hidden_states[B])."""
    source, target, reference = hf_pair
    ids, mask = batch
    translator = make(source, target, bottom, ("source", "embeddings", "hidden"))
    assert translator.spec.target_layers == tuple(range(bottom, 3))
    cache = run(translator, source, target, ids, mask)
    _, want_k, want_v = run_reference(reference, np.asarray(ids), np.asarray(mask, np.int64))
    valid = np.asarray(mask)
    for got, want in ((cache.k, want_k), (cache.v, want_v)):
        got = np.asarray(got[:bottom, :, :, : ids.shape[1]]).transpose(1, 3, 0, 2, 4)[valid]
        np.testing.assert_allclose(got, want[:bottom].transpose(1, 3, 0, 2, 4)[valid], atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        out = reference(
            input_ids=torch.tensor(np.asarray(ids)),
            attention_mask=torch.tensor(np.asarray(mask, np.int64)),
            position_ids=torch.tensor(positions_for(np.asarray(mask))),
            output_hidden_states=True,
        )
    hidden = target.run_layers(Forward(ids, mask, stop=bottom)).hidden
    np.testing.assert_allclose(
        np.asarray(hidden)[valid], out.hidden_states[bottom].numpy()[valid], atol=1e-4, rtol=1e-4
    )


def test_source_free_translation_ignores_the_source_and_the_source_reading_one_does_not(hf_pair, batch):
    source, target, _ = hf_pair
    ids, mask = batch
    other = (ids * 7 + 3) % source.config.vocab_size
    for inputs, same in ((("embeddings", "hidden"), True), (("source", "embeddings"), False)):
        translator = make(source, target, 1, inputs)
        a, b = (run(translator, source, target, ids, mask, s) for s in (ids, other))
        assert np.array_equal(np.asarray(a.k), np.asarray(b.k)) == same, inputs
        assert np.array_equal(np.asarray(a.k[:1]), np.asarray(b.k[:1]))  # the native bottom layer never reads it


def test_the_embeddings_input_is_the_target_token_identity(hf_pair, batch):
    """With no source, changing one context token changes the translated K/V at that token (position 5 of row 0
    attends nothing later: a causal translator) and nowhere before it."""
    source, target, _ = hf_pair
    ids, mask = batch
    translator = make(source, target, 0, ("embeddings",), causal=True, num_experts=1, top_k=1)
    changed = ids.at[0, 5].set((ids[0, 5] + 1) % source.config.vocab_size)
    a, b = (run(translator, source, target, x, mask) for x in (ids, changed))
    differs = np.abs(np.asarray(a.k - b.k))[:, 0].max(axis=(0, 1, 3))  # per token of row 0
    assert differs[5] > 0 and not differs[:5].any()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mode="replay", native_bottom=1), "direct.* only"),
        (dict(native_bottom=4), "outside 0..3"),
        (dict(inputs=("hidden",)), "residual stream"),
        (dict(inputs=("source", "tokens")), "Bad translator inputs"),
        (dict(inputs=()), "Bad translator inputs"),
    ],
)
def test_bad_dial_settings_are_refused_in_one_line(kwargs, message):
    kwargs = dict(mode="direct") | kwargs
    mode = kwargs.pop("mode")
    channel_map = channels.terminal(3, 3, 0.67) if mode == "replay" else None
    with pytest.raises(MotJaxError, match=message):
        TranslationSpec.build(mode, channel_map, 3, 3, **kwargs)


@pytest.mark.slow  # loads a tiny pair and builds an evaluation batch
def test_the_source_free_method_runs_no_source_and_hands_nothing_over():
    """In evaluation a source-free translator gets no source cache at all (so none can leak in) and hands over 0
    bytes; its cache equals the same translator's given the source cache."""
    from mot_jax.evals import synthetic
    from mot_jax.evals.methods import Stopwatch, Translated
    from mot_jax.evals.prompts import Settings, batches
    from mot_jax.models.model_pair import load_pair
    from mot_jax.training.config import base, tiny

    config = base()
    tiny(config, "llama", "gemma3")
    pair = load_pair(config)
    translator = make(pair.source, pair.target, 1, ("embeddings", "hidden"))
    method = Translated("free", translator, "-", 0)
    contexts, _, _ = next(batches(pair, synthetic.examples("extractive_qa", 2, seed=3), Settings(batch_size=2)))
    watch = Stopwatch()
    cache, handed = method.build(pair, contexts, contexts.length, watch)
    assert not handed.any() and "source_prefill" not in watch.stages
    source_ids, source_mask, alignment = align_batch(
        pair.target_tokenizer, pair.source_tokenizer, contexts.ids, contexts.mask
    )
    source_cache, _ = source_prefill(pair.source, jnp.asarray(source_ids), jnp.asarray(source_mask))
    want, _ = translate_jit(
        translator,
        pair.source,
        pair.target,
        source_cache,
        alignment,
        jnp.asarray(contexts.ids),
        jnp.asarray(contexts.mask),
        None,
        capacity=contexts.length,
    )
    assert_float32_close(cache.k, want.k)


def test_a_linear_translator_is_its_skip_alone(hf_pair, batch):
    """kind='linear': the translated K/V are the linear skip's output, the same as a mixture whose own output is zero;
    it needs the skip (its PyTorch export: tests/test_export_pipeline.py)."""
    source, target, _ = hf_pair
    ids, mask = batch
    linear = make(source, target, 1, ("source", "hidden"), kind="linear", linear_skip=True, output_activation="none")
    assert sorted(nnx.state(linear, nnx.Param).to_pure_dict()) == ["key_skip", "value_skip"]
    for skip in (linear.key_skip, linear.value_skip):
        skip.kernel.set_value(jax.random.normal(jax.random.key(0), skip.kernel.shape))
    got = run(linear, source, target, ids, mask)
    features = run_native_bottom(linear.spec, target, ids, mask)[1]
    x = window_inputs(
        linear.spec,
        source,
        target,
        source_prefill(source, ids, mask)[0],
        identity_alignment(*ids.shape, np.asarray(mask)),
        features,
    )[0]
    want = linear.key_skip(x).reshape(*x.shape[:3], target.config.num_kv_heads, target.config.head_dim)
    rows = np.asarray(mask).copy()
    rows[np.arange(len(rows)), np.argmax(rows, 1)] = False  # each row's first token is the target's own
    got_k = np.asarray(got.k[1:, :, :, : ids.shape[1]]).transpose(1, 3, 0, 2, 4)
    np.testing.assert_allclose(got_k[rows], np.asarray(want)[rows], atol=1e-4, rtol=1e-4)
    with pytest.raises(MotJaxError, match="linear_skip=True"):
        make(source, target, 1, kind="linear")


def test_a_linear_translator_never_builds_each_layers_copy_of_the_features(hf_pair, batch):
    """The target-side features every window layer reads are multiplied once for all layers (`LinearSkip`'s
    `shared`): the compiled translation holds no [B, T, W, ds + F] array of the joined inputs."""
    source, target, _ = hf_pair
    ids, mask = batch
    inputs = ("source", "embeddings", "hidden")
    linear = make(source, target, 1, inputs, kind="linear", linear_skip=True, output_activation="none")
    source_cache, _ = source_prefill(source, ids, mask)
    alignment = identity_alignment(*ids.shape, np.asarray(mask))
    args = (linear, source, target, source_cache, alignment, ids, mask, None)
    hlo = translate_jit.lower(*args, capacity=ids.shape[1]).compile().as_text()
    layers = f"{ids.shape[1]},{linear.cfg.window},"
    assert layers in hlo  # the per-layer source inputs are there, the joined ones not
    assert f"[{ids.shape[0]},{layers}{linear.cfg.source_width}]" not in hlo
