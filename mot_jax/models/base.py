"""What every family shares: the config and the forward over a stack of layers with a KV cache (generation:
`mot_jax.models.generation`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mot_jax.models.attention import Mask, attend
from mot_jax.models.cache import KVCache
from mot_jax.models.hooks import AttentionRead, Forward, LayerHook, LayerRecord, LayerRun, NewKeyValues
from mot_jax.models.layers import GLOBAL_WINDOW, bf16_as_bits, bits_as_bf16

# `CausalLM.remat`: what the backward pass keeps of each layer's forward (the rest it recomputes), by name; None keeps
# everything. "dots": the matmul outputs without batch dimensions (the projections, not attention's scores).
REMAT_POLICIES = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nothing": jax.checkpoint_policies.nothing_saveable,
}
# Families whose cached keys carry RoPE (decoder.RotaryLM); GPT-2 and OPT add learned position embeddings instead.
ROTARY_FAMILIES = ("qwen2", "qwen3", "llama", "gemma3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One config for all families; each family reads the fields it needs (built from an HF config.json)."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    norm_eps: float
    activation: str
    tie_embeddings: bool = True
    bias: bool = True  # GPT-2 / OPT linear biases
    qkv_bias: bool = False  # rotary families: q/k/v (Qwen2) and o_proj / MLP biases (Llama variants)
    o_bias: bool = False
    mlp_bias: bool = False
    # Rotary families. `layer_windows[i]` is the sliding window of layer i (None: global attention); sliding
    # layers use the local RoPE. Scalings are tuples of (key, value) items so the config stays hashable.
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()
    local_rope_theta: float = 10000.0
    local_rope_scaling: tuple = ()
    layer_windows: tuple = ()
    # GPT-2
    scale_attn_by_inverse_layer_idx: bool = False
    # OPT
    pre_norm: bool = True
    final_norm: bool = True
    word_embed_proj_dim: int = 0
    # Gemma-3 (qk_norm: also Qwen3)
    qk_norm: bool = False
    sandwich_norms: bool = False
    unit_offset_norms: bool = False  # (1 + w) RMSNorm scales
    embed_scale: float = 1.0
    query_scale: float = 0.0  # 0: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_id: Any = None  # int or tuple of ints
    pad_token_id: int | None = None

    @property
    def windows(self):
        """Per-layer sliding windows as ints (GLOBAL_WINDOW for global layers)."""
        windows = self.layer_windows or (None,) * self.num_layers
        return tuple(GLOBAL_WINDOW if w is None else int(w) for w in windows)

    @property
    def rotary(self) -> bool:
        """Whether the model's keys are rotated by their positions (RoPE)."""
        return self.family in ROTARY_FAMILIES

    @property
    def eos_ids(self):
        eos = self.eos_token_id
        return () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)


class LayerCache:
    """One layer's view of the cache inside the layer scan: a block calls `attend` with its new q, k, v.

    It offers the new k, v to the hooks (`hooks.NewKeyValues`), writes what they return into the full cache at
    (layer, index), offers what the attention then reads to the hooks (`hooks.AttentionRead`) and attends through the
    one entry, `attention.attend`; the updated cache arrays are read back after the block has run (trace-time
    bookkeeping only)."""

    def __init__(self, k_all, v_all, layer, cache: KVCache, q_pos, fresh, hooks=(), record=None, windows=()):
        self.k_all, self.v_all, self.layer, self.index = k_all, v_all, layer, cache.index
        self.q_pos, self.k_pos, self.k_valid = q_pos, cache.positions, cache.valid
        if cache.hidden is not None:  # slots this layer does not see
            self.k_valid = self.k_valid & ~jax.lax.dynamic_index_in_dim(cache.hidden, layer, keepdims=False)
        self.fresh = fresh  # the cache was empty before these tokens (index 0, known when tracing)
        self.hooks, self.record = hooks, record if record is not None else LayerRecord()
        self.rope = None  # this layer's RoPE cos and sin at q_pos, when the model computed them for every layer
        self.project = None  # x [B, T, D] -> the (k, v) this layer makes of it at q_pos (`NewKeyValues.project`)
        self.window_choices = tuple(sorted(set(windows)))  # the values this layer's traced window can take

    def attend(self, q, k, v, *, scale, window=GLOBAL_WINDOW, softcap=None):
        """q: [B, T, H, d], k/v: [B, T, K, d] for the new tokens; returns [B, T, H * d]."""
        new = NewKeyValues(k, v, self.project)
        for hook in self.hooks:
            new = hook.key_values(new, self.layer, self.record)
        k, v = new.k, new.v
        self.write(k, v)
        length = q.shape[1]
        if self.fresh:  # only the new tokens can be visible: attend over them alone
            keys, values, offset = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), 0
            k_pos, k_valid = self.k_pos[:, :length], self.k_valid[:, :length]
            mask = Mask(self.q_pos, k_pos, k_valid, window, causal_prefill=True, window_choices=self.window_choices)
        else:
            keys = jax.lax.dynamic_index_in_dim(self.k_all, self.layer, keepdims=False)
            values = jax.lax.dynamic_index_in_dim(self.v_all, self.layer, keepdims=False)
            mask = Mask(self.q_pos, self.k_pos, self.k_valid, window, window_choices=self.window_choices)
            offset = self.index
        read = AttentionRead(q, keys, values, mask, scale, softcap, offset)
        for hook in self.hooks:
            read = hook.attention(read, self.layer, self.record)
        on_weights = None
        if read.on_weights:
            on_weights = lambda *args: [f(*args) for f in read.on_weights]  # noqa: E731
        return attend(read.q, read.k, read.v, read.mask, scale=read.scale, softcap=read.softcap, on_weights=on_weights)

    def write(self, k, v):
        """The new tokens' k, v [B, T, K, d] into this layer's slots [index, index + T)."""
        at = (self.layer, 0, 0, self.index, 0)
        self.k_all = jax.lax.dynamic_update_slice(self.k_all, k.transpose(0, 2, 1, 3)[None], at)
        self.v_all = jax.lax.dynamic_update_slice(self.v_all, v.transpose(0, 2, 1, 3)[None], at)


class SlotCache(LayerCache):
    """A layer's view for tokens already in the cache (`CausalLM.rerun_slots`): their new k, v overwrite their own
    slots `slots` [B, n] (slots past the capacity are dropped) instead of being appended."""

    def __init__(self, k_all, v_all, layer, slots, q_pos, cache: KVCache):
        super().__init__(k_all, v_all, layer, cache, q_pos, fresh=False)
        self.slots = slots

    def write(self, k, v):
        rows = jnp.arange(k.shape[0])[:, None]

        def put(all_kv, new):  # [L, B, K, S, d] <- new [B, n, K, d] at (layer, row, slot)
            layer = jax.lax.dynamic_index_in_dim(all_kv, self.layer, keepdims=False).transpose(0, 2, 1, 3)
            layer = layer.at[rows, self.slots].set(new.astype(layer.dtype), mode="drop").transpose(0, 2, 1, 3)
            return jax.lax.dynamic_update_index_in_dim(all_kv, layer, self.layer, 0)

        self.k_all, self.v_all = put(self.k_all, k), put(self.v_all, v)


class CausalLM(nnx.Module):
    """Base of every family. A family defines `token_embeddings` (and `input_embeddings` where it adds position
    embeddings), `layers` (a stacked block), `final_norm` and `unembed`.

    Forward: `logits, cache = model(input_ids, attention_mask=None, positions=None, cache=None)`.
    - input_ids [B, T]; attention_mask [B, T] (1 = token, 0 = padding, left or right).
    - positions [B, T] default to counting valid tokens, continuing from the cache.
    - cache: a `KVCache` to extend (None: a new one holding exactly these T tokens). The returned cache holds
      the new tokens' K/V at slots [index, index + T).
    """

    config: ModelConfig
    remat: str = "none"  # a REMAT_POLICIES name for the layer scan (backpropagating through a large model)
    # a hook every forward of this model runs with (`run_layers`), before the caller's: how a variant of a model
    # changes what its layers compute for new tokens (an `nnx.Module`, so that jitted functions carry its arrays)
    forward_hook = None

    def init_cache(self, batch, capacity, dtype=None):
        cfg = self.config
        dtype = dtype or self.param_dtype
        return KVCache.init(cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim, dtype)

    def __call__(self, input_ids, attention_mask=None, positions=None, cache=None, logits_to_keep=None, layers=None):
        hidden, cache = self.hidden_states(input_ids, attention_mask, positions, cache, layers=layers)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return self.unembed(hidden), cache

    def hidden_states(self, input_ids, attention_mask=None, positions=None, cache=None, fresh=False, layers=None):
        """The final-normed hidden states [B, T, D] and the extended cache. `fresh=True` promises that `cache` is
        empty (as `init_cache` returns it), which lets a long prefill skip causally masked key blocks. `layers`: each
        layer's weights from `layer_params` (`Forward.weights`)."""
        run = self.run_layers(Forward(input_ids, attention_mask, positions, weights=layers, fresh=fresh), cache)
        return run.hidden, run.cache

    def layer_params(self) -> list:
        """Each layer's parameters as arrays of their own, sliced from the stacked weights once, for
        `Forward.weights`. The layer scan copies each layer's weights out of the stack on every pass, which in a loop
        of single-token steps moves the whole model twice more per token than reading it; a loop that runs the layers
        over these reads them where they lie. (bf16 weights are sliced as their bits: see `bf16_as_bits`.)"""
        _, stacked = nnx.split(self.layers)
        bits = bf16_as_bits(stacked)
        return [bits_as_bf16(jax.tree.map(lambda a, i=i: a[i], bits)) for i in range(self.config.num_layers)]

    def run_layers(self, forward: Forward, cache: KVCache | None = None, hooks: Sequence[LayerHook] = ()) -> LayerRun:
        """The layers over `forward`'s new tokens after `cache` (None: a new one holding exactly them), each layer
        offered to `hooks` (`mot_jax.models.hooks`; the model's own `forward_hook` first): the hidden states, the
        extended cache and the hooks' records."""
        if self.forward_hook is not None:
            hooks = (self.forward_hook, *hooks)
        batch, length = forward.shape
        mask = jnp.ones((batch, length), bool) if forward.mask is None else forward.mask.astype(bool)
        fresh = forward.fresh or cache is None
        if cache is None:
            cache = self.init_cache(batch, length)
        positions = forward.positions
        if positions is None:
            positions = cache.next_positions()[:, None] + positions_from_mask(mask)
        cache = cache.append_slots(positions, mask)
        if forward.embeddings is None:
            x = self.embed(forward.ids, positions)
        else:
            x = self.input_embeddings(forward.embeddings, positions)

        graphdef, stacked = nnx.split(self.layers)
        rope = self.rope_tables(positions)  # once, outside the layer loop
        carried = {}  # what the hooks carry from layer to layer (`LayerHook.carry`)
        for hook in hooks:
            carried |= hook.carry(x)

        def body(carry, xs):
            x, k_all, v_all, carried = carry
            layer_params, layer = xs
            record = LayerRecord(carried)
            for hook in hooks:
                x = hook.layer_input(x, layer, record)
            view = LayerCache(k_all, v_all, layer, cache, positions, fresh, hooks, record, self.config.windows)
            if rope is not None:
                layer_rope, cos, sin = rope
                view.rope = (cos[layer_rope[layer]], sin[layer_rope[layer]])
            block = nnx.merge(graphdef, bits_as_bf16(layer_params))
            rope_kw = {} if view.rope is None else dict(rope=view.rope)  # families without RoPE take none
            view.project = lambda x: block.key_value(x, positions, layer, **rope_kw)
            x = block(x, positions, layer, view)
            return (x, view.k_all, view.v_all, record.carried), record.values

        stop = self.config.num_layers if forward.stop is None else forward.stop
        if forward.weights is None:
            xs = jax.tree.map(lambda a: a[:stop], (bf16_as_bits(stacked), jnp.arange(self.config.num_layers)))
            if self.remat != "none":  # backward: recompute a layer from its input, keep what the policy saves
                body = jax.checkpoint(body, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
            (x, k, v, _), records = jax.lax.scan(body, (x, cache.k, cache.v, carried), xs)
        else:
            carry, ys = (x, cache.k, cache.v, carried), []
            for layer, params in enumerate(forward.weights[:stop]):
                carry, y = body(carry, (params, jnp.int32(layer)))
                ys.append(y)
            (x, k, v, _), records = carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)
        cache = cache.replace(k=k, v=v, index=cache.index + length)
        return LayerRun(x if forward.stop is not None else self.final_norm(x), cache, records)

    def rerun_slots(self, hidden, slots, cache: KVCache, start: int) -> KVCache:
        """`cache` with layers `start..L-1` rerun for the tokens it holds at `slots` [B, n], from their residual stream
        before layer `start`, `hidden` [B, n, D]: each layer's attention reads the cache's K/V at every other slot, and
        their new K/V overwrite their own (slots past the capacity are ignored)."""
        graphdef, stacked = nnx.split(self.layers)
        positions = jnp.take_along_axis(cache.positions, jnp.minimum(slots, cache.capacity - 1), 1)

        def body(carry, xs):
            x, k_all, v_all = carry
            layer_params, layer = xs
            view = SlotCache(k_all, v_all, layer, slots, positions, cache)
            x = nnx.merge(graphdef, bits_as_bf16(layer_params))(x, positions, layer, view)
            return (x, view.k_all, view.v_all), None

        xs = jax.tree.map(lambda a: a[start:], (bf16_as_bits(stacked), jnp.arange(self.config.num_layers)))
        (_, k, v), _ = jax.lax.scan(body, (hidden, cache.k, cache.v), xs)
        return cache.replace(k=k, v=v)

    def rope_tables(self, positions):
        """(each layer's index [L] into the tables, cos [F, B, T, 1, d], sin) of the F distinct RoPEs at `positions`
        [B, T], or None (no RoPE): computed once outside the layer loop (a rotary family overrides this)."""
        return None

    def embed(self, ids, positions):
        """The first layer's input residual stream [B, T, D] of `ids` at `positions`."""
        return self.input_embeddings(self.token_embeddings(ids), positions)

    def input_embeddings(self, x, positions):
        """Token embeddings x [B, T, E] (transformers' `inputs_embeds`: after Gemma's scale) -> the first layer's
        input: GPT-2 and OPT add position embeddings here (OPT-350m projects first); the others take x as it is."""
        return x

    @property
    def embedding_width(self) -> int:
        """E, the width of `token_embeddings` and of the final-normed hidden states (OPT-350m's 512, else D)."""
        return self.config.word_embed_proj_dim or self.config.hidden_size

    def final_norm(self, x):
        return x

    def run_bottom(self, ids, mask, stop: int, capacity: int):
        """Layers `0..stop-1` over the context `ids` [B, T] (padding per `mask`, bool) into an empty cache of
        `capacity` slots: (that cache, the residual stream after them [B, T, D]; None when stop = 0, where the cache
        holds the context's slots and no K/V)."""
        cache = self.init_cache(ids.shape[0], capacity)
        if stop:
            run = self.run_layers(Forward(ids, mask, fresh=True, stop=stop), cache)
            return run.cache, run.hidden
        return cache.append_slots(positions_from_mask(mask), mask), None

    def lone_key_values(self, ids, index, layers):
        """K and V at `layers`, each [W, B, K, 1, d], of each row's token at `index` [B] of `ids` [B, T] read alone,
        as a context of its own."""
        cache = self.run_layers(Forward(ids[jnp.arange(ids.shape[0]), index][:, None])).cache
        pick = jnp.asarray(layers)
        return cache.k[pick], cache.v[pick]

    def layer_key_values(self, layers, x_k, x_v, positions):
        """K and V [B, T, W, K, d] of the W `layers` (keys as cached: normed and rotated by the layer itself) from
        residual-stream inputs x_k and x_v [B, T, W, D], each as its layer's own forward computes them."""
        graphdef, stacked = nnx.split(self.layers)
        picked = jnp.asarray(layers)

        def one(params, layer, x_k, x_v):
            block = nnx.merge(graphdef, params)
            return block.key_value(x_k, positions, layer)[0], block.key_value(x_v, positions, layer)[1]

        chosen = jax.tree.map(lambda a: a[picked], stacked)
        return jax.vmap(one, in_axes=(0, 0, 2, 2), out_axes=2)(chosen, picked, x_k, x_v)

    def rotate_keys(self, k, positions, layers):
        """Keys k [B, T, W, K, d] of the W `layers`, each rotated as its layer rotates keys at `positions` [B, T]
        (negated positions undo that rotation). Keys of a model without RoPE carry no position: they stay as they
        are (a rotary family overrides this)."""
        return k


def positions_from_mask(mask):
    """[B, T] each token's position counting its row's valid tokens from 0 (padding before a row's first token
    takes 0), for left and right padding."""
    return jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)


def first_valid_index(mask):
    """[B] index of each row's first valid token (works for left and right padding)."""
    return jnp.argmax(mask, axis=1)


def last_valid_index(mask):
    """[B] index of each row's last valid token (works for left and right padding)."""
    length = mask.shape[1]
    return length - 1 - jnp.argmax(mask[:, ::-1].astype(jnp.int32), axis=1)
