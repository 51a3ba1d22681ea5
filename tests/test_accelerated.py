"""The accelerator attention paths against XLA's attention (`layers.attention_reference`): splash attention run by
Pallas' interpreter on the CPU for every mask kind the model's prefills make, and cuDNN's call checked through
`jax.nn.dot_product_attention`'s XLA implementation with the same mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from mot_jax.models import accelerated, attention
from mot_jax.models.base import positions_from_mask
from mot_jax.models.layers import GLOBAL_WINDOW, attention_reference

SCALE = 0.125


def qkv(t, s, heads=4, kv_heads=2, d=64, batch=2, dtype=jnp.float32, seed=0):
    q, k, v = (
        jax.random.normal(key, shape, jnp.float32).astype(dtype)
        for key, shape in zip(
            jax.random.split(jax.random.key(seed), 3),
            [(batch, t, heads, d), (batch, kv_heads, s, d), (batch, kv_heads, s, d)],
        )
    )
    return q, k, v


def padded_prefill(t, pads):
    """A prefill into an empty cache: row i padded by pads[i] on the left (> 0) or the right (< 0)."""
    mask = np.ones((len(pads), t), bool)
    for row, pad in enumerate(pads):
        if pad > 0:
            mask[row, :pad] = False
        elif pad < 0:
            mask[row, pad:] = False
    mask = jnp.asarray(mask)
    positions = positions_from_mask(mask)
    return positions, positions, mask, mask  # q_pos, k_pos, k_valid, the queries whose result is defined


def reference(q, k, v, q_pos, k_pos, k_valid, window, softcap=None):
    return attention_reference(q, k, v, q_pos, k_pos, k_valid, window, SCALE, softcap=softcap, allowed=None)


def splash(q, k, v, q_pos, k_pos, k_valid, window, **kwargs):
    return accelerated.tpu_attention(
        q, k, v, q_pos, k_pos, k_valid, scale=SCALE, window=window, interpret=True, **kwargs
    )


def assert_rows_close(out, expected, rows, tol):
    out, expected, rows = np.asarray(out, np.float32), np.asarray(expected, np.float32), np.asarray(rows)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[rows], expected[rows], atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "window, pads",
    [
        (GLOBAL_WINDOW, (0, 0)),  # causal prefill, two blocks of queries (200 pads to 256)
        (GLOBAL_WINDOW, (37, -50)),  # left and right padding
        (48, (21, -13)),  # a sliding window with padding
    ],
)
def test_splash_matches_xla_on_prefills(window, pads):
    t = 200
    q, k, v = qkv(t, t)
    q_pos, k_pos, k_valid, rows = padded_prefill(t, pads)
    out = jax.jit(lambda *a: splash(*a, window=window))(q, k, v, q_pos, k_pos, k_valid)
    assert out.shape == (2, t, 4 * 64)
    assert_rows_close(out, reference(q, k, v, q_pos, k_pos, k_valid, window), rows, 2e-5)


def test_splash_continues_a_cache_at_an_offset():
    """New tokens at slots [offset, offset + T) of a 300-slot cache whose rows hold a left-padded prompt."""
    capacity, offset, t, pads = 300, 130, 40, np.array([17, 0])
    q, k, v = qkv(t, capacity)
    slots = np.arange(capacity)[None]
    k_valid = jnp.asarray((slots >= pads[:, None]) & (slots < offset + t))
    k_pos = jnp.asarray(np.maximum(slots - pads[:, None], 0))
    q_pos = k_pos[:, offset : offset + t]
    rows = jnp.ones((2, t), bool)
    for window in (GLOBAL_WINDOW, 64):
        out = jax.jit(lambda *a, w=window: splash(*a, window=w, q_offset=offset))(q, k, v, q_pos, k_pos, k_valid)
        assert_rows_close(out, reference(q, k, v, q_pos, k_pos, k_valid, window), rows, 2e-5)


def test_splash_bfloat16_softcap_and_a_traced_window():
    """Gemma-3's case: bf16, a logit softcap, the window a traced per-layer value chosen among the static ones."""
    t = 130
    q, k, v = qkv(t, t, heads=2, kv_heads=1, dtype=jnp.bfloat16)
    q_pos, k_pos, k_valid, rows = padded_prefill(t, (5, 0))
    choices = (16, GLOBAL_WINDOW)
    run = jax.jit(lambda window, *a: splash(*a, window=window, softcap=1.5, window_choices=choices))
    for window in choices:
        out = run(jnp.int32(window), q, k, v, q_pos, k_pos, k_valid)
        assert out.dtype == jnp.bfloat16
        assert_rows_close(out, reference(q, k, v, q_pos, k_pos, k_valid, window, softcap=1.5), rows, 2e-2)


def test_splash_shards_batch_and_heads_over_a_mesh():
    """Through shard_map on 4 of the simulated CPU devices (2 batch x 2 head shards), and its gradient."""
    mesh = Mesh(np.reshape(jax.devices()[:4], (2, 2)), ("data", "tensor"))
    t = 128
    q, k, v = qkv(t, t, heads=4, kv_heads=2)
    q_pos, k_pos, k_valid, rows = padded_prefill(t, (9, -3))

    def loss(attend, q, k, v):
        out = attend(q, k, v)
        return jnp.sum(jnp.where(rows[:, :, None], out, 0.0) ** 2)

    def sharded(q, k, v):
        return splash(q, k, v, q_pos, k_pos, k_valid, 32, mesh=mesh, batch_axes="data", head_axes="tensor")

    def xla(q, k, v):
        return reference(q, k, v, q_pos, k_pos, k_valid, 32)

    out = jax.jit(sharded)(q, k, v)
    assert_rows_close(out, xla(q, k, v), rows, 2e-5)
    grads = jax.jit(jax.grad(lambda *a: loss(sharded, *a), argnums=(0, 1, 2)))(q, k, v)
    expected = jax.grad(lambda *a: loss(xla, *a), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "window, pads, kv_heads",
    [
        (GLOBAL_WINDOW, (0, 37, -50, 5), 2),  # causal, GQA (2 queries a KV head), left and right padding
        (48, (21, -13, 0, 60), 1),  # a sliding window, one KV head for all 4 query heads
    ],
)
def test_the_entry_runs_splash_on_each_chips_rows_under_a_mesh(monkeypatch, window, pads, kv_heads):
    """A causal prefill through the attention entry under `jax.set_mesh` (the trainer's mesh shape on the 8 simulated
    devices: 4 `data` x 2 `expert`), the TPU route taken and splash run in interpret mode: a shard_map over the rows
    around the kernel, and XLA's attention's values on every query a valid token reads."""
    mesh = Mesh(np.reshape(jax.devices()[:8], (4, 2)), ("data", "expert"))
    monkeypatch.setattr(attention, "default_backend", lambda: "tpu")
    splits, run = [], accelerated.tpu_attention
    interpreted = lambda *a, **kw: splits.append(kw.get("batch_axes")) or run(*a, **kw, interpret=True)
    monkeypatch.setattr(accelerated, "tpu_attention", interpreted)
    t = 136
    q, k, v = qkv(t, t, heads=4, kv_heads=kv_heads, d=32, batch=4)
    q_pos, k_pos, k_valid, rows = padded_prefill(t, pads)
    mask = attention.Mask(q_pos, k_pos, k_valid, window, causal_prefill=True)
    attend = jax.jit(lambda q, k, v: attention.attend(q, k, v, mask, scale=SCALE))
    with jax.set_mesh(mesh):
        program = str(attend.trace(q, k, v).jaxpr)
        out = attend(q, k, v)
    assert splits == ["data"]  # traced once
    assert "shard_map" in program and "pallas_call" in program
    assert_rows_close(out, reference(q, k, v, q_pos, k_pos, k_valid, window), rows, 2e-5)


def test_tpu_supports_names_what_splash_cannot_take():
    q, k, v = qkv(8, 16)
    assert accelerated.tpu_supports(q, k, v)
    assert accelerated.tpu_supports(q, k, v, q_offset=8, softcap=30.0)
    assert not accelerated.tpu_supports(q.astype(jnp.float16), k, v)  # dtype
    assert not accelerated.tpu_supports(q, k.astype(jnp.bfloat16), v)  # mixed dtypes
    assert not accelerated.tpu_supports(q, k, v, q_offset=9)  # queries past the keys
    assert not accelerated.tpu_supports(q, k, v, softcap=0.0)
    assert not accelerated.tpu_supports(*qkv(8, 16, heads=3, kv_heads=2))  # not whole KV groups
    traced = jax.ShapeDtypeStruct((), jnp.int32)
    jax.eval_shape(lambda w: np.testing.assert_equal(accelerated.tpu_supports(q, k, v, window=w), False), traced)
    with pytest.raises(ValueError, match="tpu_supports"):
        accelerated.tpu_attention(q, k, v, None, None, None, scale=1.0, window=4, q_offset=9)
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("data",))
    with pytest.raises(ValueError, match="the batch"):
        splash(q, k, v, None, None, jnp.ones((2, 16), bool), 4, mesh=mesh, batch_axes="data")


def test_gpu_attention_mask_matches_xla_for_any_positions():
    """The mask handed to cuDNN, checked through the same call's XLA implementation: padding, a window, and
    positions that do not follow the slots (a gap, and rows with no visible key: uniform over all keys)."""
    t, s = 6, 10
    q, k, v = qkv(t, s)
    k_pos = jnp.asarray([[0, 1, 2, 3, 7, 8, 9, 10, 11, 12], [5, 5, 5, 0, 1, 2, 3, 4, 5, 6]])
    k_valid = jnp.asarray([[1, 1, 1, 1, 0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]], bool)
    q_pos = jnp.asarray([[7, 8, 9, 10, 11, 12], [-1, 1, 2, 3, 4, 5]])  # row 1 starts with a query seeing no key
    for window in (GLOBAL_WINDOW, 3):
        out = accelerated.gpu_attention(
            q, k, v, q_pos, k_pos, k_valid, scale=SCALE, window=window, implementation="xla"
        )
        np.testing.assert_allclose(out, reference(q, k, v, q_pos, k_pos, k_valid, window), atol=2e-5, rtol=2e-5)


def test_gpu_supports_is_false_off_a_gpu_and_for_what_cudnn_cannot_take():
    q, k, v = qkv(8, 16, dtype=jnp.bfloat16)
    assert not accelerated.gpu_supports(q, k, v)  # these tests run on the CPU
    with pytest.raises(ValueError, match="softcap"):
        accelerated.gpu_attention(q, k, v, None, None, None, scale=1.0, softcap=50.0)
    if jax.default_backend() == "gpu":
        assert accelerated.gpu_supports(q, k, v)
    for args, kwargs in [
        (qkv(8, 16), {}),  # float32
        (qkv(8, 16, d=260, dtype=jnp.bfloat16), {}),  # head size
        (qkv(8, 16, d=60, dtype=jnp.bfloat16), {}),  # not a multiple of 8
        (qkv(7, 16, dtype=jnp.bfloat16), {}),  # odd length
        ((q, k, v), {"softcap": 30.0}),
    ]:
        assert not accelerated.gpu_supports(*args, **kwargs)
