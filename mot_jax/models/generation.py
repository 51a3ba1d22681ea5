"""Generation: prefill into a preallocated cache, greedy decoding as one program, and decoding after a cache that
already holds a context (a native or a translated one)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mot_jax.errors import MotJaxError
from mot_jax.jit import jit
from mot_jax.models.base import last_valid_index


def _prefill(model, input_ids, attention_mask, capacity):
    batch, length = input_ids.shape
    mask = jnp.ones((batch, length), bool) if attention_mask is None else attention_mask.astype(bool)
    hidden, cache = model.hidden_states(input_ids, mask, cache=model.init_cache(batch, capacity or length), fresh=True)
    return model.unembed(hidden[jnp.arange(batch), last_valid_index(mask)]), cache


@jit(static_argnames=("capacity",))
def prefill(model, input_ids, attention_mask=None, *, capacity=None):
    """(logits of each row's last valid token [B, V], a cache of `capacity` slots holding the prompt)."""
    return _prefill(model, input_ids, attention_mask, capacity)


@jit(donate_argnums=(2,))
def decode_step(model, tokens, cache):
    """One token per row [B] into a preallocated cache (donated: updated in place); returns (logits [B, V], cache)."""
    logits, cache = model(tokens[:, None], cache=cache)
    return logits[:, -1], cache


LINE_TEXT, LINE_BREAK, TEXT_BEFORE_BREAK = 1, 2, 4  # bit flags per token id of `greedy_continue`'s `lines`
MIN_DECODE_ROWS = 8  # `greedy_continue` decodes fewer rows than the batch down to this many


def greedy_continue(model, logits, cache, max_new_tokens, eos_ids=None, lines=None, layers=None):
    """Greedy decoding from the logits of each row's last token and the cache holding its prompt: [B, n] ids.

    After a row emits an end-of-sequence token (`eos_ids`, a tuple, default the config's; `()` never stops) it
    repeats that token. With `lines` ([V] bit flags per token id: `LINE_TEXT` it holds non-blank text, `LINE_BREAK`
    a line break, `TEXT_BEFORE_BREAK` text before its first break), a row also ends after the token that ends its
    first line of text (a break after non-blank text: where answers are cut) and then emits the first end token.
    The loop stops once every row has ended, so a batch of short answers costs only their steps; and once no more
    rows run than half the batch, it goes on with those rows alone (halving again, down to `MIN_DECODE_ROWS`), so
    a few long answers do not keep every row's step running. `layers`: the model's `layer_params()`, if the program
    has them already (the steps run the layers on those, not as a scan that copies each layer's weights every step).
    Traced: call it inside a jitted function.
    """
    eos_ids = model.config.eos_ids if eos_ids is None else eos_ids
    if lines is not None and not eos_ids:
        raise MotJaxError("Ending rows at a line break needs an end-of-sequence id to emit after it; pass eos_ids.")
    eos = jnp.asarray(eos_ids or (-1,), jnp.int32)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    batch = first.shape[0]
    out = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(first)

    def ended(token, started):
        """(whether a row has ended at `token`, whether its text has started, `token` included)."""
        if lines is None:
            return jnp.isin(token, eos), started
        flags = lines[token]
        line_ends = (flags & LINE_BREAK > 0) & (started | (flags & TEXT_BEFORE_BREAK > 0))
        return jnp.isin(token, eos) | line_ends, started | (flags & LINE_TEXT > 0)

    def filler(token):  # what an ended row emits: its end token again, or the first end token after a line break
        return jnp.where(jnp.isin(token, eos), token, eos[0])

    # the rows decoded together shrink through these sizes; `rows` maps them to the batch's rows, and `written`
    # [batch] counts each batch row's tokens in `out` (a row left behind has ended: the rest of it is its filler)
    sizes = [batch]
    while sizes[-1] // 2 >= MIN_DECODE_ROWS:
        sizes.append(sizes[-1] // 2)
    layers = model.layer_params() if layers is None else layers
    i, token, started, rows = jnp.int32(1), first, jnp.zeros(batch, bool), jnp.arange(batch)
    last, written = first, jnp.ones(batch, jnp.int32)
    for phase, size in enumerate(sizes):
        if phase:  # keep the running rows (and ended ones to fill the size)
            keep = jnp.argsort(ended(token, started)[0], stable=True)[:size]
            token, started, rows = token[keep], started[keep], rows[keep]
            cache = None if cache is None else cache.take_rows(keep)
        fewer = sizes[phase + 1] if phase + 1 < len(sizes) else 0  # running rows that let the next phase start

        def running(carry, fewer=fewer):
            i, token, started = carry[:3]
            still = ~ended(token, started)[0]
            return (i < max_new_tokens) & jnp.any(still) & (jnp.sum(still) > fewer)

        def step(carry, rows=rows):
            i, token, started, cache, out, last, written = carry
            done, started = ended(token, started)
            logits, cache = model(token[:, None], cache=cache, layers=layers)
            new = jnp.where(done, filler(token), jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32))
            out = out.at[rows, i].set(new)
            return i + 1, new, started, cache, out, last.at[rows].set(new), written.at[rows].set(i + 1)

        carry = (i, token, started, cache, out, last, written)
        i, token, started, cache, out, last, written = jax.lax.while_loop(running, step, carry)
    return jnp.where(jnp.arange(max_new_tokens) < written[:, None], out, filler(last)[:, None])


@jit(static_argnames=("max_new_tokens", "eos_ids"))
def generate(model, input_ids, attention_mask=None, *, max_new_tokens, eos_ids=None):
    """Greedy decoding as one program: prefill into a preallocated cache (the layer scan: its copies of each layer's
    weights are shared by the prompt's tokens), then a loop of single-token steps.

    Returns [B, max_new_tokens] token ids (see `greedy_continue` for the end-of-sequence rule).
    """
    logits, cache = _prefill(model, input_ids, attention_mask, input_ids.shape[1] + max_new_tokens)
    return greedy_continue(model, logits, cache, max_new_tokens, eos_ids)


def generate_from_cache(model, cache, input_ids, attention_mask=None, *, max_new_tokens, eos_ids=None, lines=None):
    """Greedy decoding after a cache that already holds a context (e.g. a translated one): the model reads
    `input_ids` [B, T] (a question; padding per `attention_mask`) after it, then decodes. The cache needs room for
    them and the answer (capacity >= its tokens + T + max_new_tokens). Returns [B, max_new_tokens] token ids (see
    `greedy_continue` for the end-of-sequence rule and `lines`, which ends rows at their first line's end)."""
    check_room(cache, input_ids.shape[1] + max_new_tokens)
    return generate_from_cache_jit(
        model, cache, input_ids, attention_mask, max_new_tokens=max_new_tokens, eos_ids=eos_ids, lines=lines
    )


def check_room(cache, tokens: int) -> None:
    """Refuse a cache without room for `tokens` more after its context: writing past its end would overwrite its last
    slots silently. (A traced cache is not checked.)"""
    if isinstance(cache.index, jax.core.Tracer):
        return
    needed = int(cache.index) + tokens
    if needed > cache.capacity:
        raise MotJaxError(
            f"The cache has {cache.capacity} slots but its context and the {tokens} tokens read and written after it "
            f"need {needed}; build it with capacity >= {needed}."
        )


@jit(static_argnames=("max_new_tokens", "eos_ids"))
def generate_from_cache_jit(model, cache, input_ids, attention_mask=None, *, max_new_tokens, eos_ids=None, lines=None):
    """`generate_from_cache` as one program, without its room check (for timing and lowering)."""
    mask = jnp.ones(input_ids.shape, bool) if attention_mask is None else attention_mask
    layers = model.layer_params()
    hidden, cache = model.hidden_states(input_ids, mask, cache=cache, layers=layers)
    logits = model.unembed(hidden[jnp.arange(hidden.shape[0]), last_valid_index(mask)])
    return greedy_continue(model, logits, cache, max_new_tokens, eos_ids, lines, layers)
