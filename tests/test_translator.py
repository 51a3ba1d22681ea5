"""From a source cache to a target cache: replay and direct modes, sparse indices, RoPE un/re-rotation, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from tolerances import assert_float32_close

from mot_jax import sharding
from mot_jax.errors import MotJaxError
from mot_jax.models.base import first_valid_index
from mot_jax.models.decoder import rope_table
from mot_jax.models.gguf import load_tokenizer
from mot_jax.models.hooks import Forward
from mot_jax.models.layers import apply_rope
from mot_jax.models.loading import load_model
from mot_jax.translate import channels
from mot_jax.translate.align import Alignment, identity_alignment
from mot_jax.translate.pipeline import CacheTranslator, source_prefill, translate_jit
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, mixture_config, sparse_indices
from mot_jax.translate.window import window_block

SMALL = dict(dim=32, heads=4, depth=1, num_experts=2, top_k=1)


def batch(vocab, length=10):
    ids = np.random.default_rng(0).integers(3, vocab, size=(2, length))
    mask = np.ones(ids.shape, bool)
    mask[1, 7:] = False
    return jnp.asarray(ids), jnp.asarray(mask)


def make_translator(source, target, mode="replay", channel_map=None, rotary=False, **spec):
    channel_map = channel_map or channels.terminal(source.config.num_layers, target.config.num_layers, 0.67)
    spec = TranslationSpec.build(
        mode, channel_map, source.config.num_layers, target.config.num_layers, rotary=rotary, **spec
    )
    act = "none" if rotary else "gelu"
    return KVTranslator(spec, mixture_config(spec, source, target, output_activation=act, **SMALL), rngs=nnx.Rngs(0))


def run(translator, source, target, ids, mask, alignment=None, **kw):
    source_cache, topk = source_prefill(source, ids, mask, topk=translator.spec.k_attn)
    alignment = alignment or identity_alignment(*ids.shape, np.asarray(mask))
    return translate_jit(translator, source, target, source_cache, alignment, ids, mask, topk, **kw)


def test_sparse_replay_with_every_key_equals_dense_replay(hf_pair):
    source, target, _ = hf_pair
    ids, mask = batch(source.config.vocab_size)
    sparse = make_translator(source, target, k_attn=ids.shape[1], dense_bottom=0)
    dense = make_translator(source, target, sparse_attention=False)
    got, _ = run(sparse, source, target, ids, mask)
    want, _ = run(dense, source, target, ids, mask)
    np.testing.assert_allclose(np.asarray(got.k), np.asarray(want.k), atol=1e-5, rtol=0)


def test_replay_keeps_layers_below_the_window_native_and_caches_own_kv(hf_pair):
    source, target, _ = hf_pair
    ids, mask = batch(source.config.vocab_size)
    translator = make_translator(source, target, channel_map=channels.explicit([1, 2], [1, 2]), sparse_attention=False)
    cache, aux = run(translator, source, target, ids, mask)
    _, native = target(ids, mask)
    assert_float32_close(cache.k[0], native.k[0])
    assert float(jnp.abs(cache.k[2] - native.k[2]).max()) > 1e-4  # above the first window layer it changed
    assert set(aux) == {"key", "value"} and "load_balance_loss" in aux["key"]


def test_direct_cache_holds_the_translation_and_extends(hf_pair):
    source, target, _ = hf_pair
    ids, mask = batch(source.config.vocab_size)
    translator = make_translator(source, target, mode="direct")
    assert translator.spec.target_layers == tuple(range(target.config.num_layers))
    cache, _ = run(translator, source, target, ids, mask, capacity=14)
    assert cache.k.shape[0] == target.config.num_layers and int(cache.index) == ids.shape[1]
    np.testing.assert_array_equal(np.asarray(cache.valid[:, :10]), np.asarray(mask))
    np.testing.assert_array_equal(np.asarray(cache.positions[1, :7]), np.arange(7))
    # the first token attends only to itself: its K/V are the target's own (a native prefill's), the rest translated
    native = target.run_layers(Forward(ids, mask)).cache
    assert_float32_close(cache.k[:, :, :, 0], native.k[:, :, :, 0])
    assert_float32_close(cache.v[:, :, :, 0], native.v[:, :, :, 0])
    assert not np.allclose(np.asarray(cache.k[:, :, :, 1:7]), np.asarray(native.k[:, :, :, 1:7]), atol=1e-3)
    logits, cache = target(jnp.asarray([[5, 6], [7, 8]]), cache=cache)
    np.testing.assert_array_equal(np.asarray(cache.positions[:, 10:12]), [[10, 11], [7, 8]])  # rows continue
    assert bool(jnp.isfinite(logits).all())


def test_sparse_indices_follow_layer_and_token_maps():
    rng = np.random.default_rng(0)
    ls, lt, b, t, s, k = 4, 3, 2, 5, 6, 3
    topk = rng.integers(0, s, size=(ls, b, s, k))
    alignment = Alignment(
        weights=np.zeros((b, t, s), np.float32),
        target_to_source=rng.integers(0, s, size=(b, t)).astype(np.int32),
        source_to_target=rng.integers(0, t, size=(b, s)).astype(np.int32),
    )
    spec = TranslationSpec("replay", (1, 3), (1, 2), layer_map=(0, 1, 3))
    mask = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], bool)  # row 1 left-padded: its first token is at 2
    got = np.asarray(sparse_indices(spec, jnp.asarray(topk), alignment, first_valid_index(jnp.asarray(mask))))
    for j in range(lt):
        for bi in range(b):
            for ti in range(t):
                source_keys = topk[spec.layer_map[j], bi, alignment.target_to_source[bi, ti]]
                np.testing.assert_array_equal(got[j, bi, ti, :k], alignment.source_to_target[bi, source_keys])
                assert got[j, bi, ti, k] == (0, 2)[bi]  # the first token, the target's attention sink


def test_unrotated_window_is_position_free(hf_pair):
    source, _, _ = hf_pair
    ids, mask = batch(source.config.vocab_size)
    cache, _ = source_prefill(source, ids, mask)
    freq = rope_table(source.config)
    layers = (0, 2)
    unrotated = window_block(cache.k, layers, source, cache.positions)
    # rotating back by the positions gives the cached (post-RoPE) keys again
    heads = unrotated.reshape(*unrotated.shape[:3], source.config.num_kv_heads, -1)
    again = jnp.stack([apply_rope(heads[:, :, i], cache.positions, freq[li]) for i, li in enumerate(layers)], 2)
    np.testing.assert_allclose(
        np.asarray(again.reshape(unrotated.shape)), np.asarray(window_block(cache.k, layers)), atol=1e-5
    )


def test_rotary_translation_runs_and_needs_linear_output(hf_pair):
    source, target, _ = hf_pair
    ids, mask = batch(source.config.vocab_size)
    cache, _ = run(make_translator(source, target, rotary=True, sparse_attention=False), source, target, ids, mask)
    assert bool(jnp.isfinite(cache.k).all())
    spec = TranslationSpec.build("replay", channels.explicit([2], [2]), 3, 3, rotary=True)
    with pytest.raises(MotJaxError, match="output_activation='none'"):
        KVTranslator(spec, mixture_config(spec, source, target, **SMALL), rngs=nnx.Rngs(0))


@pytest.mark.devices(4)
def test_sharded_translation_equals_unsharded(hf_pair):
    source, target, _ = hf_pair
    ids, mask = batch(source.config.vocab_size)
    ids, mask = jnp.concatenate([ids, ids]), jnp.concatenate([mask, mask])  # batch 4 over data=2
    translator = make_translator(source, target, mode="direct")
    alignment = identity_alignment(*ids.shape, np.asarray(mask))
    step = nnx.jit(lambda tr, s, t, ids, mask, al: run(tr, s, t, ids, mask, al)[0].k)
    want = step(translator, source, target, ids, mask, alignment)
    mesh = sharding.make_mesh(data=2, expert=2, devices=jax.devices()[:4])
    sharded = sharding.shard(make_translator(source, target, mode="direct"), mesh)
    fsdp_target = sharding.shard(nnx.clone(target), mesh, sharding.FSDP_RULES)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, sharding.spec(("batch",))))  # rows over `data`
    got = step(sharded, source, fsdp_target, put(ids), put(mask), alignment)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_clear_errors(hf_pair):
    source, target, _ = hf_pair
    with pytest.raises(MotJaxError, match="layer 5"):
        TranslationSpec.build("replay", channels.explicit([1, 5], [1, 2]), 3, 3)
    with pytest.raises(MotJaxError, match="mode"):
        TranslationSpec.build("telepathy", channels.explicit([1], [1]), 3, 3)
    translator = make_translator(source, target)
    ct = CacheTranslator(source, target, None, None, translator)
    ids, mask = batch(source.config.vocab_size)
    cache, _ = source_prefill(source, ids, mask)
    with pytest.raises(MotJaxError, match="one target context per source sequence"):
        ct.from_source_cache(cache, identity_alignment(1, 10), ids[:1], mask[:1])
    with pytest.raises(MotJaxError, match="non-empty"):
        ct.from_text(["a passage", "   "])


@pytest.fixture(scope="module")
def real_pair():
    return load_model("smollm2-135m")[0], load_model("gemma3-270m")[0]


@pytest.mark.slow  # the real models
@pytest.mark.parametrize("mode", ["replay", "direct"])
def test_cache_translator_on_the_offline_pair(real_pair, mode):
    """Text in, a target cache out, on the real heterogeneous pair (other depth, width, heads, tokenizer)."""
    source, target = real_pair
    translator = make_translator(source, target, mode=mode, channel_map=channels.terminal(30, 18, 0.3), k_attn=8)
    ct = CacheTranslator(source, target, load_tokenizer("smollm2-135m"), load_tokenizer("gemma3-270m"), translator)
    cache, ids, mask = ct.from_text(["Ada lives in Paris.", "The river Thames flows through London."], capacity=24)
    assert cache.k.shape == (18, 2, 1, 24, 256) and int(cache.index) == ids.shape[1]
    np.testing.assert_array_equal(np.asarray(cache.valid[:, : ids.shape[1]]), mask)
    logits, _ = target(jnp.asarray([[107, 108], [107, 108]]), cache=cache)
    assert bool(jnp.isfinite(logits).all())
    if mode == "replay":  # the dense bottom layers are the target's own reading of the context
        _, native = target(jnp.asarray(ids), jnp.asarray(mask))
        valid = np.asarray(mask)
        exact = min(translator.spec.dense_bottom, min(translator.spec.target_layers))
        below = np.asarray(cache.k[:exact])[:, :, :, : ids.shape[1]]
        np.testing.assert_allclose(
            below.transpose(1, 3, 0, 2, 4)[valid],
            np.asarray(native.k[: below.shape[0]]).transpose(1, 3, 0, 2, 4)[valid],
            atol=2e-4,
        )
