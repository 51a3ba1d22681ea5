"""Selective recomputation (`mot_jax.translate.recompute`): the target reruns its layers above the dial's bottom for
chosen tokens of a translated cache. Checked against the target's own prefill: recomputing every token, or a prefix of
tokens (which attend only to each other), gives exactly the native K/V there."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mot_jax.models import tiny
from mot_jax.models.generation import prefill
from mot_jax.translate.recompute import chosen_slots, deviation, recompute, recompute_count

START = 2  # the dial's B: layers 0..1 exact, 2..3 "translated"


@pytest.fixture(scope="module", params=["gemma3", "qwen2"])  # gemma3: sliding windows (32) shorter than the context
def target(request):
    return tiny.load(f"random:{request.param}")[0]


def contexts(target, lengths=(40, 33)):
    """Right-padded random contexts [B, T] with their mask, and the target's native cache of them."""
    width = max(lengths)
    ids = jax.random.randint(jax.random.key(0), (len(lengths), width), 3, target.config.vocab_size)
    mask = np.arange(width)[None] < np.array(lengths)[:, None]
    native = prefill(target, ids, mask, capacity=width + 8)[1]
    return ids, jnp.asarray(mask), native


def translated(target, ids, mask, native):
    """The dial's cache: the target's own bottom START layers, random K/V above (a translation that got all wrong),
    and the residual stream before layer START."""
    cache, hidden = target.run_bottom(ids, mask, START, native.capacity)
    noise = lambda key, kv: kv.at[START:].set(jax.random.normal(key, kv[START:].shape, kv.dtype))
    return cache.replace(k=noise(jax.random.key(1), native.k), v=noise(jax.random.key(2), native.v)), hidden


def context_slots(cache, mask):
    keep = np.asarray(mask)[None, :, None, :, None]
    width = mask.shape[1]
    return [np.where(keep, np.asarray(kv[:, :, :, :width]), 0.0) for kv in (cache.k, cache.v)]


def test_recomputing_every_token_gives_the_native_cache(target):
    ids, mask, native = contexts(target)
    cache, hidden = translated(target, ids, mask, native)
    redone = recompute(target, cache, hidden, ids, mask, fraction=1.0, start=START)
    for got, want in zip(context_slots(redone, mask), context_slots(native, mask)):
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)


def test_a_recomputed_prefix_is_native_and_the_rest_untouched(target):
    """The first n tokens attend only to each other, so rerun alone (the rest translated) they are exactly native."""
    ids, mask, native = contexts(target)
    cache, hidden = translated(target, ids, mask, native)
    n = 12
    slots = jnp.broadcast_to(jnp.arange(n), (ids.shape[0], n))
    redone = target.rerun_slots(hidden[:, :n], slots, cache, START)
    (k, v), (nk, nv), (ck, cv) = (context_slots(c, mask) for c in (redone, native, cache))
    np.testing.assert_allclose(k[:, :, :, :n], nk[:, :, :, :n], atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(v[:, :, :, :n], nv[:, :, :, :n], atol=2e-4, rtol=2e-4)
    np.testing.assert_array_equal(k[:, :, :, n:], ck[:, :, :, n:])
    np.testing.assert_array_equal(v[:, :, :, n:], cv[:, :, :, n:])


def test_the_tokens_chosen_are_those_the_translation_got_wrong(target):
    ids, mask, native = contexts(target)
    _, hidden = translated(target, ids, mask, native)
    wrong = np.array([[5, 17, 30], [1, 9, 32]])  # row 1 holds 33 tokens
    rows = np.arange(2)[:, None]
    k = native.k.at[START, rows, :, wrong].add(1.0)  # [B, 3, K, d] indexed: off at these tokens only
    scores = deviation(target, native.replace(k=k), hidden, mask, START)
    assert np.isneginf(np.asarray(scores)[1, 33:]).all()  # padding is never a token to recompute
    picked = np.sort(np.asarray(chosen_slots(scores, 3, native.capacity)), 1)
    np.testing.assert_array_equal(picked, wrong)
    # more picks than a row has tokens: the rest are dropped (the capacity), never padding slots
    short = np.asarray(chosen_slots(scores[:, :36], 36, native.capacity))[1]
    assert sorted(short[short < native.capacity]) == list(range(33)) and (short == native.capacity).sum() == 3


def test_recompute_count():
    assert recompute_count(0.1, 40) == 4 and recompute_count(0.01, 40) == 1 and recompute_count(1.0, 40) == 40


@pytest.mark.slow  # ~8 s: the user path end to end; the tests above check the computation in the fast subset
def test_the_cache_translator_recomputing_every_token_hands_on_the_native_cache():
    """The user-facing path (`CacheTranslator(..., recompute=share)`) with a random dial translator."""
    from flax import nnx

    from mot_jax.errors import MotJaxError
    from mot_jax.translate.pipeline import CacheTranslator
    from mot_jax.translate.spec import TranslationSpec
    from mot_jax.translate.translator import KVTranslator, mixture_config

    (source, _, source_tok), (target, _, target_tok) = tiny.load("random:llama"), tiny.load("random:gemma3")
    ls, lt = source.config.num_layers, target.config.num_layers
    spec = TranslationSpec.build("direct", None, ls, lt, native_bottom=START, inputs=("source", "hidden"))
    translator = KVTranslator(spec, mixture_config(spec, source, target, dim=8, heads=1, depth=1), rngs=nnx.Rngs(0))
    texts = ["Ada Lovelace lives in Paris, where she keeps a small garden.", "The guild meets on Tuesdays."]
    translated, ids, mask = CacheTranslator(source, target, source_tok, target_tok, translator).from_text(texts, 48)
    ct = CacheTranslator(source, target, source_tok, target_tok, translator, recompute=1.0)
    redone, _, _ = ct.from_text(texts, capacity=48)
    native = prefill(target, ids, mask, capacity=48)[1]
    for got, want, before in zip(*(context_slots(c, mask) for c in (redone, native, translated))):
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)
        assert np.abs(before - want).max() > 1e-2  # the translation alone is not the native cache
    with pytest.raises(MotJaxError, match="Recomputing 1.5 of the context's tokens needs a share in"):
        CacheTranslator(source, target, source_tok, target_tok, translator, recompute=1.5)
