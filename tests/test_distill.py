"""The distillation term of the objective (`loss.distill_weight`): KL(native || translated) over the prompt."""

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import tiny_batch
from scipy.special import logsumexp

from mot_jax.jit import jit
from mot_jax.training import objective
from mot_jax.training.config import base
from mot_jax.translate import channels
from mot_jax.translate import translator as translator_lib
from mot_jax.translate.pipeline import translate_jit
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, mixture_config


def test_kl_closed_form():
    teacher = jnp.log(jnp.asarray([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
    student = jnp.log(jnp.asarray([[[0.25, 0.25, 0.5], [0.1, 0.1, 0.8]]]))
    expected = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5)  # the second position agrees: KL 0
    got = objective.distillation_kl(student, teacher, jnp.asarray([[1.0, 1.0]]))
    np.testing.assert_allclose(got, expected / 2, rtol=1e-6)
    masked = objective.distillation_kl(student, teacher, jnp.asarray([[1.0, 0.0]]))
    np.testing.assert_allclose(masked, expected, rtol=1e-6)


frozen_forwards = jit(objective.frozen_forwards, static_argnames=("topk",))
# one program per weighting (run eagerly, each operation of the forwards compiles on its own)
correction = jit(
    lambda *a, distill: objective.context_correction(*a, objective.LossWeights(distill=distill)),
    static_argnames=("distill",),
)
forward = jit(lambda model, ids, cache: model(ids, cache=cache))


def direct_translator(source, target):
    spec = TranslationSpec.build("direct", channels.terminal(4, 4, 1.0), 4, 4, sparse_attention=False)
    cfg = mixture_config(spec, source, target, dim=16, heads=2, depth=1, num_experts=1, output_activation="none")
    return KVTranslator(spec, cfg, rngs=nnx.Rngs(0))


def test_kl_is_the_distance_to_the_native_next_token_distributions(random_pair):
    """An untrained translator: the term equals the KL between the target's prompt logits after the native prefill and
    after the translated cache (each computed by its own forward here), and adds weight x KL to the loss."""
    source, target, source_tok, target_tok = random_pair
    batch = tiny_batch(source_tok, target_tok)
    translator = direct_translator(source, target)
    frozen = frozen_forwards(source, target, batch, topk=0)
    loss, metrics = correction(translator, source, target, batch, frozen, distill=0.0)
    with_kl, kl_metrics = correction(translator, source, target, batch, frozen, distill=0.5)
    assert "kl" not in metrics

    context_length = batch.context.shape[1]
    cache, _ = translate_jit(
        translator,
        source,
        target,
        frozen[0],
        batch.alignment,
        batch.context,
        batch.context_mask,
        None,
        capacity=context_length + batch.prompt.shape[1],
    )
    translated, _ = forward(target, batch.prompt, cache)
    native = forward(target, jnp.asarray(np.concatenate([batch.context, batch.prompt], 1)), None)[0][:, context_length:]
    log_p, log_q = (
        x - logsumexp(x, axis=-1, keepdims=True)
        for x in (np.asarray(native, np.float64), np.asarray(translated, np.float64))
    )
    per_position = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    mask = np.asarray(batch.label_mask, np.float64)
    expected = (per_position * mask).sum() / mask.sum()
    assert expected > 1e-4  # an untrained translator is not native
    np.testing.assert_allclose(kl_metrics["kl"], expected, rtol=1e-4)
    np.testing.assert_allclose(with_kl, loss + 0.5 * expected, rtol=1e-5)


def test_kl_vanishes_for_the_native_translation(random_pair, monkeypatch):
    source, target, source_tok, target_tok = random_pair
    batch = tiny_batch(source_tok, target_tok)
    translator = direct_translator(source, target)
    frozen = frozen_forwards(source, target, batch, topk=0)
    native = frozen[2]
    monkeypatch.setattr(
        translator_lib, "translate_window", lambda *a, **k: (native.k, native.v, {"key": {}, "value": {}})
    )
    # a program of its own (traced with the patch), not one `correction` may have cached
    weights = objective.LossWeights(distill=1.0)
    loss, metrics = jit(lambda *a: objective.context_correction(*a, weights))(translator, source, target, batch, frozen)
    assert abs(float(metrics["kl"])) < 1e-6
    np.testing.assert_allclose(loss, metrics["ce"], rtol=1e-5)


def test_weights_come_from_the_config_and_old_configs_have_no_distillation():
    loss = base().loss
    assert objective.LossWeights.from_config(loss) == objective.LossWeights()
    loss.distill_weight = 0.25
    assert objective.LossWeights.from_config(loss).distill == 0.25
    del loss["distill_weight"]  # a config saved before the field existed
    assert objective.LossWeights.from_config(loss).distill == 0.0
