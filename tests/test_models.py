"""Every family against transformers (PyTorch) on tiny random checkpoints: logits, every layer's K/V, decoding."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_reference import CONFIGS, padded_batch, positions_for, run_reference, save_tiny

from mot_jax.models.cache import stack_rows
from mot_jax.models.generation import (
    LINE_BREAK,
    LINE_TEXT,
    TEXT_BEFORE_BREAK,
    decode_step,
    generate,
    generate_from_cache,
    greedy_continue,
    prefill,
)
from mot_jax.models.loading import load_model
from mot_jax.models.registry import hf_state_dict

VARIANTS = [(family, name) for family, variants in CONFIGS.items() for name in variants]
ATOL = 1e-4


@pytest.fixture(scope="module", params=VARIANTS, ids=[f"{f}-{n}" for f, n in VARIANTS])
def pair(request, tmp_path_factory):
    """(transformers model, our model loaded from its save_pretrained directory, directory)."""
    family, name = request.param
    path = tmp_path_factory.mktemp(f"{family}-{name}")
    reference = save_tiny(CONFIGS[family][name](), path)
    model, _ = load_model(str(path))
    return reference, model, path


def test_logits_and_kv_match_transformers_on_padded_batch(pair):
    reference, model, _ = pair
    ids, mask = padded_batch(model.config.vocab_size)
    want_logits, want_k, want_v = run_reference(reference, ids, mask)
    logits, cache = model(jnp.asarray(ids), jnp.asarray(mask))
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(logits)[valid], want_logits[valid], atol=ATOL, rtol=0)
    # cache [L, B, K, S, d] -> [B, S, L, K, d] so the padding mask selects real tokens
    to_tokens = lambda a: np.asarray(a).transpose(1, 3, 0, 2, 4)[valid]
    np.testing.assert_allclose(to_tokens(cache.k), to_tokens(want_k), atol=ATOL, rtol=0)
    np.testing.assert_allclose(to_tokens(cache.v), to_tokens(want_v), atol=ATOL, rtol=0)


def test_token_by_token_decoding_equals_full_forward(pair):
    _, model, _ = pair
    ids, mask = padded_batch(model.config.vocab_size, seed=1)
    mask[2, 9:] = 1  # right padding cannot be followed by more tokens; keep a full and a left-padded row
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    full, _ = model(ids, mask)
    split = 5
    cache = model.init_cache(ids.shape[0], ids.shape[1])
    logits, cache = model(ids[:, :split], mask[:, :split], cache=cache)
    steps = [logits]
    for t in range(split, ids.shape[1]):
        logits, cache = model(ids[:, t : t + 1], mask[:, t : t + 1], cache=cache)
        steps.append(logits)
    valid = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1))[valid], np.asarray(full)[valid], atol=ATOL, rtol=0)


def test_decode_after_right_padded_prefill(pair):
    """A right-padded row continues at its own length: same logits as the unpadded row prefilled alone."""
    _, model, _ = pair
    ids = np.random.default_rng(2).integers(3, model.config.vocab_size, size=(1, 8))
    padded = np.concatenate([ids[:, :6], [[0, 0]]], axis=1)
    padded_mask = np.array([[1] * 6 + [0, 0]])
    cache = model.init_cache(1, 9)
    _, cache = model(jnp.asarray(padded), jnp.asarray(padded_mask), cache=cache)
    step, _ = model(jnp.asarray(ids[:, 6:7]), cache=cache)
    full, _ = model(jnp.asarray(ids[:, :7]))
    np.testing.assert_allclose(np.asarray(step[:, -1]), np.asarray(full[:, -1]), atol=ATOL, rtol=0)


def test_greedy_generation_matches_transformers(pair):
    reference, model, _ = pair
    ids = np.random.default_rng(3).integers(3, model.config.vocab_size, size=(2, 6))
    ours = np.asarray(generate(model, jnp.asarray(ids), max_new_tokens=8, eos_ids=()))
    with torch.no_grad():
        theirs = reference.generate(
            torch.tensor(ids),
            attention_mask=torch.ones(ids.shape, dtype=torch.long),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    np.testing.assert_array_equal(ours, theirs[:, ids.shape[1] :].numpy())
    # Stopping: with end tokens, each row follows the same tokens up to its first and then repeats it; one row
    # stopping, then every row stopping (the loop ends early) at different steps.
    for stops in [(int(ours[0, 2]),), (int(ours[0, 2]), int(ours[1, 4]))]:
        stopped = np.asarray(generate(model, jnp.asarray(ids), max_new_tokens=8, eos_ids=stops))
        for row, full in zip(stopped, ours):
            end = next((i + 1 for i, t in enumerate(full) if t in stops), len(full))
            np.testing.assert_array_equal(row[:end], full[:end])
            assert (row[end:] == full[end - 1]).all()


def test_prefill_then_decode_steps_equal_generate(pair):
    _, model, _ = pair
    ids, mask = padded_batch(model.config.vocab_size, seed=5)  # full, left- and right-padded rows
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    want = np.asarray(generate(model, ids, mask, max_new_tokens=5, eos_ids=()))
    logits, cache = prefill(model, ids, mask, capacity=ids.shape[1] + 5)
    tokens = [jnp.argmax(logits, -1)]
    for _ in range(4):
        logits, cache = decode_step(model, tokens[-1], cache)
        tokens.append(jnp.argmax(logits, -1))
    np.testing.assert_array_equal(np.stack(tokens, 1), want)


class NextToken:
    """A stand-in decoder whose greedy next token is the current one plus one, so every step's token is known;
    `rows` records the batch sizes it was traced with."""

    config = SimpleNamespace(eos_ids=())

    def __init__(self):
        self.rows = []

    def layer_params(self):  # no layers of its own
        return []

    def __call__(self, tokens, cache, layers):
        self.rows.append(tokens.shape[0])
        return jax.nn.one_hot(tokens + 1, 64), cache


def test_decoding_ends_each_row_at_the_end_of_its_first_line_of_text():
    """Rows from tokens 10, 30, 50, 40 count up; flags make 10 a blank line (not an end: no text yet), 13 a break
    after text, 32 a break then text after 30's text, 50 text then a break, and 42 the end token: each row ends
    there and then emits 42; without the flags only the end token ends a row."""
    flags = np.zeros(64, np.int32)
    flags[[10, 13]] = LINE_BREAK
    flags[[11, 12, 30]] = LINE_TEXT
    flags[32] = LINE_BREAK | LINE_TEXT
    flags[50] = LINE_TEXT | LINE_BREAK | TEXT_BEFORE_BREAK
    logits = jax.nn.one_hot(jnp.array([10, 30, 50, 40]), 64)
    decode = lambda lines: np.asarray(greedy_continue(NextToken(), logits, None, 8, (42,), lines))
    np.testing.assert_array_equal(
        decode(jnp.asarray(flags)),
        [[10, 11, 12, 13, 42, 42, 42, 42], [30, 31, 32, 42, 42, 42, 42, 42], [50] + [42] * 7, [40, 41] + [42] * 6],
    )
    counting = [list(range(start, start + 8)) for start in (10, 30, 50)]
    np.testing.assert_array_equal(decode(None), [*counting, [40, 41] + [42] * 6])


def test_decoding_goes_on_with_the_running_rows_alone_once_most_have_ended():
    """20 rows counting up from 20, 21, ..., 39 with end token 42: row r ends after 42 - (20 + r) steps, so after
    a few steps 10 rows run and then fewer than 8; the decoder is traced for 20 rows and for 10, and every row's
    tokens (ended rows repeat 42) are those of counting up, in the batch's row order."""
    model, starts = NextToken(), np.arange(20, 40)
    logits = jax.nn.one_hot(jnp.asarray(starts), 64)
    out = np.asarray(jax.jit(lambda x: greedy_continue(model, x, None, 30, (42,)))(logits))
    want = np.minimum(starts[:, None] + np.arange(30), 42)
    np.testing.assert_array_equal(out, want)
    assert model.rows == [20, 10]


def test_caches_of_different_lengths_decode_as_one_batch_as_they_do_apart(pair):
    """`stack_rows`: a padded 11-token context and a 4-token one, in caches of other capacities (one with a layer
    hiding a slot), read one question and decode together to the tokens each gives on its own."""
    _, model, _ = pair
    rng = np.random.default_rng(6)
    ids, mask = padded_batch(model.config.vocab_size, seed=7)
    _, long = prefill(model, jnp.asarray(ids), jnp.asarray(mask), capacity=ids.shape[1] + 12)
    _, short = prefill(model, jnp.asarray(ids[:, :4]), capacity=20)
    hidden = np.zeros((model.config.num_layers, *short.valid.shape), bool)
    hidden[0, :, 1] = True
    short = short.replace(hidden=jnp.asarray(hidden))
    question = jnp.asarray(rng.integers(3, model.config.vocab_size, size=(ids.shape[0], 3)))
    apart = [generate_from_cache(model, c, question, max_new_tokens=5, eos_ids=()) for c in (long, short)]
    together = generate_from_cache(
        model, stack_rows([long, short]), jnp.tile(question, (2, 1)), max_new_tokens=5, eos_ids=()
    )
    np.testing.assert_array_equal(np.asarray(together), np.concatenate(apart))

    # 18 rows whose end tokens (taken from their endless decoding) end them at different steps: each row's tokens
    # are its endless ones up to its first end token, then that token again, though most rows end early and the
    # rest decode on alone (`greedy_continue` halves the batch)
    caches = stack_rows([long, short] * 3)
    question = jnp.asarray(rng.integers(3, model.config.vocab_size, size=(caches.valid.shape[0], 3)))
    endless = np.asarray(generate_from_cache(model, caches, question, max_new_tokens=9, eos_ids=()))
    eos = tuple(sorted({int(endless[r, 1 + r % 5]) for r in range(0, 18, 2)}))
    want = endless.copy()
    for row in want:
        ends = np.flatnonzero(np.isin(row, eos))
        if len(ends):
            row[ends[0] :] = row[ends[0]]
    assert (np.isin(want, eos).any(1).sum()) > 9  # more than half the rows end early: the batch halves
    ended = generate_from_cache(model, caches, question, max_new_tokens=9, eos_ids=eos)
    np.testing.assert_array_equal(np.asarray(ended), want)


def test_mapping_table_round_trips_the_checkpoint(pair):
    from safetensors.numpy import load_file

    _, model, path = pair
    original = load_file(path / "model.safetensors")
    exported = hf_state_dict(model)
    assert set(exported) == set(original)
    for name, value in original.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


def test_bfloat16_load_stays_close_to_fp32(pair):
    _, model, path = pair
    bf16, _ = load_model(str(path), dtype="bfloat16")
    assert bf16.init_cache(1, 4).k.dtype == jnp.bfloat16
    ids = jnp.asarray(np.random.default_rng(4).integers(3, model.config.vocab_size, size=(1, 10)))
    want, _ = model(ids)
    got, _ = bf16(ids)
    assert got.dtype == jnp.bfloat16
    scale = float(jnp.abs(want).max())
    assert float(jnp.abs(got.astype(jnp.float32) - want).max()) < 0.05 * scale + 0.05


def test_blocked_prefill_equals_full_attention(pair, monkeypatch):
    """A fresh prefill in causal query blocks (skipping keys after each block) equals attending over all slots."""
    from mot_jax.models import attention
    from mot_jax.models.hooks import Forward
    from mot_jax.translate.hooks import TopKeys

    _, model, _ = pair
    ids, mask = padded_batch(model.config.vocab_size, seed=6)
    forward = Forward(jnp.asarray(ids), jnp.asarray(mask))
    full = model.run_layers(forward, model.init_cache(3, 12), [TopKeys(3)])  # not known fresh
    monkeypatch.setattr(attention, "PREFILL_BLOCK", 5)  # 12 tokens: blocks of 5, 5 and 2 queries
    blocked = model.run_layers(forward, hooks=[TopKeys(3)])
    full, full_topk, blocked, blocked_topk = full.cache, full.records["topk"], blocked.cache, blocked.records["topk"]
    np.testing.assert_allclose(np.asarray(blocked.k), np.asarray(full.k), atol=1e-5, rtol=0)
    valid = np.asarray(mask, bool)
    np.testing.assert_array_equal(np.asarray(blocked_topk)[:, valid], np.asarray(full_topk)[:, valid])


def test_bottom_layers_over_a_context_are_the_full_forwards(pair):
    """`run_bottom`: layers 0..stop-1 hold the full forward's K/V of the context's tokens, those above stay empty,
    and the residual stream after them makes layer stop's K/V as the full forward has them; stop = 0 records the
    context's slots alone."""
    _, model, _ = pair
    ids, mask = padded_batch(model.config.vocab_size, seed=7)
    ids, mask, valid = jnp.asarray(ids), jnp.asarray(mask, bool), mask.astype(bool)
    _, full = model(ids, mask)
    stop = 1
    cache, hidden = model.run_bottom(ids, mask, stop, capacity=16)
    tokens = lambda a: np.asarray(a)[:, :, :, :12].transpose(1, 3, 0, 2, 4)[valid]  # [tokens, L, K, d]
    for got, want in ((cache.k, full.k), (cache.v, full.v)):
        np.testing.assert_allclose(tokens(got)[:, :stop], tokens(want)[:, :stop], atol=1e-5, rtol=0)
        assert not np.asarray(got[stop:]).any() and not np.asarray(got[:, :, :, 12:]).any()
    k, v = model.layer_key_values([stop], hidden[:, :, None], hidden[:, :, None], jnp.asarray(positions_for(mask)))
    np.testing.assert_allclose(np.asarray(k[:, :, 0])[valid], tokens(full.k)[:, stop], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(v[:, :, 0])[valid], tokens(full.v)[:, stop], atol=1e-4, rtol=0)
    slots, none = model.run_bottom(ids, mask, 0, capacity=16)
    assert none is None and not np.asarray(slots.k).any()
    np.testing.assert_array_equal(np.asarray(slots.valid[:, :12]), valid)
    np.testing.assert_array_equal(np.asarray(slots.positions[:, :12])[valid], positions_for(mask)[valid])


def test_a_lone_tokens_key_values_are_a_contexts_first_tokens(pair):
    """A context's first token attends to itself alone, so read alone (`lone_key_values`) it has the K/V the full
    forward gives it, at any index of a padded row."""
    _, model, _ = pair
    ids, mask = padded_batch(model.config.vocab_size, seed=8)
    _, full = model(jnp.asarray(ids), jnp.asarray(mask))
    first = np.argmax(mask, 1)  # row 1 is left-padded: its first token is at 4
    layers = list(range(model.config.num_layers))[::-1]  # any order
    k, v = model.lone_key_values(jnp.asarray(ids), jnp.asarray(first), layers)
    rows = np.arange(len(first))
    for got, want in ((k, full.k), (v, full.v)):
        want = np.asarray(want)[layers][:, rows, :, first]  # [B, W, K, d]
        np.testing.assert_allclose(np.asarray(got)[:, :, :, 0].transpose(1, 0, 2, 3), want, atol=1e-5, rtol=0)


def test_rotating_keys_back_leaves_them_position_free(pair):
    """Keys made at positions p and rotated by -p (`rotate_keys`) are the keys made at position 0, where no rotation
    applies, for every layer (Gemma-3's sliding layers use their own RoPE); a model without RoPE keeps them."""
    _, model, _ = pair
    layers = tuple(range(model.config.num_layers))
    x = jax.random.normal(jax.random.key(0), (2, 6, len(layers), model.config.hidden_size))
    positions = jnp.asarray(np.random.default_rng(9).integers(0, 50, size=(2, 6)))
    k, _ = model.layer_key_values(layers, x, x, positions)
    k0, _ = model.layer_key_values(layers, x, x, jnp.zeros_like(positions))
    np.testing.assert_allclose(
        np.asarray(model.rotate_keys(k, -positions, layers)), np.asarray(k0), atol=1e-5, rtol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(model.rotate_keys(k0, positions, layers)), np.asarray(k), atol=1e-5, rtol=1e-5
    )
    if not model.config.rotary:
        assert model.rotate_keys(k, positions, layers) is k


def test_random_model_takes_a_checkpoint_directorys_shapes_and_tokenizer(tmp_path):
    """`random:DIR`: the shapes of DIR's config.json (every parameter as the real load's), DIR's tokenizer."""
    from mot_jax.models import tiny
    from mot_jax.models.loading import load_tokenizer
    from mot_jax.models.registry import flat_params

    save_tiny(CONFIGS["qwen2"]["untied_sliding"](), tmp_path)
    tiny.tokenizer(97).save(str(tmp_path / "tokenizer.json"))
    real, _ = load_model(str(tmp_path))
    random, _ = load_model(f"random:{tmp_path}")
    shapes = lambda m: {k: v.shape for k, v in flat_params(m).items()}
    assert random.config == real.config and shapes(random) == shapes(real)
    assert not np.allclose(random.embed_tokens.embedding[...], real.embed_tokens.embedding[...])
    assert load_tokenizer(f"random:{tmp_path}").to_str() == tiny.tokenizer(97).to_str()
