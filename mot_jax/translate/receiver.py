"""Receiver adaptation (ours, after SwiftKV, arXiv 2410.03960): the target learns to read a translated cache.

Every other translator here bends the translation to the target's frozen queries. With `receiver_rank = r > 0` the
translator also holds a low-rank change to the target's query projection in each layer it writes,
W_q + down @ up (`down` [D, r] random, `up` [r, H * d] zero, so training starts at the target itself), and wherever
the target reads after a translated cache (the training loss's prompt, an evaluation's question and answer, the
pipeline) it reads through `adapted(target)`: the same model with those query projections changed. The layers below
the written ones stay its own, and so do the K/V it computes for new tokens unless the translator's kind says
otherwise (`adapted`'s `hook`: with the self-prediction kind's `new_tokens_from_map`, SwiftKV's single input for new
tokens too, `translate/hooks.py:MappedKeyValues`). SwiftKV trains full copies of those query projections; that is
not done here.

Only families whose layers have a separate query projection (`self_attn.q_proj`: Qwen2/3, Llama, Gemma-3) can be
adapted (`check`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mot_jax.errors import MotJaxError
from mot_jax.models.layers import einsum, param

QUERY_KERNEL = ("layers", "self_attn", "q_proj", "kernel")  # where a rotary family keeps its stacked W_q [L, D, H*d]


def check(target, rank) -> None:
    """Refuse, in one line, a receiver adaptation the target cannot take."""
    if rank < 0:
        raise MotJaxError(f"translator.receiver_rank={rank} is negative; pass 0 (off) or a rank such as 16.")
    if rank and not target.config.rotary:
        raise MotJaxError(
            f"translator.receiver_rank adapts the target's query projections, which a {target.config.family} target "
            "does not keep apart from its keys and values; set it to 0 or use a Qwen, Llama or Gemma-3 target."
        )


def widths(target) -> dict:
    """The adapter's widths for `target`: its residual stream (D) and its queries (H * d)."""
    cfg = target.config
    return dict(receiver_width=cfg.hidden_size, receiver_query_width=cfg.num_heads * cfg.head_dim)


class ReceiverQueries(nnx.Module):
    """Per adapted layer (`layers`, static), the low-rank change down @ up [D, H * d] to its query projection."""

    def __init__(self, layers, width, query_width, rank, *, rngs, dtype=jnp.float32):
        self.layers = tuple(int(i) for i in layers)
        count = len(self.layers)
        self.down = param(rngs.params(), (count, width, rank), ("layers", None, None), dtype, std=width**-0.5)
        self.up = param(None, (count, rank, query_width), ("layers", None, None), dtype, "zeros")

    def delta(self):
        """[W, D, H * d] the change to each adapted layer's query kernel."""
        return einsum("wdr,wrq->wdq", self.down[...], self.up[...])


def adapted(target, adapter: ReceiverQueries | None, hook=None):
    """`target` with `adapter`'s changes added to its query projections and, with `hook`, running every forward with
    it (`CausalLM.forward_hook`): a new module sharing every other weight, the target itself left as it was; the
    target itself when there is neither. Jittable: gradients reach the adapter and the hook's arrays through it."""
    if adapter is None and hook is None:
        return target
    graphdef, state = nnx.split(target)
    if adapter is not None:
        picked = np.asarray(adapter.layers)

        def change(path, value):
            if tuple(getattr(p, "key", getattr(p, "name", p)) for p in path)[:4] != QUERY_KERNEL:
                return value
            return value.at[picked].add(adapter.delta().astype(value.dtype))

        state = jax.tree_util.tree_map_with_path(change, state)
    reader = nnx.merge(graphdef, state)
    if hook is not None:
        reader.forward_hook = hook
    return reader
