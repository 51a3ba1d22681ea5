"""The translator's hooks on a model's forward (`mot_jax.translate.hooks`): injected K/V, sparse top-k attention, the
source's top-k attention."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_reference import CONFIGS, padded_batch, positions_for, save_tiny
from tolerances import assert_float32_close

from mot_jax.jit import jit
from mot_jax.models.attention import Mask, attend
from mot_jax.models.hooks import Forward
from mot_jax.models.loading import load_model
from mot_jax.translate.hooks import InjectKV, SparseKeys, TopKeys

FAMILIES = [
    ("gpt2", "inverse_layer_scale"),
    ("opt", "post_ln_projected"),
    ("qwen2", "untied_sliding"),
    ("qwen3", "untied_bias_sliding"),
    ("gemma3", "sliding_softcap"),
]


@pytest.fixture(scope="module", params=FAMILIES, ids=[f for f, _ in FAMILIES])
def pair(request, tmp_path_factory):
    family, name = request.param
    path = tmp_path_factory.mktemp(family)
    reference = save_tiny(CONFIGS[family][name](), path)
    return reference, load_model(str(path))[0]


@jit
def run_layers(model, ids, mask, hooks=()):
    """`model.run_layers` as one program (run eagerly, every operation outside its layer scan compiles on its own):
    the cache and the source's top-k keys (None without `TopKeys`)."""
    run = model.run_layers(Forward(ids, mask), hooks=hooks)
    return run.cache, run.records.get("topk")


def native(model):
    ids, mask = padded_batch(model.config.vocab_size)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    cache, topk = run_layers(model, ids, mask, [TopKeys(3)])
    return ids, mask, cache, topk


def window_injection(cache, layers, scale=1.0):
    slot = np.full(cache.k.shape[0], -1, np.int32)
    slot[layers] = np.arange(len(layers))
    return InjectKV(cache.k[np.asarray(layers)] * scale, cache.v[np.asarray(layers)] * scale, slot)


def test_injecting_the_native_kv_reproduces_the_native_cache(pair):
    _, model = pair
    ids, mask, cache, _ = native(model)
    layers = list(range(1, model.config.num_layers))
    replayed, _ = run_layers(model, ids, mask, [window_injection(cache, layers)])
    np.testing.assert_allclose(np.asarray(replayed.k), np.asarray(cache.k), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(replayed.v), np.asarray(cache.v), atol=1e-5, rtol=0)


def test_injection_changes_only_the_layers_above_the_window(pair):
    _, model = pair
    ids, mask, cache, _ = native(model)
    replayed, _ = run_layers(model, ids, mask, [window_injection(cache, [1], scale=2.0)])
    # the window layer still caches its own K/V; the layers above read a changed residual stream
    assert_float32_close(replayed.k[:2], cache.k[:2])  # another program than the native run's
    assert float(jnp.abs(replayed.k[2:] - cache.k[2:]).max()) > 1e-3


def test_sparse_replay_with_every_key_equals_dense_replay(pair):
    _, model = pair
    ids, mask, cache, _ = native(model)
    injection = window_injection(cache, [1], scale=1.5)
    layers, batch, length = model.config.num_layers, *ids.shape
    every_key = jnp.broadcast_to(jnp.arange(length), (layers, batch, length, length))
    dense_cache, _ = run_layers(model, ids, mask, [injection])
    sparse_cache, _ = run_layers(model, ids, mask, [injection, SparseKeys(every_key, jnp.ones(layers, bool))])
    np.testing.assert_allclose(np.asarray(sparse_cache.k), np.asarray(dense_cache.k), atol=1e-5, rtol=0)


def test_top_k_attention_indices_match_transformers_attentions(pair):
    reference, model = pair
    ids, mask = padded_batch(model.config.vocab_size)
    _, _, _, topk = native(model)
    with torch.no_grad():
        out = reference(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions_for(mask)),
            output_attentions=True,
        )
    for layer, probs in enumerate(out.attentions):
        averaged = probs.mean(dim=1).numpy()  # [B, T, S]
        for b, t in zip(*np.nonzero(mask)):
            got = set(np.asarray(topk[layer, b, t]).tolist())
            want = set(np.argsort(-averaged[b, t], kind="stable")[:3].tolist())
            top3 = np.sort(averaged[b, t])[::-1][:4]
            if top3[2] - top3[3] > 1e-6:  # skip exact ties (e.g. three equal zeros)
                assert got == want, (layer, b, t)


def test_query_with_no_allowed_key_attends_to_itself():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(1, 3, 2, 4), (1, 2, 3, 4), (1, 2, 3, 4)])
    pos = jnp.arange(3)[None]
    allowed = jnp.zeros((1, 3, 3), bool).at[0, 2, 0].set(True)  # queries 0 and 1 allowed nothing
    out = np.asarray(attend(q, k, v, Mask(pos, pos, jnp.ones((1, 3), bool), allowed=allowed), scale=1.0))
    own = np.asarray(v).transpose(0, 2, 1, 3)  # [B, S, K, d]: query t alone sees its own value
    np.testing.assert_allclose(out[0, 0].reshape(2, 4), own[0, 0], atol=1e-6)
    np.testing.assert_allclose(out[0, 1].reshape(2, 4), own[0, 1], atol=1e-6)
    np.testing.assert_allclose(out[0, 2].reshape(2, 4), own[0, 0], atol=1e-6)  # query 2 sees key 0 only
