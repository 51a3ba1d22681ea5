"""Mixture of translators: a per-token top-k router over N experts, dense or sparse (real dispatch).

- dense: every expert runs on every token; y = sum_n w_n E_n(x) with w zero outside the top-k (the reference).
- sparse: each expert runs its query chain only for the tokens routed to it, in a fixed number of query slots per
  batch row; its attention context stays the whole sequence, so a routed token gets the same numbers as on the dense
  path. Dropless: the step picks the smallest slot count of `TranslatorConfig.capacities` that holds the busiest
  expert's queue in every row (one `lax.switch` branch per count, compiled once), and the dense path when none
  does, so no token ever loses an expert. `stats["capacity"]` is the slot count used (T: the dense path).

Also returned: the Switch load-balancing loss and the router z-loss (for the training loss) and routing statistics
(importance, load, their CV^2 and the importance entropy) for logging, all over valid (non-padding) tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mot_jax.errors import MotJaxError
from mot_jax.models.layers import LayerNorm, Linear, einsum
from mot_jax.translate.config import TranslatorConfig
from mot_jax.translate.expert import EPS, Experts, gelu, torch_std


class Router(nnx.Module):
    """LayerNorm -> Linear -> GELU -> Linear to N logits, per token, on the flattened raw window."""

    def __init__(self, cfg: TranslatorConfig, *, rngs, dtype=jnp.float32):
        width, hidden = cfg.window * cfg.source_width, cfg.router_hidden
        self.norm = LayerNorm(width, EPS, rngs=rngs, dtype=dtype)
        self.hidden = Linear(width, hidden, (None, "mlp"), rngs=rngs, dtype=dtype, std=torch_std(width))
        self.out = Linear(hidden, cfg.num_experts, ("mlp", None), rngs=rngs, dtype=dtype, std=torch_std(hidden))

    def __call__(self, x):
        return self.out(gelu(self.hidden(self.norm(x.reshape(*x.shape[:2], -1))))).astype(jnp.float32)


def check_config(cfg: TranslatorConfig):
    if not 1 <= cfg.top_k <= cfg.num_experts:
        raise MotJaxError(f"top_k={cfg.top_k} must be between 1 and num_experts={cfg.num_experts}; lower top_k.")
    if cfg.dispatch not in ("dense", "sparse"):
        raise MotJaxError(f"dispatch={cfg.dispatch!r} is not 'dense' or 'sparse'.")
    if cfg.output_activation not in ("gelu", "none"):
        raise MotJaxError(f"output_activation={cfg.output_activation!r} is not 'gelu' or 'none'.")
    if cfg.dim % cfg.heads:
        raise MotJaxError(f"translator dim {cfg.dim} is not divisible by heads {cfg.heads}; change one of them.")


class MixtureOfTranslators(nnx.Module):
    def __init__(self, cfg: TranslatorConfig, *, rngs, dtype=jnp.float32):
        check_config(cfg)
        self.cfg = cfg
        self.experts = Experts(cfg, rngs=rngs, dtype=dtype)
        self.router = Router(cfg, rngs=rngs, dtype=dtype) if cfg.num_experts > 1 else None

    def __call__(self, x, token_mask=None):
        """x [B, T, W, ds] (source K or V on the target token grid) -> (y [B, T, W, dt], aux dict)."""
        cfg = self.cfg
        b, t = x.shape[:2]
        mask = jnp.ones((b, t), bool) if token_mask is None else token_mask.astype(bool)
        if self.router is None:  # N = 1: no routing
            y = self.experts(x, mask, jnp.broadcast_to(jnp.arange(t), (1, b, t)))[0]
            return y, {}
        logits = self.router(x)  # [B, T, N]
        top_logits, top_experts = jax.lax.top_k(logits, cfg.top_k)
        top_weights = jax.nn.softmax(top_logits, axis=-1)
        chosen = jax.nn.one_hot(top_experts, cfg.num_experts, dtype=bool).any(axis=2) & mask[..., None]  # [B,T,N]
        weights = einsum("btk,btkn->btn", top_weights, jax.nn.one_hot(top_experts, cfg.num_experts))
        weights = weights * mask[..., None]  # padding tokens get no translation
        if cfg.dispatch == "dense":
            y, capacity = combine_dense(self.experts, x, mask, weights), jnp.asarray(t, jnp.int32)
        else:
            y, capacity = self.sparse(x, mask, chosen, weights)
        return y, aux_losses_and_stats(logits, chosen, weights, mask, capacity)

    def sparse(self, x, mask, chosen, weights):
        """Dropless dispatch: the smallest capacity that holds every row's busiest expert, else the dense path."""
        t = mask.shape[1]
        capacities = self.cfg.capacities(t)
        graphdef, experts = nnx.split(self.experts)
        branches = [lambda e, *a, c=c: dispatch(nnx.merge(graphdef, e), c, *a) for c in capacities]
        branches.append(lambda e, x, mask, chosen, weights: combine_dense(nnx.merge(graphdef, e), x, mask, weights))
        slots = jnp.asarray(capacities + (t,), jnp.int32)  # the last: the dense path, T slots
        choice = jnp.searchsorted(slots, jnp.max(jnp.sum(chosen, axis=1)))  # the first that holds the busiest queue
        return jax.lax.switch(choice, branches, experts, x, mask, chosen, weights), slots[choice]


def combine_dense(experts, x, mask, weights):
    """Every expert on every token, combined with the routing weights (zero outside each token's top k)."""
    n, (b, t) = weights.shape[-1], mask.shape
    query_index = jnp.broadcast_to(jnp.arange(t), (n, b, t))
    return einsum("btn,nbtwd->btwd", weights.astype(x.dtype), experts(x, mask, query_index))


def dispatch(experts, capacity, x, mask, chosen, weights):
    """Each row's routed tokens to their experts' `capacity` query slots, then combined; every queue must fit."""
    (b, t), n = mask.shape, weights.shape[-1]
    slot = jnp.cumsum(chosen, axis=1) - 1  # position of token t in expert n's queue of its row: [B, T, N]
    # query_index[n, b, c] = the token in slot c of expert n (0 for empty slots, whose outputs are unused)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None, None], slot.shape)
    expert = jnp.broadcast_to(jnp.arange(n), slot.shape)
    tokens = jnp.broadcast_to(jnp.arange(t)[None, :, None], slot.shape)
    query_index = jnp.zeros((n, b, capacity), jnp.int32)
    query_index = query_index.at[expert, rows, jnp.where(chosen, slot, capacity)].set(tokens, mode="drop")
    out = experts(x, mask, query_index)  # [N, B, C, W, dt]
    gathered = out[expert, rows, jnp.clip(slot, 0, capacity - 1)]  # [B, T, N, W, dt]
    return einsum("btn,btnwd->btwd", jnp.where(chosen, weights, 0.0).astype(x.dtype), gathered)


def aux_losses_and_stats(logits, chosen, weights, mask, capacity):
    """Switch load-balancing loss N * sum_n f_n P_n, router z-loss, and routing statistics over valid tokens."""
    n = logits.shape[-1]
    valid = mask[..., None].astype(jnp.float32)
    count = jnp.maximum(valid.sum(), 1.0)
    probs = jax.nn.softmax(logits, axis=-1)
    load = (chosen * valid).sum(axis=(0, 1))  # tokens routed to each expert
    fraction = load / jnp.maximum(load.sum(), 1.0)
    mean_prob = (probs * valid).sum(axis=(0, 1)) / count
    z = jax.nn.logsumexp(logits, axis=-1)
    importance = (weights * valid).sum(axis=(0, 1))
    share = importance / jnp.maximum(importance.sum(), 1e-9)
    return {
        "load_balance_loss": n * jnp.sum(fraction * mean_prob),
        "z_loss": jnp.sum(jnp.square(z) * mask) / count,
        "stats": {
            "importance": importance,
            "load": load,
            "importance_cv2": cv2(importance),
            "load_cv2": cv2(load),
            "importance_entropy": -jnp.sum(share * jnp.log(jnp.maximum(share, 1e-9))),
            "capacity": capacity,
        },
    }


def cv2(v):
    """Squared coefficient of variation with the population variance, as the reference logs it."""
    return jnp.var(v) / (jnp.square(jnp.mean(v)) + 1e-10)
