"""Layers shared by every family: parameters with logical axis names, norms, RoPE and cached attention.

Parameters of the decoder blocks carry a leading `layers` axis (one array per weight for the whole stack), so
the forward pass is one `jax.lax.scan` over layers; inside the scan a block sees one layer's slice and the code
below is written for that slice.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mot_jax import kernels

# Keys outside the window / causal mask get this logit: finite, so a query with no visible key (a padding
# position) gives a uniform softmax instead of NaN.
MASK_VALUE = -1e30
GLOBAL_WINDOW = 2**30  # "no sliding window" as an int, so per-layer windows can live in one array


def param(key, shape, names, dtype, init="normal", std=0.02):
    """An `nnx.Param` with logical axis names (mapped to mesh axes by the sharding rules, not here)."""
    assert len(shape) == len(names), (shape, names)
    # under jit or eval_shape the key is traced; the numpy path needs threefry's per-index values (the default)
    if init == "normal" and (isinstance(key, jax.core.Tracer) or not jax.config.jax_threefry_partitionable):
        value = (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    elif init == "normal":
        value = (std * flat_normal(key, math.prod(shape)).reshape(shape)).astype(dtype)
    else:
        value = (np.ones if init == "ones" else np.zeros)(shape, dtype)
    return nnx.Param(jnp.asarray(value), out_sharding=tuple(names), eager_sharding=False)


def flat_normal(key, size):
    """The first `size` values of `jax.random.normal(key, (n,))` for n the next power of two, as numpy: the values of
    `jax.random.normal(key, shape)` (threefry is partitionable: each value depends on its index only), from one
    compiled program per power of two instead of one eager program per shape and operation."""
    n = 1 << max(size - 1, 1).bit_length()
    return np.asarray(_normal(key, n))[:size]


@functools.partial(jax.jit, static_argnums=1)
def _normal(key, n):
    return jax.random.normal(key, (n,), jnp.float32)


def einsum(spec, lhs, rhs, *, dtype=None):
    """`jnp.einsum` of two operands accumulating in float32, returned in `dtype` (default: the operands' dtype). Every
    matmul of the models and translators goes through here.

    In bfloat16 this is the fast path as well as the better sum: XLA:CPU's bf16 kernel (YNNPACK) takes bf16 x bf16 ->
    f32 only, and runs a bf16 -> bf16 dot as converts to f32 around an f32 matmul; accelerators accumulate in f32 too.
    In float32 the sums are unchanged. The contraction is computed in dot_general's own order (batch, lhs, rhs
    dimensions) and transposed after. XLA:CPU otherwise folds the output order into the dot by swapping its operands:
    for attention's probs @ v that is an f32 kernel ~4x slower, and in bf16 a batched dot YNNPACK refuses, for which
    XLA:CPU has no bf16 x bf16 -> f32 fallback (DotThunk: unsupported). `test_layers.py` checks the compiled bf16
    prefill and runs it.
    """
    dtype = dtype or jnp.result_type(lhs, rhs)
    inputs, out = spec.split("->")
    left, right = inputs.split(",")
    if jnp.bfloat16 in (lhs.dtype, rhs.dtype):
        if _free_size(left, lhs, right) == 1 and (product := _row_product(left, right, out, lhs, rhs)) is not None:
            return product.astype(dtype)
        # XLA:CPU runs a bf16 dot whose operand has a single row (decoding one sequence, the last position's logits)
        # as a matrix-vector product that first converts the other operand to f32: a whole weight, cache or
        # vocabulary per call. With two rows it takes the bf16 kernel: such an operand gets a zero row on a new
        # leading axis, dropped after.
        pad = next(c for c in "zyxw" if c not in spec)
        if _free_size(left, lhs, right) == 1:
            return einsum(f"{pad}{left},{right}->{pad}{out}", _with_zero_row(lhs), rhs, dtype=dtype)[0]
        if _free_size(right, rhs, left) == 1:
            return einsum(f"{left},{pad}{right}->{pad}{out}", lhs, _with_zero_row(rhs), dtype=dtype)[0]
    batch = [c for c in left if c in right and c in out]
    natural = "".join(batch + [c for c in left + right if c in out and c not in batch])
    y = jnp.einsum(f"{inputs}->{natural}", lhs, rhs, preferred_element_type=jnp.float32)
    return (y if natural == out else y.transpose([natural.index(c) for c in out])).astype(dtype)


def _row_product(left, right, out, x, w):
    """A single row `x` ("...k") times a matrix `w` ("kn" or "nk") by the CPU kernel (`kernels.row_product`: it reads
    w once as stored, where XLA:CPU's bf16 kernel repacks it), shaped as the einsum's output; None where the spec
    (`left`,`right`->`out`) is another product or the kernel cannot take the operands."""
    contracted, row = left[-1], x.reshape(1, -1)
    if not (left.startswith("...") and len(right) == 2 and contracted in right):
        return None
    if out != left[:-1] + right.replace(contracted, "") or not kernels.rows_supported(row, w):
        return None
    y = kernels.row_product(row, w, right[1] == contracted)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _free_size(spec, x, other):
    """The number of rows of operand `x` (its `spec`, e.g. "...d") in a dot with an operand of spec `other`: the
    product of its dimensions the other lacks (a leading ellipsis included)."""
    named = spec.removeprefix("...")
    rows = math.prod(x.shape[: x.ndim - len(named)]) if spec.startswith("...") and "..." not in other else 1
    return rows * math.prod(n for c, n in zip(named, x.shape[x.ndim - len(named) :]) if c not in other)


def _with_zero_row(x):
    return jnp.stack([x, jnp.zeros_like(x)])


def bf16_as_bits(tree):
    """The bf16 leaves of `tree` bitcast to uint16 (`bits_as_bf16` undoes it): a scan over a stack of bf16 weights
    carries their bits, since XLA:CPU slices a bf16 stack inside a loop by converting all of it to f32 once a call."""
    return jax.tree.map(lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x, tree)


def bits_as_bf16(tree):
    return jax.tree.map(lambda x: jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x, tree)


class Linear(nnx.Module):
    """y = x @ kernel + bias, kernel stored [in, out] (HF torch Linear weights are transposed on load)."""

    def __init__(self, din, dout, names, *, rngs, dtype, bias=True, lead=(), lead_names=None, std=0.02):
        lead_names = lead_names or ("layers",) * len(lead)
        self.kernel = param(rngs.params(), (*lead, din, dout), lead_names + names, dtype, std=std)
        self.bias = param(rngs.params(), (*lead, dout), lead_names + names[1:], dtype, "zeros") if bias else None

    def __call__(self, x):
        y = einsum("...i,io->...o", x, self.kernel[...])
        return y if self.bias is None else y + self.bias[...]


class Embed(nnx.Module):
    def __init__(self, num, dim, names, *, rngs, dtype):
        self.embedding = param(rngs.params(), (num, dim), names, dtype)

    def __call__(self, ids):
        return jnp.take(self.embedding[...], ids, axis=0)

    def attend(self, x):
        """Tied output head: logits against the embedding matrix."""
        # Tied to x, the table is no longer invariant in a decoding loop: XLA would hoist a transpose of it out of the
        # loop and multiply against a [D, V] copy (made once a call; in bf16 on CPU the slower product).
        x, table = jax.lax.optimization_barrier((x, self.embedding[...]))
        return einsum("...d,vd->...v", x, table)


class LayerNorm(nnx.Module):
    def __init__(self, dim, eps, *, rngs, dtype, lead=(), lead_names=None, affine=True):
        names = (lead_names or ("layers",) * len(lead)) + ("embed",)
        self.eps = eps
        self.scale = param(None, (*lead, dim), names, dtype, "ones") if affine else None
        self.bias = param(None, (*lead, dim), names, dtype, "zeros") if affine else None

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = ((x32 - mean) * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return y if self.scale is None else y * self.scale[...] + self.bias[...]


class RMSNorm(nnx.Module):
    """RMSNorm; `unit_offset` gives Gemma's (1 + w) scale, computed in fp32 before the cast as Gemma does."""

    def __init__(self, dim, eps, *, rngs, dtype, lead=(), unit_offset=False, names=("embed",)):
        self.eps, self.unit_offset = eps, unit_offset
        init = "zeros" if unit_offset else "ones"
        self.scale = param(None, (*lead, dim), ("layers",) * len(lead) + names, dtype, init)

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (y * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        return self.scale[...] * y.astype(x.dtype)


def activation(name):
    acts = {
        "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "relu": jax.nn.relu,
        "silu": jax.nn.silu,
        "swish": jax.nn.silu,
    }
    if name not in acts:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(acts)}")
    return acts[name]


# ---------------------------------------------------------------------------------------------------- RoPE


def rope_inv_freq(head_dim, theta, scaling=None):
    """Inverse frequencies as transformers computes them, for rope types default, linear and llama3."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv
    if rope_type == "linear":
        return inv / scaling["factor"]
    if rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return jnp.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3")


def rope_tables(positions, inv_freq, dtype):
    """`apply_rope`'s cos and sin [B, T, 1, d] at positions [B, T] (computed once for every layer that shares them:
    XLA:CPU evaluates sin and cos element by element)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, d/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)[:, :, None, :].astype(dtype)
    sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)[:, :, None, :].astype(dtype)
    return cos, sin


def apply_rope(x, positions, inv_freq, tables=None):
    """Rotate-half RoPE (the HF layout). x: [B, T, H, d]; positions: [B, T]; inv_freq: [d/2]; `tables`: their
    `rope_tables` when already computed."""
    cos, sin = rope_tables(positions, inv_freq, x.dtype) if tables is None else tables
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], -1) * sin


# ---------------------------------------------------------------------------------------------- attention


def attention_weights(q, k, q_pos, k_pos, k_valid, *, scale, window=GLOBAL_WINDOW, softcap=None, allowed=None):
    """Softmax weights [B, K, G, T, S] (fp32) of causal-by-position attention with GQA, padding and windows.

    q: [B, T, H, d]; k: [B, K, S, d] (the cache layout); q_pos: [B, T]; k_pos, k_valid: [B, S].
    A key is visible when it is valid, not after the query, and less than `window` positions behind it.
    `allowed` [B, T, S] further restricts each query to chosen keys (sparse top-k attention); a query left with
    no visible key then attends to itself rather than to masked keys (the reference leaks future keys there).
    """
    b, t, h, d = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(b, t, kv_heads, h // kv_heads, d)
    logits = einsum("btkgd,bksd->bkgts", q, k, dtype=jnp.float32) * scale
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    delta = q_pos[:, :, None] - k_pos[:, None, :]  # [B, T, S]
    visible = k_valid[:, None, :] & (delta >= 0) & (delta < window)
    if allowed is not None:
        stranded = ~jnp.any(visible & allowed, axis=-1, keepdims=True)
        visible = visible & (allowed | (stranded & (delta == 0)))
    logits = jnp.where(visible[:, None, None], logits, MASK_VALUE)
    return jax.nn.softmax(logits, axis=-1)


def attention_reference(q, k, v, q_pos, k_pos, k_valid, window, scale, *, softcap, allowed):
    """`attention_weights` applied to v [B, K, S, d], [B, T, H * d]: attention through XLA in one block (the CPU
    kernel's gradient; the models' entry is `mot_jax.models.attention.attend`)."""
    probs = attention_weights(q, k, q_pos, k_pos, k_valid, scale=scale, window=window, softcap=softcap, allowed=allowed)
    out = einsum("bkgts,bksd->btkgd", probs.astype(v.dtype), v)
    return out.reshape(*q.shape[:2], -1)
