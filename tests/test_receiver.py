"""Receiver adaptation (`mot_jax/translate/receiver.py`): the target reads a translated cache through trained low-rank
changes to the query projections of the layers the translator writes. Checked against transformers' model with the
same change made to its weights by hand, against the target itself where the change is zero, through training (the
change trains, the target stays frozen) and evaluation (an adapted translator's answers are the hand-adapted
target's), and the loss terms that train it against closed forms."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import hf_model, load_config, perturb, tiny_batch

from mot_jax.errors import MotJaxError
from mot_jax.evals import synthetic
from mot_jax.evals.methods import Native, Translated
from mot_jax.evals.prompts import Settings
from mot_jax.evals.tasks import evaluate_examples
from mot_jax.models.loading import load_model
from mot_jax.models.model_pair import load_pair
from mot_jax.training import config as config_lib
from mot_jax.training import objective
from mot_jax.training.config import base, tiny
from mot_jax.training.objective import distillation_kl, hidden_error
from mot_jax.translate import receiver
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, mixture_config


def random_adapter(target, layers, rank=3, seed=0):
    cfg = target.config
    adapter = receiver.ReceiverQueries(layers, cfg.hidden_size, cfg.num_heads * cfg.head_dim, rank, rngs=nnx.Rngs(seed))
    adapter.up[...] = 0.3 * jax.random.normal(jax.random.key(seed + 1), adapter.up[...].shape)
    return adapter


def test_the_adapted_target_is_transformers_model_with_those_query_weights_changed(tmp_path):
    target, hf, _ = hf_model("random:qwen2", tmp_path)
    layers = (1, 3)
    adapter = random_adapter(target, layers)
    ids = np.arange(3, 40).reshape(1, -1) % target.config.vocab_size
    got, _ = receiver.adapted(target, adapter)(jnp.asarray(ids))
    delta = np.asarray(adapter.delta())  # [W, D, H * d]: torch's Linear keeps the weight as [out, in]
    with torch.no_grad():
        for w, layer in enumerate(layers):
            hf.model.layers[layer].self_attn.q_proj.weight += torch.from_numpy(delta[w].T.copy())
        want = hf(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=0)
    plain, _ = target(jnp.asarray(ids))
    assert np.abs(np.asarray(plain) - want).max() > 1e-2  # the change matters at this size


def test_an_untrained_adapter_is_the_target_itself_and_the_target_is_left_unchanged():
    target, _ = load_model("random:qwen2")
    adapter = receiver.ReceiverQueries((2, 3), target.config.hidden_size, 64, 4, rngs=nnx.Rngs(0))
    ids = jnp.arange(5, 25)[None]
    before = np.asarray(target.layers.self_attn.q_proj.kernel[...])
    np.testing.assert_array_equal(receiver.adapted(target, adapter)(ids)[0], target(ids)[0])  # `up` starts at 0
    receiver.adapted(target, random_adapter(target, (2, 3)))(ids)
    np.testing.assert_array_equal(target.layers.self_attn.q_proj.kernel[...], before)


def test_the_kl_at_a_temperature_and_the_hidden_error_match_their_closed_forms():
    rng = np.random.default_rng(0)
    student, teacher = rng.normal(size=(2, 3, 7)) * 2, rng.normal(size=(2, 3, 7)) * 2
    mask = np.array([[1, 1, 0], [0, 1, 1]], np.float32)
    for t in (1.0, 2.0):
        p = np.exp(teacher / t) / np.exp(teacher / t).sum(-1, keepdims=True)
        q = np.exp(student / t) / np.exp(student / t).sum(-1, keepdims=True)
        kl = (p * np.log(p / q)).sum(-1)
        want = t * t * (kl * mask).sum() / mask.sum()
        np.testing.assert_allclose(distillation_kl(student, teacher, mask, t), want, rtol=1e-5)
    h, g = rng.normal(size=(2, 3, 5)), rng.normal(size=(2, 3, 5))
    want = ((h - g) ** 2 * mask[..., None]).sum() / (g**2 * mask[..., None]).sum()
    np.testing.assert_allclose(hidden_error(h, g, mask), want, rtol=1e-5)


def test_a_receiver_rank_that_cannot_run_is_refused_in_one_line():
    config = load_config("qwen_coder.py", "self,questions,tiny")
    config.translator.receiver_rank = 4
    config.loss.distill_weight = config.loss.hidden_weight = 0.0
    with pytest.raises(MotJaxError, match="^translator.receiver_rank trains the target's queries .* set one of"):
        config_lib.check(config)
    config.loss.distill_weight = 1.0
    for temperature in (0.0, -2.0, float("inf")):  # -2 was told to pass a value >= 0, which 0 is not
        config.loss.distill_temperature = temperature
        with pytest.raises(MotJaxError, match=rf"^loss.distill_temperature={temperature} must be above 0 and finite; "):
            config_lib.check(config)
    gpt2, _ = load_model("random:gpt2")
    with pytest.raises(MotJaxError, match="^translator.receiver_rank adapts the target's query projections, which a "):
        receiver.check(gpt2, 4)


def adapted_dial(pair, rank=4):
    """A dial translator (direct, the target's bottom 2 layers exact, hidden-state inputs and outputs) with a random
    map and, with `rank`, a random receiver adapter."""
    layers = pair.target.config.num_layers
    spec = TranslationSpec.build(
        "direct", None, layers, layers, native_bottom=2, inputs=("hidden",), outputs="hidden", kind="linear"
    )
    cfg = mixture_config(spec, pair.source, pair.target, kind="linear", linear_skip=True, receiver_rank=rank)
    translator = KVTranslator(spec, cfg, rngs=nnx.Rngs(0))
    perturb(translator, seed=1, scale=0.02)
    if rank:
        translator.receiver_queries = random_adapter(pair.target, spec.target_layers, rank)
    return translator


@pytest.fixture(scope="module")
def qwen_pair():
    config = base()
    tiny(config, "qwen2", "qwen2")
    return load_pair(config)


def test_the_training_loss_reaches_the_adapter(qwen_pair):
    source, target = qwen_pair.source, qwen_pair.target
    translator = adapted_dial(qwen_pair)
    translator.receiver_queries.up[...] = jnp.zeros_like(translator.receiver_queries.up[...])  # as it starts
    batch = jax.tree.map(jnp.asarray, tiny_batch(qwen_pair.source_tokenizer, qwen_pair.target_tokenizer))
    frozen = objective.frozen_forwards(source, target, batch, topk=0)
    weights = objective.LossWeights(correction=0.0, ce=0.0, distill=1.0, temperature=2.0, hidden=1.0)
    graphdef, params = nnx.split(translator)

    def loss(params):
        return objective.context_correction(nnx.merge(graphdef, params), source, target, batch, frozen, weights)[0]

    grads = jax.grad(loss)(params)
    assert np.abs(np.asarray(grads["receiver_queries"]["up"].value)).max() > 0


def test_an_adapted_translator_answers_as_the_target_adapted_by_hand(qwen_pair):
    """The evaluation answers an adapted translator's cache with the adapted target, beside a method that answers
    with the target itself in the same run: its predictions and gold log-probabilities are those of the same maps
    without an adapter read by the target adapted by hand."""
    translator = adapted_dial(qwen_pair)
    plain = adapted_dial(qwen_pair, rank=0)
    plain.key_skip, plain.value_skip = translator.key_skip, translator.value_skip
    examples = synthetic.examples("extractive_qa", 4, seed=3)
    settings = Settings(batch_size=2, max_new_tokens=6)
    got = evaluate_examples(qwen_pair, [Native(), Translated("adapted", translator, "-", 0)], examples, settings)
    by_hand = dataclasses.replace(qwen_pair, target=receiver.adapted(qwen_pair.target, translator.receiver_queries))
    want = evaluate_examples(by_hand, [Translated("plain", plain, "-", 0)], examples, settings)["plain"]
    unadapted = evaluate_examples(qwen_pair, [Native(), Translated("plain", plain, "-", 0)], examples, settings)
    logprobs = lambda rows: np.array([p["logprob"] for p in rows["predictions"]])
    assert [p["answer"] for p in got["adapted"]["predictions"]] == [p["answer"] for p in want["predictions"]]
    np.testing.assert_allclose(logprobs(got["adapted"]), logprobs(want), atol=1e-5, rtol=0)
    assert np.abs(logprobs(got["adapted"]) - logprobs(unadapted["plain"])).max() > 1e-3  # the adapter matters
    assert got["native"]["predictions"] == unadapted["native"]["predictions"]  # native still read by the target
