"""The CPU kernels against XLA's paths (fused attention against XLA's attention, the row kernel against float64
products) and their build."""

import ctypes
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mot_jax import kernels
from mot_jax.errors import MotJaxError
from mot_jax.jit import jit
from mot_jax.models import layers, tiny
from mot_jax.models.attention import Mask, attend
from mot_jax.models.layers import GLOBAL_WINDOW

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler to build the kernels")


def inputs(rng, b, t, h, kv, s, d, *, offset, pad=0, dtype=jnp.float32):
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(b, kv, s, d)), dtype) for _ in range(2))
    q_pos = jnp.tile(jnp.arange(offset, offset + t), (b, 1))
    k_pos = jnp.tile(jnp.arange(s), (b, 1))
    k_valid = (k_pos < offset + t) & (k_pos >= jnp.arange(b)[:, None] * pad)  # row i: i * pad padding slots
    return q, k, v, q_pos, k_pos, k_valid


def entry(q, k, v, q_pos, k_pos, k_valid, *, scale, window=GLOBAL_WINDOW, softcap=None):
    """The models' attention entry (`attention.attend`): the kernel where it takes the operands."""
    return attend(q, k, v, Mask(q_pos, k_pos, k_valid, window), scale=scale, softcap=softcap)


def reference(q, k, v, q_pos, k_pos, k_valid, *, scale, window=GLOBAL_WINDOW, softcap=None):
    return layers.attention_reference(
        q, k, v, q_pos, k_pos, k_valid, window, scale=scale, softcap=softcap, allowed=None
    )


CASES = {
    # name: (b, t, h, kv, s, d, offset, pad, window, softcap)
    "prefill, 3 query heads a KV head, several query blocks and key tiles": (1, 300, 9, 3, 300, 64, 0, 0, None, None),
    "continuation over a cache with empty slots, left padding": (2, 37, 4, 2, 200, 24, 90, 20, None, None),
    "sliding window smaller than a key tile": (2, 130, 4, 1, 130, 16, 0, 3, 17, None),
    "soft-capped logits, one head a KV head": (1, 70, 2, 2, 70, 8, 0, 0, None, 5.0),
    "one decoding query over a long cache": (3, 1, 8, 2, 300, 32, 150, 7, None, None),
    "wide heads (Gemma-3's 256)": (1, 65, 4, 1, 65, 256, 0, 0, None, None),
}
BF16_CASES = {  # head widths that are multiples of 32 take the AMX tiles where the CPU has them
    "bf16 prefill, heads of 64": (1, 300, 9, 3, 300, 64, 0, 0, None, None),
    "bf16 continuation over a padded cache, heads of 128": (2, 37, 4, 2, 200, 128, 90, 20, None, None),
    "bf16 sliding window, heads of 256": (2, 100, 4, 1, 100, 256, 0, 3, 40, None),
    "bf16 decoding query, heads of 64": (3, 1, 8, 2, 300, 64, 150, 7, None, None),
    "bf16 heads of 24 (vector path)": (1, 50, 4, 2, 50, 24, 0, 0, None, 5.0),
}


@pytest.mark.parametrize(
    "case, dtype",
    [(c, jnp.float32) for c in CASES] + [(c, jnp.bfloat16) for c in BF16_CASES],
    ids=list(CASES) + list(BF16_CASES),
)
def test_kernel_matches_xla_attention(case, dtype):
    b, t, h, kv, s, d, offset, pad, window, softcap = {**CASES, **BF16_CASES}[case]
    args = inputs(np.random.default_rng(0), b, t, h, kv, s, d, offset=offset, pad=pad, dtype=dtype)
    options = dict(scale=d**-0.5, window=window or GLOBAL_WINDOW, softcap=softcap)
    assert kernels.supports(*args[:3], softcap)
    fused = jax.jit(lambda *a: entry(*a, **options))
    assert "mot_jax_attention" in fused.lower(*args).as_text()
    got, want = (np.asarray(x, np.float32) for x in (fused(*args), reference(*args, **options)))
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    else:  # XLA rounds the probabilities to bf16 before their product with v, the kernel too (AMX) or not
        np.testing.assert_allclose(got, want, atol=2**-6, rtol=2**-7)


def test_query_that_sees_no_key_attends_uniformly_as_in_xla():
    q, k, v, q_pos, k_pos, k_valid = inputs(np.random.default_rng(1), 2, 20, 4, 2, 150, 16, offset=0)
    q_pos = q_pos.at[1, :5].set(-1)  # before every key: nothing visible
    got = entry(q, k, v, q_pos, k_pos, k_valid, scale=0.25)
    want = reference(q, k, v, q_pos, k_pos, k_valid, scale=0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)
    uniform = np.repeat(np.asarray(v[1]).mean(1), 2, axis=0).reshape(-1)  # 2 query heads a KV head
    np.testing.assert_allclose(np.asarray(got[1, 0]), uniform, atol=2e-6)


def test_gradients_are_xlas_and_scale_may_be_traced():
    args = inputs(np.random.default_rng(2), 2, 40, 4, 2, 100, 16, offset=50, pad=5)
    cotangent = jnp.asarray(np.random.default_rng(3).normal(size=(2, 40, 64)), jnp.float32)

    def loss(attend, q, k, v, scale):
        return jnp.sum(attend(q, k, v, *args[3:], scale=scale, window=30) * cotangent)

    got = jax.jit(jax.grad(lambda *a: loss(entry, *a), argnums=(0, 1, 2, 3)))(*args[:3], 0.25)
    want = jax.grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2, 3))(*args[:3], 0.25)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_model_prefill_and_continuation_equal_xlas(family, monkeypatch):
    """A left-padded prefill of 150 tokens (three query blocks, Gemma-3's sliding windows) and 20 more tokens
    over its cache, with the kernel and with XLA's attention."""
    model, config, _ = tiny.load(f"random:{family}")
    rng = np.random.default_rng(4)
    ids, more = (jnp.asarray(rng.integers(3, config["vocab_size"], size=(2, n))) for n in (150, 20))
    mask = jnp.ones_like(ids).at[1, :6].set(0)

    def run():  # new functions each time: traced afresh
        prefill = jit(lambda m, i, a: m(i, attention_mask=a))
        logits, cache = prefill(model, ids, mask)
        more_logits = jit(lambda m, i, c: m(i, cache=c)[0])(model, more, cache.with_capacity(200))
        return logits, more_logits, "mot_jax_attention" in prefill.lower(model, ids, mask).as_text()

    *fused, fused_lowered = run()
    monkeypatch.setattr(kernels, "available", lambda: False)
    *xla, xla_lowered = run()
    assert fused_lowered and not xla_lowered
    for a, b in zip(fused, xla):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5, rtol=1e-4)


def test_an_unknown_attention_choice_is_refused_in_one_line(monkeypatch):
    """MOT_JAX_ATTENTION names the kernel or XLA's attention; anything else is refused, not taken as the default."""
    model, config, _ = tiny.load("random:llama")
    ids = jnp.ones((1, 4), jnp.int32)
    monkeypatch.setenv("MOT_JAX_ATTENTION", "bogus")
    with pytest.raises(MotJaxError, match=r"^MOT_JAX_ATTENTION='bogus' is not one of fused, xla; unset it "):
        model(ids)
    monkeypatch.setenv("MOT_JAX_ATTENTION", "xla")
    assert np.isfinite(np.asarray(model(ids)[0])).all()


def test_build_is_cached_and_a_missing_compiler_falls_back_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("MOT_JAX_CACHE", str(tmp_path))
    compiler = shutil.which("g++")
    first = kernels._build(compiler)
    assert kernels._build(compiler) == first and [p.name for p in first.parent.glob("*.so")] == [first.name]
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    kernels.available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="CPU kernels are unavailable"):
            assert not kernels.available()
        q, k, v, *rest = inputs(np.random.default_rng(5), 1, 10, 2, 1, 10, 8, offset=0)
        assert not kernels.supports(q, k, v, None) and not kernels.rows_supported(q[0, 0].astype(jnp.bfloat16), q[0, 0])
        np.testing.assert_allclose(
            np.asarray(entry(q, k, v, *rest, scale=0.3)), np.asarray(reference(q, k, v, *rest, scale=0.3))
        )
    finally:
        kernels.available.cache_clear()


@pytest.mark.parametrize(
    "m, k, n, transposed",
    [
        (1, 640, 2048, False),  # whole vectors of bf16 pairs, several blocks of rows
        (1, 100, 1000, False),  # 8 columns left after the whole vectors of pairs
        (3, 33, 70, False),  # a last block of one row
        (1, 640, 4099, True),  # a tied head: rows of w in fours and a remainder
        (2, 100, 37, True),
        (3, 17, 5, True),
    ],
)
def test_row_product_matches_float64(m, k, n, transposed):
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(n, k) if transposed else (k, n)), jnp.bfloat16)
    assert kernels.rows_supported(x, w)
    product = jax.jit(kernels.row_product, static_argnums=2)
    assert kernels.ROWS_TARGET in product.lower(x, w, transposed).as_text()
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    w64 = w64.T if transposed else w64
    got = np.asarray(product(x, w, transposed))
    assert got.dtype == np.float32 and got.shape == (m, n)
    np.testing.assert_allclose(got, x64 @ w64, rtol=0, atol=1e-6 * (np.abs(x64) @ np.abs(w64)).max())


def test_row_product_gradients_are_xlas():
    rng = np.random.default_rng(7)
    x, w = jnp.asarray(rng.normal(size=(1, 48)), jnp.bfloat16), jnp.asarray(rng.normal(size=(40, 48)), jnp.bfloat16)
    cotangent = jnp.asarray(rng.normal(size=(1, 40)), jnp.float32)
    got = jax.grad(lambda x, w: jnp.sum(kernels.row_product(x, w, True) * cotangent), argnums=(0, 1))(x, w)
    want = jax.grad(
        lambda x, w: jnp.sum(jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32) * cotangent),
        argnums=(0, 1),
    )(x, w)
    for g, v in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(v, np.float32))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_bfloat16_decoding_with_the_row_kernel_equals_xlas(family, monkeypatch):
    """Decode steps of one sequence in bf16 (every projection and the head a single row, on the row kernel) against
    the same steps on XLA's dots."""
    model, config, _ = tiny.load(f"random:{family}", dtype=jnp.bfloat16)
    ids, more = (jnp.asarray(np.random.default_rng(8).integers(3, config["vocab_size"], size=(1, n))) for n in (12, 4))

    def run():  # traced afresh each time
        steps = jit(lambda m, t, c: m(t[:, None], cache=c))
        _, cache = jit(lambda m, i: m(i))(model, ids)
        cache, logits = cache.with_capacity(20), []
        for i in range(more.shape[1]):
            out, cache = steps(model, more[:, i], cache)
            logits.append(out[:, -1])
        lowered = steps.lower(model, more[:, 0], cache).as_text()
        return np.asarray(jnp.stack(logits), np.float32), kernels.ROWS_TARGET in lowered

    kernel, kernel_lowered = run()
    monkeypatch.setattr(kernels, "available", lambda: False)
    xla, xla_lowered = run()
    assert kernel_lowered and not xla_lowered
    np.testing.assert_allclose(kernel, xla, atol=0.03 * np.abs(xla).max())  # bf16 logits (~1% apart here)


def _tiny_sources(tmp_path, monkeypatch, text):
    """The build of one small source instead of the kernels' (the same steps, in a second rather than ten)."""
    monkeypatch.setenv("MOT_JAX_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "tiny.cc"
    source.write_text(text)
    monkeypatch.setattr(kernels, "SOURCES", [source])


def test_a_damaged_cached_library_is_built_again_in_one_line(tmp_path, monkeypatch):
    """A library cut short (a full disk, a killed copy) would crash whatever loads it: it is checked and rebuilt."""
    _tiny_sources(tmp_path, monkeypatch, 'extern "C" int mot_jax_answer() { return 42; }\n')
    compiler = shutil.which("g++")
    library = kernels._build(compiler)
    whole = library.read_bytes()
    for cut in (len(whole) // 2, 0):
        library.write_bytes(whole[:cut])
        with pytest.warns(UserWarning, match="is damaged.*building it again") as caught:
            assert kernels._build(compiler) == library
        assert len(caught) == 1 and "\n" not in str(caught[0].message)
        assert library.read_bytes() == whole
    assert ctypes.CDLL(str(library)).mot_jax_answer() == 42  # loaded last: cutting a loaded library short crashes
    assert sorted(p.name for p in library.parent.iterdir() if not p.name.startswith(".")) == [
        library.name,
        library.name + ".sha256",
    ]  # nothing half-written beside it


def test_a_failed_build_warns_in_one_line_with_its_cause_first(tmp_path, monkeypatch):
    """A compiler's long output (here 30 warnings before the error) goes to a log file; the warning names the cause."""
    _tiny_sources(tmp_path, monkeypatch, "#warning filler\n" * 30 + "#error the real cause\n")
    kernels.available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="CPU kernels are unavailable") as caught:
            assert not kernels.available()
    finally:
        kernels.available.cache_clear()
    (message,) = [str(w.message) for w in caught]
    assert "\n" not in message and "the real cause" in message and "filler" not in message
    log = message.split("full output is in ")[1].rstrip(")")
    assert Path(log).read_text().count("warning: #warning filler") == 30
    Path(log).unlink()
