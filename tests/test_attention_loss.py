"""The attention-output term of the objective (`loss.attention_weight`, issue 17): the target's native prompt queries
over the translated against the native K/V, per written layer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from helpers import tiny_batch
from hf_reference import CONFIGS, padded_batch, run_reference, save_tiny

from mot_jax.jit import jit
from mot_jax.models.cache import KVCache
from mot_jax.models.loading import load_model
from mot_jax.models.model_pair import load_pair
from mot_jax.training import config as config_lib
from mot_jax.training import objective
from mot_jax.training.channel_search import resolve_channels
from mot_jax.training.setup import make_mesh, translation
from mot_jax.training.trainer import Trainer
from mot_jax.translate import channels
from mot_jax.translate import translator as translator_lib
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, mixture_config


def numpy_attention(q, k, v, q_pos, k_pos, k_valid, scale, window, softcap):
    """[B, T, H, d] softmax attention of q [B, T, H, d] over k, v [B, K, S, d]; query head h reads KV head
    h // (H / K); a key is visible when valid, not after the query and less than `window` positions behind it."""
    b, t, h, d = q.shape
    group = h // k.shape[1]
    out = np.zeros_like(q)
    for row in range(b):
        for i in range(t):
            delta = q_pos[row, i] - k_pos[row]
            visible = k_valid[row] & (delta >= 0) & (delta < window)
            for head in range(h):
                logits = scale * (k[row, head // group] @ q[row, i, head])
                logits = np.tanh(logits / softcap) * softcap
                p = np.where(visible, np.exp(logits - logits[visible].max()), 0.0)
                out[row, i, head] = (p / p.sum()) @ v[row, head // group]
    return out


def test_attention_error_closed_form():
    """Two rows of 3 context slots (the first row's middle one padding) and 2 prompt queries (the second row's last
    one padding), 4 query heads over 2 KV heads, a window of 3 positions and a soft-cap: numpy's relative error."""
    rng = np.random.default_rng(0)
    B, K, H, d, S, T = 2, 2, 4, 3, 5, 2
    q = rng.normal(size=(B, T, H, d))
    k, v, k_got, v_got = (rng.normal(size=(B, K, S, d)) for _ in range(4))
    k_got[:, :, 3:], v_got[:, :, 3:] = k[:, :, 3:], v[:, :, 3:]  # the prompt's slots stay native
    k_valid = np.array([[1, 0, 1, 1, 1], [1, 1, 1, 1, 0]], bool)
    k_pos = np.array([[0, 0, 1, 2, 3], [0, 1, 2, 3, 4]])
    q_pos, q_valid = k_pos[:, 3:], k_valid[:, 3:]
    scale, window, softcap = 0.7, 3, 2.0
    cache = KVCache(
        k=jnp.asarray(k[None], jnp.float32),
        v=jnp.asarray(v[None], jnp.float32),
        positions=jnp.asarray(k_pos, jnp.int32),
        valid=jnp.asarray(k_valid),
        index=jnp.asarray(S, jnp.int32),
    )
    reads = objective.NativeReads(
        queries=jnp.asarray(q[None], jnp.float32),
        scale=jnp.asarray([scale], jnp.float32),
        window=jnp.asarray([window], jnp.int32),
        positions=jnp.asarray(q_pos, jnp.int32),
        valid=jnp.asarray(q_valid),
        cache=cache,
    )
    error = jit(objective.attention_error, static_argnames=("softcap",))
    got = error(reads, jnp.asarray(k_got[None], jnp.float32), jnp.asarray(v_got[None], jnp.float32), softcap=softcap)
    o_got, o_want = (
        numpy_attention(q, a, b, q_pos, k_pos, k_valid, scale, window, softcap) for a, b in ((k_got, v_got), (k, v))
    )
    expected = np.square(o_got - o_want)[q_valid].sum() / np.square(o_want)[q_valid].sum()
    assert expected > 1e-2
    np.testing.assert_allclose(got, [expected], rtol=1e-5)
    same = error(reads, cache.k, cache.v, softcap=softcap)
    np.testing.assert_array_equal(same, [0.0])


def direct_or_replay(mode, source, target, ratio):
    spec = TranslationSpec.build(mode, channels.terminal(4, 4, ratio), 4, 4, sparse_attention=False)
    cfg = mixture_config(spec, source, target, dim=16, heads=2, depth=1, num_experts=1, output_activation="none")
    return KVTranslator(spec, cfg, rngs=nnx.Rngs(0))


frozen_forwards = jit(objective.frozen_forwards, static_argnames=("topk", "reads"))


@pytest.mark.parametrize("mode", ["replay", "direct"])
def test_native_translation_has_no_attention_error(random_pair, mode, monkeypatch):
    """The translation replaced by the target's own K/V (as in test_objective): the term is zero and adds nothing."""
    source, target, source_tok, target_tok = random_pair
    batch = tiny_batch(source_tok, target_tok)
    translator = direct_or_replay(mode, source, target, 0.5)
    frozen = frozen_forwards(source, target, batch, topk=0, reads=True)
    native, layers = frozen[2], np.asarray(translator.spec.target_layers)
    monkeypatch.setattr(
        translator_lib,
        "translate_window",
        lambda *a, **k: (native.k[layers], native.v[layers], {"key": {}, "value": {}}),
    )
    weights = objective.LossWeights(attention=1.0)
    loss, metrics = jit(lambda *a: objective.context_correction(*a, weights))(translator, source, target, batch, frozen)
    assert 0.0 <= float(metrics["attention"]) < 1e-10
    np.testing.assert_allclose(loss, metrics["ce"], rtol=1e-6)


def output_projections(family, model):
    """The torch modules whose inputs are each layer's attention outputs [B, T, H * d]."""
    if family == "gpt2":
        return [block.attn.c_proj for block in model.transformer.h]
    return [layer.self_attn.o_proj for layer in model.model.layers]


@pytest.mark.parametrize(
    "family,variant", [("llama", "llama3_rope"), ("gemma3", "sliding_softcap"), ("gpt2", "inverse_layer_scale")]
)
def test_recorded_queries_reproduce_the_attention_outputs_of_transformers(tmp_path, family, variant):
    """Each layer's recorded queries (q-norm, RoPE at padded positions, scale, sliding window) over transformers' own
    K/V give transformers' attention outputs (the inputs of its output projections) at every valid position."""
    reference = save_tiny(CONFIGS[family][variant](), tmp_path)
    model = load_model(str(tmp_path))[0]
    ids, mask = padded_batch(reference.config.vocab_size)
    outputs = []
    hooks = [
        m.register_forward_pre_hook(lambda _, args: outputs.append(args[0]))
        for m in output_projections(family, reference)
    ]
    _, k, v = run_reference(reference, ids, mask)
    for hook in hooks:
        hook.remove()
    reads = jit(objective.layer_reads)(model, jnp.asarray(ids), jnp.asarray(mask))
    got = jit(objective.read_outputs, static_argnames=("softcap",))(reads, k, v, softcap=model.config.attn_softcap)
    want = torch.stack(outputs).numpy()
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(got)[:, valid], want[:, valid], atol=2e-5, rtol=1e-4)


def test_training_step_with_the_attention_term():
    """A tiny replay run with `loss.attention_weight=1`: the trainer's loss (the one its train step differentiates)
    reports the term, finite and positive for an untrained translator, and the term alone has a non-zero gradient on
    the translator. One program: the train step's own compile would add ~30 s and check nothing more."""
    c = config_lib.tiny(config_lib.base(), "llama", "gemma3")
    c.translator.channels.mode, c.loss.attention_weight = "terminal", 1.0
    pair = load_pair(c)
    mesh = make_mesh(c)
    spec, tcfg = translation(c, resolve_channels(c, pair, None, mesh, None), pair)
    trainer = Trainer(c, pair, spec, tcfg, mesh, total_steps=1)

    @jax.jit
    def attention_and_gradient(params, llm_states, batch):
        loss_fn = trainer._loss(params, llm_states, batch)
        return jax.value_and_grad(lambda p: loss_fn(p)[1]["attention"])(params)

    batch = trainer.place(tiny_batch(pair.source_tokenizer, pair.target_tokenizer), micro=False)
    attention, grads = attention_and_gradient(trainer.state["params"], trainer.llm_states, batch)
    assert np.isfinite(float(attention)) and float(attention) > 0
    assert float(optax.global_norm(grads)) > 0


def test_weights_come_from_the_config_and_old_configs_have_no_attention_term():
    loss = config_lib.base().loss
    assert objective.LossWeights.from_config(loss).attention == 0.0
    loss.attention_weight = 0.5
    assert objective.LossWeights.from_config(loss).attention == 0.5
    del loss["attention_weight"]  # a config saved before the field existed
    assert objective.LossWeights.from_config(loss).attention == 0.0
