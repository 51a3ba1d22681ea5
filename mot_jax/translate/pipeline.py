"""The end-to-end pipeline from context text to a target cache: the source's side of a batch (`read_source`: the
source re-encodes the text, its tokens are aligned onto the target's, it prefills them), the jitted translation
(`translate_jit`), and `CacheTranslator`, the user-facing object that starts from text or a source cache.
Evaluation shares `read_source` and `translate_jit`.
"""

from __future__ import annotations

import dataclasses
import reprlib

import jax
import jax.numpy as jnp
import numpy as np

from mot_jax.errors import MotJaxError
from mot_jax.jit import jit
from mot_jax.models.base import CausalLM
from mot_jax.models.cache import KVCache
from mot_jax.translate import align as alignment_lib
from mot_jax.translate.recompute import check_share, recompute
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, source_read, translate
from mot_jax.translate.window import target_side


@jit(static_argnames=("topk", "layer_inputs", "last_hidden"))
def source_prefill(source, source_ids, source_mask, *, topk=0, layer_inputs=False, last_hidden=False):
    """`source_read`, jitted: (the source's cache, or its layer inputs or last hidden states in the cache layout; its
    attention top-k)."""
    return source_read(source, source_ids, source_mask, topk, layer_inputs, last_hidden)


@jit(static_argnames=("capacity",))
def translate_jit(
    translator,
    source,
    target,
    source_cache,
    alignment,
    target_ids,
    target_mask,
    source_topk,
    *,
    capacity=None,
    side=None,
):
    """`translate`, jitted: (the target cache, the aux outputs); `side`: the context's `TargetSide` when the caller
    has it."""
    args = (source_cache, alignment, target_ids, target_mask, source_topk, capacity)
    return translate(translator, source, target, *args, side=side)


@jit(static_argnames=("native_bottom", "capacity"))
def bottom_run_jit(target, target_ids, target_mask, *, native_bottom, capacity):
    """`CausalLM.run_bottom` into an empty cache of `capacity` slots, jitted: the target's own bottom layers over the
    context."""
    return target.run_bottom(target_ids, target_mask.astype(bool), native_bottom, capacity)


@jit(static_argnames=("spec", "capacity"))
def target_side_jit(target, target_ids, target_mask, bottom=None, *, spec, capacity):
    """`target_side`, jitted: what `translate` reads of the target over the context (from `bottom_run_jit`'s
    `bottom` when the caller has it)."""
    return target_side(spec, target, target_ids, target_mask, capacity, bottom)


def runs_source(spec: TranslationSpec) -> bool:
    """Whether translating needs the source to read the context: for its K/V (`reads_source`) or, in sparse replay,
    for its attention. The source-free control runs no source at all, so none of it can leak in."""
    return spec.reads_source or bool(spec.attention_topk)


@dataclasses.dataclass
class SourceRead:
    """The source's side of a batch of target contexts (`read_source`): what `translate` takes from the source."""

    ids: np.ndarray  # [B, S] the source's tokens of the contexts' text, right-padded
    mask: np.ndarray  # [B, S]
    alignment: alignment_lib.Alignment  # the source tokens onto the target grid
    # the source's prefill of `ids` (kind='mot_h': its layer inputs; kind='interlat': its last hidden states); None:
    # no source
    cache: KVCache | None = None
    topk: jax.Array | None = None  # its attention's top-k key indices [Ls, B, S, k] for sparse replay, else None

    def take(self, rows) -> SourceRead:
        """The read of rows `rows` [b] of the batch, in that order."""
        a = self.alignment
        return SourceRead(
            self.ids[rows],
            self.mask[rows],
            alignment_lib.Alignment(a.weights[rows], a.target_to_source[rows], a.source_to_target[rows]),
            None if self.cache is None else self.cache.take_rows(jnp.asarray(rows)),
            None if self.topk is None else jnp.take(self.topk, jnp.asarray(rows), 1),
        )


def read_source(
    spec: TranslationSpec, source: CausalLM, source_tokenizer, target_tokenizer, target_ids, target_mask, bucket=None
) -> SourceRead:
    """The source's side of a batch of right-padded target contexts: the source re-encodes their text (as the target
    tokenizer decodes it), its tokens are aligned onto the target's, and it prefills them (with its attention's top-k
    keys for sparse replay) unless `runs_source(spec)` says the translator needs nothing of it. `bucket` pads the
    source tokens to a multiple of it, so that jitted programs compile once per bucket rather than per batch."""
    source_ids, source_mask, alignment = alignment_lib.align_batch(
        target_tokenizer, source_tokenizer, np.asarray(target_ids), np.asarray(target_mask)
    )
    if not runs_source(spec):
        return SourceRead(source_ids, source_mask, alignment)
    longest = int(source_mask.sum(1).max())
    if longest > source.config.max_positions:
        raise MotJaxError(
            f"A context re-encodes to {longest} source tokens, more than the source model's "
            f"{source.config.max_positions}; shorten it (in evaluation: lower the context budget, --config.budgets)."
        )
    if bucket:
        length = -(-source_ids.shape[1] // bucket) * bucket
        source_ids, source_mask, alignment = alignment_lib.pad_source(source_ids, source_mask, alignment, length)
    flags = dict(topk=spec.attention_topk, **spec.source_hands)
    cache, topk = source_prefill(source, source_ids, source_mask, **flags)
    return SourceRead(source_ids, source_mask, alignment, cache, topk)


def check_capacity(capacity, tokens: int) -> None:
    """`capacity` (None: the context's length) must be a whole number of cache slots that holds the `tokens`."""
    whole = isinstance(capacity, int | np.integer) and not isinstance(capacity, bool)
    if capacity is not None and (not whole or capacity < tokens):
        raise MotJaxError(
            f"capacity={capacity!r} cannot hold the context's {tokens} tokens; pass a whole number of cache slots "
            f">= {tokens} (the context, plus room for what follows it), or None for the context alone."
        )


class CacheTranslator:
    """Turns source text (or a source cache) into a target cache ready for the target's generation, for a batch.

    ct = CacheTranslator(source, target, source_tokenizer, target_tokenizer, translator)
    cache, ids, mask = ct.from_text(["passage one ...", "passage two ..."], capacity=T + suffix)
    logits, cache = ct.reader(suffix_ids, suffix_mask, cache=cache)

    `reader` is the target as it reads after the translated cache (`KVTranslator.receiver`): the target itself, or for
    a translator trained with `receiver_rank` the target with its adapted query projections
    (`mot_jax.translate.receiver`), and for a self-prediction translator with `new_tokens_from_map` the target making
    every new token's upper K/V from its own layer-B state (`mot_jax.translate.hooks.MappedKeyValues`).

    `recompute`: the share of context tokens whose K/V the target recomputes above a dial translator's exact bottom
    (`mot_jax.translate.recompute`; 0: none).
    """

    def __init__(
        self, source, target, source_tokenizer, target_tokenizer, translator: KVTranslator, recompute: float = 0.0
    ):
        if recompute:
            check_share(translator, recompute, "the context")
        self.source, self.target, self.translator, self.recompute = source, target, translator, recompute
        self.source_tokenizer, self.target_tokenizer = source_tokenizer, target_tokenizer
        self.reader = translator.receiver(target)

    def from_text(self, texts, capacity=None):
        """(target cache, target ids [B, T], target mask [B, T]) for a batch of context texts."""
        if not isinstance(texts, list | tuple) or not all(isinstance(t, str) for t in texts):
            raise MotJaxError(
                f"texts={reprlib.repr(texts)} is not a list of strings; pass a list of context texts ([text] for one)."
            )
        if not texts or any(not t.strip() for t in texts):
            raise MotJaxError("Every context text must be non-empty; drop empty examples before translating.")
        ids, mask = alignment_lib.encode_texts(self.target_tokenizer, texts)
        return self.from_target_ids(ids, mask, capacity), ids, mask

    def from_target_ids(self, target_ids, target_mask, capacity=None):
        """The target cache of a padded batch of target-tokenized contexts (the source reads the same text)."""
        read = read_source(
            self.translator.spec, self.source, self.source_tokenizer, self.target_tokenizer, target_ids, target_mask
        )
        return self.from_source_cache(read.cache, read.alignment, target_ids, target_mask, read.topk, capacity)

    def from_source_cache(self, source_cache, alignment, target_ids, target_mask, source_topk=None, capacity=None):
        """The target cache of a padded batch of target contexts from the source's cache of the same text (None for
        a translator that reads no source), its alignment onto the target tokens and, for sparse replay, its
        attention's top-k keys."""
        if source_cache is not None and source_cache.k.shape[1] != np.shape(target_ids)[0]:
            raise MotJaxError(
                f"The source cache holds {source_cache.k.shape[1]} sequences but {np.shape(target_ids)[0]} target "
                "contexts were given; pass one target context per source sequence."
            )
        ids, mask, side = jnp.asarray(target_ids), jnp.asarray(target_mask), None
        check_capacity(capacity, ids.shape[1])
        if self.recompute:  # the target's own bottom once: for the translation and the recomputation
            capacity = capacity or ids.shape[1]
            bottom = bottom_run_jit(
                self.target, ids, mask, native_bottom=self.translator.spec.native_bottom, capacity=capacity
            )
            side = target_side_jit(self.target, ids, mask, bottom, spec=self.translator.spec, capacity=capacity)
        args = (self.translator, self.source, self.target, source_cache, alignment, ids, mask, source_topk)
        cache, _ = translate_jit(*args, capacity=capacity, side=side)
        if self.recompute:
            start = self.translator.spec.native_bottom
            cache = recompute(self.target, cache, bottom[1], ids, mask, fraction=self.recompute, start=start)
        return cache
