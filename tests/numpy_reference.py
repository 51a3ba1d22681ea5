"""Float64 numpy transcriptions of the translators' building blocks (torch's erf GELU, LayerNorm, Linear and MoT's
cross-attention block), for tests that check a module against a forward written out independently."""

import numpy as np
from scipy.special import erf


def gelu(a):
    return 0.5 * a * (1 + erf(a / np.sqrt(2)))


def layer_norm(x, n, eps=1e-5):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * n["scale"] + n["bias"]


def linear(x, m):
    return x @ m["kernel"] + m["bias"]


def cross_attention_block(b, g, ctx, heads):
    """One block of parameters `b` (a dict of numpy arrays): g [B, C, D] queries attend to ctx [B, T, D] (unmasked,
    torch's packed MultiheadAttention), then the feed-forward; both residual."""
    d = g.shape[-1]
    w, bias = b["in_proj"]["kernel"], b["in_proj"]["bias"]
    q, kv = layer_norm(g, b["norm_q"]), layer_norm(ctx, b["norm_ctx"])
    split = lambda a: a.reshape(*a.shape[:2], heads, d // heads)  # noqa: E731
    q, k, v = (split(x @ w[:, i * d : (i + 1) * d] + bias[i * d : (i + 1) * d]) for i, x in enumerate((q, kv, kv)))
    logits = np.einsum("bchd,bthd->bhct", q, k) / np.sqrt(d // heads)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    g = g + linear(np.einsum("bhct,bthd->bchd", probs, v).reshape(g.shape), b["out_proj"])
    return g + linear(gelu(linear(layer_norm(g, b["norm_ffn"]), b["fc1"])), b["fc2"])
