"""What every family shares: the config and the forward over a stack of layers with a KV cache (generation:
`mot_jax.models.generation`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from mot_jax import kernels
from mot_jax.models.cache import KVCache
from mot_jax.models.layers import GLOBAL_WINDOW, attention, attention_weights, bf16_as_bits, bits_as_bf16, einsum

PREFILL_BLOCK = 512  # query block of a prefill into an empty cache (causal blocks above the diagonal are skipped)
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


@struct.dataclass
class Injection:
    """Per-layer changes to a prefill over T new tokens: MoT's replay of the target over its context.

    A layer with `slot[l] >= 0` computes its own K/V (and caches them) but its attention reads the injected
    `k[slot[l]]`, `v[slot[l]]` for the new tokens instead; or, with `hidden` (MoT-h; k and v None), the layer takes
    `hidden[slot[l]]` as its input residual stream and runs on it as usual. A layer with `sparse[l]` lets each query
    attend only to the keys listed in `sparse_index[l]` (token indices into the new tokens; out-of-range entries are
    ignored).
    """

    k: jax.Array | None  # [W, B, K, T, d]
    v: jax.Array | None  # [W, B, K, T, d]
    slot: jax.Array  # [L] int32, -1 = not injected
    sparse_index: jax.Array | None = None  # [L, B, T, k] int32
    sparse: jax.Array | None = None  # [L] bool
    hidden: jax.Array | None = None  # [W, B, T, D] the injected layers' input residual streams


class LayerCache:
    """One layer's view of the cache inside the layer scan: a block calls `attend` with its new q, k, v.

    It writes the new k, v into the full cache at (layer, index) and attends over every slot, reading injected
    K/V and a sparse key set where an `Injection` says so; the updated cache arrays (and the head-averaged top-k
    attention indices, when asked for) are read back after the block has run (trace-time bookkeeping only).
    """

    def __init__(self, k_all, v_all, layer, index, q_pos, cache: KVCache, injection=None, topk=0, fresh=False):
        self.k_all, self.v_all, self.layer, self.index = k_all, v_all, layer, index
        self.q_pos, self.k_pos, self.k_valid = q_pos, cache.positions, cache.valid
        if cache.hidden is not None:  # slots this layer does not see (KVComm)
            self.k_valid = self.k_valid & ~jax.lax.dynamic_index_in_dim(cache.hidden, layer, keepdims=False)
        self.injection, self.topk, self.topk_indices = injection, topk, None
        self.fresh = fresh  # the cache was empty before these tokens (index 0, known when tracing)
        self.rope = None  # this layer's RoPE cos and sin at q_pos, when the model computed them for every layer

    def attend(self, q, k, v, *, scale, window=GLOBAL_WINDOW, softcap=None):
        """q: [B, T, H, d], k/v: [B, T, K, d] for the new tokens; returns [B, T, H * d]."""
        self.write(k, v)
        length = q.shape[1]
        if self.fresh:  # only the new tokens can be visible: attend over them, in causal blocks
            k_layer, v_layer = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
            k_pos, k_valid, offset = self.k_pos[:, :length], self.k_valid[:, :length], 0
        else:
            k_layer = jax.lax.dynamic_index_in_dim(self.k_all, self.layer, keepdims=False)
            v_layer = jax.lax.dynamic_index_in_dim(self.v_all, self.layer, keepdims=False)
            k_pos, k_valid, offset = self.k_pos, self.k_valid, self.index
        allowed = None
        if self.injection is not None:
            k_layer, v_layer, allowed = self.injected(k_layer, v_layer, length, offset)
        if allowed is None and not self.topk and kernels.supports(q, k_layer, v_layer, softcap):
            return attention(
                q, k_layer, v_layer, self.q_pos, k_pos, k_valid, scale=scale, window=window, softcap=softcap
            )
        # XLA's attention (no kernel, sparse keys or top-k indices asked for): query blocks of a fresh prefill skip
        # the keys after their last query (all causally masked).
        block = PREFILL_BLOCK if self.fresh and length > PREFILL_BLOCK else length
        topk = min(self.topk, block)
        outs, tops = [], []
        for start in range(0, length, block):
            stop = min(start + block, length)
            keys = stop if self.fresh else k_layer.shape[2]
            probs = attention_weights(
                q[:, start:stop],
                k_layer[:, :, :keys],
                self.q_pos[:, start:stop],
                k_pos[:, :keys],
                k_valid[:, :keys],
                scale=scale,
                window=window,
                softcap=softcap,
                allowed=None if allowed is None else allowed[:, start:stop, :keys],
            )
            if topk:  # the keys this layer attends to most, averaged over heads: [B, block, topk]
                tops.append(jax.lax.top_k(probs.mean(axis=(1, 2)), topk)[1].astype(jnp.int32))
            outs.append(einsum("bkgts,bksd->btkgd", probs.astype(v_layer.dtype), v_layer[:, :, :keys]))
        if topk:
            self.topk_indices = jnp.concatenate(tops, axis=1)
        return jnp.concatenate(outs, axis=1).reshape(*q.shape[:2], -1)

    def write(self, k, v):
        """The new tokens' k, v [B, T, K, d] into this layer's slots [index, index + T)."""
        at = (self.layer, 0, 0, self.index, 0)
        self.k_all = jax.lax.dynamic_update_slice(self.k_all, k.transpose(0, 2, 1, 3)[None], at)
        self.v_all = jax.lax.dynamic_update_slice(self.v_all, v.transpose(0, 2, 1, 3)[None], at)

    def injected(self, k_layer, v_layer, length, offset):
        """This layer's attention keys/values and allowed-key mask under the injection (new tokens at `offset`)."""
        inj, layer_slot = self.injection, self.injection.slot
        if inj.k is not None:
            use = layer_slot >= 0
            read = lambda a: jax.lax.dynamic_index_in_dim(a, jnp.maximum(layer_slot, 0), keepdims=False)
            at = (0, 0, offset, 0)
            k_layer = jnp.where(
                use, jax.lax.dynamic_update_slice(k_layer, read(inj.k).astype(k_layer.dtype), at), k_layer
            )
            v_layer = jnp.where(
                use, jax.lax.dynamic_update_slice(v_layer, read(inj.v).astype(v_layer.dtype), at), v_layer
            )
        if inj.sparse_index is None:
            return k_layer, v_layer, None
        b, capacity = k_layer.shape[0], k_layer.shape[2]
        index = inj.sparse_index  # [B, T, k] token indices into the new tokens
        slots = jnp.where((index >= 0) & (index < length), index + offset, capacity)
        rows = jnp.arange(b)[:, None, None]
        chosen = (
            jnp.zeros((b, length, capacity), bool)
            .at[rows, jnp.arange(length)[None, :, None], slots]
            .set(True, mode="drop")
        )
        return k_layer, v_layer, chosen | ~inj.sparse


class SlotCache(LayerCache):
    """A layer's view for tokens already in the cache (`CausalLM.rerun_slots`): their new k, v overwrite their own
    slots `slots` [B, n] (slots past the capacity are dropped) instead of being appended."""

    def __init__(self, k_all, v_all, layer, slots, q_pos, cache: KVCache):
        super().__init__(k_all, v_all, layer, cache.index, q_pos, cache)
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
        empty (as `init_cache` returns it), which lets a long prefill skip causally masked key blocks. `layers`: see
        `run_layers`."""
        hidden, cache, _ = self.run_layers(input_ids, attention_mask, positions, cache, fresh=fresh, layers=layers)
        return hidden, cache

    def layer_params(self) -> list:
        """Each layer's parameters as arrays of their own, sliced from the stacked weights once, for `run_layers`'s
        `layers`. The layer scan copies each layer's weights out of the stack on every pass, which in a loop of
        single-token steps moves the whole model twice more per token than reading it; a loop that runs the layers
        over these reads them where they lie. (bf16 weights are sliced as their bits: see `bf16_as_bits`.)"""
        _, stacked = nnx.split(self.layers)
        bits = bf16_as_bits(stacked)
        return [bits_as_bf16(jax.tree.map(lambda a, i=i: a[i], bits)) for i in range(self.config.num_layers)]

    def run_layers(
        self,
        input_ids,
        attention_mask=None,
        positions=None,
        cache=None,
        injection=None,
        topk=0,
        fresh=False,
        stop=None,
        layer_inputs=False,
        view=LayerCache,
        embeddings=None,
        layers=None,
    ):
        """`hidden_states` with an optional `Injection`, and with `topk > 0` also each layer's top-k attended keys
        (head-averaged attention weights) as [L, B, T, topk] slot indices (else None). With `stop` only layers
        `0..stop-1` run (the cache's other layers stay as they were) and the hidden states are their output, the
        residual stream before layer `stop`, not final-normed. `layer_inputs=True` returns a fourth value: every
        layer's input residual stream [L, B, T, D]. `view` is the class of each layer's view of the cache (a
        `LayerCache`); what it leaves in `topk_indices` is stacked over layers and returned (a subclass may record
        another per-layer statistic there: KVComm's calibration records attention mass). `embeddings` [B, T, E] replace
        the token embeddings of `input_ids` (transformers' `inputs_embeds`, `token_embeddings`: Interlat's latents);
        `input_ids` then give only the shape. `layers` (from `layer_params`, computed outside a loop over tokens)
        runs the layers one after another in the program, each on its own arrays, instead of a scan over the stack."""
        batch, length = input_ids.shape
        mask = jnp.ones((batch, length), bool) if attention_mask is None else attention_mask.astype(bool)
        if cache is None:
            cache, fresh = self.init_cache(batch, length), True
        if positions is None:
            positions = cache.next_positions()[:, None] + positions_from_mask(mask)
        cache = cache.append_slots(positions, mask)
        x = self.embed(input_ids, positions) if embeddings is None else self.input_embeddings(embeddings, positions)

        graphdef, stacked = nnx.split(self.layers)
        rope = self.rope_tables(positions)  # once, outside the layer loop
        per_layer = None
        if injection is not None:  # the injection's per-layer fields travel through the scan
            per_layer = injection.replace(k=None, v=None, hidden=None)

        def body(carry, xs):
            x, k_all, v_all = carry
            layer_params, layer, layer_injection = xs
            layer_params = bits_as_bf16(layer_params)
            if layer_injection is not None:
                layer_injection = layer_injection.replace(k=injection.k, v=injection.v)
                if injection.hidden is not None:  # MoT-h: an injected layer's input residual stream is replaced
                    slot = layer_injection.slot
                    replaced = jax.lax.dynamic_index_in_dim(injection.hidden, jnp.maximum(slot, 0), keepdims=False)
                    x = jnp.where(slot >= 0, replaced.astype(x.dtype), x)
            layer_cache = view(k_all, v_all, layer, cache.index, positions, cache, layer_injection, topk, fresh)
            if rope is not None:
                kinds, cos, sin = rope
                layer_cache.rope = (cos[kinds[layer]], sin[kinds[layer]])
            inputs = x if layer_inputs else None
            x = nnx.merge(graphdef, layer_params)(x, positions, layer, layer_cache)
            return (x, layer_cache.k_all, layer_cache.v_all), (layer_cache.topk_indices, inputs)

        xs = (bf16_as_bits(stacked), jnp.arange(self.config.num_layers), per_layer)
        if stop is not None:
            xs = jax.tree.map(lambda a: a[:stop], xs)
        if layers is None:
            (x, k, v), (topk_indices, inputs) = jax.lax.scan(body, (x, cache.k, cache.v), xs)
        else:
            carry, ys = (x, cache.k, cache.v), []
            for layer, params in enumerate(layers[:stop]):
                own = jax.tree.map(lambda a, layer=layer: a[layer], per_layer)
                carry, y = body(carry, (params, jnp.int32(layer), own))
                ys.append(y)
            (x, k, v), (topk_indices, inputs) = carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)
        cache = cache.replace(k=k, v=v, index=cache.index + length)
        out = (x if stop is not None else self.final_norm(x)), cache, topk_indices
        return (*out, inputs) if layer_inputs else out

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
        """(each layer's index [L], cos [F, B, T, 1, d], sin) of the F distinct RoPEs at `positions` [B, T], or None
        (no RoPE): computed once outside the layer loop (a rotary family overrides this)."""
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

    def window_key_values(self, layers, x_k, x_v, positions):
        """K and V [B, T, W, K, d] of the W `layers` (keys as cached: normed and rotated by the layer itself) from
        residual-stream inputs x_k and x_v [B, T, W, D], each as its layer's own forward computes them."""
        graphdef, stacked = nnx.split(self.layers)
        picked = jnp.asarray(layers)

        def one(params, layer, x_k, x_v):
            block = nnx.merge(graphdef, params)
            return block.key_value(x_k, positions, layer)[0], block.key_value(x_v, positions, layer)[1]

        chosen = jax.tree.map(lambda a: a[picked], stacked)
        return jax.vmap(one, in_axes=(0, 0, 2, 2), out_axes=2)(chosen, picked, x_k, x_v)


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
