"""Cross-tokenizer alignment through character spans (docs/method.md §1.2; reference §1.3 and §1.5), batched.

The target's context ids are decoded to text, that text is re-encoded with the source tokenizer, and both token
sequences get character spans over that one text. `A[t, s]` = characters shared by target token t and source token
s, normalised per target row; a target token sharing no character (zero-width spans included) takes weight 1 on
the valid source token whose span centre is nearest. Source K/V are resampled onto the target grid with
`resample`. Everything after tokenization is vectorised numpy over the padded batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
from functools import cached_property

import numpy as np

from mot_jax.errors import MotJaxError


class TokenizerAdapter:
    """The reference's tokenizer calls for a `tokenizers.Tokenizer` or a transformers fast tokenizer.

    encode: no special tokens added, with character offsets; decode: special tokens kept as their literal strings,
    no clean-up of spaces.
    """

    def __init__(self, tokenizer):
        import tokenizers

        self.tokenizer = tokenizer
        if isinstance(tokenizer, tokenizers.Tokenizer):
            self.backend, self.hf = tokenizer, False
        elif isinstance(getattr(tokenizer, "backend_tokenizer", None), tokenizers.Tokenizer):
            self.backend, self.hf = tokenizer.backend_tokenizer, True
        else:
            raise MotJaxError(
                f"Alignment needs character offsets, which {type(tokenizer).__name__} does not give; pass a "
                "tokenizers.Tokenizer or a transformers fast tokenizer."
            )

    def encode_batch(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        if self.hf:
            out = self.tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
            return [(list(i), [tuple(o) for o in off]) for i, off in zip(out["input_ids"], out["offset_mapping"])]
        return [(e.ids, e.offsets) for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode_batch(self, sequences: list[list[int]]) -> list[str]:
        sequences = [list(map(int, s)) for s in sequences]
        if self.hf:
            return self.tokenizer.batch_decode(sequences, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return self.backend.decode_batch(sequences, skip_special_tokens=False)

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        return self.encode_batch([text])[0]

    def leading_specials(self) -> list[int]:
        """The ids the tokenizer puts before a text's own tokens (e.g. Gemma's BOS; none for GPT-2 or SmolLM2)."""
        plain = self.backend.encode("a", add_special_tokens=False).ids
        full = self.backend.encode("a", add_special_tokens=True).ids
        return full[: full.index(plain[0])] if plain and plain[0] in full else []

    def decode(self, ids) -> str:
        return self.decode_batch([ids])[0]

    @cached_property
    def special_ids(self) -> np.ndarray:
        specials = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        if self.hf:
            specials |= set(self.tokenizer.all_special_ids)
        return np.array(sorted(specials), np.int64)


def adapter(tokenizer) -> TokenizerAdapter:
    return tokenizer if isinstance(tokenizer, TokenizerAdapter) else TokenizerAdapter(tokenizer)


_fingerprints: dict[int, tuple[object, str]] = {}  # id(backend) -> (backend, sha256 of its serialized form)


def _fingerprint(tokenizer) -> str:
    backend = adapter(tokenizer).backend
    if id(backend) not in _fingerprints:  # the backend is kept, so its id is not reused by another object
        _fingerprints[id(backend)] = (backend, hashlib.sha256(backend.to_str().encode()).hexdigest())
    return _fingerprints[id(backend)][1]


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers are one and the same (vocabulary, merges, normalizer, pre-tokenizer, special tokens),
    compared by their serialized form, not by their names: e.g. two models of one family."""
    return a is b or _fingerprint(a) == _fingerprint(b)


# chat formats, by the special token that marks them: (user turn opening, user turn close + assistant turn opening)
CHAT_TURNS = {
    "<|im_start|>": ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"),  # ChatML: SmolLM2, Qwen
    "<start_of_turn>": ("<start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n"),  # Gemma
}


def chat_turns(tokenizer) -> tuple[str, str] | None:
    """The tokenizer's chat format (`CHAT_TURNS`), None when it knows none of them."""
    backend = adapter(tokenizer).backend
    return next((turns for marker, turns in CHAT_TURNS.items() if backend.token_to_id(marker) is not None), None)


def encode_texts(tokenizer, texts):
    """Right-padded target ids [B, T] and mask of texts, with the tokenizer's own special tokens (e.g. a BOS)."""
    encoded = [e.ids for e in adapter(tokenizer).backend.encode_batch(list(texts))]
    ids = np.zeros((len(encoded), max(map(len, encoded))), np.int32)
    mask = np.zeros(ids.shape, bool)
    for row, e in enumerate(encoded):
        ids[row, : len(e)], mask[row, : len(e)] = e, True
    return ids, mask


def _lcp(text: str, text_u32: np.ndarray, prefix: str) -> int:
    """Length of the longest common prefix of `text` and `prefix`."""
    if text.startswith(prefix):
        return len(prefix)
    other = np.frombuffer(prefix.encode("utf-32-le"), "<u4")
    n = min(len(text_u32), len(other))
    diff = np.flatnonzero(text_u32[:n] != other[:n])
    return int(diff[0]) if diff.size else n


def _prefix_spans(tok: TokenizerAdapter, text: str, ids: list[int]) -> np.ndarray:
    """The reference's fallback: e_i = max(e_{i-1}, min(len(text), lcp(text, decode(ids[:i])))), last end stretched."""
    if not ids:
        return np.zeros((0, 2), np.int32)
    prefixes = tok.decode_batch([ids[:i] for i in range(1, len(ids) + 1)])  # quadratic, but in Rust
    text_u32 = np.frombuffer(text.encode("utf-32-le"), "<u4")
    common = np.array([_lcp(text, text_u32, p) for p in prefixes], np.int64)
    ends = np.maximum.accumulate(np.minimum(common, len(text)))
    ends[-1] = len(text)
    return np.stack([np.concatenate([[0], ends[:-1]]), ends], -1).astype(np.int32)


def _spans(tok: TokenizerAdapter, text: str, ids: list[int], encoded: list[int], offsets) -> np.ndarray:
    """Spans of `ids` over `text`, given the re-encode (`encoded`, `offsets`) of `text`."""
    if encoded == ids:
        return np.asarray(offsets, np.int32).reshape(-1, 2)
    ids_array = np.asarray(ids, np.int64)
    special = np.isin(ids_array, tok.special_ids)
    if special.any() and ids_array[~special].tolist() == encoded:
        # only special tokens (e.g. an added BOS) are missing from the re-encode: zero width at the previous end
        spans = np.zeros((len(ids), 2), np.int32)
        spans[~special] = np.asarray(offsets, np.int32).reshape(-1, 2)
        previous_end = np.maximum.accumulate(np.where(special, 0, spans[:, 1]))
        spans[special] = previous_end[special, None]
        return spans
    return _prefix_spans(tok, text, ids)


def token_spans(tokenizer, text: str, ids) -> np.ndarray:
    """[n, 2] int32 character spans of token `ids` over `text`.

    Fast-tokenizer offsets when re-encoding `text` gives `ids` exactly; offsets plus zero-width spans when only
    special tokens are missing from the re-encode; otherwise the reference's prefix-decoding rule.
    """
    tok = adapter(tokenizer)
    ids = np.asarray(ids, np.int64).reshape(-1).tolist()
    return _spans(tok, text, ids, *tok.encode(text))


@dataclasses.dataclass(frozen=True)
class Alignment:
    """Target-grid alignment of one padded batch (a JAX pytree once `register_pytree()` ran, so it can enter jitted
    code; this module itself needs only numpy, so the PyTorch export can align without JAX).

    weights [B, T, S] float32, row-stochastic on valid target rows, zero on padded rows and columns;
    target_to_source [B, T] and source_to_target [B, S] int32 hard maps (0 at padded positions).
    """

    weights: np.ndarray
    target_to_source: np.ndarray
    source_to_target: np.ndarray


def register_pytree():
    """Make `Alignment` a JAX pytree (called by the JAX modules that pass alignments into jitted code)."""
    import jax

    if not getattr(Alignment, "_pytree", False):
        fields = [f.name for f in dataclasses.fields(Alignment)]
        jax.tree_util.register_dataclass(Alignment, data_fields=fields, meta_fields=[])
        Alignment._pytree = True


def _nearest(centres_from: np.ndarray, centres_to: np.ndarray, valid_to: np.ndarray) -> np.ndarray:
    """For each row k, the first valid index j minimising |centres_to[k, j] - centres_from[k]|."""
    distance = np.abs(centres_to - centres_from[:, None])
    return np.where(valid_to, distance, np.iinfo(np.int64).max).argmin(-1)


def _first_max(key: np.ndarray, value: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per distinct `key`, the `index` of the largest `value` (ties: smallest index): (keys, indices)."""
    order = np.lexsort((index, -value, key))
    key, index = key[order], index[order]
    first = np.concatenate([[True], key[1:] != key[:-1]])
    return key[first], index[first]


def _candidates(tb, te, sb, se, sv):
    """(row, target, source) index triples that can share characters: a band of sources per target token.

    Per row, sources are sorted by start (padding last); the band of target t runs from the first source whose
    running-max end passes b_t to the last source starting before e_t. Row offsets turn the batch into one flat
    sorted array, so each bound is one searchsorted.
    """
    batch, length = tb.shape
    width = sb.shape[1]
    top = int(max(te.max(initial=0), se.max(initial=0), sb.max(initial=0))) + 1
    order = np.argsort(np.where(sv, sb, top), axis=1, kind="stable")
    offset = np.arange(batch)[:, None] * (top + 1)
    starts = np.take_along_axis(np.where(sv, sb, top), order, 1) + offset
    ends = np.maximum.accumulate(np.take_along_axis(np.where(sv, se, 0), order, 1), axis=1) + offset
    b = np.repeat(np.arange(batch), length)
    lo = np.searchsorted(ends.ravel(), (tb + offset).ravel(), "right") - b * width
    hi = np.searchsorted(starts.ravel(), (te + offset).ravel(), "left") - b * width
    count = np.maximum(hi - lo, 0)
    entry = np.repeat(np.arange(count.size), count)
    position = lo[entry] + np.arange(entry.size) - (np.cumsum(count) - count)[entry]
    return b[entry], entry % length, order[b[entry], position]


def align(target_spans, target_valid, source_spans, source_valid) -> Alignment:
    """Overlap alignment of padded span batches [B, T, 2] / [B, S, 2] with boolean valid masks [B, T] / [B, S].

    Only pairs that can overlap are visited (a band per target token), so the work is about B * (T + S), plus
    writing the dense weights.
    """
    tv, sv = np.asarray(target_valid, bool), np.asarray(source_valid, bool)
    ts, ss = np.asarray(target_spans, np.int64), np.asarray(source_spans, np.int64)
    if ts.shape[:2] != tv.shape or ss.shape[:2] != sv.shape or ts.shape[2:] != (2,) or ss.shape[2:] != (2,):
        raise MotJaxError(
            f"Spans {ts.shape}/{ss.shape} do not fit masks {tv.shape}/{sv.shape}; pass spans [B, T, 2] and [B, S, 2] "
            "with masks [B, T] and [B, S]."
        )
    if len(ts) != len(ss):
        raise MotJaxError(f"Target batch {len(ts)} and source batch {len(ss)} differ; align rows one to one.")
    lonely = np.flatnonzero(tv.any(1) & ~sv.any(1))
    if lonely.size:
        raise MotJaxError(f"Row {lonely[0]} has target tokens but no source token; give every row a source text.")
    tb, te = np.where(tv, ts[..., 0], 0), np.where(tv, ts[..., 1], 0)
    sb, se = np.where(sv, ss[..., 0], 0), np.where(sv, ss[..., 1], 0)
    if (tb < 0).any() or (sb < 0).any() or (te < tb).any() or (se < sb).any():
        raise MotJaxError("A span starts below 0 or ends before it starts; pass (begin, end) character offsets.")
    batch, length, width = *tv.shape, sv.shape[1]
    b, t, s = _candidates(tb, te, sb, se, sv)  # padded targets are (0, 0): an empty band
    value = np.minimum(te[b, t], se[b, s]) - np.maximum(tb[b, t], sb[b, s])
    keep = value > 0
    b, t, s, value = b[keep], t[keep], s[keep], value[keep]
    tc, sc = tb + te, sb + se  # twice the span centres, exact in integers
    empty = tv.copy()
    empty[b, t] = False
    eb, et = np.nonzero(empty)  # target tokens sharing no character: weight 1 on the nearest source centre
    b, t = np.concatenate([b, eb]), np.concatenate([t, et])
    s = np.concatenate([s, _nearest(tc[eb, et], sc[eb], sv[eb])])
    value = np.concatenate([value, np.ones(eb.size, np.int64)])
    rows = np.bincount(b * length + t, value, batch * length).astype(np.float32).reshape(batch, length)
    weights = np.zeros((batch, length, width), np.float32)
    weights[b, t, s] = value.astype(np.float32) / rows[b, t]
    target_to_source = np.zeros(batch * length, np.int32)
    key, index = _first_max(b * length + t, value, s)
    target_to_source[key] = index
    source_to_target = np.zeros(batch * width, np.int32)
    key, index = _first_max(b * width + s, value, t)
    source_to_target[key] = index
    source_to_target = source_to_target.reshape(batch, width)
    hit = np.zeros(batch * width, bool)
    hit[key] = True
    cb, cs = np.nonzero(sv & ~hit.reshape(batch, width))  # sources no target overlaps: the nearest target centre
    source_to_target[cb, cs] = _nearest(sc[cb, cs], tc[cb], tv[cb])
    return Alignment(weights, target_to_source.reshape(batch, length), source_to_target)


def identity_alignment(batch: int, length: int, mask=None) -> Alignment:
    """Same tokenizer on both sides: identity weights and maps (padded positions zero when `mask` [B, L] is given)."""
    weights = np.broadcast_to(np.eye(length, dtype=np.float32), (batch, length, length))
    index = np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length))
    if mask is not None:
        mask = np.asarray(mask, bool)
        weights, index = weights * mask[:, :, None], np.where(mask, index, 0).astype(np.int32)
    return Alignment(weights, index, index)


def pad_source(source_ids, source_mask, alignment: Alignment, length: int):
    """Right-pad the source side of an aligned batch to `length` tokens (a fixed shape, so jitted code compiles
    once per length bucket); the padding is masked and takes no alignment weight."""
    pad = length - source_ids.shape[1]
    if pad < 0:
        raise MotJaxError(f"The source side holds {source_ids.shape[1]} tokens, more than length={length}.")
    if not pad:
        return source_ids, source_mask, alignment
    widths = ((0, 0), (0, pad))
    return (
        np.pad(source_ids, widths),
        np.pad(source_mask, widths),
        Alignment(
            np.pad(alignment.weights, ((0, 0), (0, 0), (0, pad))),
            alignment.target_to_source,
            np.pad(alignment.source_to_target, widths),
        ),
    )


def _identity_batch(ids: np.ndarray, mask: np.ndarray, source_length: int | None):
    batch, length = ids.shape
    if source_length is not None and source_length < length:
        raise MotJaxError(
            f"The same-tokenizer path keeps the target grid of {length} tokens, more than source_length="
            f"{source_length}; pass source_length >= {length} or None."
        )
    result = identity_alignment(batch, length, mask)
    return pad_source(ids.astype(np.int32), mask, result, source_length or length)


def align_batch(target_tokenizer, source_tokenizer, target_ids, target_mask, source_length: int | None = None):
    """Source ids for a padded batch of target context ids, and the alignment onto the target grid.

    Each row's valid target ids (any padding side) are decoded to text, which is re-encoded by the source tokenizer.
    Returns (source_ids [B, S] int32 right-padded with 0, source_mask [B, S] bool, Alignment [B, T, S]), S being
    `source_length` or the longest row. The same tokenizer (`same_tokenizer`, or one giving the same ids for every
    row) returns the target ids themselves and the identity alignment, which is what the general path computes then.
    """
    ids, mask = np.asarray(target_ids), np.asarray(target_mask, bool)
    if ids.ndim != 2 or mask.shape != ids.shape:
        raise MotJaxError(f"Target ids {ids.shape} and mask {mask.shape} differ; pass both as [batch, length].")
    empty = np.flatnonzero(~mask.any(1))
    if empty.size:
        raise MotJaxError(f"Row {empty[0]} has no valid target token (empty context); drop it or give it text.")
    if source_length is not None and source_length < 1:
        raise MotJaxError(f"source_length={source_length} is not positive; pass a positive length or None.")
    if same_tokenizer(target_tokenizer, source_tokenizer):
        return _identity_batch(ids, mask, source_length)
    return align_by_spans(target_tokenizer, source_tokenizer, ids, mask, source_length, shortcut=True)


def align_by_spans(target_tokenizer, source_tokenizer, ids, mask, source_length=None, shortcut=False):
    """`align_batch`'s general path: the alignment through character spans over the decoded text (with `shortcut`,
    the identity when the source re-encodes every row to the target's own ids)."""
    tgt, src = adapter(target_tokenizer), adapter(source_tokenizer)
    rows = [row[keep].tolist() for row, keep in zip(ids, mask)]
    texts = tgt.decode_batch(rows)
    source = src.encode_batch(texts)
    if shortcut and all(s == r for (s, _), r in zip(source, rows)):
        return _identity_batch(ids, mask, source_length)
    # Another tokenizer must not read the target's BOS as literal text ("<bos>"): the source gets the text after it,
    # and the BOS a zero-width span, so it aligns to the first source token.
    lead = tgt.leading_specials()
    cuts = [len(lead) if lead and r[: len(lead)] == lead else 0 for r in rows]
    if any(cuts):
        texts = tgt.decode_batch([r[c:] for r, c in zip(rows, cuts)])
        source = src.encode_batch(texts)
    lengths = [len(s) for s, _ in source]
    width = max(lengths) if source_length is None else source_length
    for b, n in enumerate(lengths):
        if n == 0:
            raise MotJaxError(f"Row {b} decodes to text that the source tokenizer encodes to no token; drop that row.")
        if n > width:
            raise MotJaxError(
                f"Row {b} re-encodes to {n} source tokens, more than source_length={width}; raise source_length "
                "or shorten the context."
            )
    batch, length = ids.shape
    source_ids, source_mask = np.zeros((batch, width), np.int32), np.zeros((batch, width), bool)
    source_spans, target_spans = np.zeros((batch, width, 2), np.int32), np.zeros((batch, length, 2), np.int32)
    for b, ((s_ids, s_offsets), (t_ids, t_offsets)) in enumerate(zip(source, tgt.encode_batch(texts))):
        n = len(s_ids)
        source_ids[b, :n], source_mask[b, :n] = s_ids, True
        source_spans[b, :n] = np.asarray(s_offsets, np.int32).reshape(-1, 2)
        spans = _spans(tgt, texts[b], rows[b][cuts[b] :], t_ids, t_offsets)
        target_spans[b, mask[b]] = np.concatenate([np.zeros((cuts[b], 2), np.int32), spans])
    return source_ids, source_mask, align(target_spans, mask, source_spans, source_mask)


def resample(block, weights):
    """Source K/V [B, S, ...] onto the target grid [B, T, ...]: einsum('bts,bs...->bt...'), computed in fp32 or
    wider and returned in the block's dtype."""
    import jax.numpy as jnp

    block = jnp.asarray(block)
    dtype = jnp.promote_types(block.dtype, jnp.float32)
    return jnp.einsum("bts,bs...->bt...", jnp.asarray(weights, dtype), block.astype(dtype)).astype(block.dtype)
