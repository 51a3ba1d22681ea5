"""The translator expert: the paper's cross-layer window translator (reference section 2), N experts stacked.

Input per token: the W window layers' flattened source K (or V) vectors, x [B, T, W, ds]. Output: [B, T, W, dt],
reshaped by the caller into target heads. All N experts of a mixture live in one module with a leading `expert`
axis on every parameter, so they run as one `vmap` and shard over the `expert` mesh axis.

An expert computes the context P = GELU(Linear(LN(x))) for every token (the keys/values of its cross-attention),
and the query chain only for the token positions it is given: all of them on the dense path, the routed ones on
the sparse path. The two paths therefore give the same numbers for a routed token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mot_jax.models.layers import MASK_VALUE, LayerNorm, Linear, einsum
from mot_jax.translate.config import TranslatorConfig

EPS = 1e-5


def gelu(x):
    return jax.nn.gelu(x, approximate=False)  # torch's default (erf) GELU, as the reference


def torch_std(fan_in):
    return (3 * fan_in) ** -0.5  # the std of torch.nn.Linear's default uniform init


class CrossAttentionBlocks(nnx.Module):
    """R x W un-shared blocks (leading axes [expert, block]); `__call__` is one block: g <- Block(g, ctx); `chain`
    runs them all."""

    def __init__(self, cfg: TranslatorConfig, *, rngs, dtype, experts=True):
        """`experts=False`: no expert axis, the blocks of one chain (the C2C fuser's)."""
        D, hidden = cfg.dim, cfg.mlp_ratio * cfg.dim
        lead, names = (cfg.depth * cfg.window,), ("layers",)
        if experts:
            lead, names = (cfg.num_experts, *lead), ("expert", *names)
        kw = dict(rngs=rngs, dtype=dtype, lead=lead, lead_names=names)
        self.heads = cfg.heads
        self.norm_q = LayerNorm(D, EPS, **kw)
        self.norm_ctx = LayerNorm(D, EPS, **kw)
        self.in_proj = Linear(D, 3 * D, ("embed", "heads"), **kw, std=torch_std(D))  # packed q, k, v
        self.out_proj = Linear(D, D, ("heads", "embed"), **kw, std=torch_std(D))
        self.norm_ffn = LayerNorm(D, EPS, **kw)
        self.fc1 = Linear(D, hidden, ("embed", "mlp"), **kw, std=torch_std(D))
        self.fc2 = Linear(hidden, D, ("mlp", "embed"), **kw, std=torch_std(hidden))

    def __call__(self, g, ctx, visible):
        """g [B, C, D] queries, ctx [B, T, D] one window layer's context, visible [B, C|1, T]."""
        g = g + self.out_proj(self.attention(self.norm_q(g), self.norm_ctx(ctx), visible))
        return g + self.fc2(gelu(self.fc1(self.norm_ffn(g))))

    def attention(self, q_in, ctx, visible):
        """torch.nn.MultiheadAttention (packed in-projection, no positions): q [B, C, D] attends to ctx [B, T, D]."""
        d, h = q_in.shape[-1], self.heads
        kernel, bias = self.in_proj.kernel[...], self.in_proj.bias[...]
        proj = lambda x, part: einsum("...i,io->...o", x, kernel[:, part]) + bias[part]
        q, k, v = proj(q_in, slice(0, d)), proj(ctx, slice(d, 2 * d)), proj(ctx, slice(2 * d, None))
        split = lambda a: a.reshape(*a.shape[:2], h, d // h)
        logits = einsum("bchd,bthd->bhct", split(q), split(k), dtype=jnp.float32)
        logits = jnp.where(visible[:, None], logits * (d // h) ** -0.5, MASK_VALUE)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        return einsum("bhct,bthd->bchd", probs, split(v)).reshape(q.shape)


class Experts(nnx.Module):
    def __init__(self, cfg: TranslatorConfig, *, rngs, dtype=jnp.float32):
        self.cfg = cfg
        D, W = cfg.dim, cfg.window
        kw = dict(rngs=rngs, dtype=dtype, lead=(cfg.num_experts,), lead_names=("expert",))
        self.input_norm = LayerNorm(cfg.source_width, EPS, **kw)
        self.input_proj = Linear(cfg.source_width, D, (None, "embed"), **kw, std=torch_std(cfg.source_width))
        self.blocks = CrossAttentionBlocks(cfg, rngs=rngs, dtype=dtype)
        if cfg.fused_output:
            self.output_norm = LayerNorm(W * D, EPS, **kw)
            self.output_proj = Linear(W * D, W * cfg.target_width, ("embed", None), **kw, std=torch_std(W * D))
        else:  # per window layer: [expert, W, ...]
            per_layer = dict(rngs=rngs, dtype=dtype, lead=(cfg.num_experts, W), lead_names=("expert", "layers"))
            self.output_norm = LayerNorm(D, EPS, **per_layer)
            self.output_proj = Linear(D, cfg.target_width, ("embed", None), **per_layer, std=torch_std(D))

    def __call__(self, x, token_mask, query_index):
        """x [B, T, W, ds]; token_mask [B, T]; query_index [E, B, C] token positions -> [E, B, C, W, dt]."""
        graphdef, params = nnx.split(self)
        return jax.vmap(lambda p, q: nnx.merge(graphdef, p).one_expert(x, token_mask, q))(params, query_index)

    def one_expert(self, x, token_mask, query_index):
        """One expert's slice of the parameters: x [B, T, W, ds], query_index [B, C] -> [B, C, W, dt]."""
        cfg = self.cfg
        b, t, w, _ = x.shape
        context = gelu(self.input_proj(self.input_norm(x)))  # P [B, T, W, D]
        g = context[jnp.arange(b)[:, None], query_index, 0]  # the chain starts from P_0 of its queries [B, C, D]
        visible = token_mask[:, None, :]  # [B, 1, T]
        if cfg.causal:
            visible = visible & (jnp.arange(t)[None, None, :] <= query_index[:, :, None])
        last_stage = chain(self.blocks, g, context, visible, cfg.depth)
        y = output_head(self.output_norm, self.output_proj, last_stage, cfg.fused_output)
        if cfg.output_activation == "gelu":
            y = gelu(y)
        return y.reshape(b, -1, w, cfg.target_width)


def chain(blocks: CrossAttentionBlocks, g, context, visible, depth: int):
    """The recurrent cross-layer chain (reference section 2) of one expert's blocks: from queries g [B, C, D],
    `depth` stages of W blocks, block r * W + l attending to window layer l of context [B, T, W, D]; returns the last
    stage's W states [B, C, W, D]."""
    w = context.shape[2]
    graphdef, params = nnx.split(blocks)

    def step(g, xs):
        params, layer = xs
        g = nnx.merge(graphdef, params)(g, jax.lax.dynamic_index_in_dim(context, layer, 2, False), visible)
        return g, g

    _, states = jax.lax.scan(step, g, (params, jnp.tile(jnp.arange(w), depth)))
    return jnp.moveaxis(states[-w:], 0, 2)


def output_head(norm: LayerNorm, proj: Linear, states, fused: bool):
    """The last stage's W states [B, C, W, D] to the output, before its activation: `fused` (paper) one LayerNorm
    and projection of all W states together to all W layers, [B, C, W * dt]; else one per layer, [B, C, W, dt]."""
    if fused:
        return proj(norm(states.reshape(*states.shape[:2], -1)))
    return einsum("bcwd,wdo->bcwo", norm(states), proj.kernel[...]) + proj.bias[...]
