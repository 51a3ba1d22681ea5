"""The README's Python API for a trained workdir ("A trained translator in Python"): its lines run as written on the
shared tiny trained run, and what they return equals computations that do not go through them."""

import dataclasses
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerances import assert_float32_close

from mot_jax.errors import MotJaxError
from mot_jax.jit import jit
from mot_jax.models import tiny
from mot_jax.models.generation import decode_step, generate, generate_from_cache
from mot_jax.models.loading import load_model
from mot_jax.training import trained as trained_lib
from mot_jax.translate.align import align_batch
from mot_jax.translate.pipeline import CacheTranslator, source_prefill, translate_jit
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, mixture_config

README = Path(__file__).resolve().parent.parent / "README.md"
WORKDIR = '"/tmp/mot_quickstart"'  # the README's workdir, replaced by the tiny run's
NEW_TOKENS = 20  # the README's max_new_tokens


def readme_lines(workdir) -> dict:
    """Run the README section's Python block on `workdir`; its variables."""
    text = README.read_text()
    section = text[text.index("## A trained translator in Python\n") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert code.count(WORKDIR) == 1 and f"max_new_tokens={NEW_TOKENS}" in code
    names = {}
    exec(code.replace(WORKDIR, repr(str(workdir))), names)
    return names


@jit
def forward(model, ids, cache):
    """A forward over `ids` after `cache` as one program (run eagerly, each of its operations compiles on its own)."""
    return model(ids, cache=cache)


def greedy_reference(target, cache, question):
    """Greedy tokens of the target reading `question` [1, Q] after `cache`, one forward per token, up to the first
    end-of-sequence token."""
    logits, cache = forward(target, question, cache)
    tokens = [int(jnp.argmax(logits[0, -1]))]
    while len(tokens) < NEW_TOKENS and tokens[-1] not in target.config.eos_ids:
        logits, cache = decode_step(target, jnp.asarray([tokens[-1]], jnp.int32), cache)
        tokens.append(int(jnp.argmax(logits[0])))
    return tokens


def test_readme_lines_translate_a_text_with_the_trained_translator_and_answer_greedily(tiny_run, capsys):
    got = readme_lines(tiny_run[0])
    trained, source, target = got["trained"], got["source"], got["target"]
    assert trained.step == 2 and trained.translator.spec.attention_topk  # the tiny run: sparse replay
    ids, mask, question = got["ids"], got["mask"], jnp.asarray([got["question"]])
    assert ids.shape[1] + question.shape[1] + NEW_TOKENS <= got["cache"].capacity == 128  # the README's room
    # the same cache, step by step: alignment, the source's prefill, the translation
    source_ids, source_mask, alignment = align_batch(got["target_tokenizer"], got["source_tokenizer"], ids, mask)
    source_cache, topk = source_prefill(source, source_ids, source_mask, topk=trained.translator.spec.attention_topk)
    want, _ = translate_jit(trained.translator, source, target, source_cache, alignment, ids, mask, topk, capacity=128)
    cache = got["cache"]
    assert_float32_close(cache.k, want.k)
    assert_float32_close(cache.v, want.v)
    for field in ("positions", "valid", "index"):
        np.testing.assert_array_equal(np.asarray(getattr(cache, field)), np.asarray(getattr(want, field)))
    expected = greedy_reference(target, want, question)
    tokens = np.asarray(got["tokens"])[0].tolist()
    assert len(tokens) == NEW_TOKENS and tokens[: len(expected)] == expected, (tokens, expected)
    assert all(t == expected[-1] for t in tokens[len(expected) :])  # after an end of sequence, it repeats
    assert capsys.readouterr().out == got["target_tokenizer"].decode(tokens) + "\n"


def test_readme_lines_with_every_target_layer_native_answer_as_the_target_reading_the_text(tiny_run, monkeypatch):
    """A translator with native_bottom = all target layers in place of the trained one: the README's answer is the
    target's own greedy answer to the context and question read as one sequence."""
    trained = trained_lib.load_trained(tiny_run[0])
    source, target = (load_model(name)[0] for name in (trained.config.source, trained.config.target))
    layers = target.config.num_layers
    spec = TranslationSpec.build("direct", None, source.config.num_layers, layers, native_bottom=layers)
    translator = KVTranslator(spec, mixture_config(spec, source, target), rngs=nnx.Rngs(0))
    native = dataclasses.replace(trained, translator=translator)
    monkeypatch.setattr(trained_lib, "load_trained", lambda workdir: native)
    got = readme_lines(tiny_run[0])
    assert got["trained"] is native
    full = jnp.concatenate([jnp.asarray(got["ids"]), jnp.asarray([got["question"]])], 1)
    want = generate(got["target"], full, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(np.asarray(got["tokens"]), np.asarray(want))


def test_generating_from_a_cache_without_room_is_refused():
    """A cache with too few free slots would have the question's and answer's keys overwrite its last slots."""
    target, _, _ = tiny.load("random:gemma3")
    context = jnp.ones((1, 6), jnp.int32)
    question = jnp.ones((1, 3), jnp.int32)
    _, cache = forward(target, context, target.init_cache(1, 6 + 3 + 4))
    assert generate_from_cache(target, cache, question, max_new_tokens=4).shape == (1, 4)
    with pytest.raises(MotJaxError, match="has 13 slots but .* need 14; build it with capacity >= 14"):
        generate_from_cache(target, cache, question, max_new_tokens=5)


def test_bad_arguments_of_from_text_are_refused_in_one_line(random_pair):
    """Too small a capacity gave a raw JAX error, -5 or 2.5 a TypeError, [None] an AttributeError; 0 meant None."""
    source, target, source_tokenizer, target_tokenizer = random_pair
    layers = target.config.num_layers
    spec = TranslationSpec.build("direct", None, source.config.num_layers, layers, native_bottom=layers)
    translator = KVTranslator(spec, mixture_config(spec, source, target), rngs=nnx.Rngs(0))
    ct = CacheTranslator(source, target, source_tokenizer, target_tokenizer, translator)
    text = "one two three four five six seven eight"
    tokens = len(target_tokenizer.encode(text).ids)
    for texts, capacity in [([text], tokens - 1), ([text], -5), ([text], 2.5), ([text], 0), ([text], True)]:
        with pytest.raises(MotJaxError, match=rf"capacity={capacity!r} cannot hold the context's {tokens} tokens"):
            ct.from_text(texts, capacity=capacity)
    for texts in ([None], text, None):
        with pytest.raises(MotJaxError, match="is not a list of strings"):
            ct.from_text(texts)
    cache, ids, _ = ct.from_text([text], capacity=np.int64(tokens + 2))
    assert ids.shape == (1, tokens) and cache.capacity == tokens + 2
