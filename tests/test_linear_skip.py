"""The linear skip beside the mixtures: its least-squares fit against the translated K/V it produces."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import tiny_batch

from mot_jax.jit import jit
from mot_jax.training import objective
from mot_jax.translate import channels
from mot_jax.translate.linear_skip import linear_skip_sums, solve_linear_skip
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, mixture_config
from mot_jax.translate.window import run_native_bottom, translate_window


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
    _, features = run_native_bottom(translator.spec, target, context, mask, target.init_cache(*context.shape))
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
