"""From a source cache to a target cache: the K and V mixtures, their window, and the two injection modes.

- `replay` (paper): the translated K/V replace the target's own in the window layers while the target re-runs
  its context; the cache handed on is the target's own recomputed K/V at every layer. Attention in the replay is
  dense, or (paper) sparse top-k with key indices from the source's head-averaged attention, mapped across layers
  (channel-map interpolation) and tokenizers (hard alignment maps), the bottom layers dense.
- `direct`: the window is every target layer; the translated K/V are the cache, the target never reads the context.
  With `native_bottom=B` (ours, a dial between direct and native) the target runs its own layers `0..B-1` over the
  context exactly and the translator writes layers `B..L-1`: `B=0` is direct, `B=L` native context.

What the translator reads per token (`inputs`): the window's aligned source K (or V) vectors (`source`, the paper),
and ours, the target's own input embedding of the token (`embeddings`: the token identity extractive answers copy,
at the cost of a lookup) and, for `B>0`, its residual stream before layer `B` (`hidden`). The target-side features
are RMS-normalised per token and shared by every window layer. Without `source` the translator is the source-free
control: the target's own bottom layers and embeddings alone predict its upper K/V.

What it writes per token and window layer (`outputs`): K and V (the paper), or ours (`hidden`) two residual-stream
vectors, the layer's inputs for its keys and for its values, which the target's own frozen norm, K/V projections,
k-norm and RoPE turn into K/V (as SwiftKV computes upper K/V from a hidden state), so keys land in the target's
geometry.

Two rules for a context's first token, in both modes (not in the reference): its K/V are the target's own, computed
from that token alone (it attends only to itself, so nothing needs translating; for Gemma it is the BOS, the
attention sink every later token reads), and sparse attention always lets a query see it (docs/translators.md and the
results logs under docs/results/ measure what they are worth).

`KVTranslator` holds the trainable parameters: the modules its kind builds (`kinds/`: a K and a V mixture for the
paper's `mot`, or each kind's own) and, with `linear_skip`, a linear map per window layer beside the K and V modules,
set by least squares before training (`linear_skip.py`). `translate` is the jittable function that training and
evaluation share: a kind's own path where it has one, else the window path (`window.py`). The spec is `spec.py`; the
pipeline from text to a target cache (`read_source`, `CacheTranslator`) is `pipeline.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mot_jax.errors import MotJaxError
from mot_jax.models.base import CausalLM, first_valid_index, positions_from_mask
from mot_jax.models.hooks import Forward, LayerInputs
from mot_jax.models.layers import einsum, param
from mot_jax.translate import kinds, receiver
from mot_jax.translate.config import TranslatorConfig
from mot_jax.translate.hooks import InjectKV, SparseKeys, TopKeys
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.window import join_shared, target_side, translate_window


def mixture_config(spec: TranslationSpec, source: CausalLM, target: CausalLM, **kwargs) -> TranslatorConfig:
    """The config of a translator for `spec` between the two models: its widths from what it reads and writes (the
    kind's declarations, `spec.written`), `kwargs` its other fields (`kinds.translator_config`)."""
    target_features = sum(i != "source" for i in spec.inputs) * target.config.hidden_size
    receiver.check(target, kwargs.get("receiver_rank", 0))
    if kwargs.get("receiver_rank"):
        kwargs |= receiver.widths(target)
    return kinds.translator_config(
        source_width=spec.source_reads.width(source) * spec.reads_source + target_features,
        target_width=spec.written.width(target),
        window=len(spec.target_layers),
        **kwargs,
    )


class LinearSkip(nnx.Module):
    """Per window layer, y = x @ kernel + bias from the aligned source vectors [B, T, W, ds] to [B, T, W, dt]; zero
    until training starts it at the least-squares fit (`linear_skip.solve_linear_skip`)."""

    def __init__(self, cfg: TranslatorConfig, *, dtype=jnp.float32):
        shape = (cfg.window, cfg.source_width, cfg.target_width)
        self.kernel = param(None, shape, ("layers", None, None), dtype, "zeros")
        self.bias = param(None, (cfg.window, cfg.target_width), ("layers", None), dtype, "zeros")

    def __call__(self, x, shared=None):
        """`shared` [B, T, F]: inputs every window layer reads after its own `x` (`window.join_shared`), multiplied
        once for all layers rather than broadcast to each (the dial's features are most of the inputs)."""
        kernel = self.kernel[...]
        y = einsum("btwi,wio->btwo", x, kernel[:, : x.shape[-1]]) + self.bias[...]
        if shared is not None:
            y = y + einsum("btf,wfo->btwo", shared, kernel[:, x.shape[-1] :])
        return y

    def layer(self, shared, slot):
        """Window layer `slot`'s map (traced: e.g. inside the layer scan) of the shared inputs alone, [B, T, F] ->
        [B, T, dt], for a translator that reads no inputs of each layer's own (`shared` is all it reads)."""
        kernel = jax.lax.dynamic_index_in_dim(self.kernel[...], slot, keepdims=False)
        if kernel.shape[0] != shared.shape[-1]:
            raise MotJaxError(
                f"This linear skip reads {kernel.shape[0]} inputs per layer, not the {shared.shape[-1]} shared ones "
                "alone; map the layers together with its call instead."
            )
        bias = jax.lax.dynamic_index_in_dim(self.bias[...], slot, keepdims=False)
        return einsum("btf,fo->bto", shared, kernel) + bias


class KVTranslator(nnx.Module):
    """The modules its kind builds (`Kind.build`: for the window path, a K and a V module, `key` and `value`, each
    [B, T, W, ds] -> [B, T, W, dt]); with `cfg.linear_skip`, a linear map beside each whose output is added to
    theirs; with `cfg.receiver_rank`, the change to the target's queries it reads with (`receiver`)."""

    def __init__(self, spec: TranslationSpec, cfg: TranslatorConfig, *, rngs, dtype=jnp.float32):
        kinds.check(spec, cfg)
        if spec.rotary and cfg.output_activation != "none":
            raise MotJaxError("rotary=True needs output_activation='none' (rotated keys take any sign).")
        self.spec, self.cfg = spec, cfg
        if not spec.target_layers:  # native_bottom = L: nothing to translate (native context), no parameters
            return
        for name, module in kinds.get(cfg.kind).build(spec, cfg, rngs, dtype).items():
            setattr(self, name, module)
        if cfg.linear_skip:
            self.key_skip, self.value_skip = LinearSkip(cfg, dtype=dtype), LinearSkip(cfg, dtype=dtype)
        if cfg.receiver_rank:
            self.receiver_queries = receiver.ReceiverQueries(
                spec.target_layers,
                cfg.receiver_width,
                cfg.receiver_query_width,
                cfg.receiver_rank,
                rngs=rngs,
                dtype=dtype,
            )

    def receiver(self, target: CausalLM) -> CausalLM:
        """The target as it reads after this translator's cache: itself, or with `cfg.receiver_rank`, adapted
        (`receiver.adapted`), and where the kind changes how new tokens' K/V are made (`Kind.reader_hook`: the
        self-prediction kind's `new_tokens_from_map`), running every forward with that hook."""
        return receiver.adapted(target, getattr(self, "receiver_queries", None), self.reader_hook())

    def reader_hook(self):
        """The hook the target runs every forward after this translator's cache with (`Kind.reader_hook`; None:
        none, or nothing translated)."""
        make = kinds.get(self.cfg.kind).reader_hook
        return make(self) if make and self.spec.target_layers else None

    @property
    def changes_reader(self) -> bool:
        """Whether the target reads after this translator's cache as a model of its own (`receiver`), not itself."""
        return bool(self.cfg.receiver_rank) or self.reader_hook() is not None

    def __call__(self, k, v, mask, shared=None):
        """Aligned source window vectors k, v [B, T, W, ds] and the inputs all window layers share [B, T, F] (or None)
        -> translated k, v [B, T, W, dt] and the aux outputs. The modules read each layer's inputs joined; the linear
        skip reads them in parts (under jit a module that ignores its inputs, the linear kind's, costs no join)."""
        k_out, aux_k = self.key(join_shared(k, shared), mask)
        v_out, aux_v = self.value(join_shared(v, shared), mask)
        if self.cfg.linear_skip:
            k_out, v_out = k_out + self.key_skip(k, shared), v_out + self.value_skip(v, shared)
        return k_out, v_out, {"key": aux_k, "value": aux_v}


def source_read(source: CausalLM, source_ids, source_mask, topk=0, layer_inputs=False, last_hidden=False):
    """The source's prefill of its context as a translator reads it: (its cache, its attention's top-k key indices
    [Ls, B, S, k] with `topk > 0`, else None; `spec.source_hands` gives the flags). `layer_inputs` (MoT-h's): the
    cache's K holds every layer's input residual stream [Ls, B, S, D] as one head of width D, and V nothing (width 0),
    so that batching, the alignment and `window_block` take the streams as they take K. `last_hidden` (Interlat's):
    so does the last layer's final-normed output [1, B, 1, S, E], one layer."""
    hooks = ([TopKeys(topk)] if topk else []) + ([LayerInputs()] if layer_inputs else [])
    run = source.run_layers(Forward(source_ids, source_mask), hooks=hooks)
    cache = run.cache
    if last_hidden:
        states = run.hidden[None, :, None].astype(cache.k.dtype)  # [1, B, 1, S, E]
        cache = cache.replace(k=states, v=states[..., :0])
    if layer_inputs:
        streams = run.records["inputs"][:, :, None].astype(cache.k.dtype)  # [Ls, B, 1, S, D]
        cache = cache.replace(k=streams, v=streams[..., :0])
    return cache, run.records.get("topk")


def sparse_indices(spec: TranslationSpec, source_topk, alignment, first):
    """Per target layer, the target key tokens each target query may attend to: [Lt, B, T, k + 1].

    source_topk [Ls, B, S, k] are the source's most-attended key tokens per query; target layer j reads source
    layer layer_map[j], target query t reads source query target_to_source[t], and each source key s becomes
    target token source_to_target[s]. The last column is each row's first target token (index `first` [B]): the
    target's attention sink (e.g. Gemma's BOS) stays visible whatever the source attended to.
    """
    layer_map = jnp.asarray(spec.layer_map)
    picked = source_topk[layer_map]  # [Lt, B, S, k]
    rows = jnp.arange(picked.shape[1])[:, None]
    by_target_query = picked[:, rows, alignment.target_to_source]  # [Lt, B, T, k]
    keys = alignment.source_to_target[rows[..., None], by_target_query]
    first = jnp.broadcast_to(first[None, :, None, None], (*keys.shape[:3], 1))
    return jnp.concatenate([keys, first.astype(keys.dtype)], -1)


def translate(
    translator,
    source,
    target,
    source_cache,
    alignment,
    target_ids,
    target_mask,
    source_topk=None,
    capacity=None,
    receiver=None,
    noise=None,
    side=None,
):
    """Jittable core: the target cache (capacity slots, default T) for the target context, and the aux outputs.
    For a kind with a path of its own (`Kind.translate`): `receiver`, the target's own prefill of the context when
    the caller has it (C2C's, else it runs here), and `noise`, the kind's training noise (`Kind.noise`; None in
    evaluation). The window path: `side`, the context's `TargetSide` when the caller has it (else computed here)."""
    spec = translator.spec
    batch, length = target_ids.shape
    mask = target_mask.astype(bool)
    own_path = kinds.get(translator.cfg.kind).translate
    if own_path:
        args = (target_ids, mask, capacity or length, receiver, noise)
        return own_path(translator, source, target, source_cache, alignment, *args)
    side = side if side is not None else target_side(spec, target, target_ids, mask, capacity or length)
    cache = target.init_cache(batch, capacity or length)
    if spec.mode == "direct":  # the context's slots, with the native bottom layers' K/V
        cache = cache.append_slots(positions_from_mask(mask), mask)
        if spec.native_bottom:
            bottom = lambda kv, got: kv.at[: spec.native_bottom, :, :, :length].set(got)
            cache = cache.replace(k=bottom(cache.k, side.bottom_k), v=bottom(cache.v, side.bottom_v))
        if not spec.target_layers:  # B = L: the target read the whole context itself
            return cache.replace(index=jnp.asarray(length, jnp.int32)), {}
    k, v, aux = translate_window(translator, source, target, source_cache, alignment, mask, side.features)
    first = first_valid_index(mask)
    is_first = (jnp.arange(length) == first[:, None])[None, :, None, :, None]  # [1, B, 1, T, 1]
    k, v = jnp.where(is_first, side.first_k, k), jnp.where(is_first, side.first_v, v)
    if spec.mode == "direct":
        at = (spec.native_bottom, 0, 0, 0, 0)
        return cache.replace(
            k=jax.lax.dynamic_update_slice(cache.k, k, at),
            v=jax.lax.dynamic_update_slice(cache.v, v, at),
            index=jnp.asarray(length, jnp.int32),
        ), aux
    slot = np.full(target.config.num_layers, -1, np.int32)
    slot[list(spec.target_layers)] = np.arange(len(spec.target_layers))
    hooks = [InjectKV(k, v, slot)]
    if spec.sparse_attention:
        if source_topk is None:
            raise MotJaxError("Sparse replay needs the source's attention top-k indices; pass source_topk.")
        sparse = np.arange(target.config.num_layers) >= spec.dense_bottom
        hooks.append(SparseKeys(sparse_indices(spec, source_topk, alignment, first), sparse))
    return target.run_layers(Forward(target_ids, mask, fresh=True), cache, hooks).cache, aux
