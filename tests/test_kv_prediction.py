"""kind='kv_prediction' (`mot_jax/translate/kinds/kv_prediction.py`), beside what tests/test_kinds.py checks of every
kind: its per-layer L1 term against numpy on a padded tiny batch, and configs/qwen_coder.py:kvp,tiny training."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import load_config, perturb, tiny_batch, whole_and_resumed

from mot_jax.errors import MotJaxError
from mot_jax.models.hooks import Forward
from mot_jax.models.model_pair import load_pair
from mot_jax.training import objective, setup
from mot_jax.translate import align
from mot_jax.translate.kinds import kv_prediction
from mot_jax.translate.translator import KVTranslator, source_read, translate


def numpy_l1(translated, native, mask, first):
    """Per written layer l >= first, the mean over valid context tokens (and heads and channels) of
    |translated - native|, then the mean over those layers; translated [L, B, K, C, d] with C >= T, native and mask
    [B, T] over the context."""
    translated, native, mask = (np.asarray(a, np.float64) for a in (translated, native, mask))
    length = mask.shape[1]
    per_layer = []
    for layer in range(first, native.shape[0]):
        total, count = 0.0, 0
        for b, t in zip(*np.nonzero(mask), strict=True):
            total += np.abs(translated[layer, b, :, t] - native[layer, b, :, t]).sum()
            count += native.shape[2] * native.shape[4]
        per_layer.append(total / count)
    assert translated.shape[3] >= length
    return float(np.mean(per_layer))


@pytest.mark.parametrize("native_bottom", [0, 1])
def test_the_l1_term_is_the_per_layer_mean_absolute_error_over_valid_context_tokens(native_bottom):
    overrides = {"translator.native_bottom": native_bottom, "translator.l1_weight": 0.5}
    config = load_config("qwen_coder.py", "kvp,tiny", **overrides)
    assert config.translator.kind == "kv_prediction" and config.loss.correction_weight == 0
    pair = load_pair(config)
    spec, tcfg = setup.translation(config, None, pair)
    translator = KVTranslator(spec, tcfg, rngs=nnx.Rngs(0))
    perturb(translator, seed=1)  # the linear maps start at zero before their least-squares fit
    batch = tiny_batch(pair.source_tokenizer, pair.target_tokenizer, batch=3)
    # row 1 left-padded by 3 tokens (as evaluation pads): those tokens must not count
    mask = np.array(batch.context_mask)
    mask[1, :3] = False
    source_ids, source_mask, alignment = align.align_batch(
        pair.target_tokenizer, pair.source_tokenizer, batch.context, mask, batch.source_ids.shape[1]
    )
    batch = dataclasses.replace(
        batch, context_mask=mask, source_ids=source_ids, source_mask=source_mask, alignment=alignment
    )
    batch = jax.tree.map(jnp.asarray, batch)
    weights = objective.LossWeights.from_config(config.loss)

    frozen = objective.frozen_forwards(pair.source, pair.target, batch, spec.attention_topk, **spec.source_hands)
    loss, metrics = objective.context_correction(translator, pair.source, pair.target, batch, frozen, weights)

    # the caches again, outside the objective: the translation, and the target's own prefill of the context
    read, topk = source_read(pair.source, batch.source_ids, batch.source_mask, spec.attention_topk)
    capacity = batch.context.shape[1] + batch.prompt.shape[1]
    args = (translator, pair.source, pair.target, read, batch.alignment, batch.context, batch.context_mask, topk)
    cache, _ = translate(*args, capacity=capacity)
    native = pair.target.run_layers(Forward(batch.context, batch.context_mask, fresh=True)).cache
    for name in ("k", "v"):
        got, want = getattr(cache, name), getattr(native, name)
        expected = numpy_l1(got, want, mask, native_bottom)
        assert expected > 0
        np.testing.assert_allclose(float(metrics[f"l1_{name}"]), expected, rtol=1e-5)
        # with every token counted, the padded slots would change it: the mask is what is read
        assert not np.isclose(numpy_l1(got, want, np.ones_like(mask), native_bottom), expected, rtol=1e-5)
    # the loss: the prompt CE plus the L1 terms at their weight; no K/V MSE (correction_weight 0)
    assert tcfg.l1_weight == 0.5  # its own field, through the translator config
    extra = 0.5 * (metrics["l1_k"] + metrics["l1_v"])
    np.testing.assert_allclose(float(loss), float(metrics["ce"] + extra), rtol=1e-5)


def test_it_refuses_replay_a_missing_linear_skip_and_a_negative_weight():
    for mode, skip, why in (("replay", True, "set mode='direct'"), ("direct", False, "set linear_skip=True")):
        with pytest.raises(MotJaxError, match=f"^kind='kv_prediction' .*; {why}"):
            kv_prediction.check(SimpleNamespace(mode=mode), SimpleNamespace(linear_skip=skip, l1_weight=1.0))
    with pytest.raises(MotJaxError, match="^l1_weight=-1.0 must be a finite number of at least 0"):
        kv_prediction.check(SimpleNamespace(mode="direct"), SimpleNamespace(linear_skip=True, l1_weight=-1.0))


@pytest.mark.slow
def test_qwen_coder_kvp_tiny_trains_three_steps(tmp_path, monkeypatch):
    config = load_config("qwen_coder.py", "kvp,tiny", steps=3, checkpoint_every=1)
    whole, trained = whole_and_resumed(config, tmp_path, monkeypatch, stop_after=1)
    assert np.isfinite(whole["final_validation"]["loss"])
    assert trained[0].cfg.kind == "kv_prediction" and trained[0].spec.native_bottom == 0
    for a, b in zip(*(jax.tree.leaves(nnx.state(t, nnx.Param)) for t in trained), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
