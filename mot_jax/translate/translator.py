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

`KVTranslator` holds the trainable parameters (a K and a V mixture, or projector, and with `linear_skip` a linear map
per window layer beside each, set by least squares before training: `linear_skip.py`; or C2C's K and V fusers,
`c2c.py`, which add gated residuals to the target's own prefill: `fuse_receiver`; or LSC's, `lsc.py`, every source
layer through a shared latent into every target layer; or MoT-h's one mixture, `mot_h.py`, from the source's window
layers' input residual streams to the target's, which replace its own in its forward: `replace_inputs`; or
Interlat's adapter, `interlat.py`, from the source's last hidden states to the target's input embeddings, whose
forward builds the cache: `embed_latents`);
`translate` is the jittable function that training and evaluation share. The pipeline from text to a target cache
(`read_source`, `CacheTranslator`) is `pipeline.py`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from mot_jax.errors import MotJaxError
from mot_jax.models import decoder
from mot_jax.models.base import CausalLM, Injection, first_valid_index, positions_from_mask
from mot_jax.models.layers import apply_rope, einsum, param
from mot_jax.translate import align as alignment_lib
from mot_jax.translate import c2c, channels, interlat, lsc, mot_h
from mot_jax.translate.expert import TranslatorConfig
from mot_jax.translate.mixture import MixtureOfTranslators
from mot_jax.translate.projector import Projector

MODES = ("replay", "direct")
INPUTS = ("source", "embeddings", "hidden")  # what the translator may read per token (TranslationSpec.inputs)
# what it writes per token and layer (TranslationSpec.outputs; kind='mot_h': "residual", kind='interlat': "embeddings")
OUTPUTS = ("kv", "hidden")


class NoMixture(nnx.Module):
    """`kind="linear"`: no mixture beside the linear skip, which is then the whole translator (least-squares
    started, then trained): the cheapest translator."""

    def __init__(self, cfg: TranslatorConfig, *, rngs, dtype=jnp.float32):
        self.width = cfg.target_width

    def __call__(self, x, mask):
        return jnp.zeros((*x.shape[:-1], self.width), x.dtype), {}


# TranslatorConfig.kind -> module
KINDS = {
    "mot": MixtureOfTranslators,
    "projector": Projector,
    "linear": NoMixture,
    "c2c": c2c.ResidualCacheFuser,
    "lsc": lsc.LatentTranslator,
    "mot_h": MixtureOfTranslators,
    "interlat": interlat.Adapter,
}
alignment_lib.register_pytree()  # alignments enter jitted code here


@dataclasses.dataclass(frozen=True)
class TranslationSpec:
    """Where translated K/V come from and go to, and how the target uses them (static)."""

    mode: str  # "replay" | "direct"
    source_layers: tuple  # per window slot, the source layer read (direct: may repeat)
    target_layers: tuple  # per window slot, the target layer written (direct: every layer)
    layer_map: tuple  # per target layer, its source layer (sparse-attention indices; channel interpolation)
    sparse_attention: bool = True  # replay: top-k attention from the source's attention (paper) or dense
    k_attn: int = 32
    dense_bottom: int = 2  # replay: layers below this stay dense
    rotary: bool = False  # un-rotate source keys, translate, re-rotate at target positions
    native_bottom: int = 0  # direct: the target's own layers below this run over the context (their K/V native)
    inputs: tuple = ("source",)  # per token, a subset of INPUTS
    # K/V (paper), or layer inputs that the target's own K/V projections turn into K/V (ours, "hidden"), or
    # "residual" (kind='mot_h'): the window layers' input residual streams, replacing the target's own in its forward,
    # or "embeddings" (kind='interlat'): the target's input embeddings, from the source's last hidden states
    outputs: str = "kv"

    @property
    def reads_source(self) -> bool:
        return "source" in self.inputs

    @property
    def layer_inputs(self) -> bool:
        """kind='mot_h': the source hands over its layers' input residual streams (`source_read`), not its K/V."""
        return self.outputs == "residual"

    @property
    def last_hidden(self) -> bool:
        """kind='interlat': the source hands over its last layer's (final-normed) hidden states (`source_read`)."""
        return self.outputs == "embeddings"

    @property
    def attention_topk(self) -> int:
        """Keys per query the replay takes from the source's attention; 0 when the target attends densely."""
        return self.k_attn if self.mode == "replay" and self.sparse_attention else 0

    def to_dict(self) -> dict:
        """Every field, JSON-ready (tuples as lists): what a checkpoint's identity and an export's config.json hold."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, saved: dict) -> TranslationSpec:
        """Back from `to_dict()` (JSON lists to tuples), also as saved before later fields existed
        (`with_added_fields`)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in cls.with_added_fields(saved).items()})

    @staticmethod
    def with_added_fields(saved: dict) -> dict:
        """A saved dict (JSON form) plus the fields added after runs were saved, at the value those runs had, so
        that they still resume and load (fixed here: a later change of a default must not change an old run)."""
        return dict(native_bottom=0, inputs=["source"], outputs="kv") | saved

    @classmethod
    def build(
        cls,
        mode,
        channel_map,
        num_source_layers,
        num_target_layers,
        native_bottom=0,
        inputs=("source",),
        outputs="kv",
        fuse=False,
        every_source_layer=False,
        residual=False,
        latents=False,
        **kwargs,
    ):
        """`fuse` (kind='c2c'): a direct window of C2C's terminal alignment, the top min(Ls, Lt) layers of each side
        paired from the top, in place of every target layer. `every_source_layer` (kind='lsc'): a direct window that
        reads all source layers in order (not the full-depth map's one per target layer) and writes every target
        layer. `residual` (kind='mot_h'): outputs="residual", the window layers' input residual streams. `latents`
        (kind='interlat'): outputs="embeddings", a direct window that reads the source's last layer and whose forward
        writes every target layer."""
        if mode not in MODES:
            raise MotJaxError(f"Unknown translation mode {mode!r}; use one of {', '.join(MODES)}.")
        if outputs not in OUTPUTS:
            raise MotJaxError(f"Unknown translator outputs {outputs!r}; use one of {', '.join(OUTPUTS)}.")
        if residual:
            if outputs != "kv":
                raise MotJaxError(
                    f"kind='mot_h' writes the window layers' input residual streams, not outputs={outputs!r}; "
                    "leave outputs at 'kv' (its default)."
                )
            outputs = "residual"
        if latents:
            if outputs != "kv":
                raise MotJaxError(
                    f"kind='interlat' writes the target's input embeddings, not outputs={outputs!r}; leave outputs at "
                    "'kv' (its default)."
                )
            outputs = "embeddings"
        inputs = tuple(inputs)
        if not inputs or any(i not in INPUTS for i in inputs) or len(set(inputs)) < len(inputs):
            raise MotJaxError(f"Bad translator inputs {inputs!r}; pass a comma list of {', '.join(INPUTS)}.")
        if native_bottom and mode != "direct":
            raise MotJaxError("native_bottom applies to mode='direct' only; set it to 0 for replay.")
        if not 0 <= native_bottom <= num_target_layers:
            raise MotJaxError(
                f"native_bottom={native_bottom} is outside 0..{num_target_layers} (the target's layers); pass one in "
                "that range."
            )
        if "hidden" in inputs and not native_bottom:
            raise MotJaxError(
                "The 'hidden' input is the target's residual stream after its native bottom layers; "
                "set native_bottom > 0 or drop it."
            )
        kwargs |= dict(native_bottom=int(native_bottom), inputs=inputs, outputs=outputs)
        if mode == "direct":
            layer_map = tuple(int(s) for s in channels.full_depth(num_source_layers, num_target_layers))
            source = layer_map[native_bottom:]
            target = tuple(range(native_bottom, num_target_layers))
            if fuse:
                top = channels.terminal(num_source_layers, num_target_layers, 1.0)
                source, target = tuple(top.source), tuple(top.target)
            if every_source_layer:
                source = tuple(range(num_source_layers))
            if latents:  # one source read, its last layer's output
                source = (num_source_layers - 1,)
        else:
            channel_map.validate(num_source_layers, num_target_layers)
            source, target = tuple(channel_map.source), tuple(channel_map.target)
            layer_map = channels.target_to_source_layers(channel_map, num_target_layers, num_source_layers)
        return cls(mode, source, target, tuple(int(s) for s in layer_map), **kwargs)


def mixture_config(spec: TranslationSpec, source: CausalLM, target: CausalLM, **kwargs) -> TranslatorConfig:
    s, t = source.config, target.config
    target_features = sum(i != "source" for i in spec.inputs) * t.hidden_size
    source_width = s.hidden_size if spec.layer_inputs else s.num_kv_heads * s.head_dim
    target_width = t.hidden_size if spec.outputs in ("hidden", "residual") else t.num_kv_heads * t.head_dim
    if spec.last_hidden:  # kind='interlat': hidden states in, input embeddings out
        source_width, target_width = source.embedding_width, target.embedding_width
    return TranslatorConfig(
        source_width=source_width * spec.reads_source + target_features,
        target_width=target_width,
        window=len(spec.target_layers),
        **kwargs | dict(source_window=len(spec.source_layers) if kwargs.get("kind") == "lsc" else 0),
    )


class LinearSkip(nnx.Module):
    """Per window layer, y = x @ kernel + bias from the aligned source vectors [B, T, W, ds] to [B, T, W, dt]; zero
    until training starts it at the least-squares fit (`linear_skip.solve_linear_skip`)."""

    def __init__(self, cfg: TranslatorConfig, *, dtype=jnp.float32):
        shape = (cfg.window, cfg.source_width, cfg.target_width)
        self.kernel = param(None, shape, ("layers", None, None), dtype, "zeros")
        self.bias = param(None, (cfg.window, cfg.target_width), ("layers", None), dtype, "zeros")

    def __call__(self, x):
        return einsum("btwi,wio->btwo", x, self.kernel[...]) + self.bias[...]


class KVTranslator(nnx.Module):
    """Separate mixtures for K and V, as the paper (or, `cfg.kind="projector"`, the C2C-Project baseline's MLPs,
    `"c2c"`, C2C's fusers: `fuse`, or `"lsc"`, LSC's latent translators, all source layers to all target layers), and
    with `cfg.linear_skip` a linear map beside each whose output is added to theirs; `"mot_h"`: one mixture, `hidden`,
    of residual streams (`replace_inputs`); `"interlat"`: one adapter, `adapter`, of hidden states into the target's
    input embeddings (`embed_latents`)."""

    def __init__(self, spec: TranslationSpec, cfg: TranslatorConfig, *, rngs, dtype=jnp.float32):
        if cfg.kind == "mot_h":  # first: its rotary refusal says why rotary means nothing for it
            mot_h.check_spec(spec, cfg)
        elif spec.layer_inputs:
            raise MotJaxError("outputs='residual' (residual streams in place of K/V) is MoT-h's; set kind='mot_h'.")
        if cfg.kind == "interlat":
            interlat.check_spec(spec, cfg)
        elif spec.last_hidden:
            raise MotJaxError(
                "outputs='embeddings' (the target's input embeddings) is Interlat's; set kind='interlat'."
            )
        if spec.rotary and cfg.output_activation != "none":
            raise MotJaxError("rotary=True needs output_activation='none' (rotated keys take any sign).")
        if cfg.kind not in KINDS:
            raise MotJaxError(f"Unknown translator kind {cfg.kind!r}; use one of {', '.join(KINDS)}.")
        if cfg.kind == "linear" and not cfg.linear_skip:
            raise MotJaxError("kind='linear' is the linear skip alone; set linear_skip=True.")
        if cfg.kind == "c2c":
            c2c.check_fusable(spec, cfg)
        if cfg.kind == "lsc":
            lsc.check_spec(spec, cfg)
        self.spec, self.cfg = spec, cfg
        if not spec.target_layers:  # native_bottom = L: nothing to translate (native context), no parameters
            return
        if cfg.kind == "mot_h":  # one mixture of the residual stream, not one per K and V
            self.hidden = KINDS[cfg.kind](cfg, rngs=rngs, dtype=dtype)
            return
        if cfg.kind == "interlat":  # one adapter of the last hidden states
            self.adapter = KINDS[cfg.kind](cfg, rngs=rngs, dtype=dtype)
            return
        self.key = KINDS[cfg.kind](cfg, rngs=rngs, dtype=dtype)
        self.value = KINDS[cfg.kind](cfg, rngs=rngs, dtype=dtype)
        if cfg.linear_skip:
            self.key_skip, self.value_skip = LinearSkip(cfg, dtype=dtype), LinearSkip(cfg, dtype=dtype)

    def __call__(self, k, v, mask):
        """Aligned source window vectors k, v [B, T, W, ds] -> translated k, v [B, T, W, dt] and the aux outputs."""
        k_out, aux_k = self.key(k, mask)
        v_out, aux_v = self.value(v, mask)
        if self.cfg.linear_skip:
            k_out, v_out = k_out + self.key_skip(k), v_out + self.value_skip(v)
        return k_out, v_out, {"key": aux_k, "value": aux_v}

    def fuse(self, own_k, own_v, k, v, mask, noise=None):
        """kind='c2c': the receiver's window K/V own_k, own_v [B, T, W, dt] fused with the aligned source's k, v
        [B, T, W, ds] -> fused k, v [B, T, W, dt] and the aux outputs, with "gate": the K and V gates [2, W]; `noise` a
        `c2c.GateNoise` in training (split: K and V draw their own), None for the hard gate."""
        k_noise, v_noise = (None, None) if noise is None else noise.split()
        k_out, gate_k = self.key(own_k, k, mask, k_noise)
        v_out, gate_v = self.value(own_v, v, mask, v_noise)
        return k_out, v_out, {"key": {}, "value": {}, "gate": jnp.stack([gate_k, gate_v])}


def source_read(source: CausalLM, source_ids, source_mask, topk=0, layer_inputs=False, last_hidden=False):
    """The source's prefill of its context as a translator reads it: (its cache, its attention's top-k key indices
    [Ls, B, S, k] with `topk > 0`, else None). `layer_inputs` (kind='mot_h', `spec.layer_inputs`): the cache's K holds
    every layer's input residual stream [Ls, B, S, D] as one head of width D, and V nothing (width 0), so that
    batching, the alignment and `window_block` take the streams as they take K. `last_hidden` (kind='interlat',
    `spec.last_hidden`): so does the last layer's final-normed output [1, B, 1, S, E], one layer."""
    hidden, cache, indices, *inputs = source.run_layers(source_ids, source_mask, topk=topk, layer_inputs=layer_inputs)
    if last_hidden:
        states = hidden[None, :, None].astype(cache.k.dtype)  # [1, B, 1, S, E]
        cache = cache.replace(k=states, v=states[..., :0])
    if layer_inputs:
        streams = inputs[0][:, :, None].astype(cache.k.dtype)  # [Ls, B, 1, S, D]
        cache = cache.replace(k=streams, v=streams[..., :0])
    return cache, indices


def rope_or_none(model: CausalLM):
    return decoder.rope_table(model.config) if model.config.rotary else None


def window_block(cache_kv, layers, positions=None, inv_freq=None):
    """[L, B, K, S, d] -> the window layers as [B, S, W, K * d]; un-rotated by -positions when given tables."""
    x = cache_kv[jnp.asarray(layers)].transpose(1, 3, 0, 2, 4)  # [B, S, W, K, d]
    if inv_freq is not None:
        x = jnp.stack([apply_rope(x[:, :, i], -positions, inv_freq[li]) for i, li in enumerate(layers)], 2)
    return x.reshape(*x.shape[:3], -1)


def first_token_kv(target: CausalLM, target_ids, first, layers):
    """The target's own K/V at `layers` of each row's first token (at index `first` [B]), each [W, B, Kt, 1, dt].
    The first token attends only to itself, so its K/V depend on that token alone (a BOS: the attention sink every
    later token reads) and are computed exactly, not translated."""
    _, cache, _ = target.run_layers(target_ids[jnp.arange(target_ids.shape[0]), first][:, None])
    pick = jnp.asarray(layers)
    return cache.k[pick], cache.v[pick]


def rotary_tables(spec: TranslationSpec, source: CausalLM, target: CausalLM):
    """(source, target) RoPE tables when keys are translated un-rotated (spec.rotary and both models rotary), else
    (None, None)."""
    source_freq, target_freq = rope_or_none(source), rope_or_none(target)
    if spec.rotary and source_freq is not None and target_freq is not None:
        return source_freq, target_freq
    return None, None


def rms_normalized(x):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6)


def run_native_bottom(spec: TranslationSpec, target: CausalLM, target_ids, mask, cache):
    """The target's own layers `0..native_bottom-1` over the context into `cache` (empty), and the target-side
    features the translator reads ([B, T, F], None when it reads the source alone)."""
    hidden = None
    if spec.native_bottom:
        hidden, cache, _ = target.run_layers(target_ids, mask, cache=cache, fresh=True, stop=spec.native_bottom)
    else:
        cache = cache.append_slots(positions_from_mask(mask), mask)
    features = []
    if "embeddings" in spec.inputs:
        features.append(rms_normalized(target.embed(target_ids, positions_from_mask(mask))))
    if "hidden" in spec.inputs:
        features.append(rms_normalized(hidden))
    return cache, (jnp.concatenate(features, -1) if features else None)


def window_inputs(spec: TranslationSpec, source: CausalLM, target: CausalLM, source_cache, alignment, features=None):
    """The translator's inputs, each [B, T, W, F]: the window's source K (un-rotated for rotary specs) and V on the
    target grid (`spec.reads_source`), then the target-side `features` [B, T, Ft] of every window layer."""
    parts_k, parts_v = [], []
    if spec.reads_source:
        source_freq, _ = rotary_tables(spec, source, target)
        k = window_block(source_cache.k, spec.source_layers, source_cache.positions, source_freq)
        v = window_block(source_cache.v, spec.source_layers)
        parts_k.append(alignment_lib.resample(k, alignment.weights))
        parts_v.append(alignment_lib.resample(v, alignment.weights))
    if features is not None:
        shared = jnp.broadcast_to(
            features[:, :, None], (*features.shape[:2], len(spec.target_layers), features.shape[-1])
        )
        dtype = parts_k[0].dtype if parts_k else shared.dtype
        parts_k.append(shared.astype(dtype))
        parts_v.append(shared.astype(dtype))
    return jnp.concatenate(parts_k, -1), jnp.concatenate(parts_v, -1)


def translate_window(
    translator: KVTranslator, source: CausalLM, target: CausalLM, source_cache, alignment, mask, features=None
):
    """The translated window K/V, each [W, B, Kt, T, dt], and the mixtures' aux outputs {"key": .., "value": ..}."""
    spec, t = translator.spec, target.config
    k, v, aux = translator(*window_inputs(spec, source, target, source_cache, alignment, features), mask)
    pos = positions_from_mask(mask)
    if spec.outputs == "hidden":  # layer inputs: the target's own projections, k-norm and RoPE make the K/V
        k, v = target.window_key_values(spec.target_layers, k, v, pos)  # [B, T, W, Kt, dt]
        return to_cache(k, target), to_cache(v, target), aux
    heads = lambda y: y.reshape(*y.shape[:3], t.num_kv_heads, t.head_dim)
    k, v = heads(k), heads(v)  # [B, T, W, Kt, dt]
    _, target_freq = rotary_tables(spec, source, target)
    if target_freq is not None:
        k = jnp.stack([apply_rope(k[:, :, i], pos, target_freq[li]) for i, li in enumerate(spec.target_layers)], 2)
    return to_cache(k, target), to_cache(v, target), aux


def to_cache(y, target: CausalLM):
    """[B, T, W, K, d] -> the cache layout [W, B, K, T, d] in the target's dtype."""
    return y.transpose(2, 0, 3, 1, 4).astype(target.param_dtype)


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


def fuse_receiver(translator, source, target, source_cache, alignment, target_ids, mask, capacity, receiver, noise):
    """kind='c2c': the target's own prefill of its context (`receiver`, or run here) with its window layers' K/V
    fused with the source's (`c2c.py`), in a cache of `capacity` slots; and the aux outputs (`KVTranslator.fuse`)."""
    spec, t = translator.spec, target.config
    batch, length = target_ids.shape
    if receiver is None:
        _, receiver, _ = target.run_layers(target_ids, mask, cache=target.init_cache(batch, capacity), fresh=True)
    cache = receiver.with_capacity(capacity)
    own = lambda kv: window_block(kv[..., :length, :], spec.target_layers)  # [B, T, W, Kt * dt]
    k, v, aux = translator.fuse(
        own(cache.k), own(cache.v), *window_inputs(spec, source, target, source_cache, alignment), mask, noise
    )
    heads = lambda y: to_cache(y.reshape(*y.shape[:3], t.num_kv_heads, t.head_dim), target)
    layers = jnp.asarray(spec.target_layers)
    return cache.replace(
        k=cache.k.at[layers, :, :, :length].set(heads(k)), v=cache.v.at[layers, :, :, :length].set(heads(v))
    ), aux


@struct.dataclass
class TargetSide:
    """What `translate` reads from the frozen target over a context, whatever the translator (`target_side`): the
    feature cache (training/features.py) stores it per chunk so that training skips those forwards."""

    bottom_k: jax.Array | None  # direct, native_bottom = B > 0: the native K/V of layers 0..B-1, [B, b, Kt, T, dt]
    bottom_v: jax.Array | None
    features: jax.Array | None  # direct: the target-side inputs the translator reads, [b, T, F] (None: source only)
    first_k: jax.Array | None  # the first token's own K/V at the window layers, [W, b, Kt, 1, dt] (None: no window)
    first_v: jax.Array | None


def target_side(spec: TranslationSpec, target: CausalLM, target_ids, mask, capacity: int) -> TargetSide:
    """The `TargetSide` of the context `target_ids` [b, T] (padding per `mask`), as `translate` computes it into a
    cache of `capacity` slots."""
    batch, length = target_ids.shape
    mask = mask.astype(bool)
    bottom_k = bottom_v = features = first_k = first_v = None
    if spec.mode == "direct":
        cache, features = run_native_bottom(spec, target, target_ids, mask, target.init_cache(batch, capacity))
        if spec.native_bottom:
            bottom = lambda kv: kv[: spec.native_bottom, :, :, :length]
            bottom_k, bottom_v = bottom(cache.k), bottom(cache.v)
    if spec.target_layers:
        first_k, first_v = first_token_kv(target, target_ids, first_valid_index(mask), spec.target_layers)
    return TargetSide(bottom_k, bottom_v, features, first_k, first_v)


def replace_inputs(translator, source, target, source_cache, alignment, target_ids, mask, capacity):
    """kind='mot_h': the target's dense forward over its context (a cache of `capacity` slots) with each window layer's
    input residual stream replaced by the translation of the source's (`source_read(layer_inputs=True)`), but at each
    row's first token, which keeps the target's own; (its cache, {"hidden": the mixture's aux outputs})."""
    spec = translator.spec
    batch, length = target_ids.shape
    streams = alignment_lib.resample(window_block(source_cache.k, spec.source_layers), alignment.weights)
    hidden, aux = translator.hidden(streams, mask)  # [B, T, W, Dt]
    first = first_valid_index(mask)
    *_, own = target.run_layers(target_ids[jnp.arange(batch), first][:, None], layer_inputs=True)  # [Lt, B, 1, Dt]
    is_first = (jnp.arange(length) == first[:, None])[None, :, :, None]  # [1, B, T, 1]
    hidden = jnp.where(is_first, own[jnp.asarray(spec.target_layers)], hidden.transpose(2, 0, 1, 3))
    slot = np.full(target.config.num_layers, -1, np.int32)
    slot[list(spec.target_layers)] = np.arange(len(spec.target_layers))
    injection = Injection(k=None, v=None, slot=jnp.asarray(slot), hidden=hidden)
    cache = target.init_cache(batch, capacity)
    _, cache, _ = target.run_layers(target_ids, mask, cache=cache, injection=injection, fresh=True)
    return cache, {"hidden": aux}


def embed_latents(translator, source, target, source_cache, alignment, target_ids, mask, capacity, key=None):
    """kind='interlat': the target's forward over the adapter's latents of the source's last hidden states
    (`source_read(last_hidden=True)`) in place of its context's token embeddings, but at each row's first token,
    which keeps the target's own; its cache (`capacity` slots) and no aux outputs. `key`: the training dropout's."""
    batch, length = target_ids.shape
    hidden = alignment_lib.resample(source_cache.k[0, :, 0], alignment.weights)  # [B, T, Es] on the target grid
    own = target.token_embeddings(target_ids)
    latents = translator.adapter(hidden, mask, key).astype(own.dtype)  # [B, T, Et]
    is_first = (jnp.arange(length) == first_valid_index(mask)[:, None])[..., None]
    cache = target.init_cache(batch, capacity)
    embeddings = jnp.where(is_first, own, latents)
    _, cache, _ = target.run_layers(target_ids, mask, cache=cache, fresh=True, embeddings=embeddings)
    return cache, {}


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
    kind='c2c' only: `receiver`, the target's own prefill of the context when the caller has it (else it runs
    here), and `noise`, the training gate's (`c2c.GateNoise`; None: the hard gate); kind='interlat': `noise`, the
    adapter's training dropout key (None: no dropout). Other kinds: `side`, the
    context's `TargetSide` when the caller has it (else computed here)."""
    spec = translator.spec
    batch, length = target_ids.shape
    mask = target_mask.astype(bool)
    if translator.cfg.kind == "c2c":
        args = (target_ids, mask, capacity or length, receiver, noise)
        return fuse_receiver(translator, source, target, source_cache, alignment, *args)
    if translator.cfg.kind == "mot_h":
        args = (target_ids, mask, capacity or length)
        return replace_inputs(translator, source, target, source_cache, alignment, *args)
    if translator.cfg.kind == "interlat":  # `noise`: the training dropout's key
        args = (target_ids, mask, capacity or length, noise)
        return embed_latents(translator, source, target, source_cache, alignment, *args)
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
    injection = Injection(k=k, v=v, slot=jnp.asarray(slot))
    if spec.sparse_attention:
        if source_topk is None:
            raise MotJaxError("Sparse replay needs the source's attention top-k indices; pass source_topk.")
        sparse = np.arange(target.config.num_layers) >= spec.dense_bottom
        injection = injection.replace(sparse_index=sparse_indices(spec, source_topk, alignment, first), sparse=sparse)
    _, cache, _ = target.run_layers(target_ids, mask, cache=cache, injection=injection, fresh=True)
    return cache, aux
