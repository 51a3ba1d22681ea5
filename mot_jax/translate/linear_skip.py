"""The linear skip's start: the least-squares fit, before training, of what the untrained mixture leaves of the
target's native K/V, per window layer (`KVTranslator` with `cfg.linear_skip`; `Trainer.fit_linear_skip` sets its
`key_skip` and `value_skip` to the fit).

`linear_skip_sums` takes one batch's sufficient statistics (jittable, added over batches); `solve_linear_skip` solves
the ridge-regularised least squares from them on the host, and `choose_ridge` picks each layer's ridge by the error it
leaves on held-out batches' statistics.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from mot_jax.models.base import CausalLM, first_valid_index, positions_from_mask
from mot_jax.models.hooks import Forward, LayerInputs
from mot_jax.translate.translator import KVTranslator
from mot_jax.translate.window import (
    join_shared,
    rms_normalized,
    run_native_bottom,
    unrotated,
    window_block,
    window_parts,
)


def linear_skip_sums(
    translator: KVTranslator, source: CausalLM, target: CausalLM, source_cache, alignment, native, mask, target_ids
):
    """Sufficient statistics of one batch for `solve_linear_skip`, per "key" and "value": over the valid tokens except
    each row's first (whose K/V are the target's own), the count `n`, sums `x` [W, F], `r` [W, dt], `rr` [W] and
    products `xr` [W, F, dt] and, in parts (`layer_products`), x x^T, where x are the translator's joined inputs
    (`window_inputs`: each layer's own [ds], then the features every layer shares [F - ds]) and r the target's native
    K/V (`native`, its cache of the context `target_ids`; keys un-rotated for rotary specs), or for `outputs="hidden"`
    the window layers' RMS-normalised native inputs, less the mixture's output. The shared features' products are
    one [F - ds, F - ds] block for the whole window, not one per layer (they are most of the inputs)."""
    spec = translator.spec
    _, features = run_native_bottom(spec, target, target_ids, mask)
    *own, shared = window_parts(spec, source, target, source_cache, alignment, features)
    if spec.kv_from_hidden:  # the window layers' native inputs, RMS-normalised (their norms ignore the scale)
        below = Forward(target_ids, mask, stop=max(spec.target_layers) + 1)
        every = target.run_layers(below, hooks=[LayerInputs()]).records["inputs"]
        layer_input = rms_normalized(every[jnp.asarray(spec.target_layers)].transpose(1, 2, 0, 3))
        wanted = (layer_input, layer_input)
    else:
        rotated_by = target if unrotated(spec, source, target) else None
        wanted = (
            window_block(native.k, spec.target_layers, rotated_by, positions_from_mask(mask)),
            window_block(native.v, spec.target_layers),
        )
    weight = (mask & (jnp.arange(mask.shape[1]) != first_valid_index(mask)[:, None])).astype(jnp.float32)
    s = jnp.zeros((*mask.shape, 0)) if shared is None else shared.astype(jnp.float32)  # [B, T, F - ds]
    ws = s * weight[:, :, None]
    sums = {}
    for name, x, want in zip(("key", "value"), own, wanted):
        x = x.astype(jnp.float32)
        r = want.astype(jnp.float32) - getattr(translator, name)(join_shared(x, shared), mask)[0].astype(jnp.float32)
        wx, wr = x * weight[:, :, None, None], r * weight[:, :, None, None]
        sums[name] = dict(
            n=weight.sum(),
            x=jnp.concatenate([wx.sum((0, 1)), jnp.broadcast_to(ws.sum((0, 1)), (x.shape[2], s.shape[-1]))], -1),
            r=wr.sum((0, 1)),
            rr=(wr * r).sum((0, 1, 3)),
            xr=jnp.concatenate([jnp.einsum("btwi,btwo->wio", wx, r), jnp.einsum("btf,btwo->wfo", ws, r)], 1),
            own_own=jnp.einsum("btwi,btwj->wij", wx, x),
            own_shared=jnp.einsum("btwi,btf->wif", wx, s),
            shared_shared=jnp.einsum("btf,btg->fg", ws, s),
        )
    return sums


def layer_products(sums: dict, layer: int) -> np.ndarray:
    """Window layer `layer`'s summed x x^T [F, F] in float64, assembled from `linear_skip_sums`' parts."""
    own, cross = np.asarray(sums["own_own"][layer], np.float64), np.asarray(sums["own_shared"][layer], np.float64)
    return np.block([[own, cross], [cross.T, np.asarray(sums["shared_shared"], np.float64)]])


def solve_linear_skip(sums: dict, ridge=1e-3):
    """Least squares from summed statistics (`linear_skip_sums`, added over batches): per window layer the kernel and
    bias minimising the mean squared residual, with a ridge of `ridge` (one number, or one per window layer) x the
    layer's mean input variance for stability. Returns (kernel [W, F, dt], bias [W, dt], residual MSE before, after),
    in float64. Solved a layer at a time: the whole window's [W, F, F] temporaries would take several GB beside the
    models (24 layers of 3,328 inputs are 2.1 GB per copy in float64)."""
    n = float(sums["n"])
    x, r, xr = (sums[k] for k in ("x", "r", "xr"))
    layers, inputs, outputs = xr.shape
    ridge = np.broadcast_to(np.asarray(ridge, np.float64), (layers,))
    kernel, bias = np.empty((layers, inputs, outputs)), np.empty((layers, outputs))
    explained = 0.0  # of the mean of r^2 summed over layers and channels, what the fit removes beyond the mean of r
    for w in range(layers):
        mx, mr = np.asarray(x[w], np.float64) / n, np.asarray(r[w], np.float64) / n
        cov = layer_products(sums, w) / n - np.outer(mx, mx)
        cross = np.asarray(xr[w], np.float64) / n - np.outer(mx, mr)
        scale = ridge[w] * np.trace(cov) / inputs
        cov[np.diag_indices(inputs)] += scale
        kernel[w] = np.linalg.solve(cov, cross)
        bias[w] = mr - mx @ kernel[w]
        # 2 <cross, K> - <K, cov K> with the unregularised cov, where (cov + scale) K = cross
        explained += np.vdot(cross, kernel[w]) + scale * np.vdot(kernel[w], kernel[w])
    mean_r = np.asarray(r, np.float64) / n
    before = np.asarray(sums["rr"], np.float64).sum() / n / mean_r.size  # mean of r^2 over tokens, layers, channels
    after = before - (np.square(mean_r).sum() + explained) / mean_r.size
    return kernel, bias, before, after


def held_out_error(sums: dict, kernel, bias):
    """Per window layer [W], the mean squared residual left by (`kernel`, `bias`) on the tokens summed in `sums`
    (other batches than the fit's), from the statistics alone."""
    n = float(sums["n"])
    xr, x, r, rr = (np.asarray(sums[k], np.float64) for k in ("xr", "x", "r", "rr"))
    total = rr - 2 * ((xr * kernel).sum((1, 2)) + (r * bias).sum(1))  # sum of (r - x K - b)^2, expanded
    total += [np.vdot(kernel[w], layer_products(sums, w) @ kernel[w]) for w in range(len(kernel))]
    total += 2 * np.einsum("wo,wi,wio->w", bias, x, kernel, optimize=True)
    return (total + n * np.square(bias).sum(1)) / n / bias.shape[1]


# the ridges tried per layer when some fit batches are held out to choose it: these times translator.skip_ridge
RIDGE_GRID = 10.0 ** np.arange(5)


def choose_ridge(fit: dict, held: dict, ridges) -> tuple[np.ndarray, np.ndarray]:
    """Per window layer, the ridge of `ridges` whose fit on the sums `fit` leaves the least error on the held-out sums
    `held`: (ridge [W], the held-out mean squared error of every ridge [G, W])."""
    errors = np.stack([held_out_error(held, *solve_linear_skip(fit, ridge)[:2]) for ridge in ridges])
    return np.asarray(ridges, np.float64)[errors.argmin(0)], errors
