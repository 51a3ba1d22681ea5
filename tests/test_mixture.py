"""The mixture of translators: sparse dispatch against the dense reference path, routing losses, sharding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from mot_jax import sharding
from mot_jax.errors import MotJaxError
from mot_jax.jit import jit
from mot_jax.translate.config import TranslatorConfig
from mot_jax.translate.mixture import MixtureOfTranslators

TINY = TranslatorConfig(source_width=12, target_width=20, window=3, dim=32, heads=4, depth=2)


def inputs(batch=3, length=10, seed=1):
    x = jax.random.normal(jax.random.key(seed), (batch, length, TINY.window, TINY.source_width))
    mask = jnp.ones((batch, length), bool).at[1, 7:].set(False).at[2, :3].set(False)  # right and left padding
    return x, mask


def mixture(**changes):
    return MixtureOfTranslators(dataclasses.replace(TINY, **changes), rngs=nnx.Rngs(0))


@jit
def forward(m, x, mask):
    """The forward as one program: run eagerly, each operation compiles on its own (this file: 4.8x the compiles)."""
    return m(x, mask)


@pytest.mark.parametrize("experts,k,fused", [(2, 1, True), (4, 2, True), (8, 1, True), (8, 2, False)])
def test_sparse_dispatch_equals_dense(experts, k, fused):
    x, mask = inputs()
    common = dict(num_experts=experts, top_k=k, fused_output=fused)
    sparse = mixture(**common, dispatch="sparse")
    dense = mixture(**common, dispatch="dense")
    y_sparse, aux = forward(sparse, x, mask)
    y_dense, aux_dense = forward(dense, x, mask)
    np.testing.assert_allclose(np.asarray(y_sparse), np.asarray(y_dense), atol=1e-5, rtol=0)
    np.testing.assert_allclose(aux["load_balance_loss"], aux_dense["load_balance_loss"], rtol=1e-6)


# the busiest queue (9 of 16 tokens) fits the first capacity (12), the second (10 = 2 x 5), neither (the dense
# path), and every token on one expert
@pytest.mark.parametrize("favourite_bias,factor", [(0.0, 3.0), (0.0, 1.25), (0.0, 0.5), (50.0, 1.25)])
def test_sparse_dispatch_is_dropless_at_any_routing(favourite_bias, factor):
    """Queues over the first capacity (skewed routers, small factors) take a larger one or the dense path: every
    token keeps every expert it chose, and the slot count used is the smallest that holds the busiest queue."""
    x, mask = inputs(length=16)
    common = dict(num_experts=4, top_k=1, capacity_factor=factor)
    sparse, dense = mixture(**common, dispatch="sparse"), mixture(**common, dispatch="dense")
    for m in (sparse, dense):
        m.router.out.bias.set_value(jnp.array([favourite_bias, 0.0, 0.0, 0.0]))  # expert 0 gets more tokens
    y_sparse, aux = forward(sparse, x, mask)
    y_dense, _ = forward(dense, x, mask)
    np.testing.assert_allclose(np.asarray(y_sparse), np.asarray(y_dense), atol=1e-5, rtol=0)
    chosen = np.asarray(jax.nn.one_hot(jnp.argmax(sparse.router(x), -1), 4, dtype=bool) & mask[..., None])
    busiest = chosen.sum(axis=1).max()
    first = -(-int(factor * 16) // 4)
    want = next(c for c in (first, 2 * first, 16) if c >= busiest)
    assert int(aux["stats"]["capacity"]) == want


@pytest.mark.parametrize("dispatch", ["sparse", "dense"])
def test_expert_without_tokens_gets_zero_gradient(dispatch):
    x, mask = inputs()
    m = mixture(num_experts=3, top_k=1, dispatch=dispatch)
    m.router.out.bias.set_value(jnp.array([0.0, 50.0, 0.0]))  # every token picks expert 1

    def loss(m):
        y, _ = m(x, mask)
        return jnp.sum(y**2)

    grads = nnx.jit(nnx.grad(loss))(m)
    for path, g in nnx.to_flat_state(nnx.state(grads.experts, nnx.Param)):
        g = np.asarray(g[...])
        assert np.all(g[[0, 2]] == 0), path
        assert np.any(g[1] != 0), path


def test_balanced_router_gives_unit_load_balance_loss():
    x, mask = inputs()
    m = mixture(num_experts=4, top_k=1)
    m.router.out.kernel.set_value(jnp.zeros_like(m.router.out.kernel[...]))  # uniform probabilities
    _, aux = forward(m, x, mask)
    # P_n = 1/N for every expert and sum_n f_n = 1, so N * sum_n f_n P_n = 1 whatever the (tied) top-1 choice
    np.testing.assert_allclose(float(aux["load_balance_loss"]), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(aux["z_loss"]), np.log(4) ** 2, rtol=1e-5)


@pytest.mark.devices(8)
def test_sharded_forward_and_gradient_equal_unsharded():
    x, mask = inputs(batch=4)

    def loss(m, x, mask):
        y, aux = m(x, mask)
        return jnp.sum(y**2) + aux["load_balance_loss"] + aux["z_loss"]

    step = nnx.jit(nnx.value_and_grad(loss))
    want_loss, want_grads = step(mixture(num_experts=4, top_k=2), x, mask)
    mesh = sharding.make_mesh(data=2, expert=4)
    sharded = sharding.shard(mixture(num_experts=4, top_k=2), mesh)
    assert sharded.experts.blocks.fc1.kernel[...].sharding.spec[0] == "expert"
    rows = NamedSharding(mesh, sharding.spec(("batch",)))  # the batch axis over `data`, as the Trainer places batches
    x, mask = jax.device_put(x, rows), jax.device_put(mask, rows)
    got_loss, got_grads = step(sharded, x, mask)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    for (path, want), (_, got) in zip(
        nnx.to_flat_state(nnx.state(want_grads)), nnx.to_flat_state(nnx.state(got_grads))
    ):
        np.testing.assert_allclose(np.asarray(got[...]), np.asarray(want[...]), atol=1e-5, rtol=1e-5, err_msg=str(path))


@pytest.mark.parametrize(
    "changes,message",
    [(dict(num_experts=2, top_k=3), "top_k=3"), (dict(dispatch="fast"), "dispatch"), (dict(heads=5), "divisible")],
)
def test_bad_config_is_a_clear_error(changes, message):
    with pytest.raises(MotJaxError, match=message):
        mixture(**changes)
