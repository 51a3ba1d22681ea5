"""Cross-tokenizer alignment: the vectorised, batched path against the per-token reference on real tokenizers."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mot_jax.errors import MotJaxError
from mot_jax.models.gguf import load_tokenizer
from mot_jax.translate.align import (
    Alignment,
    adapter,
    align,
    align_batch,
    align_by_spans,
    encode_texts,
    identity_alignment,
    register_pytree,
    resample,
    same_tokenizer,
    token_spans,
)
from mot_jax.translate.align_reference import (
    reference_alignment,
    reference_overlap,
    reference_token_spans,
    synthetic_text,
)

TEXTS = [
    "Hello wörld  日本 😀\n\nx<eos>y and <|endoftext|> too </s>",
    "Café naïve résumé — “quoted” façade über straße\tTab\n   three spaces",
    "東京で翻訳🚀👍🏽 模型 한국어 mixed with English words and numbers 3.14, 1,000",
    "   leading spaces and trailing   \n",
    "a\n\n\nb    c",
]


def local_bpe(decoder=None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoder or decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([synthetic_text(5000, i) for i in range(4)], trainer)
    return tok


@pytest.fixture(scope="module")
def toks():
    return dict(gemma=load_tokenizer("gemma3-270m"), smol=load_tokenizer("smollm2-135m"), bpe=local_bpe())


def encode(tok, text):
    return adapter(tok).encode(text)[0]


def variants(tok, bos, text):
    """Target id rows for one text: canonical, with a BOS, split into separately encoded pieces, and sliced."""
    ids = encode(tok, text)
    cuts = [0, 3, len(text) // 2 + 1, len(text) - 2, len(text)]
    pieces = [i for a, b in zip(cuts, cuts[1:]) for i in encode(tok, text[a:b])]
    return dict(canonical=ids, bos=[bos] + ids, pieces=pieces, sliced=ids[1:-1])


PAIRS = [("gemma", "smol", 2), ("smol", "gemma", 0), ("bpe", "gemma", 0), ("gemma", "bpe", 2)]


def check_row(alignment: Alignment, b, source_ids, source_mask, expected):
    ref_source, ref_weights, ref_t2s, ref_s2t = expected
    keep = np.asarray(source_mask[b])
    assert np.asarray(source_ids[b])[keep].tolist() == ref_source
    assert not np.asarray(source_ids[b])[~keep].any()
    return ref_weights, ref_t2s, ref_s2t


@pytest.mark.parametrize("target,source,bos", PAIRS)
def test_matches_reference(toks, target, source, bos):
    tgt, src = toks[target], toks[source]
    fallbacks = 0
    lead = adapter(tgt).leading_specials()
    for text in TEXTS:
        for name, ids in variants(tgt, bos, text).items():
            decoded = adapter(tgt).decode(ids)
            fallbacks += encode(tgt, decoded) != ids
            assert token_spans(tgt, decoded, ids).tolist() == [
                list(s) for s in reference_token_spans(tgt, decoded, ids)
            ]
            source_ids, source_mask, got = align_batch(tgt, src, np.array([ids]), np.ones((1, len(ids)), bool))
            if name == "bos" and lead == [bos]:
                # deliberate change: the source does not read the target's BOS as text ("<bos>"); the reference's
                # rule on the rest of the text, with the BOS as a zero-width span at its start
                text_after = adapter(tgt).decode(ids[1:])
                ref_source = adapter(src).encode(text_after)[0]
                weights, t2s, s2t = reference_overlap(
                    [(0, 0), *reference_token_spans(tgt, text_after, ids[1:])],
                    reference_token_spans(src, text_after, ref_source),
                )
            else:
                ref_source, weights, t2s, s2t = reference_alignment(tgt, src, ids)
            assert source_ids[0].tolist() == ref_source and source_mask.all()
            np.testing.assert_allclose(got.weights[0], np.array(weights), atol=1e-6)
            assert got.target_to_source[0].tolist() == t2s
            assert got.source_to_target[0].tolist() == s2t
            assert got.weights.dtype == np.float32 and got.target_to_source.dtype == np.int32
            np.testing.assert_allclose(got.weights.sum(-1), 1, atol=1e-6)
    assert fallbacks  # the prefix-decoding fallback was exercised


def test_bos_and_eos_strings_reproduce(toks):
    """Gemma's decoded "<bos>" and an "<eos>" in the text re-encode to the same ids: offsets, no fallback."""
    gemma = toks["gemma"]
    ids = [2] + encode(gemma, "x<eos>y")
    assert 1 in ids and encode(gemma, adapter(gemma).decode(ids)) == ids
    assert token_spans(gemma, "<bos>x<eos>y", ids).tolist() == [[0, 5], [5, 6], [6, 11], [11, 12]]


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_rows(toks, side):
    tgt, src = toks["gemma"], toks["smol"]
    rows = [[2] + encode(tgt, t) for t in TEXTS] + [variants(tgt, 2, TEXTS[2])["sliced"]]
    length = max(map(len, rows)) + 2
    ids, mask = np.full((len(rows), length), 7), np.zeros((len(rows), length), bool)
    for b, row in enumerate(rows):
        span = slice(length - len(row), length) if side == "left" else slice(0, len(row))
        ids[b, span], mask[b, span] = row, True
    source_ids, source_mask, got = align_batch(tgt, src, ids, mask)
    assert got.weights.shape == (len(rows), length, source_ids.shape[1])
    for b, row in enumerate(rows):
        one_ids, _, one = align_batch(tgt, src, np.array([row]), np.ones((1, len(row)), bool))
        n = one_ids.shape[1]
        assert source_ids[b, :n].tolist() == one_ids[0].tolist() and source_mask[b].sum() == n
        np.testing.assert_array_equal(got.weights[b][mask[b]][:, :n], one.weights[0])
        assert not got.weights[b][~mask[b]].any() and not got.weights[b][:, n:].any()
        assert got.target_to_source[b][mask[b]].tolist() == one.target_to_source[0].tolist()
        assert got.source_to_target[b, :n].tolist() == np.flatnonzero(mask[b])[one.source_to_target[0]].tolist()
    np.testing.assert_allclose(got.weights.sum(-1), mask, atol=1e-6)
    # a fixed source length pads further; too short names the row
    assert (
        align_batch(tgt, src, ids, mask, source_length=source_ids.shape[1] + 3)[0].shape[1] == source_ids.shape[1] + 3
    )
    with pytest.raises(MotJaxError, match=r"Row \d+ re-encodes to \d+ source tokens"):
        align_batch(tgt, src, ids, mask, source_length=5)


def test_identity(toks):
    smol = toks["smol"]
    ids = np.array([[0, 0] + encode(smol, "a b c"), encode(smol, "a b c d e")])
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], bool)
    source_ids, source_mask, got = align_batch(smol, smol, ids, mask)
    assert (source_ids == ids).all() and (source_mask == mask).all()
    np.testing.assert_array_equal(got.weights, np.eye(5) * mask[:, :, None])
    assert got.target_to_source.tolist() == [[0, 0, 2, 3, 4], list(range(5))] == got.source_to_target.tolist()
    # another object with the same ids (transformers' wrapper around the same tokenizer): identity too
    wrapped = align_batch(PreTrainedTokenizerFast(tokenizer_object=smol), smol, ids, mask, source_length=7)
    assert wrapped[0].shape == (2, 7) and (wrapped[0][:, :5] == ids).all() and not wrapped[1][:, 5:].any()
    np.testing.assert_array_equal(wrapped[2].weights[:, :, :5], got.weights)
    with pytest.raises(MotJaxError, match="same-tokenizer path"):
        align_batch(smol, smol, ids, mask, source_length=4)
    plain = identity_alignment(3, 4)
    assert plain.weights.shape == (3, 4, 4) and (plain.weights == np.eye(4)).all()
    assert (plain.source_to_target == np.arange(4)).all()


def test_same_tokenizer_is_detected_by_content_and_equals_the_general_path(toks):
    """Two separately loaded copies of one tokenizer (as two models of one family have) take the identity, which is
    what the general span aligner computes for them wherever tokens own their characters (where byte-level BPE splits
    one character over several tokens, the span aligner can only share it out; the identity stays exact); a
    tokenizer that differs in one special token is not the same."""
    first, second = local_bpe(), local_bpe()
    assert first is not second and same_tokenizer(first, second)
    assert not same_tokenizer(first, toks["bpe"].__class__.from_str(first.to_str().replace('"<s>"', '"<S>"')))
    assert not same_tokenizer(first, toks["smol"])
    ascii_texts = [t for t in TEXTS if t.isascii()] + ["The river Vell runs 42 km, from Oskar's mill to the sea."]
    ids, mask = encode_texts(first, ascii_texts)
    identity = align_batch(first, second, ids, mask)
    general = align_by_spans(first, second, ids, mask)
    for got, want in zip(identity[:2], general[:2], strict=True):
        np.testing.assert_array_equal(got, want)
    for field in ("weights", "target_to_source", "source_to_target"):
        np.testing.assert_array_equal(getattr(identity[2], field), getattr(general[2], field))


def test_transformers_tokenizer_matches_tokenizers(toks):
    tgt, src = toks["smol"], toks["bpe"]
    ids = variants(tgt, 0, TEXTS[0])["pieces"]
    batch = (np.array([ids]), np.ones((1, len(ids)), bool))
    plain = align_batch(tgt, src, *batch)
    wrapped = align_batch(
        PreTrainedTokenizerFast(tokenizer_object=tgt), PreTrainedTokenizerFast(tokenizer_object=src), *batch
    )
    assert (plain[0] == wrapped[0]).all()
    np.testing.assert_array_equal(plain[2].weights, wrapped[2].weights)


def test_special_tokens_missing_from_reencode():
    """A special token that decodes to nothing gets a zero-width span; the rest keep the fast offsets."""
    tok = local_bpe(decoders.Sequence([decoders.Replace("<s>", ""), decoders.ByteLevel()]))
    bos = tok.token_to_id("<s>")
    text = "Café 日本 ok"
    ids = [bos] + encode(tok, text) + [bos]
    assert adapter(tok).decode(ids) == text
    spans = token_spans(tok, text, ids)
    offsets = tok.encode(text, add_special_tokens=False).offsets
    assert spans[0].tolist() == [0, 0] and spans[-1].tolist() == [len(text)] * 2
    assert spans[1:-1].tolist() == [list(o) for o in offsets]


def test_align_spans_by_hand():
    # target: "ab" (0,2), zero-width (2,2), "cdef" (2,6), padding; source: "abc" (0,3), "de" (3,5), "f" (5,6), padding
    target = np.array([[[0, 2], [2, 2], [2, 6], [9, 9]]])
    source = np.array([[[0, 3], [3, 5], [5, 6], [0, 0]]])
    got = align(target, np.array([[1, 1, 1, 0]], bool), source, np.array([[1, 1, 1, 0]], bool))
    expected = [[1, 0, 0, 0], [1, 0, 0, 0], [1 / 4, 2 / 4, 1 / 4, 0], [0, 0, 0, 0]]
    np.testing.assert_allclose(got.weights[0], expected, rtol=1e-6)
    assert got.target_to_source[0].tolist() == [0, 0, 1, 0]  # zero-width (2,2): nearest centre is "abc" (1.5 vs 4)
    assert got.source_to_target[0].tolist() == [0, 2, 2, 0]
    weights, t2s, s2t = reference_overlap(target[0, :3].tolist(), source[0, :3].tolist())
    np.testing.assert_allclose(got.weights[0, :3, :3], weights, rtol=1e-6)
    assert (t2s, s2t) == (got.target_to_source[0, :3].tolist(), got.source_to_target[0, :3].tolist())
    # a source token overlapping no target falls back to the nearest target centre; ties take the first index
    got = align(
        np.array([[[0, 1], [3, 4]]]), np.ones((1, 2), bool), np.array([[[0, 1], [1, 3], [3, 4]]]), np.ones((1, 3), bool)
    )
    assert got.source_to_target[0].tolist() == [0, 0, 1] and got.target_to_source[0].tolist() == [0, 2]
    register_pytree()
    assert jax.jit(lambda a: a.weights.sum())(got) == 2  # a pytree once registered (translator.py does it)


@pytest.mark.parametrize("seed", range(4))
def test_align_random_spans(seed):
    """Unsorted, overlapping, nested and zero-width spans, padding anywhere: equal to the loops, row by row."""
    rng = np.random.default_rng(seed)
    batch, length, width = 3, 17, 13

    def spans(n):
        begin = rng.integers(0, 30, (batch, n))
        return np.stack([begin, begin + rng.choice([0, 0, 1, 2, 3, 9], (batch, n))], -1)

    target, source = spans(length), spans(width)
    tv, sv = rng.random((batch, length)) < 0.8, rng.random((batch, width)) < 0.8
    if seed == 0:  # sorted, contiguous spans as tokenizers give them
        target, source = np.sort(target.reshape(batch, -1), 1).reshape(target.shape), source.cumsum(1)
    got = align(target, tv, source, sv)
    for b in range(batch):
        t_index, s_index = np.flatnonzero(tv[b]), np.flatnonzero(sv[b])
        weights, t2s, s2t = reference_overlap(target[b, t_index].tolist(), source[b, s_index].tolist())
        np.testing.assert_allclose(got.weights[b][np.ix_(t_index, s_index)], weights, rtol=1e-6)
        assert got.target_to_source[b, t_index].tolist() == s_index[t2s].tolist()
        assert got.source_to_target[b, s_index].tolist() == t_index[s2t].tolist()
    assert not got.weights[~tv].any() and not got.weights.transpose(0, 2, 1)[~sv].any()
    assert not got.target_to_source[~tv].any() and not got.source_to_target[~sv].any()


def test_resample_matches_loop():
    rng = np.random.default_rng(0)
    weights = rng.random((2, 5, 7)).astype(np.float32)
    block = rng.standard_normal((2, 7, 3, 4)).astype(np.float32)
    expected = np.zeros((2, 5, 3, 4), np.float32)
    for b in range(2):
        for t in range(5):
            for s in range(7):
                expected[b, t] += weights[b, t, s] * block[b, s]
    np.testing.assert_allclose(resample(block, weights), expected, rtol=1e-5, atol=1e-6)
    got = resample(block.astype(jax.numpy.bfloat16), weights)
    assert got.dtype == jax.numpy.bfloat16 and got.shape == (2, 5, 3, 4)


def test_bad_input(toks):
    gemma, smol = toks["gemma"], toks["smol"]
    with pytest.raises(MotJaxError, match="ids .* and mask .* differ"):
        align_batch(gemma, smol, np.ones((2, 5), int), np.ones((3, 5), bool))
    with pytest.raises(MotJaxError, match="Row 1 has no valid target token"):
        align_batch(gemma, smol, np.ones((2, 3), int), np.array([[1, 1, 1], [0, 0, 0]], bool))
    with pytest.raises(MotJaxError, match="Target batch 2 and source batch 3 differ"):
        align(np.zeros((2, 4, 2)), np.ones((2, 4), bool), np.zeros((3, 4, 2)), np.ones((3, 4), bool))
    with pytest.raises(MotJaxError, match="Row 0 has target tokens but no source token"):
        align(np.zeros((1, 4, 2)), np.ones((1, 4), bool), np.zeros((1, 4, 2)), np.zeros((1, 4), bool))
    with pytest.raises(MotJaxError, match="tokenizers.Tokenizer or a transformers fast tokenizer"):
        align_batch(object(), smol, np.ones((1, 3), int), np.ones((1, 3), bool))
