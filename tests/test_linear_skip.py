"""The linear skip beside the mixtures: its least-squares fit against the translated K/V it produces."""

import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import tiny_batch

from mot_jax.jit import jit
from mot_jax.models.base import first_valid_index
from mot_jax.training import objective
from mot_jax.translate import channels
from mot_jax.translate.linear_skip import (
    RIDGE_GRID,
    choose_ridge,
    held_out_error,
    layer_products,
    linear_skip_sums,
    solve_linear_skip,
)
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, mixture_config
from mot_jax.translate.window import run_native_bottom, translate_window, window_inputs


@pytest.fixture(scope="module")
def pair(random_pair):
    source, target, source_tok, target_tok = random_pair
    # 4 rows of 40 context tokens: more fitted tokens than the 32 source features of a window layer
    return source, target, tiny_batch(source_tok, target_tok, batch=4, context=40, source_length=160)


# Each as one program: run eagerly, every operation of the models' forwards compiles on its own
frozen_forwards = jit(objective.frozen_forwards, static_argnames=("topk",))
skip_sums = jit(linear_skip_sums)


def window_error(translator, source, target, batch, frozen):
    """Mean squared error of the translated window K and V against the native cache, over the context's valid tokens
    except each row's first (computed through translate_window, the path the cache takes)."""
    source_cache, _, native = frozen
    mask = jnp.asarray(batch.context_mask)
    context = jnp.asarray(batch.context)
    _, features = run_native_bottom(translator.spec, target, context, mask)
    k, v, _ = translate_window(translator, source, target, source_cache, batch.alignment, mask, features)
    layers = np.asarray(translator.spec.target_layers)
    tokens = mask.at[:, 0].set(False)
    return [objective.layer_mse(got, want[layers], tokens).mean() for got, want in ((k, native.k), (v, native.v))]


@pytest.mark.parametrize(
    "mode, rotary, dial",
    [
        ("direct", True, {}),
        ("replay", False, {}),
        ("direct", True, dict(native_bottom=1, inputs=("source", "hidden"))),  # fewer inputs than fitted tokens
    ],
)
def test_least_squares_skip_minimises_the_translated_kv_error(pair, mode, rotary, dial):
    """After the fit, the translated K/V error (through the whole window path, re-rotation and the target-side inputs
    included) is at a minimum over the skips' parameters (zero gradient), lower than before, and equal to what the
    solve reports."""
    source, target, batch = pair
    ls, lt = source.config.num_layers, target.config.num_layers
    spec = TranslationSpec.build(
        mode, channels.terminal(ls, lt, 0.5), ls, lt, rotary=rotary, sparse_attention=False, **dial
    )
    cfg = mixture_config(
        spec, source, target, dim=16, heads=2, depth=1, num_experts=2, output_activation="none", linear_skip=True
    )
    translator = KVTranslator(spec, cfg, rngs=nnx.Rngs(0))
    graphdef, initial = nnx.split(translator, nnx.Param)
    frozen = frozen_forwards(source, target, batch, topk=0)

    def total(params):
        errors = window_error(nnx.merge(graphdef, params), source, target, batch, frozen)
        return sum(errors), errors

    # the K skip changes only the K error and the V skip only the V error, so one gradient of the sum serves both;
    # the errors come out of the same program as their gradient (one compile of the window path, not two)
    errors_and_gradient = jax.jit(jax.value_and_grad(total, has_aux=True))
    (_, before), at_zero = errors_and_gradient(initial)  # the skips start at zero

    mask, context = jnp.asarray(batch.context_mask), jnp.asarray(batch.context)
    sums = skip_sums(translator, source, target, frozen[0], batch.alignment, frozen[2], mask, context)
    reported = {}
    for name in ("key", "value"):
        kernel, bias, *reported[name] = solve_linear_skip(jax.device_get(sums[name]), ridge=1e-9)
        skip = getattr(translator, f"{name}_skip")
        skip.kernel.set_value(jnp.asarray(kernel, jnp.float32))
        skip.bias.set_value(jnp.asarray(bias, jnp.float32))
    fitted = nnx.state(translator, nnx.Param)
    (_, after), at_fit = errors_and_gradient(fitted)

    for i, name in enumerate(("key", "value")):
        np.testing.assert_allclose(reported[name], [before[i], after[i]], rtol=2e-3)
        assert after[i] < 0.9 * before[i], (name, before[i], after[i])
        skip = f"{name}_skip"
        assert optax.global_norm(at_fit[skip]) < 1e-3 * optax.global_norm(at_zero[skip]), name


def statistics(x, r):
    """`linear_skip_sums`'s statistics of explicit samples x [N, W, F] (inputs of each layer's own), r [N, W, dt], by
    their definition."""
    return dict(
        n=len(x),
        x=x.sum(0),
        r=r.sum(0),
        rr=np.square(r).sum((0, 2)),
        xr=np.einsum("nwi,nwo->wio", x, r),
        own_own=np.einsum("nwi,nwj->wij", x, x),
        own_shared=np.zeros((x.shape[1], x.shape[2], 0)),
        shared_shared=np.zeros((0, 0)),
    )


def test_the_statistics_hold_the_shared_features_products_once_for_the_window(pair):
    """The dial's target-side features, the same for every window layer, are most of its inputs: their products are
    one block for the whole window, and each layer's assembled products are those of its joined inputs."""
    source, target, batch = pair
    ls, lt = source.config.num_layers, target.config.num_layers
    dial = dict(native_bottom=1, inputs=("source", "embeddings", "hidden"))
    spec = TranslationSpec.build("direct", channels.terminal(ls, lt, 0.5), ls, lt, rotary=True, **dial)
    cfg = mixture_config(spec, source, target, dim=16, heads=2, depth=1, output_activation="none", linear_skip=True)
    translator = KVTranslator(spec, cfg, rngs=nnx.Rngs(0))
    source_cache, _, native = frozen_forwards(source, target, batch, topk=0)
    mask, context = jnp.asarray(batch.context_mask), jnp.asarray(batch.context)
    sums = jax.device_get(skip_sums(translator, source, target, source_cache, batch.alignment, native, mask, context))
    _, features = run_native_bottom(spec, target, context, mask)
    joined = window_inputs(spec, source, target, source_cache, batch.alignment, features)
    first = np.arange(mask.shape[1]) == np.asarray(first_valid_index(mask))[:, None]  # each row's first token: left out
    weight = (np.asarray(mask) & ~first).astype(np.float64)[:, :, None, None]
    shared = features.shape[-1]
    for name, x in zip(("key", "value"), joined):
        x = np.asarray(x, np.float64)
        layers, inputs = x.shape[2:]
        assert 0 < inputs - shared < shared and all(a.size < layers * shared**2 for a in jax.tree.leaves(sums[name]))
        want = np.einsum("btwi,btwj->wij", x * weight, x)
        for w in range(layers):
            np.testing.assert_allclose(layer_products(sums[name], w), want[w], rtol=2e-5, atol=1e-3)


def test_held_out_error_from_statistics_is_the_residual_of_the_samples():
    rng = np.random.default_rng(0)
    x, r = rng.normal(size=(50, 3, 4)) + 1.0, rng.normal(size=(50, 3, 2))
    kernel, bias = rng.normal(size=(3, 4, 2)), rng.normal(size=(3, 2))
    residual = r - np.einsum("nwi,wio->nwo", x, kernel) - bias
    np.testing.assert_allclose(held_out_error(statistics(x, r), kernel, bias), np.square(residual).mean((0, 2)))


def test_each_layer_gets_the_ridge_its_held_out_batches_want():
    """Layer 0's target is an exact linear map of its inputs (the smallest ridge fits it best), layer 1's is noise
    independent of them (the fit of 12 samples on 8 inputs only overfits: the largest ridge wins); the solve at the
    chosen ridges leaves the reported held-out error on the held-out samples."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 2, 8))
    r = np.stack([x[:, 0] @ rng.normal(size=(8, 3)), rng.normal(size=(200, 3))], axis=1)
    fit, held = statistics(x[:12], r[:12]), statistics(x[12:], r[12:])
    ridges = 1e-3 * RIDGE_GRID
    chosen, errors = choose_ridge(fit, held, ridges)
    assert errors.shape == (len(ridges), 2) and list(chosen) == [ridges[0], ridges[-1]], chosen
    error = errors.min(0)
    kernel, bias = solve_linear_skip(fit, chosen)[:2]
    residual = r[12:] - np.einsum("nwi,wio->nwo", x[12:], kernel) - bias
    np.testing.assert_allclose(error, np.square(residual).mean((0, 2)))
    assert error[0] < 1e-4 < 0.9 < error[1]


def test_the_solve_holds_one_layers_matrices_at_a_time():
    """The solve's float64 temporaries are one layer's [ds, ds], not the whole window's: a Qwen window of 24 layers of
    3,328 inputs would otherwise add several GB beside the models. The result is the batched closed form's."""
    rng = np.random.default_rng(2)
    layers, inputs, outputs = 8, 192, 4
    x, r = rng.normal(size=(400, layers, inputs)), rng.normal(size=(400, layers, outputs))
    sums = statistics(x, r)
    tracemalloc.start()
    kernel, bias, before, after = solve_linear_skip(sums, ridge=1e-3)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < layers * inputs * inputs * 8, peak  # below one window-wide [W, F, F] array in float64
    centred = x - x.mean(0)
    cov = np.einsum("nwi,nwj->wij", centred, centred) / len(x)
    cov += 1e-3 * np.trace(cov, axis1=1, axis2=2)[:, None, None] / inputs * np.eye(inputs)
    want = np.linalg.solve(cov, np.einsum("nwi,nwo->wio", centred, r - r.mean(0)) / len(x))
    np.testing.assert_allclose(kernel, want, rtol=1e-8, atol=1e-10)
    residual = r - np.einsum("nwi,wio->nwo", x, kernel) - bias
    np.testing.assert_allclose([before, after], [np.square(r).mean(), np.square(residual).mean()], rtol=1e-8)
