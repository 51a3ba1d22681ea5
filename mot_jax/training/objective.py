"""The Context Correction objective (reference section 5.1) and the frozen forwards it needs.

loss = CE(prompt labels | translated cache) + lambda * (MSE_K + MSE_V) + router auxiliary losses, where the MSEs
compare the target's cache built from the translation (replay: its own recomputed K/V; direct: the translated K/V)
with its clean prefill of the same context, over the layers from the first window layer to the top (direct: all but
the target's own `native_bottom` layers),
context tokens only, mean over every element. Only the translator receives gradients.

`loss.ce_weight` (ours, default 1) scales the CE; at 0, with no KL, the objective lives in K/V space alone and the
target's forward over the prompt is skipped (validation still reports the CE): what the feature cache
(`features.py`) needs, whose translator-independent inputs are then read from disk instead of computed.

Ours, off by default (`loss.distill_weight`): + mu * KL(native || translated), the target's next-token distributions
over the prompt after its native cache against after the translated one (SwiftKV's distillation objective), at the
labelled positions, softened by `loss.distill_temperature` T and scaled by T^2. CE rewards the labels alone; the KL
asks for the whole distribution the native context gives. `loss.hidden_weight`: + the relative squared error of the
final-normed hidden states there (SwiftKV's hidden-state MSE). The translated side reads as `KVTranslator.receiver`
makes the target: with `translator.receiver_rank` through its adapted queries (`translate/receiver.py`), with the
self-prediction kind's `new_tokens_from_map` making the prompt's upper K/V from each token's layer-B state; the
native side is the target itself.

Ours, off by default (`loss.attention_weight`): + nu * the attention-output error, averaged over the layers
the translator writes (those of the MSEs):

    error_l = sum_{b, p, h, c} (o_l(q, K~, V~) - o_l(q, K, V))^2 / sum_{b, p, h, c} o_l(q, K, V)^2

- Queries q: the target's native queries at the prompt positions p (the ones that read the context at answer time),
  from its native forward over the prompt after its native context cache (= one forward over context + prompt),
  recorded as each layer hands them to attention (q-norm, RoPE at their positions) with the layer's own logit scale
  and sliding window (`QueryProbe`), and the model's soft-cap. Frozen inputs: `NativeReads`, from
  `frozen_forwards(..., reads=True)`, computed only when the term is on. GQA: query head h reads KV head h // (H / K),
  as in the model.
- Keys and values: context + prompt. Native (K, V): that forward's cache. Translated (K~, V~): the same cache with
  the written layers' context slots taken from the translated cache, the prompt's slots kept native. The prompt's
  keys make the softmax compete as at answer time, so a translated context that draws too much or too little
  attention mass counts (over the context alone, a common shift of a query's context logits would be invisible);
  keeping them native keeps each layer's term a function of that layer's translation alone (the prompt's own K/V
  after the translated cache drift with every layer below, which CE and the KL already measure).
- Distance: the squared error of the attention outputs o [H * d] (before the output projection), summed over the
  batch's valid prompt queries (keys masked for padding, causality and windows as in the forward), over the native
  outputs' sum of squares: a relative error, comparable across layers of any scale, 1 for an all-zero output. Not
  1 - cosine: the output projection and the residual stream read the norm too, and values off by a factor keep the
  cosine at 1.

A kind may add a loss of its own (`Kind.extra_loss`: Interlat's plan-similarity and random-contrast terms over the
prompt's next-token distributions, `translate/kinds/interlat.py`).

Also reported, not in the loss: `unexplained_k` / `unexplained_v`, each layer's MSE over that layer's native variance in
the batch (1 - R^2), averaged over layers: a fidelity that does not depend on the models' activation scales, above 1
when the translation is further off than predicting every channel's mean would be.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from mot_jax.errors import MotJaxError
from mot_jax.models.attention import Mask, attend
from mot_jax.models.cache import KVCache
from mot_jax.models.hooks import Forward, LayerHook
from mot_jax.translate import kinds
from mot_jax.translate.translator import source_read, translate


@dataclasses.dataclass(frozen=True)
class LossWeights:
    correction: float = 1.0
    load_balance: float = 0.01
    z_loss: float = 0.001
    distill: float = 0.0
    attention: float = 0.0
    ce: float = 1.0
    temperature: float = 1.0  # the KL's
    hidden: float = 0.0

    @classmethod
    def from_config(cls, loss) -> LossWeights:
        """From a config's `loss` block (configs saved before the later terms have none of them)."""
        return cls(
            loss.correction_weight,
            loss.load_balance_weight,
            loss.z_loss_weight,
            loss.get("distill_weight", 0.0),
            loss.get("attention_weight", 0.0),
            loss.get("ce_weight", 1.0),
            loss.get("distill_temperature", 1.0),
            loss.get("hidden_weight", 0.0),
        )

    @property
    def reads_prompt(self) -> bool:
        """Whether the loss needs the target's forward over the prompt after the translated cache (CE, KL, hidden)."""
        return bool(self.ce or self.distill or self.hidden)

    @property
    def needs_teacher(self) -> bool:
        """Whether the loss needs the target's forward over the prompt after its native cache (KL, hidden)."""
        return bool(self.distill or self.hidden)


@struct.dataclass
class NativeReads:
    """What every layer of a forward over T new tokens attends with: the attention-output term's frozen inputs."""

    queries: jax.Array  # [L, B, T, H, d] as each layer hands them to attention (q-normed, rotated)
    scale: jax.Array  # [L] fp32, each layer's logit scale
    window: jax.Array  # [L] int32, each layer's sliding window (GLOBAL_WINDOW: none)
    positions: jax.Array  # [B, T] the new tokens' positions
    valid: jax.Array  # [B, T] bool, the new tokens' mask
    cache: KVCache  # the cache after the forward: the keys and values it read

    def from_layer(self, first: int) -> NativeReads:
        """The reads of layers `first..L-1` alone (their cache's K/V too)."""
        top = lambda a: a[first:]
        cache = self.cache.replace(k=top(self.cache.k), v=top(self.cache.v))
        return self.replace(queries=top(self.queries), scale=top(self.scale), window=top(self.window), cache=cache)


@struct.dataclass
class QueryProbe(LayerHook):
    """Records the queries, scale and window each layer attends with (`records["queries"]`, `"scale"`, `"window"`)."""

    def attention(self, read, layer, record):
        record.put("queries", read.q)
        record.put("scale", jnp.asarray(read.scale, jnp.float32))
        record.put("window", jnp.asarray(read.mask.window, jnp.int32))
        return read


def layer_reads(model, ids, mask=None, cache=None) -> NativeReads:
    """`NativeReads` of `model` reading `ids` [B, T] (padding per `mask`) after `cache` (None: a fresh one)."""
    run = model.run_layers(Forward(ids, mask), cache, [QueryProbe()])
    cache, queries, scale, window = run.cache, run.records["queries"], run.records["scale"], run.records["window"]
    length = ids.shape[1]
    new = lambda a: jax.lax.dynamic_slice_in_dim(a, cache.index - length, length, axis=1)  # the T slots just written
    return NativeReads(queries, scale, window, new(cache.positions), new(cache.valid), cache)


def read_outputs(reads: NativeReads, k, v, softcap=None):
    """[L, B, T, H * d] fp32: each layer's attention of the recorded queries over k, v [L, B, K, S, d] (masked by the
    recorded cache's slot positions and validity), with the layer's scale and window and the model's `softcap`."""

    def one(q, k, v, scale, window):
        c = reads.cache
        return attend(q, k, v, Mask(reads.positions, c.positions, c.valid, window), scale=scale, softcap=softcap)

    f32 = lambda x: x.astype(jnp.float32)
    return jax.vmap(one)(f32(reads.queries), f32(k), f32(v), reads.scale, reads.window)


def attention_error(reads: NativeReads, k, v, softcap=None):
    """[L] per layer: the squared error of the attention outputs over k, v [L, B, K, S, d] against over the reads'
    own cache, summed over valid queries, over the latter's sum of squares (see the module docstring)."""
    got = read_outputs(reads, k, v, softcap)
    want = read_outputs(reads, reads.cache.k, reads.cache.v, softcap)
    weight = reads.valid[None, :, :, None].astype(jnp.float32)
    error = (jnp.square(got - want) * weight).sum((1, 2, 3))
    return error / jnp.maximum((jnp.square(want) * weight).sum((1, 2, 3)), 1e-12)


def frozen_forwards(
    source, target, batch, topk: int, reads=False, run_source=True, layer_inputs=False, last_hidden=False
):
    """The source's cache (and attention top-k for sparse replay; `layer_inputs`, MoT-h's: its layer inputs in the
    cache layout, `source_read`; `last_hidden`, Interlat's: its last hidden states; both None when not
    `run_source`: a translator that reads nothing of it, `pipeline.runs_source`) and the target's native cache of the
    context; with `reads=True` a fourth value, the target's `NativeReads` of the prompt after that cache (the
    attention term's)."""
    source_cache = source_topk = None
    if run_source:
        args = (batch.source_ids, batch.source_mask, topk, layer_inputs, last_hidden)
        source_cache, source_topk = source_read(source, *args)
    native = target.run_layers(Forward(batch.context, batch.context_mask, fresh=True)).cache
    if not reads:
        return source_cache, source_topk, native
    capacity = batch.context.shape[1] + batch.prompt.shape[1]
    return source_cache, source_topk, native, layer_reads(target, batch.prompt, cache=native.with_capacity(capacity))


def layer_mse(a, b, mask):
    """[L] mean of (a - b)^2 per layer over [L, B, K, T, d] elements whose token (mask [B, T]) is valid."""
    weight = mask[None, :, None, :, None].astype(jnp.float32)
    diff = jnp.square(a.astype(jnp.float32) - b.astype(jnp.float32)) * weight
    return diff.sum((1, 2, 3, 4)) / jnp.maximum(weight.sum() * a.shape[2] * a.shape[4], 1.0)


def layer_variance(x, mask):
    """[L] variance per layer of the valid tokens of x [L, B, K, T, d], around each channel's mean."""
    weight = mask[None, :, None, :, None].astype(jnp.float32)
    mean = (x * weight).sum((1, 3), keepdims=True) / jnp.maximum(weight.sum((1, 3), keepdims=True), 1.0)
    return layer_mse(x, mean, mask)


def token_cross_entropy(logits, labels, mask):
    """Mean next-token cross-entropy over valid label positions, in fp32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1)


def distillation_kl(logits, teacher_logits, mask, temperature=1.0):
    """Mean over valid positions of KL(teacher || student) between next-token distributions softened by
    `temperature` T (logits / T), times T^2 (so that its gradients keep their scale as T changes), in fp32."""
    teacher = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
    student = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    kl = jnp.sum(jnp.exp(teacher) * (teacher - student), axis=-1)
    return temperature**2 * jnp.sum(kl * mask) / jnp.maximum(jnp.sum(mask), 1)


def hidden_error(hidden, teacher_hidden, mask):
    """The squared error of hidden states [B, T, D] against the teacher's, summed over valid positions, over the
    teacher's squared norm there: relative, 1 for all-zero states (fp32)."""
    weight = mask[..., None].astype(jnp.float32)
    want = teacher_hidden.astype(jnp.float32)
    error = jnp.sum(jnp.square(hidden.astype(jnp.float32) - want) * weight)
    return error / jnp.maximum(jnp.sum(jnp.square(want) * weight), 1e-12)


def prompt_cross_entropy(target, cache, batch):
    """CE of the labels when the target reads the prompt after `cache` (None: with no context at all)."""
    logits, _ = target(batch.prompt, cache=cache)
    return token_cross_entropy(logits, batch.labels, batch.label_mask)


def context_correction(
    translator, source, target, batch, frozen, weights: LossWeights, noise=None, side=None, prompt=False
):
    """(loss, metrics) of one micro-batch; `frozen` = `frozen_forwards(...)` (no gradient flows into it), with
    `reads=True` where `weights.attention` is on; `side` the context's `TargetSide` when the caller has it (the
    feature cache), else `translate` computes it. The target reads the prompt after the translated cache, and `ce`
    is reported, where the loss needs it (`weights.reads_prompt`) or `prompt` asks for it (validation)."""
    source_cache, source_topk, native, *reads = jax.lax.stop_gradient(frozen)
    side = jax.lax.stop_gradient(side)
    spec = translator.spec
    context_length, prompt_length = batch.context.shape[1], batch.prompt.shape[1]
    capacity = context_length + prompt_length
    kind = kinds.get(translator.cfg.kind)

    def translated(source_cache, alignment, noise):
        return translate(
            translator,
            source,
            target,
            source_cache,
            alignment,
            batch.context,
            batch.context_mask,
            source_topk,
            capacity=capacity,
            receiver=native,  # C2C fuses into it; `noise`: the kind's training noise (None in validation)
            noise=noise,
            side=side,
        )

    cache, aux = translated(source_cache, batch.alignment, noise)
    first = spec.native_bottom if spec.mode == "direct" else min(spec.target_layers)  # the layers it writes
    context = lambda kv: kv[first:, :, :, :context_length]
    errors = {}
    for name, got, want in (("k", cache.k, native.k), ("v", cache.v, native.v)):
        mse = layer_mse(context(got), want[first:], batch.context_mask)
        unexplained = mse / jnp.maximum(layer_variance(want[first:], batch.context_mask), 1e-12)
        errors |= {f"mse_{name}": mse.mean(), f"unexplained_{name}": unexplained.mean()}
    gates = aux.pop("gate", None)  # C2C: the K and V gates of this forward [2, W]
    routed = [a for a in aux.values() if a]  # the K and V mixtures' aux outputs (empty with one expert)
    load_balance = sum((a["load_balance_loss"] for a in routed), jnp.zeros(()))
    z_loss = sum((a["z_loss"] for a in routed), jnp.zeros(()))
    correction = errors["mse_k"] + errors["mse_v"]
    loss = weights.correction * correction + weights.load_balance * load_balance + weights.z_loss * z_loss
    metrics = dict(**errors, load_balance=load_balance, z_loss=z_loss)
    if gates is not None:
        metrics["gate"] = gates.mean()
    logits = teacher = None
    if weights.reads_prompt or prompt or kind.teacher:  # else a KV-space objective: no forward over the prompt
        reader = translator.receiver(target)  # the target, adapted to read translations where the translator says so
        hidden, _ = reader.hidden_states(batch.prompt, cache=cache)
        logits = reader.unembed(hidden)
        metrics["ce"] = token_cross_entropy(logits, batch.labels, batch.label_mask)
        loss = loss + weights.ce * metrics["ce"]
    if weights.needs_teacher or kind.teacher:  # one more target forward over the prompt, after the native cache
        teacher_hidden, _ = target.hidden_states(batch.prompt, cache=native.with_capacity(capacity))
        teacher_hidden = jax.lax.stop_gradient(teacher_hidden)  # no gradient reaches it
        teacher = target.unembed(teacher_hidden)
    if weights.distill:
        metrics["kl"] = distillation_kl(logits, teacher, batch.label_mask, weights.temperature)
        loss = loss + weights.distill * metrics["kl"]
    if weights.hidden:
        metrics["hidden"] = hidden_error(hidden, teacher_hidden, batch.label_mask)
        loss = loss + weights.hidden * metrics["hidden"]
    if kind.extra_loss:
        extra, terms = kind.extra_loss(
            cfg=translator.cfg,
            translated=translated,
            target=target,
            batch=batch,
            source_cache=source_cache,
            noise=noise,
            cache=cache,
            native=native,
            first=first,
            logits=logits,
            teacher=teacher,
        )
        loss, metrics = loss + extra, metrics | terms
    if weights.attention:
        if not reads:
            raise MotJaxError("The attention-output loss needs the native queries: call frozen_forwards(reads=True).")
        written = reads[0].from_layer(first)  # native reads of context + prompt at the layers the translator writes
        # the translated side: the same cache with its context slots from the translation
        swap = lambda got, want: jnp.concatenate(
            [got[first:, :, :, :context_length], want[:, :, :, context_length:]], 3
        )
        k, v = swap(cache.k, written.cache.k), swap(cache.v, written.cache.v)
        error = attention_error(written, k, v, target.config.attn_softcap)
        metrics["attention"] = error.mean() if error.size else jnp.zeros(())
        loss = loss + weights.attention * metrics["attention"]
    metrics["loss"] = loss
    if routed:
        # query slots per expert and row that dispatch used, as a fraction of the tokens (1: the dense work)
        metrics["dispatch_slots"] = sum(a["stats"]["capacity"] for a in routed) / (len(routed) * context_length)
        metrics["load_cv2"] = sum(a["stats"]["load_cv2"] for a in routed) / len(routed)
    return loss, metrics
