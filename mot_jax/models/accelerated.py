"""Fused attention on accelerators: Pallas splash attention on TPU, cuDNN's flash attention on GPU.

Both take the arguments of XLA's attention (`layers.attention_reference`: q [B, T, H, d]; k, v [B, K, S, d] with
H = K * G; q_pos [B, T]; k_pos, k_valid [B, S]; `window` in positions, `layers.GLOBAL_WINDOW` for global attention)
and return [B, T, H * d]. Each has a predicate saying when it applies; the models' attention entry
(`attention.attend`) chooses among them by backend.

- `gpu_attention` passes the exact position mask (valid, k_pos <= q_pos, q_pos - k_pos < window) to cuDNN as a
  [B, 1, T, S] bias, so it equals XLA's attention for any positions, rows with no visible key included (those
  attend uniformly to all S keys, as there). The bias costs T * S entries a row, far less than the [B, H, T, S]
  float32 scores XLA's path writes.
- `tpu_attention` (splash) can only express a mask by slot index, fixed when tracing: a query at slot
  `q_offset + t` of the keys sees the valid keys at slots s <= q_offset + t that are less than `window` slots
  behind it. That is the position rule whenever each row's valid tokens sit in consecutive slots with consecutive
  positions (a prefill into an empty cache with left or right padding; a cache filled by appending, continued at
  a known slot), the layouts the model's prefills use. Queries off that rule (padding, which no valid token reads)
  get finite values that differ from XLA's. Splash skips the key blocks no query of a block can see, so a
  sliding-window or causal prefill does O(T * window) or half the work, and never holds the scores.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from mot_jax.models.layers import GLOBAL_WINDOW

TPU_DTYPES = (jnp.float32, jnp.bfloat16)
GPU_DTYPES = (jnp.float16, jnp.bfloat16)  # cuDNN's flash attention takes no float32
SPLASH_BLOCK = 512  # splash's query and key block; shorter sequences use one block rounded up to 128 (a TPU lane row)
LANES = 128


# ---------------------------------------------------------------------------------------------------------- TPU


def tpu_supports(q, k, v, *, softcap=None, window=GLOBAL_WINDOW, q_offset=0, window_choices=None) -> bool:
    """Whether `tpu_attention` takes these arguments (the slot layout it assumes is the caller's to know).

    Splash attention wants float32 or bfloat16 q, k, v of one dtype and head size, whole KV groups (H a multiple of
    K), a positive softcap if any, a static query offset with the queries inside the keys, and a window known when
    tracing: a Python int, or a traced one that is one of `window_choices` (Gemma-3's local and global layers
    inside one layer scan)."""
    t, s = q.shape[1], k.shape[2]
    static_window = isinstance(window, int | np.integer)
    return (
        q.dtype == k.dtype == v.dtype
        and any(q.dtype == d for d in TPU_DTYPES)
        and q.shape[-1] == k.shape[-1] == v.shape[-1]
        and q.shape[2] % k.shape[1] == 0
        and (softcap is None or softcap > 0)
        and isinstance(q_offset, int | np.integer)
        and 0 <= q_offset
        and q_offset + t <= s
        and (static_window or bool(window_choices))
    )


def tpu_attention(
    q,
    k,
    v,
    q_pos,
    k_pos,
    k_valid,
    *,
    scale,
    window,
    softcap=None,
    q_offset=0,
    window_choices=None,
    mesh=None,
    batch_axes=None,
    head_axes=None,
    interpret=False,
):
    """`layers.attention_reference` through Pallas splash attention (module docstring: the slot layout it assumes).

    q_pos and k_pos are not read: the mask is by slot (`q_offset`: the slot of the first query among the keys).
    `window`: a Python int, or a traced scalar equal to one of `window_choices` (each compiled, one run).
    `mesh` with `batch_axes` / `head_axes` (mesh axis names, or tuples of them) runs the kernel on each device's
    shard through `shard_map` (a Pallas call has no partitioning rule: without it XLA would gather whole arrays
    onto every device). `interpret=True` runs the kernel's Python on any backend (tests on CPU)."""
    del q_pos, k_pos  # the slot layout stands for them
    if not tpu_supports(q, k, v, softcap=softcap, window=window, q_offset=q_offset, window_choices=window_choices):
        raise ValueError(
            "tpu_attention does not take these arguments (dtypes, head sizes, KV groups, softcap, q_offset or a "
            "traced window without window_choices); check with tpu_supports first."
        )
    run = functools.partial(
        _splash, scale=scale, softcap=softcap, q_offset=int(q_offset), interpret=interpret, out_dtype=v.dtype
    )
    if isinstance(window, int | np.integer):
        choices, window = (int(window),), jnp.int32(window)
    else:
        choices = tuple(int(w) for w in window_choices)

    def body(q, k, v, k_valid, window):
        if len(choices) == 1:
            return run(q, k, v, k_valid, window=choices[0])
        branches = [functools.partial(run, window=w) for w in choices]
        return jax.lax.switch(jnp.argmax(jnp.asarray(choices) == window), branches, q, k, v, k_valid)

    if mesh is None:
        return body(q, k, v, k_valid, window)
    _check_divisible(mesh, batch_axes, q.shape[0], "the batch")
    _check_divisible(mesh, head_axes, k.shape[1], "the KV heads")
    heads = PartitionSpec(batch_axes, head_axes)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(
            PartitionSpec(batch_axes, None, head_axes),  # q [B, T, H, d]
            heads,  # k [B, K, S, d]
            heads,  # v
            PartitionSpec(batch_axes),  # k_valid [B, S]
            PartitionSpec(),  # window
        ),
        out_specs=PartitionSpec(batch_axes, None, head_axes),  # [B, T, H * d]: heads lead the flattened axis
        check_vma=False,
    )(q, k, v, k_valid, window)


def _check_divisible(mesh, axes, size, what):
    names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    shards = math.prod(mesh.shape[name] for name in names)
    if size % shards:
        raise ValueError(f"tpu_attention: {what} ({size}) do not split over mesh axes {names} ({shards} shards).")


def _splash(q, k, v, k_valid, *, window, scale, softcap, q_offset, interpret, out_dtype):
    """Splash attention of one shard: q [B, T, H, d], k, v [B, K, S, d], k_valid [B, S] -> [B, T, H * d]."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash  # only where it runs

    b, t, h, d = q.shape
    s = k.shape[2]
    block_q, block_kv = _block(t), _block(s)
    t_pad, s_pad = _round_up(t, block_q), _round_up(s, block_kv)
    # the softmax scale on q (splash applies none); padded queries are dropped, padded keys are invalid
    q = jnp.pad((q * scale).astype(q.dtype).transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, t_pad - t), (0, 0)))
    k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, s_pad - s), (0, 0))) for a in (k, v))
    kv_ids = jnp.pad(k_valid.astype(jnp.int32), ((0, 0), (0, s_pad - s)))
    ids = splash.SegmentIds(q=jnp.ones((t_pad,), jnp.int32), kv=kv_ids)  # a key is seen only when valid (id 1)
    shape = (t_pad, s_pad)
    if window >= t_pad + q_offset:  # no key lies that far back: causal only
        mask = splash.CausalMask(shape, offset=q_offset)
    else:  # visible: q_offset + t - (window - 1) <= slot <= q_offset + t
        mask = splash.LocalMask(shape, window_size=(window - 1, 0), offset=q_offset)
    blocks = splash.BlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_kv_compute=block_kv,
        block_q_dkv=block_q,
        block_kv_dkv=block_kv,
        block_kv_dkv_compute=block_kv,
        block_q_dq=block_q,
        block_kv_dq=block_kv,
    )
    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([mask] * h),
        block_sizes=blocks,
        head_shards=1,
        q_seq_shards=1,
        attn_logits_soft_cap=softcap,
        interpret=interpret,
    )
    # bf16 operands have one matmul precision: Mosaic refuses the float32 one `jax_default_matmul_precision=highest`
    # would ask for
    precision = "default" if q.dtype == jnp.bfloat16 else jax.config.jax_default_matmul_precision
    with jax.default_matmul_precision(precision):
        out = jax.vmap(kernel, in_axes=(0, 0, 0, splash.SegmentIds(q=None, kv=0)))(q, k, v, ids)  # [B, H, T', d]
    return out[:, :, :t].transpose(0, 2, 1, 3).reshape(b, t, h * d).astype(out_dtype)


def _block(length):
    return min(SPLASH_BLOCK, _round_up(length, LANES))


def _round_up(n, multiple):
    return -(-n // multiple) * multiple


# ---------------------------------------------------------------------------------------------------------- GPU


def gpu_supports(q, k, v, *, softcap=None) -> bool:
    """Whether cuDNN's flash attention (`gpu_attention`) takes these arguments on this machine's GPU: float16 or
    bfloat16 q, k, v of one dtype and head size, the head size a multiple of 8 up to 128 (256 from Hopper on),
    whole KV groups, no softcap, even lengths (its backward with a bias needs them)."""
    head = q.shape[-1]
    return (
        jax.default_backend() == "gpu"
        and q.dtype == k.dtype == v.dtype
        and any(q.dtype == d for d in GPU_DTYPES)
        and q.shape[-1] == k.shape[-1] == v.shape[-1]
        and head % 8 == 0
        and head <= _gpu_max_head()
        and q.shape[2] % k.shape[1] == 0
        and softcap is None
        and q.shape[1] % 2 == 0
        and k.shape[2] % 2 == 0
    )


def _gpu_max_head() -> int:
    try:
        capability = float(getattr(jax.devices()[0], "compute_capability", "0"))
    except (RuntimeError, ValueError):
        return 0
    return 256 if capability >= 9.0 else 128


def gpu_attention(q, k, v, q_pos, k_pos, k_valid, *, scale, window=GLOBAL_WINDOW, softcap=None, implementation="cudnn"):
    """XLA's attention through `jax.nn.dot_product_attention` (cuDNN by default; `implementation="xla"` runs
    the same call anywhere). The position mask goes in whole, so any positions work (module docstring)."""
    if softcap is not None:
        raise ValueError("gpu_attention: cuDNN's flash attention has no logit softcap; use attention.xla_attention.")
    delta = q_pos[:, :, None] - k_pos[:, None, :]  # [B, T, S]
    visible = k_valid[:, None, :] & (delta >= 0) & (delta < window)
    out = jax.nn.dot_product_attention(
        q,
        k.transpose(0, 2, 1, 3),  # [B, S, K, d]
        v.transpose(0, 2, 1, 3),
        mask=visible[:, None],
        scale=scale,
        implementation=implementation,
    )
    # a row with no visible key attends uniformly to all S keys, as XLA's attention does (its finite mask value)
    uniform = jnp.repeat(v.astype(jnp.float32).mean(axis=2), q.shape[2] // k.shape[1], axis=1)  # [B, H, d]
    out = jnp.where(visible.any(-1)[:, :, None, None], out, uniform[:, None].astype(out.dtype))
    return out.reshape(*q.shape[:2], -1)
