"""SwiftKV's single input for new tokens (the self-prediction kind's `new_tokens_from_map`,
`translate/hooks.py:MappedKeyValues`): every token the target reads after a self-prediction cache makes its K/V at
the written layers l >= B from the same per-layer map of its own layer-B state. Checked against a forward written
here in numpy (float64) from the model's weights, against itself token by token (the jitted decode paths), and with
the switch off against the target as it read before; then through training (the maps' gradients) and evaluation
(the answers change, the translation does not)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import perturb, tiny_batch

from mot_jax.evals import synthetic
from mot_jax.evals.methods import Native, Translated
from mot_jax.evals.prompts import Settings
from mot_jax.evals.tasks import evaluate_examples
from mot_jax.models.base import ModelConfig
from mot_jax.models.generation import decode_step, generate_from_cache
from mot_jax.models.hooks import Forward
from mot_jax.models.model_pair import load_pair
from mot_jax.training import objective
from mot_jax.training.config import base, tiny
from mot_jax.translate import kinds, receiver
from mot_jax.translate.hooks import MappedKeyValues
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, mixture_config, translate

BOTTOM = 2  # B: of the tiny qwen2 target's 4 layers


@pytest.fixture(scope="module")
def pair():
    config = base()
    tiny(config, "qwen2", "qwen2")
    return load_pair(config)


def self_prediction(target, mapped: bool, rank=4, seed=1):
    """A self-prediction translator at B=2 with random maps and, with `rank`, a random receiver adapter."""
    layers = target.config.num_layers
    spec = TranslationSpec.build(
        "direct", None, layers, layers, native_bottom=BOTTOM, inputs=("hidden",), outputs="hidden",
        kind="self_prediction",
    )  # fmt: skip
    options = dict(linear_skip=True, output_activation="none", receiver_rank=rank, new_tokens_from_map=mapped)
    translator = KVTranslator(
        spec, mixture_config(spec, target, target, kind="self_prediction", **options), rngs=nnx.Rngs(0)
    )
    perturb(translator, seed=seed, scale=0.05)
    if rank:  # a receiver change that matters (its `up` starts at zero)
        up = translator.receiver_queries.up
        up[...] = 0.3 * jax.random.normal(jax.random.key(seed + 7), up[...].shape)
    return translator


def context_and_prompt(target, batch=2, context=9, prompt=5, room=6, seed=0):
    ids = jax.random.randint(jax.random.key(seed), (batch, context + prompt), 3, target.config.vocab_size)
    return ids[:, :context], ids[:, context:], context + prompt + room


def translated_cache(translator, target, context, capacity):
    mask = jnp.ones(context.shape, bool)
    return translate(translator, None, target, None, None, context, mask, capacity=capacity)[0]


# --- the reference: one forward over the prompt after the cache, in numpy float64 ----------------------------------


def weights(target):
    f64 = lambda a: np.asarray(a[...], np.float64)
    layers, attn, mlp = target.layers, target.layers.self_attn, target.layers.mlp
    w = dict(
        ln1=f64(layers.input_layernorm.scale), ln2=f64(layers.post_attention_layernorm.scale),
        wq=f64(attn.q_proj.kernel), bq=f64(attn.q_proj.bias), wk=f64(attn.k_proj.kernel), bk=f64(attn.k_proj.bias),
        wv=f64(attn.v_proj.kernel), bv=f64(attn.v_proj.bias), wo=f64(attn.o_proj.kernel),
        gate=f64(mlp.gate_proj.kernel), up=f64(mlp.up_proj.kernel), down=f64(mlp.down_proj.kernel),
        norm=f64(target.norm.scale), embed=f64(target.embed_tokens.embedding),
    )  # fmt: skip
    assert attn.o_proj.bias is None and mlp.gate_proj.bias is None  # the tiny qwen2's, as the reference assumes
    return w


def rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def rope(x, positions, cfg: ModelConfig):
    """Rotate-half RoPE of x [B, T, N, d] at positions [B, T]."""
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d)
    angles = positions[..., None] * inv_freq
    cos, sin = (np.concatenate([f(angles)] * 2, -1)[:, :, None] for f in (np.cos, np.sin))
    return x * cos + np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def reference(target, cache, prompt, maps=None, query_change=None):
    """(final-normed hidden states [B, P, D], the prompt's K and V per layer [L, B, P, K, d]) of the target reading
    `prompt` [B, P] after `cache` (every context slot valid). `maps`: (B, key kernels [W, D, D], key biases [W, D],
    value kernels, value biases): layers l >= B make the prompt's K/V from the RMS-normed layer-B state through
    map l - B; None: from each layer's own input. `query_change` [W, D, H * d]: added to layers B.. query kernels."""
    cfg, w = target.config, weights(target)
    H, K, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps
    b, p = prompt.shape
    context = int(cache.index)
    positions = np.broadcast_to(np.arange(context, context + p, dtype=np.float64), (b, p))
    visible = np.concatenate([np.ones((p, context), bool), np.tri(p, dtype=bool)], 1)  # [P, context + P]
    x = w["embed"][np.asarray(prompt)]
    ks, vs = [], []
    for layer in range(cfg.num_layers):
        if layer == (maps[0] if maps else -1):
            state = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)  # the translator's RMS normalisation
        kv_k = kv_v = x
        if maps and layer >= maps[0]:
            slot = layer - maps[0]
            kv_k, kv_v = state @ maps[1][slot] + maps[2][slot], state @ maps[3][slot] + maps[4][slot]
        heads = lambda y, n: y.reshape(b, p, n, d)
        k = rope(heads(rms(kv_k, w["ln1"][layer], eps) @ w["wk"][layer] + w["bk"][layer], K), positions, cfg)
        v = heads(rms(kv_v, w["ln1"][layer], eps) @ w["wv"][layer] + w["bv"][layer], K)
        ks.append(k), vs.append(v)
        wq = w["wq"][layer] + (query_change[layer - BOTTOM] if query_change is not None and layer >= BOTTOM else 0)
        q = rope(heads(rms(x, w["ln1"][layer], eps) @ wq + w["bq"][layer], H), positions, cfg)
        keys = np.concatenate([np.asarray(cache.k[layer, :, :, :context], np.float64).transpose(0, 2, 1, 3), k], 1)
        values = np.concatenate([np.asarray(cache.v[layer, :, :, :context], np.float64).transpose(0, 2, 1, 3), v], 1)
        group = np.arange(H) // (H // K)  # query head h reads KV head h // (H / K)
        scores = np.einsum("bphd,bshd->bhps", q, keys[:, :, group]) * d**-0.5
        scores = np.where(visible, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("bhps,bshd->bphd", probs, values[:, :, group]).reshape(b, p, H * d)
        x = x + out @ w["wo"][layer]
        h = rms(x, w["ln2"][layer], eps)
        gate = h @ w["gate"][layer]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w["up"][layer])) @ w["down"][layer]
    return rms(x, w["norm"], eps), np.stack(ks), np.stack(vs)


def maps_of(translator):
    f64 = lambda a: np.asarray(a[...], np.float64)
    key, value = translator.key_skip, translator.value_skip
    return BOTTOM, f64(key.kernel), f64(key.bias), f64(value.kernel), f64(value.bias)


def prompt_kv(cache, length):
    """The cache's K and V [L, B, P, K, d] at the `length` slots before its index."""
    at = lambda a: np.asarray(a[:, :, :, int(cache.index) - length : int(cache.index)]).transpose(0, 1, 3, 2, 4)
    return at(cache.k), at(cache.v)


# --- the tests -------------------------------------------------------------------------------------------------------


def test_a_prompt_read_with_the_switch_on_is_the_hand_built_forward_and_off_the_target_as_before(pair):
    target = pair.target
    context, prompt, capacity = context_and_prompt(target)
    mapped, plain = self_prediction(target, True), self_prediction(target, False)
    cache = translated_cache(mapped, target, context, capacity)
    change = np.asarray(mapped.receiver_queries.delta(), np.float64)
    for translator, maps in ((mapped, maps_of(mapped)), (plain, None)):
        hidden, after = translator.receiver(target).hidden_states(prompt, cache=cache)
        want, want_k, want_v = reference(target, cache, prompt, maps, change)
        np.testing.assert_allclose(hidden, want, atol=2e-4, rtol=0)
        got_k, got_v = prompt_kv(after, prompt.shape[1])
        np.testing.assert_allclose(got_k, want_k, atol=2e-5, rtol=0)  # what the cache keeps for later tokens
        np.testing.assert_allclose(got_v, want_v, atol=2e-5, rtol=0)
    # the bottom layers' K/V are the target's own either way; the upper ones change with the switch
    _, on = mapped.receiver(target).hidden_states(prompt, cache=cache)
    _, off = plain.receiver(target).hidden_states(prompt, cache=cache)
    on_k, off_k = prompt_kv(on, prompt.shape[1])[0], prompt_kv(off, prompt.shape[1])[0]
    np.testing.assert_array_equal(on_k[:BOTTOM], off_k[:BOTTOM])
    assert np.abs(on_k[BOTTOM:] - off_k[BOTTOM:]).max() > 1e-2
    # off, the reader is the target adapted as before: bit for bit, the switch adds nothing to it
    before = receiver.adapted(target, plain.receiver_queries)
    np.testing.assert_array_equal(
        plain.receiver(target).hidden_states(prompt, cache=cache)[0], before.hidden_states(prompt, cache=cache)[0]
    )
    assert self_prediction(target, False, rank=0).receiver(target) is target


def test_decoding_token_by_token_gives_the_one_shot_forward_and_greedy_generation_follows_it(pair):
    target = pair.target
    context, prompt, capacity = context_and_prompt(target, seed=1)
    translator = self_prediction(target, True)
    reader = translator.receiver(target)
    cache = translated_cache(translator, target, context, capacity)
    one_shot, _ = reader(prompt, cache=cache)
    steps, stepped = [], jax.tree.map(jnp.copy, cache)  # each step donates the cache it extends
    for t in range(prompt.shape[1]):  # the jitted decode step: the layer scan
        logits, stepped = decode_step(reader, prompt[:, t], stepped)
        steps.append(logits)
    np.testing.assert_allclose(jnp.stack(steps, 1), one_shot, atol=1e-4, rtol=0)
    layers, unrolled = reader.layer_params(), cache  # the layers one after another, as generation's loop runs them
    for t in range(prompt.shape[1]):
        logits, unrolled = reader(prompt[:, t : t + 1], cache=unrolled, layers=layers)
        np.testing.assert_allclose(logits[:, 0], one_shot[:, t], atol=1e-4, rtol=0)
    np.testing.assert_allclose(unrolled.k, stepped.k, atol=1e-5, rtol=0)
    # greedy generation (one program, a while loop of unrolled steps) emits the one-shot forward's argmax each step
    question, new = prompt[:, :3], 5
    out = generate_from_cache(reader, cache, question, max_new_tokens=new, eos_ids=())
    forced, _ = reader(jnp.concatenate([question, out[:, :-1]], 1), cache=cache)
    np.testing.assert_array_equal(out, jnp.argmax(forced[:, question.shape[1] - 1 :], -1))
    plain = self_prediction(target, False).receiver(target)
    assert np.abs(np.asarray(plain(prompt, cache=cache)[0] - one_shot)).max() > 1e-2  # the switch matters here


def test_a_forward_with_no_mapped_layer_run_is_the_targets_bit_for_bit(pair):
    """Only the layers from B up change: a reader's run of the bottom layers alone (`Forward.stop`, the translation's
    bottom run) and its first token's own K/V are the target's, while a full forward of one token is not."""
    target = pair.target
    context, _, _ = context_and_prompt(target)
    reader = self_prediction(target, True).receiver(target)
    forward = Forward(context, stop=BOTTOM)
    np.testing.assert_array_equal(reader.run_layers(forward).hidden, target.run_layers(forward).hidden)
    lone = lambda model: model.lone_key_values(context, jnp.zeros(2, jnp.int32), (BOTTOM,))[0]
    assert np.abs(np.asarray(lone(reader)) - np.asarray(lone(target))).max() > 1e-3


def test_the_training_loss_reads_the_prompt_through_the_maps(pair):
    target = pair.target
    batch = jax.tree.map(jnp.asarray, tiny_batch(pair.source_tokenizer, pair.target_tokenizer))
    frozen = objective.frozen_forwards(pair.source, target, batch, topk=0)
    weights = objective.LossWeights(correction=0.0, ce=0.0, distill=1.0, temperature=2.0, hidden=1.0)

    def grads(translator):
        graphdef, params = nnx.split(translator)
        loss = lambda p: objective.context_correction(nnx.merge(graphdef, p), None, target, batch, frozen, weights)
        (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(params)
        return metrics, np.asarray(grad["key_skip"]["kernel"].value)

    on, on_grad = grads(self_prediction(target, True))
    off, off_grad = grads(self_prediction(target, False))
    assert np.isfinite(on_grad).all() and np.abs(on_grad - off_grad).max() > 1e-6
    assert abs(float(on["kl"]) - float(off["kl"])) > 1e-6
    np.testing.assert_array_equal(on["mse_k"], off["mse_k"])  # the context's translation is the same


def test_the_evaluation_answers_through_the_maps_and_translates_with_the_target_itself(pair):
    mapped, plain = self_prediction(pair.target, True), self_prediction(pair.target, False)
    examples = synthetic.examples("extractive_qa", 4, seed=3)
    settings = Settings(batch_size=2, max_new_tokens=6)
    methods = [Native(), Translated("mapped", mapped, "-", 0), Translated("plain", plain, "-", 0)]
    got = evaluate_examples(pair, methods, examples, settings)
    logprobs = lambda rows: np.array([p["logprob"] for p in rows["predictions"]])
    assert np.abs(logprobs(got["mapped"]) - logprobs(got["plain"])).max() > 1e-3
    alone = evaluate_examples(pair, [Native()], examples, settings)
    assert got["native"]["predictions"] == alone["native"]["predictions"]
    # the reader answers; the translation is the target's own (as in training), not the reader's
    method = methods[1]
    readers, _ = method.reader(pair, settings)
    assert isinstance(readers.target.forward_hook, MappedKeyValues) and pair.target.forward_hook is None
    assert method.translating(readers).target is pair.target


def test_the_recipe_turns_the_switch_on_and_saved_runs_read_it_off():
    from mot_jax.training.saved import translator_dict

    assert kinds.get("self_prediction").recipe["translator.new_tokens_from_map"] is True
    assert kinds.get("self_prediction").fields == {"new_tokens_from_map": False}
    saved = dict(source_width=64, target_width=64, window=2, kind="self_prediction", linear_skip=True)
    assert translator_dict(saved)["new_tokens_from_map"] is False  # a run saved before the switch
