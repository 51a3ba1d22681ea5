"""What the compute bounds of the bench parts share: the matmul FLOPs of a forward in closed form and of any traced
program (its jaxpr), and the machine's matmul rate measured in the run.

The FLOPs are counted as a perfect kernel would do them: on the real tokens, causally (no padding, no masked keys),
2 per multiply-add, matmuls only (norms, softmax and activations are left out). The rate is that of one square matmul
in the dtype, the way the models run theirs (`layers.einsum`: bf16 operands accumulate in float32).
"""

from __future__ import annotations

import math
import statistics
import time

GATED = ("llama", "qwen2", "qwen3", "gemma3")  # families whose MLP has gate, up and down projections


def linear_flops(cfg) -> int:
    """Matmul FLOPs per token of one layer's projections: q, k, v, o and the MLP (2 per multiply-add)."""
    d, h, k, hd, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    mlp = (3 if cfg.family in GATED else 2) * d * f
    return 2 * (d * hd * (h + 2 * k) + h * hd * d + mlp)


def attended(cfg, layer: int, past: int, new: int) -> int:
    """Keys the `new` tokens at positions past..past+new-1 attend to in `layer`, summed (causal, the layer's window)."""
    window = cfg.windows[layer] if cfg.layer_windows else None
    return sum(min(q + 1, window) if window else q + 1 for q in range(past, past + new))


def forward_flops(cfg, new: int, past: int = 0, logits: int = 1) -> int:
    """Matmul FLOPs of one row's forward over `new` tokens after `past` cached ones, with `logits` positions
    unembedded: every layer's projections for each new token, attention scores and values over the keys each new
    token sees, and the unembedding (OPT's projections to and from its word-embedding width included)."""
    if new <= 0:
        return 0
    d, heads, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    width = getattr(cfg, "word_embed_proj_dim", 0) or d
    projections = 2 * width * d * (new + logits) if width != d else 0
    layers = cfg.num_layers * new * linear_flops(cfg)
    attention = sum(4 * heads * hd * attended(cfg, layer, past, new) for layer in range(cfg.num_layers))
    return layers + attention + projections + 2 * width * cfg.vocab_size * logits


def prefill_flops(cfg, tokens: int, batch: int = 1) -> int:
    """FLOPs of `bench models`' prefill: `batch` rows of `tokens` into an empty cache, the last position's logits."""
    return batch * forward_flops(cfg, tokens)


def matmul_flops(jaxpr) -> float:
    """2*M*N*K of every dot_general in a jaxpr, loop bodies times their trip count (scan; a while loop's body
    counts once). XLA's `cost_analysis()` counts every loop body once, and the models run their layers in a scan."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
        inner = [matmul_flops(j) for value in eqn.params.values() for j in _jaxprs(value)]
        if inner:
            trips = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
            total += trips * (max(inner) if eqn.primitive.name == "cond" else sum(inner))
    return total


def _jaxprs(value):
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(getattr(value, "jaxpr", None), "eqns"):  # a closed jaxpr
        yield value.jaxpr
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _jaxprs(v)


def matmul_rate(size: int, dtype: str, runs: int) -> float:
    """FLOP/s of a jitted [size, size] @ [size, size] matmul in `dtype` (accumulated in float32 and cast back, as
    `layers.einsum` runs the models' matmuls), the median of `runs` after a warm-up."""
    import jax
    import jax.numpy as jnp

    from mot_jax.models.layers import einsum

    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32).astype(dtype)
    product = jax.jit(lambda a, b: einsum("ij,jk->ik", a, b))
    jax.block_until_ready(product(a, b))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(product(a, b))
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def rate_size(plan) -> int:
    """The square matmul's size: the plan's, or 8,192 at least on an accelerator (a small one does not reach its
    rate)."""
    import jax

    return plan.matmul_size if jax.default_backend() == "cpu" or plan.quick else max(plan.matmul_size, 8192)
