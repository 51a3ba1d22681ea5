"""The models' one attention entry: `attend(q, k, v, mask)` picks the implementation by backend and capability.

Every attention of the model layer goes through here (each layer of a forward, the attention loss's re-reads); what
a query may see is a `Mask` (positions, validity, a sliding window, optionally a per-query set of keys), never a
materialised [T, S] matrix unless a caller's key set is one. The implementations, in the order they are tried:
- `cpu_kernel`: the fused CPU kernel (`mot_jax.kernels`, XLA FFI), on the CPU backend where it takes the operands;
- `tpu`: splash attention (`accelerated.tpu_attention`) on the TPU backend, for a causal prefill into an empty cache
  (splash masks by slot, which there is the position rule; a continuation's slot is traced); under a mesh set with
  `jax.set_mesh` it runs on each chip's rows (and KV heads, where a rule splits them) through `shard_map`, since a
  Pallas kernel has no partitioning rule and XLA would otherwise gather the whole operands onto every chip;
- `gpu`: cuDNN's flash attention (`accelerated.gpu_attention`, the position mask as a bias) on the GPU backend where
  its constraints hold (bf16/fp16, head sizes, no soft-cap);
- `xla`: softmax weights materialised (`layers.attention_weights`), in query blocks for a causal prefill so that
  blocks above the diagonal are skipped; the only path that can hand the weights to a caller (`on_weights`) and the
  one every other path is tested against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from mot_jax import kernels, sharding
from mot_jax.models import accelerated
from mot_jax.models.layers import GLOBAL_WINDOW, attention_reference, attention_weights, einsum

PREFILL_BLOCK = 512  # query block of a causal prefill on XLA's path (key blocks above the diagonal are skipped)
IMPLEMENTATIONS = ("cpu_kernel", "tpu", "gpu", "xla")


@struct.dataclass
class Mask:
    """Which keys each query sees: a key is visible when valid, not after the query (by position) and less than
    `window` positions behind it, and (with `allowed` [B, T, S]) chosen for that query; a query left with no chosen
    visible key attends to itself. `causal_prefill`: the keys are the queries' own tokens in order with nothing
    before them (a prefill into an empty cache), so a block of queries needs the keys up to its end only.
    `window_choices`: every value a traced `window` can take (the model's per-layer windows inside its layer scan)."""

    q_pos: jax.Array  # [B, T]
    k_pos: jax.Array  # [B, S]
    k_valid: jax.Array  # [B, S] bool
    window: jax.Array | int = GLOBAL_WINDOW
    allowed: jax.Array | None = None  # [B, T, S] bool
    causal_prefill: bool = struct.field(pytree_node=False, default=False)
    window_choices: tuple = struct.field(pytree_node=False, default=())

    @property
    def windows(self) -> dict:
        """The window and its possible values, as the splash functions take them."""
        return dict(window=self.window, window_choices=self.window_choices)


def implementation(q, k, v, mask: Mask, softcap=None, needs_weights=False) -> str:
    """The name (`IMPLEMENTATIONS`) of the implementation `attend` runs for these operands on this backend."""
    if needs_weights or mask.allowed is not None:
        return "xla"
    backend = default_backend()
    if backend == "cpu" and kernels.supports(q, k, v, softcap):
        return "cpu_kernel"
    if backend == "tpu" and mask.causal_prefill and accelerated.tpu_supports(q, k, v, softcap=softcap, **mask.windows):
        return "tpu"
    if backend == "gpu" and accelerated.gpu_supports(q, k, v, softcap=softcap):
        return "gpu"
    return "xla"


def default_backend() -> str:
    """The backend the program is traced for: the platform of the mesh set with `jax.set_mesh` (an ahead-of-time
    compile for a TPU slice traces on a CPU machine), else JAX's default backend. A function of its own, so tests
    can trace another backend's choice."""
    device = getattr(context_mesh(), "abstract_device", None)
    return jax.default_backend() if device is None else device.platform


def context_mesh():
    """The (abstract) mesh set with `jax.set_mesh` around the trace, or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def mesh_split(q, k) -> dict:
    """How `tpu_attention` splits its operands over the context mesh: the rows over the mesh axes the `batch` rule
    names, the KV heads over those the `kv_heads` rule names (`tensor`), each where it divides (`sharding.spec`);
    {} without a mesh of several devices."""
    mesh = context_mesh()
    if mesh is None or mesh.size == 1:
        return {}
    batch, heads = sharding.spec(("batch", "kv_heads"), sharding.MODEL_RULES, (q.shape[0], k.shape[1]), mesh)
    return dict(mesh=mesh, batch_axes=batch, head_axes=heads)


def attend(q, k, v, mask: Mask, *, scale, softcap=None, on_weights: Callable | None = None):
    """Attention of queries q [B, T, H, d] over keys and values k, v [B, K, S, d] (the cache layout; H = K * G, GQA)
    under `mask`; returns [B, T, H * d]. `on_weights(probs, start, block)`, when given, is called with each query
    block's softmax weights [B, K, G, t, S'] (fp32), its first query and the block size (XLA's path runs then)."""
    chosen = implementation(q, k, v, mask, softcap, on_weights is not None)
    positions = (mask.q_pos, mask.k_pos, mask.k_valid)
    if chosen == "cpu_kernel":
        reference = functools.partial(attention_reference, softcap=softcap, allowed=None)
        return kernels.attention(q, k, v, *positions, mask.window, scale, softcap=softcap, reference=reference)
    if chosen == "tpu":
        split = mesh_split(q, k)
        return accelerated.tpu_attention(q, k, v, *positions, scale=scale, softcap=softcap, **mask.windows, **split)
    if chosen == "gpu":
        return accelerated.gpu_attention(q, k, v, *positions, scale=scale, window=mask.window, softcap=softcap)
    return xla_attention(q, k, v, mask, scale=scale, softcap=softcap, on_weights=on_weights)


def xla_attention(q, k, v, mask: Mask, *, scale, softcap=None, on_weights=None):
    """`attend` through XLA: the softmax weights materialised, in query blocks of `PREFILL_BLOCK` for a long causal
    prefill (each block reads the keys up to its last query)."""
    length = q.shape[1]
    block = PREFILL_BLOCK if mask.causal_prefill and length > PREFILL_BLOCK else length
    outs = []
    for start in range(0, length, block):
        stop = min(start + block, length)
        keys = stop if mask.causal_prefill else k.shape[2]
        probs = attention_weights(
            q[:, start:stop],
            k[:, :, :keys],
            mask.q_pos[:, start:stop],
            mask.k_pos[:, :keys],
            mask.k_valid[:, :keys],
            scale=scale,
            window=mask.window,
            softcap=softcap,
            allowed=None if mask.allowed is None else mask.allowed[:, start:stop, :keys],
        )
        if on_weights is not None:
            on_weights(probs, start, block)
        outs.append(einsum("bkgts,bksd->btkgd", probs.astype(v.dtype), v[:, :, :keys]))
    return jnp.concatenate(outs, axis=1).reshape(*q.shape[:2], -1)
