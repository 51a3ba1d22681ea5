"""Translated caches for Hugging Face transformers models: torch, transformers and numpy only (no JAX).

    pipe = CachePipeline.from_export("exported/")  # written by python -m mot_jax.export; loads the models it names
    # or, with your own models (eager attention) and tokenizers:
    # pipe = CachePipeline(source, target, source_tokenizer, target_tokenizer, KVTranslator.from_pretrained(...))
    cache, ids, mask = pipe.from_text(["The passage ...", "Another ..."])  # a DynamicCache, left-padded rows
    ones = torch.ones_like(question_ids)                                 # the same question [B, Q] for every row
    out = target.generate(torch.cat([ids, question_ids], 1), attention_mask=torch.cat([mask, ones], 1),
                          cache=cache, max_new_tokens=20)

`direct`: the translated K/V of every target layer are the cache (a `kind="c2c"` translator: the target's own
cache of its context, its window layers' K/V fused with the source's). With `native_bottom=B` the transformers
target runs its own layers 0..B-1 over the context (`run_native_bottom`: hooks stop its forward there), whose K/V
are the cache's bottom and which give the target-side inputs (`embeddings`, `hidden`); with `outputs="hidden"` the
window layers' own norm and attention turn the translated layer inputs into K/V (`layer_key_values`); a translator
without "source" in `inputs` runs no source. `kind="interlat"`: the adapter's latents of the source's last hidden
states are the target's `inputs_embeds` in one forward over its context (`from_source_hidden`); `kind="mot_h"`: the
translated input residual streams of the source's window layers replace the target's own (forward pre-hooks) in one
dense forward over its context (`from_source_streams`); that forward's cache is the cache. `replay`: the
transformers target runs over its context with the translated K/V read by the window layers' attention (a
registered attention function) and sparse top-k attention from the source's attention where the translator was
trained with it; the cache it builds (its own recomputed K/V) is handed on, as in `mot_jax.translate.translator`
(`torch_replay.py` holds that attention function and the sparse keys).

The translation runs on right-padded contexts (each row's positions count from slot 0, as mot_jax); the cache handed
back is left-padded, the layout transformers' batched generation expects: every row's context ends at the last slot,
so the tokens that follow continue it at the same slot in every row and a sliding layer's last slots are each row's
own. `left_padded` gives the ids and mask of that layout; pass the mask to `generate`. The models must use eager
attention (`attn_implementation="eager"`): the source's attention weights pick the sparse keys.

`from_export` finds the models a training run named (`model_folder`, in `torch_models.py`): a folder as is, an
embedded model or GGUF file in the folder mot_jax converted it into (`$MOT_JAX_CACHE/<name>-<key>/`, default
`~/.cache/mot_jax`), a hub id fetched as mot_jax fetches it.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import DynamicCache

from mot_jax.export.torch_models import load_tokenizer, model_folder
from mot_jax.export.torch_replay import allowed_keys, head_averaged_topk, replay, sparse_indices
from mot_jax.export.torch_translator import CONFIG_FILE, KVTranslator, target_positions
from mot_jax.translate.align import align_batch, encode_texts


def _cache_layers(cache):
    return [(layer.keys, layer.values) for layer in cache.layers]


def left_padded(ids, mask):
    """Right-padded ids and mask [B, T] -> the left-padded layout of the caches this module returns (torch, long)."""
    ids, mask = torch.as_tensor(np.asarray(ids), dtype=torch.long), torch.as_tensor(np.asarray(mask), dtype=torch.long)
    return _shift_right(ids[:, None, :, None], mask)[:, 0, :, 0], _shift_right(mask[:, None, :, None], mask)[:, 0, :, 0]


def _shift_right(x, mask):
    """[B, H, T, D] right-padded along T -> each row's valid slots moved to the end (its padding wraps to the front,
    where the mask hides it)."""
    length = x.shape[2]
    shift = length - mask.sum(-1)  # [B]
    source = (torch.arange(length)[None] - shift[:, None]) % length  # [B, T]: new slot t takes old slot source[t]
    return torch.take_along_dim(x, source[:, None, :, None].to(x.device), dim=2)


def _left_padded_cache(config, layers, mask):
    """A DynamicCache for `config` of full-length right-padded (K, V) per layer, left-padded (sliding layers then
    keep each row's own last slots)."""
    cache = DynamicCache(config=config)
    for layer, (k, v) in enumerate(layers):
        cache.update(_shift_right(k, mask), _shift_right(v, mask), layer)
    return cache


class _Stop(Exception):
    """Raised by a hook to end a transformers forward early (the layers above are not needed)."""


def decoder_layers(model):
    """The decoder layers of a transformers causal LM (Llama-like `model.layers`, GPT-2's `h`, OPT's `decoder`)."""
    base = model.base_model
    base = getattr(base, "decoder", base)
    return base.layers if hasattr(base, "layers") else base.h


@contextlib.contextmanager
def _pre_hooks(model, hooks):
    """{decoder layer: forward pre-hook (module, args, kwargs) -> None or new (args, kwargs)} registered meanwhile."""
    layers = decoder_layers(model)
    handles = [layers[i].register_forward_pre_hook(hook, with_kwargs=True) for i, hook in hooks.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _layer_input(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def layer_inputs(model, layers, **inputs):
    """{layer: its input residual stream [B, T, D]} (for layer 0 the embeddings) of the decoder `layers` in a forward
    of `model` over `inputs` (keyword arguments of its call), which ends at the highest of them."""
    seen, top = {}, max(layers)

    def hook(index):
        def record(module, args, kwargs):
            seen[index] = _layer_input(args, kwargs)
            if index == top:
                raise _Stop

        return record

    with _pre_hooks(model, {i: hook(i) for i in set(layers)}), contextlib.suppress(_Stop):
        model(**inputs)
    return seen


def run_native_bottom(model, ids, mask, bottom, inputs=()):
    """The target's own layers 0..bottom-1 over right-padded contexts ids, mask [B, T] (the layers above do not run):
    their full-length (K, V) per layer, and the inputs a translator reads of them (`inputs`: "embeddings", the
    input of layer 0; "hidden", that of layer `bottom`, the residual stream after layer bottom-1), {name: [B, T, D]}."""
    wanted = {"embeddings": 0, "hidden": bottom}
    if not bottom and not inputs:  # nothing to run
        return [], {}
    cache = DynamicCache()  # full-length layers, also the sliding ones
    stops = {wanted[name] for name in inputs} | {bottom}
    seen = layer_inputs(model, stops, input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    return _cache_layers(cache)[:bottom], {name: seen[wanted[name]] for name in inputs}


class _Capture:
    """A cache that records the K/V a layer's attention caches and ends its forward there (no attention runs)."""

    def update(self, key, value, *args, **kwargs):
        self.kv = key, value
        raise _Stop


def layer_key_values(model, layers, x_k, x_v, mask):
    """K and V [W, B, Kt, T, dt] of the target's window `layers` from residual-stream inputs x_k, x_v [W, B, T, D]:
    each layer's own input norm and attention (K/V projections, k-norm, RoPE at the positions of the right-padded
    mask [B, T]) computes them, as it caches them (outputs='hidden'; rotary decoders: Llama, Qwen2/3, Gemma-3)."""
    positions, rotary = target_positions(mask), model.base_model.rotary_emb
    typed = "layer_type" in inspect.signature(rotary.forward).parameters  # Gemma-3: local and global RoPE

    def cached(layer, x):
        block, capture = decoder_layers(model)[layer], _Capture()
        rope = rotary(x, positions, *((model.config.layer_types[layer],) if typed else ()))
        with contextlib.suppress(_Stop):
            block.self_attn(block.input_layernorm(x), position_embeddings=rope, attention_mask=None, cache=capture)
        return capture.kv

    k = [cached(layer, x_k[slot].to(model.dtype))[0] for slot, layer in enumerate(layers)]
    v = [cached(layer, x_v[slot].to(model.dtype))[1] for slot, layer in enumerate(layers)]
    return torch.stack(k), torch.stack(v)


class CachePipeline:
    """A source and a target transformers model (eager attention), their tokenizers, and an exported translator."""

    def __init__(self, source, target, source_tokenizer, target_tokenizer, translator: KVTranslator):
        self.source, self.target, self.translator = source, target, translator
        self.source_tokenizer, self.target_tokenizer = source_tokenizer, target_tokenizer
        for name, model in (("source", source), ("target", target)):
            if model.config._attn_implementation != "eager":
                raise ValueError(f"The {name} model must be loaded with attn_implementation='eager'.")

    @classmethod
    def from_export(cls, folder, source=None, target=None, dtype=None) -> CachePipeline:
        """The pipeline of an export folder (`python -m mot_jax.export --out=folder`): its translator, and the
        source and target models (eager attention, eval mode) and tokenizers of the training run's model names in
        its config.json (`model_folder`). `source` / `target` (a folder, hub id or embedded model) replace those
        names; `dtype` (a torch dtype) replaces the run's LLM dtype."""
        translator = KVTranslator.from_pretrained(folder)  # checks config.json and the weights
        config = json.loads((Path(folder) / CONFIG_FILE).read_text())
        dtype = dtype or getattr(torch, config.get("dtype") or "float32", None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{folder}/{CONFIG_FILE} names the dtype {config['dtype']!r}; pass dtype=torch.float32.")
        loaded = []
        for side, name in (("source", source), ("target", target)):
            name = name or config.get(side)
            if not name:
                raise ValueError(f"{folder}/{CONFIG_FILE} names no {side} model; pass {side}=its folder.")
            path = model_folder(str(name))
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(path), attn_implementation="eager", dtype=dtype
            )
            loaded += [model.eval(), load_tokenizer(path)]
        (source_model, source_tokenizer), (target_model, target_tokenizer) = loaded[:2], loaded[2:]
        return cls(source_model, target_model, source_tokenizer, target_tokenizer, translator)

    def from_text(self, texts):
        """(DynamicCache, target ids [B, T], mask [B, T]) of the contexts, left-padded (the target tokenizer's own
        special tokens, e.g. a BOS, as mot_jax's CacheTranslator)."""
        ids, mask = encode_texts(self.target_tokenizer, texts)
        return self.from_target_ids(ids, mask), *left_padded(ids, mask)

    @torch.no_grad()
    def from_target_ids(self, target_ids, target_mask):
        """The target cache (left-padded: `left_padded`) of right-padded target-tokenized contexts; the source reads
        the same text (decoded, re-encoded)."""
        target_ids, target_mask = np.asarray(target_ids), np.asarray(target_mask, bool)
        if not target_mask[:, 0].all():
            raise ValueError("Target contexts must be right-padded (transformers counts positions from slot 0).")
        source_ids, source_mask, alignment = align_batch(
            self.target_tokenizer, self.source_tokenizer, target_ids, target_mask
        )
        cfg = self.translator.config
        source_inputs = dict(
            input_ids=torch.as_tensor(source_ids, dtype=torch.long),
            attention_mask=torch.as_tensor(source_mask, dtype=torch.long),
        )
        if cfg.source_reads == "last_hidden":
            hidden = self.source.base_model(**source_inputs, use_cache=False).last_hidden_state  # final-normed
            return self.from_source_hidden(hidden, alignment, target_ids, target_mask)
        if cfg.source_reads == "layer_inputs":
            streams = layer_inputs(self.source, cfg.source_layers, **source_inputs, use_cache=False)
            return self.from_source_streams([streams[i] for i in cfg.source_layers], alignment, target_ids, target_mask)
        sparse = cfg.mode == "replay" and cfg.sparse_attention
        if "source" not in cfg.inputs and not sparse:  # the source-free translator: the source does not run
            return self.from_source_cache(None, alignment, target_ids, target_mask)
        out = self.source(
            **source_inputs,
            cache=DynamicCache(),  # full-length layers, also for sliding-window sources
            use_cache=True,
            output_attentions=sparse,
        )
        return self.from_source_cache(out.cache, alignment, target_ids, target_mask, out.attentions)

    @torch.no_grad()
    def from_source_cache(self, source_cache, alignment, target_ids, target_mask, source_attentions=None):
        """The target cache from a source DynamicCache over the context (full-length layers), the alignment of its
        tokens onto the target's (`mot_jax.translate.align.align_batch`) and, for sparse replay, the source's
        attention weights over the context (`output_attentions=True`). `source_cache` is None for a translator that
        reads no source (`inputs` without "source"). With `native_bottom=B` the target's own layers 0..B-1 read the
        context first; the target-side inputs (`embeddings`, `hidden`) come from that run."""
        cfg = self.translator.config
        if cfg.call == "fuse_window":  # fuses the target's own cache of the context with the source's
            return self._fused(_cache_layers(source_cache), alignment, target_ids, target_mask)
        ids = torch.as_tensor(np.asarray(target_ids), dtype=torch.long)
        mask = torch.as_tensor(np.asarray(target_mask), dtype=torch.long)
        target_inputs = [name for name in cfg.inputs if name != "source"]
        bottom, features = run_native_bottom(self.target, ids, mask, cfg.native_bottom, target_inputs)
        source = (None, None, None)
        if "source" in cfg.inputs:
            if source_cache is None:
                raise ValueError("The translator reads the source's K/V; pass the source's cache of the context.")
            layers = _cache_layers(source_cache)
            source = ([kv[0] for kv in layers], [kv[1] for kv in layers], alignment.weights)
        k, v = self.translator.translate_window(*source, mask.bool(), **features)
        if cfg.kv_from_hidden:  # layer inputs: the target's own layers make them K/V
            k, v = layer_key_values(self.target, cfg.target_layers, k, v, mask)
        # the first token sees only itself: its K/V are the target's own, not translated (as mot_jax)
        own = _cache_layers(self.target(input_ids=ids[:, :1], cache=DynamicCache(), use_cache=True).cache)
        for slot, layer in enumerate(cfg.target_layers):
            k[slot][:, :, :1], v[slot][:, :, :1] = own[layer][0].to(k.dtype), own[layer][1].to(v.dtype)
        if cfg.mode == "direct":
            return _left_padded_cache(self.target.config, bottom + list(zip(k, v)), mask)
        allowed = None
        if cfg.sparse_attention:
            if source_attentions is None:
                raise ValueError("Sparse replay needs the source's attention weights; pass source_attentions.")
            topk = head_averaged_topk(source_attentions, cfg.k_attn)
            allowed = allowed_keys(sparse_indices(cfg, topk, alignment), ids.shape[1])
        return self._replay(ids, mask, k, v, allowed)

    @torch.no_grad()
    def from_source_hidden(self, source_hidden, alignment, target_ids, target_mask):
        """kind='interlat': the target cache from the source's final-normed last hidden states [B, S, Es] (its base
        model's `last_hidden_state`): the adapter's latents are the target's `inputs_embeds` in one forward over its
        context, but at each row's first token (right padding: slot 0), which keeps its own token embedding."""
        ids = torch.as_tensor(np.asarray(target_ids), dtype=torch.long)
        mask = torch.as_tensor(np.asarray(target_mask), dtype=torch.long)
        latents = self.translator.embed_latents(source_hidden, alignment.weights, mask.bool())
        own = self.target.get_input_embeddings()(ids[:, :1])  # Gemma's embedding scale included, as mot_jax's
        embeddings = torch.cat([own, latents[:, 1:].to(own.dtype)], 1)
        cache = DynamicCache()  # full-length layers: the sliding ones are cut after the shift
        self.target(inputs_embeds=embeddings, attention_mask=mask, cache=cache, use_cache=True)
        return _left_padded_cache(self.target.config, _cache_layers(cache), mask)

    @torch.no_grad()
    def from_source_streams(self, source_streams, alignment, target_ids, target_mask):
        """kind='mot_h': the target cache from the source's input residual streams of its window layers (per window
        slot [B, S, Ds]): their translations replace the target's own window-layer inputs (forward pre-hooks) in one
        dense forward over its context, but at each row's first token, which keeps its own."""
        cfg = self.translator.config
        ids = torch.as_tensor(np.asarray(target_ids), dtype=torch.long)
        mask = torch.as_tensor(np.asarray(target_mask), dtype=torch.long)
        streams = self.translator.translate_streams(source_streams, alignment.weights, mask.bool())  # [W, B, T, Dt]
        own = layer_inputs(self.target, cfg.target_layers, input_ids=ids[:, :1], use_cache=False)
        replaced = {}
        for slot, layer in enumerate(cfg.target_layers):
            replaced[layer] = torch.cat([own[layer], streams[slot][:, 1:].to(own[layer].dtype)], 1)

        def hook(layer):
            def replace(module, args, kwargs):
                if args:
                    return (replaced[layer], *args[1:]), kwargs
                return args, kwargs | dict(hidden_states=replaced[layer])

            return replace

        cache = DynamicCache()
        with _pre_hooks(self.target, {layer: hook(layer) for layer in replaced}):
            self.target(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        return _left_padded_cache(self.target.config, _cache_layers(cache), mask)

    def _fused(self, source_layers, alignment, target_ids, target_mask):
        """kind='c2c': the target reads its context itself, then its window layers take the fused K/V."""
        ids = torch.as_tensor(np.asarray(target_ids), dtype=torch.long)
        mask = torch.as_tensor(np.asarray(target_mask), dtype=torch.long)
        out = self.target(input_ids=ids, attention_mask=mask, cache=DynamicCache(), use_cache=True)
        own = [list(kv) for kv in _cache_layers(out.cache)]
        k, v = self.translator.fuse_window(
            [kv[0] for kv in own],
            [kv[1] for kv in own],
            [kv[0] for kv in source_layers],
            [kv[1] for kv in source_layers],
            alignment.weights,
            mask.bool(),
        )
        for slot, layer in enumerate(self.translator.config.target_layers):
            own[layer] = [k[slot].to(own[layer][0].dtype), v[slot].to(own[layer][1].dtype)]
        return _left_padded_cache(self.target.config, own, mask)

    def _replay(self, ids, mask, k, v, allowed):
        cache = replay(self.target, self.translator.config, ids, mask, k, v, allowed)
        return _left_padded_cache(self.target.config, _cache_layers(cache), mask)
