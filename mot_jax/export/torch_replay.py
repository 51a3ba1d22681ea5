"""The replay of a translated cache in transformers (`CachePipeline`, mode='replay'): torch and transformers only.

The target runs over its context with an attention function of its own (`ATTENTION`, registered with transformers'
`AttentionInterface`) in which the window layers' attention reads the translated K/V in place of the K/V the layer
computed, and, where the translator was trained with sparse attention, the layers from `dense_bottom` up attend only
to the keys chosen from the source's attention (`head_averaged_topk` -> `sparse_indices` -> `allowed_keys`, as
`mot_jax.translate.translator`). The cache that forward builds (the target's own recomputed K/V) is the result
(`replay`). The eager attention of the module's own family does the rest, so the models must use eager attention.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

ATTENTION = "mot_replay"
_running = None  # the injection of the replay that is running (layer -> translated K/V, sparse masks)


def _eager(module):
    """The eager attention function of the module's own family (softcap, scaling and GQA handled as it does)."""
    return sys.modules[type(module).__module__].eager_attention_forward


def _replay_attention(module, query, key, value, attention_mask, **kwargs):
    state, layer = _running, module.layer_idx
    if state is not None and query.shape[2] == key.shape[2]:  # the context pass (the cache was empty)
        if layer in state["slot"]:
            slot = state["slot"][layer]
            key, value = state["k"][slot].to(key.dtype), state["v"][slot].to(value.dtype)
        if state["allowed"] is not None and layer >= state["dense_bottom"]:
            attention_mask = _sparse_mask(attention_mask, state["allowed"][layer], query.dtype)
    return _eager(module)(module, query, key, value, attention_mask, **kwargs)


def _sparse_mask(mask, allowed, dtype):
    """The additive mask restricted to the chosen keys; a query left with none attends to itself (as mot_jax)."""
    visible = mask[:, 0] > torch.finfo(mask.dtype).min / 2  # [B, T, T]
    stranded = ~(visible & allowed).any(-1, keepdim=True)
    diagonal = torch.eye(visible.shape[-1], dtype=torch.bool, device=visible.device)
    keep = visible & (allowed | (stranded & diagonal))
    return torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]


AttentionInterface.register(ATTENTION, _replay_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, eager_mask)


@contextlib.contextmanager
def _attention(model, name):
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def replay(target, config, ids, mask, k, v, allowed=None) -> DynamicCache:
    """The target's cache (full-length right-padded layers, also the sliding ones) of its forward over right-padded
    contexts ids, mask [B, T] in which the window layers (`config.target_layers`) read the translated K and V [W, B,
    Kt, T, dt], and the layers from `config.dense_bottom` up only the keys `allowed` [Lt, B, T, T] (None: dense)."""
    global _running
    slot = {layer: i for i, layer in enumerate(config.target_layers)}
    _running = dict(slot=slot, k=k, v=v, allowed=allowed, dense_bottom=config.dense_bottom)
    try:
        with _attention(target, ATTENTION):
            cache = DynamicCache()  # full-length layers: the sliding ones are cut after the shift
            target(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    finally:
        _running = None
    return cache


def head_averaged_topk(attentions, k):
    """Per layer, the k keys each query attends to most, averaged over heads: [L, B, S, k] (ties: lower index)."""
    probs = torch.stack([a.float().mean(1) for a in attentions])  # [L, B, S, S]
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
    return order[..., : min(k, probs.shape[-1])]


def sparse_indices(config, source_topk, alignment):
    """Target layer j reads source layer layer_map[j]; target query t reads source query target_to_source[t]; a source
    key s becomes target token source_to_target[s]; the first token (the target's attention sink) is always allowed:
    [Lt, B, T, k + 1] (as mot_jax.translate.translator)."""
    picked = source_topk[torch.as_tensor(config.layer_map)]  # [Lt, B, S, k]
    rows = torch.arange(picked.shape[1])[:, None]
    by_query = picked[:, rows, torch.as_tensor(alignment.target_to_source, dtype=torch.long)]  # [Lt, B, T, k]
    keys = torch.as_tensor(alignment.source_to_target, dtype=torch.long)[rows[..., None], by_query]
    return torch.cat([keys, torch.zeros_like(keys[..., :1])], -1)  # + the first token (right padding: slot 0)


def allowed_keys(indices, length):
    """[Lt, B, T, k] chosen token indices -> [Lt, B, T, T] boolean masks."""
    allowed = torch.zeros(*indices.shape[:3], length + 1, dtype=torch.bool)
    clipped = torch.where((indices >= 0) & (indices < length), indices, length)
    return allowed.scatter_(-1, clipped, True)[..., :length]
