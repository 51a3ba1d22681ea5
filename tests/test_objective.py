"""The Context Correction objective and the optimizer schedule against independent computations."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_batch

from mot_jax.jit import jit
from mot_jax.training import objective
from mot_jax.training.optim import warmup_cosine
from mot_jax.translate import channels
from mot_jax.translate import translator as translator_lib
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, mixture_config


@pytest.mark.parametrize("mode", ["replay", "direct"])
def test_native_translation_gives_native_loss(random_pair, mode, monkeypatch):
    """With the translation replaced by the target's own K/V, the MSE terms vanish and the CE equals the target's
    CE on the whole sequence read as text (one forward over context + prompt)."""
    source, target, source_tok, target_tok = random_pair
    batch = tiny_batch(source_tok, target_tok)
    channel_map = channels.terminal(4, 4, 0.5)
    spec = TranslationSpec.build(mode, channel_map, 4, 4, sparse_attention=False)
    cfg = mixture_config(spec, source, target, dim=16, heads=2, depth=1, num_experts=1, output_activation="none")
    translator = KVTranslator(spec, cfg, rngs=nnx.Rngs(0))
    # each computation as one program (run eagerly, each operation of the models' forwards compiles on its own)
    frozen = jit(objective.frozen_forwards, static_argnames=("topk",))(source, target, batch, topk=0)
    native = frozen[2]
    layers = np.asarray(spec.target_layers)
    monkeypatch.setattr(
        translator_lib,
        "translate_window",
        lambda *a, **k: (native.k[layers], native.v[layers], {"key": {}, "value": {}}),
    )
    loss, metrics = jit(lambda *a: objective.context_correction(*a, objective.LossWeights()))(
        translator, source, target, batch, frozen
    )
    full = np.concatenate([batch.context, batch.prompt], 1)
    logits, _ = jit(lambda model, ids: model(ids))(target, jnp.asarray(full))
    reference = objective.token_cross_entropy(logits[:, batch.context.shape[1] :], batch.labels, batch.label_mask)
    np.testing.assert_allclose(metrics["ce"], reference, rtol=1e-5)
    assert float(metrics["mse_k"]) < 1e-10 and float(metrics["mse_v"]) < 1e-10
    np.testing.assert_allclose(loss, metrics["ce"], rtol=1e-6)


def test_layer_mse_and_cross_entropy_closed_form():
    a = jnp.arange(2 * 3 * 1 * 4 * 2, dtype=jnp.float32).reshape(2, 3, 1, 4, 2)
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 1]], bool)
    got = objective.layer_mse(a, jnp.zeros_like(a), mask)
    expected = np.square(np.asarray(a)).transpose(0, 1, 3, 2, 4)[:, mask].reshape(2, -1).mean(1)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    logits = jnp.log(jnp.asarray([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
    ce = objective.token_cross_entropy(logits, jnp.asarray([[0, 2]]), jnp.asarray([[1.0, 1.0]]))
    np.testing.assert_allclose(ce, -(math.log(0.5) + math.log(0.8)) / 2, rtol=1e-6)


def test_unexplained_fraction_is_one_for_the_channel_mean_at_any_layer_scale():
    """Predicting each channel's mean over the valid tokens leaves all of a layer's variance unexplained (1), whatever
    the layer's scale (the layers here differ by 10^4)."""
    rng = np.random.default_rng(0)
    scales = np.array([1.0, 100.0, 0.01], np.float32)[:, None, None, None, None]
    native = rng.normal(size=(3, 2, 1, 5, 4)).astype(np.float32) * scales
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    weight = mask[None, :, None, :, None]
    mean = (native * weight).sum((1, 3), keepdims=True) / weight.sum((1, 3), keepdims=True)
    prediction = np.broadcast_to(mean, native.shape)
    mse = objective.layer_mse(jnp.asarray(prediction), jnp.asarray(native), mask)
    variance = objective.layer_variance(jnp.asarray(native), mask)
    np.testing.assert_allclose(mse / variance, np.ones(3), rtol=1e-5)
    valid = native.transpose(0, 1, 3, 2, 4)[:, mask]  # [L, valid tokens, K, d]
    np.testing.assert_allclose(variance, valid.var(axis=1).mean((1, 2)), rtol=1e-5)


def test_schedule_warmup_then_cosine():
    f = warmup_cosine(1.0, 4, 12)
    got = [float(f(c)) for c in range(12)]
    expected = [(s / 4 if s <= 4 else 0.5 * (1 + math.cos(math.pi * (s - 4) / 8))) for s in range(1, 13)]
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert got[0] == 0.25  # the first update is already scaled (the reference runs it at the full rate)
