"""The Interlat baseline (`TranslatorConfig.kind="interlat"`): the source's last-layer hidden states through an adapter
as the target's input embeddings.

Reference section 7 (`interlat`), checked against the MoT authors' `alg/interlat/train.py` and the
`HiddenStateProcessor` they vendor from the Interlat repository (`alg/interlat/vender/hidden_model/custom_model.py`;
prosopher/MoT at a99e3669 and 889a9704):

- what the source sends: its last layer's hidden states (transformers' `hidden_states[-1]`, final-normed), [B, S, Es],
  aligned onto the target's tokens as K/V are (`source_read(last_hidden=True)` carries them in the cache layout);
- the adapter, per row x [B, T, Es] -> [B, T, Et] (E: `CausalLM.embedding_width`):

      x = Linear(x)                                  only when Es != Et (torch's default weight scale)
      n = LN(x)                                      eps 1e-6
      a = MHA(n, n, n)                               torch's MultiheadAttention, every token to every token (not
                                                     causal), dropout 0.1 on the attention weights in training;
                                                     heads: the largest divisor of Et up to `heads`
      o = LN(n + a)                                  eps 1e-6
      r = o * s                                      s learnable, 0.2 at init
      y = clip((r + Linear(LN(GELU(Linear(r))))) * s_out, -10, 10)     s_out learnable, 0.1; LN eps 1e-5

  init: the first inner Linear N(0, 0.02), the second xavier with gain 1e-2, the attention's packed q/k/v xavier with
  gain 1/sqrt(3) and its output xavier (as normals of the same variance), biases zero (the projector's too, where
  torch draws them uniform);
- the injection: y are the target's `inputs_embeds` (after Gemma's embedding scale, before GPT-2's and OPT's position
  embeddings) in one forward over the context, whose cache is what generation reads: the target never sees the
  context's tokens;
- the loss: the prompt CE, plus with weights set each step from the terms' own (detached) values
      plan-similarity  0.7 KL(P || Q) + 0.3 (1 - cos(Q, P)),   weight 0.01 + 0.04 clip(term / 4, 0, 1)
      random-contrast  max(0, 0.69 - JS(Q, R)),                  weight 0.01 + 0.49 clip(term / 0.69, 0, 1)
  over the valid prompt positions, Q = softmax of the prompt logits after the translated cache, P after the target's
  native cache of the context (the "plan", detached), R after the cache translated from another row's source (the
  batch rolled by one row, detached); probabilities clamped at 1e-8; KL batch-mean (over positions); the cosine
  over all positions and the vocabulary flattened; the reference's JS is 0.5 KL(M || Q) + 0.5 KL(M || R), M = (Q +
  R) / 2 (torch's `kl_div` argument order), transcribed as it is. The reference's config weights are fallbacks for a
  non-finite term only, where a run here stops anyway (the non-finite loss), so there are none.

Differences, each small: the source reads the target's text and is aligned onto the target's tokens as for every
translator here (the reference feeds one token sequence to both models), so the latents are one per target token;
padding tokens are hidden from the adapter's attention (the reference trains on unpadded chunks); the context's
first token keeps the target's own token embedding (a BOS: the attention sink), as the other translators keep its
K/V (`translator.py`); the mismatched source is row b - 1's aligned hidden states (the same as the reference's roll
on unpadded rows of one length). `loss.correction_weight` adds MoT's K/V MSE (0 in `configs/smollm2_gemma3.py:
interlat`, as the reference).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mot_jax.models.base import first_valid_index
from mot_jax.models.hooks import Forward
from mot_jax.models.layers import MASK_VALUE, LayerNorm, Linear, einsum
from mot_jax.translate import align as alignment_lib
from mot_jax.translate.config import TranslatorConfig
from mot_jax.translate.expert import EPS, gelu, torch_std
from mot_jax.translate.kinds.registry import LAST_HIDDEN, Kind, Outputs, refuse, register

DROPOUT = 0.1  # on the adapter's attention weights, in training
CLIP = 10.0  # the adapter's outputs are clipped to [-CLIP, CLIP]
PLAN = (0.7, 0.3)  # the plan-similarity term's KL and (1 - cosine) weights
MARGIN = 0.69  # the random-contrast hinge's margin (nats)
FLOOR = 1e-8  # probabilities are clamped at this


def attention_heads(width: int, requested: int) -> int:
    """The reference's head count: the largest divisor of `width` that is at most `requested`."""
    return next(h for h in range(min(requested, width), 0, -1) if width % h == 0)


def xavier_std(fan_in, fan_out, gain=1.0):
    return gain * (2.0 / (fan_in + fan_out)) ** 0.5  # the std of torch's xavier_uniform_


class Adapter(nnx.Module):
    """The reference's `HiddenStateProcessor` (module docstring): source hidden states [B, T, Es] -> latents [B, T, Et].
    Reads the widths and `heads` of its config."""

    def __init__(self, cfg: TranslatorConfig, *, rngs, dtype=jnp.float32):
        ds, d = cfg.source_width, cfg.target_width
        kw = dict(rngs=rngs, dtype=dtype)
        self.heads = attention_heads(d, cfg.heads)
        self.input_proj = Linear(ds, d, (None, "embed"), **kw, std=torch_std(ds)) if ds != d else None
        self.pre_norm = LayerNorm(d, 1e-6, **kw)
        self.in_proj = Linear(d, 3 * d, ("embed", None), **kw, std=xavier_std(d, 3 * d, 3**-0.5))
        self.out_proj = Linear(d, d, (None, "embed"), **kw, std=xavier_std(d, d))
        self.post_norm = LayerNorm(d, 1e-6, **kw)
        scalar = lambda value: nnx.Param(jnp.asarray(value, dtype), out_sharding=(), eager_sharding=False)  # noqa: E731
        self.scale, self.output_scale = scalar(0.2), scalar(0.1)
        self.fc1 = Linear(d, d, ("embed", None), **kw, std=0.02)
        self.norm = LayerNorm(d, EPS, **kw)
        self.fc2 = Linear(d, d, (None, "embed"), **kw, std=xavier_std(d, d, 1e-2))

    def attention(self, x, token_mask, key):
        b, t, d = x.shape
        q, k, v = (y.reshape(b, t, self.heads, d // self.heads) for y in jnp.split(self.in_proj(x), 3, -1))
        logits = einsum("bqhd,bkhd->bhqk", q, k, dtype=jnp.float32) * (d // self.heads) ** -0.5
        logits = jnp.where(token_mask[:, None, None, :], logits, MASK_VALUE)
        probs = jax.nn.softmax(logits, -1).astype(x.dtype)
        if key is not None:  # training: dropout on the attention weights, as torch's
            keep = jax.random.bernoulli(key, 1 - DROPOUT, probs.shape)
            probs = jnp.where(keep, probs / (1 - DROPOUT), 0)
        return self.out_proj(einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d))

    def __call__(self, x, token_mask, key=None):
        """x [B, T, Es], token_mask [B, T]; `key` the training dropout's (None: none) -> latents [B, T, Et]."""
        if self.input_proj is not None:
            x = self.input_proj(x)
        normed = self.pre_norm(x)
        out = self.post_norm(normed + self.attention(normed, token_mask.astype(bool), key))
        residual = out * self.scale[...]
        y = (residual + self.fc2(self.norm(gelu(self.fc1(residual))))) * self.output_scale[...]
        return jnp.clip(y, -CLIP, CLIP)


def mismatched(source_cache, alignment):
    """The random-contrast term's source: row b reads row b - 1's hidden states (cyclically; the reference's
    `torch.roll(shifts=1, dims=0)`) through row b - 1's alignment, so that they land on a grid like row b's."""
    rolled = dataclasses.replace(alignment, weights=jnp.roll(alignment.weights, 1, 0))
    return source_cache.replace(k=jnp.roll(source_cache.k, 1, 1)), rolled


def _probs(logits):
    return jnp.maximum(jax.nn.softmax(logits.astype(jnp.float32), -1), FLOOR)


def plan_similarity(logits, plan_logits, mask):
    """(0.7 KL(P || Q) + 0.3 (1 - cos(Q, P)), the cosine) over the valid positions (`mask` [B, T]), P from
    `plan_logits` (detached)."""
    mask = mask.astype(jnp.float32)[..., None]
    count = jnp.maximum(mask.sum(), 1.0)
    plan = jax.lax.stop_gradient(_probs(plan_logits))
    log_q = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    kl = (plan * (jnp.log(plan) - log_q) * mask).sum() / count
    q, p = _probs(logits) * mask, plan * mask
    cosine = (q * p).sum() / jnp.maximum(jnp.sqrt((q * q).sum() * (p * p).sum()), FLOOR)
    return PLAN[0] * kl + PLAN[1] * (1 - cosine), cosine


def random_contrast(logits, random_logits, mask):
    """max(0, 0.69 - JS) with the reference's JS = 0.5 KL(M || Q) + 0.5 KL(M || R) over the valid positions, R from
    `random_logits` (detached)."""
    mask = mask.astype(jnp.float32)[..., None]
    count = jnp.maximum(mask.sum(), 1.0)
    q, r = _probs(logits), jax.lax.stop_gradient(_probs(random_logits))
    m = 0.5 * (q + r)
    kl = lambda other: (m * (jnp.log(m) - jnp.log(other)) * mask).sum() / count  # noqa: E731
    return jnp.maximum(MARGIN - (0.5 * kl(q) + 0.5 * kl(r)), 0.0)


def dynamic_weights(plan, contrast):
    """The terms' weights from their own detached values: plan in [0.01, 0.05], random contrast in [0.01, 0.5]."""
    plan, contrast = jax.lax.stop_gradient(plan), jax.lax.stop_gradient(contrast)
    return 0.01 + jnp.clip(plan / 4, 0, 1) * 0.04, 0.01 + jnp.clip(contrast / MARGIN, 0, 1) * 0.49


def auxiliary_loss(logits, plan_logits, random_logits, mask):
    """(the weighted plan-similarity plus random-contrast terms, their metrics) of one micro-batch."""
    plan, cosine = plan_similarity(logits, plan_logits, mask)
    contrast = random_contrast(logits, random_logits, mask)
    plan_weight, contrast_weight = dynamic_weights(plan, contrast)
    metrics = dict(plan=plan, plan_cosine=cosine, random_contrast=contrast, plan_weight=plan_weight)
    return plan_weight * plan + contrast_weight * contrast, metrics | dict(random_weight=contrast_weight)


def check_spec(spec, cfg: TranslatorConfig):
    """Refuse the switches that mean nothing for Interlat (its latents are the target's whole input), in one line."""
    refusals = (
        (spec.mode != "direct", "builds the target's cache from the latents alone (no replay); set mode='direct'"),
        (spec.native_bottom, "feeds the latents to the target's first layer; set native_bottom=0"),
        (tuple(spec.inputs) != ("source",), "reads the source's last hidden states alone; set inputs='source'"),
        (spec.rotary, "sends hidden states, which hold no rotated keys; set rotary=False"),
        (cfg.linear_skip, "has no linear skip; set linear_skip=False"),
    )
    refuse("interlat", refusals)


def embed_latents(translator, source, target, source_cache, alignment, target_ids, mask, capacity, receiver, noise):
    """The target's forward over the adapter's latents of the source's last hidden states
    (`source_read(last_hidden=True)`) in place of its context's token embeddings, but at each row's first token,
    which keeps the target's own; its cache (`capacity` slots) and no aux outputs. `noise`: the training dropout's key
    (None: no dropout)."""
    batch, length = target_ids.shape
    hidden = alignment_lib.resample(source_cache.k[0, :, 0], alignment.weights)  # [B, T, Es] on the target grid
    own = target.token_embeddings(target_ids)
    latents = translator.adapter(hidden, mask, noise).astype(own.dtype)  # [B, T, Et]
    is_first = (jnp.arange(length) == first_valid_index(mask)[:, None])[..., None]
    forward = Forward(target_ids, mask, embeddings=jnp.where(is_first, own, latents), fresh=True)
    return target.run_layers(forward, target.init_cache(batch, capacity)).cache, {}


def extra_loss(*, translated, target, batch, source_cache, noise, logits, teacher, **_):
    """The reference's plan-similarity and random-contrast terms (`auxiliary_loss`) of the prompt's `logits` after
    the translated cache, `teacher` after the native one, and after the cache translated from the mismatched source
    (its own dropout key); (loss, metrics)."""
    key = None if noise is None else jax.random.fold_in(noise, 1)
    other, _ = translated(*mismatched(source_cache, batch.alignment), key)
    random_logits, _ = target(batch.prompt, cache=jax.lax.stop_gradient(other))
    return auxiliary_loss(logits, teacher, random_logits, batch.label_mask)


register(
    Kind(
        name="interlat",
        label=lambda cfg: "Interlat",  # its TTFT (translation) holds the target's forward over the latents
        build=lambda spec, cfg, rngs, dtype: {"adapter": Adapter(cfg, rngs=rngs, dtype=dtype)},
        translate=embed_latents,
        check=check_spec,
        # the target's input embeddings, from the source's last hidden states (both at the models' embedding widths)
        outputs=Outputs(
            "embeddings",
            "the target's input embeddings",
            lambda model: model.embedding_width,
            reads=LAST_HIDDEN,
            kv=False,
        ),
        torch={"adapter": "Adapter"},
        torch_call="embed_latents",
        window=lambda num_source, num_target: ((num_source - 1,), range(num_target)),  # one read: the last layer
        # the reference's adapter has 8 heads; its loss has no K/V MSE
        recipe={"translator.mode": "direct", "translator.heads": 8, "loss.correction_weight": 0.0},
        noise=lambda key, step, total_steps, micro_batches: jax.random.split(key, micro_batches),
        extra_loss=extra_loss,
        teacher=True,
    )
)
