"""The Context Correction objective (reference section 5.1) and the frozen forwards it needs.

loss = CE(prompt labels | translated cache) + lambda * (MSE_K + MSE_V) + router auxiliary losses, where the MSEs
compare the target's cache built from the translation (replay: its own recomputed K/V; direct: the translated K/V)
with its clean prefill of the same context, over the layers from the first window layer to the top (direct: all but
the target's own `native_bottom` layers),
context tokens only, mean over every element. Only the translator receives gradients.

Ours, off by default (`loss.distill_weight`): + mu * KL(native || translated), the target's next-token distributions
over the prompt after its native cache against after the translated one (SwiftKV's distillation objective). CE
rewards the labels alone; the KL asks for the whole distribution the native context gives, at every prompt position.

Also reported, not in the loss: `unexplained_k` / `unexplained_v`, each layer's MSE over that layer's native variance in
the batch (1 - R^2), averaged over layers: a fidelity that does not depend on the models' activation scales, above 1
when the translation is further off than predicting every channel's mean would be.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mot_jax.translate.translator import translate


@dataclasses.dataclass(frozen=True)
class LossWeights:
    correction: float = 1.0
    load_balance: float = 0.01
    z_loss: float = 0.001
    distill: float = 0.0

    @classmethod
    def from_config(cls, loss) -> LossWeights:
        """From a config's `loss` block (configs saved before `distill_weight` existed have none)."""
        return cls(
            loss.correction_weight, loss.load_balance_weight, loss.z_loss_weight, loss.get("distill_weight", 0.0)
        )


def frozen_forwards(source, target, batch, topk: int):
    """The source's cache (and attention top-k for sparse replay) and the target's native cache of the context."""
    _, source_cache, source_topk = source.run_layers(batch.source_ids, batch.source_mask, topk=topk)
    _, native, _ = target.run_layers(batch.context, batch.context_mask, fresh=True)
    return source_cache, source_topk, native


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


def distillation_kl(logits, teacher_logits, mask):
    """Mean over valid positions of KL(teacher || student) between next-token distributions, in fp32."""
    teacher = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
    student = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    kl = jnp.sum(jnp.exp(teacher) * (teacher - student), axis=-1)
    return jnp.sum(kl * mask) / jnp.maximum(jnp.sum(mask), 1)


def prompt_cross_entropy(target, cache, batch):
    """CE of the labels when the target reads the prompt after `cache` (None: with no context at all)."""
    logits, _ = target(batch.prompt, cache=cache)
    return token_cross_entropy(logits, batch.labels, batch.label_mask)


def context_correction(translator, source, target, batch, frozen, weights: LossWeights):
    """(loss, metrics) of one micro-batch; `frozen` = `frozen_forwards(...)` (no gradient flows into it)."""
    source_cache, source_topk, native = jax.lax.stop_gradient(frozen)
    spec = translator.spec
    context_length, prompt_length = batch.context.shape[1], batch.prompt.shape[1]
    cache, aux = translate(
        translator,
        source,
        target,
        source_cache,
        batch.alignment,
        batch.context,
        batch.context_mask,
        source_topk,
        capacity=context_length + prompt_length,
    )
    logits, _ = target(batch.prompt, cache=cache)
    ce = token_cross_entropy(logits, batch.labels, batch.label_mask)
    first = spec.native_bottom if spec.mode == "direct" else min(spec.target_layers)  # the layers it writes
    context = lambda kv: kv[first:, :, :, :context_length]
    errors = {}
    for name, got, want in (("k", cache.k, native.k), ("v", cache.v, native.v)):
        mse = layer_mse(context(got), want[first:], batch.context_mask)
        unexplained = mse / jnp.maximum(layer_variance(want[first:], batch.context_mask), 1e-12)
        errors |= {f"mse_{name}": mse.mean(), f"unexplained_{name}": unexplained.mean()}
    routed = [a for a in aux.values() if a]  # the K and V mixtures' aux outputs (empty with one expert)
    load_balance = sum((a["load_balance_loss"] for a in routed), jnp.zeros(()))
    z_loss = sum((a["z_loss"] for a in routed), jnp.zeros(()))
    correction = errors["mse_k"] + errors["mse_v"]
    loss = ce + weights.correction * correction + weights.load_balance * load_balance + weights.z_loss * z_loss
    metrics = dict(ce=ce, **errors, load_balance=load_balance, z_loss=z_loss)
    if weights.distill:  # one more target forward over the prompt, after the native cache (no gradient reaches it)
        teacher, _ = target(batch.prompt, cache=native.with_capacity(context_length + prompt_length))
        metrics["kl"] = distillation_kl(logits, jax.lax.stop_gradient(teacher), batch.label_mask)
        loss = loss + weights.distill * metrics["kl"]
    metrics["loss"] = loss
    if routed:
        # query slots per expert and row that dispatch used, as a fraction of the tokens (1: the dense work)
        metrics["dispatch_slots"] = sum(a["stats"]["capacity"] for a in routed) / (len(routed) * context_length)
        metrics["load_cv2"] = sum(a["stats"]["load_cv2"] for a in routed) / len(routed)
    return loss, metrics
