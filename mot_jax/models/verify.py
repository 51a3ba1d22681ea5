"""Compare one of our models with a transformers (PyTorch) model on the same tokens: logits and every layer's K/V."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class Comparison:
    logits: float  # largest |ours - theirs| over all logits
    k: list[float]  # per layer, largest |dK|
    v: list[float]

    def worst(self):
        """(what, layer, diff) of the largest difference."""
        candidates = [("logits", None, self.logits)]
        candidates += [("K", i, d) for i, d in enumerate(self.k)] + [("V", i, d) for i, d in enumerate(self.v)]
        return max(candidates, key=lambda c: c[2])

    def ok(self, atol):
        return self.worst()[2] <= atol

    def summary(self):
        what, layer, diff = self.worst()
        where = "the logits" if layer is None else f"{what} of layer {layer}"
        kl, vl = int(np.argmax(self.k)), int(np.argmax(self.v))
        return (
            f"max |logits diff| {self.logits:.3g}; max |K diff| {self.k[kl]:.3g} (layer {kl}); "
            f"max |V diff| {self.v[vl]:.3g} (layer {vl}); largest difference: {where} ({diff:.3g})"
        )


def compare_with_transformers(model, torch_model, input_ids) -> Comparison:
    """Run both on `input_ids` [B, T] (no padding) in fp32 on the reference side; compare."""
    import torch
    import transformers

    with torch.no_grad():
        out = torch_model(
            input_ids=torch.tensor(np.asarray(input_ids)), cache=transformers.DynamicCache(), use_cache=True
        )
    logits, cache = model(jnp.asarray(input_ids))
    theirs = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    diff = lambda a, b: float(np.max(np.abs(np.asarray(a, np.float32) - b.float().numpy())))  # noqa: E731
    return Comparison(
        logits=diff(logits, out.logits),
        k=[diff(cache.k[i], layer.keys) for i, layer in enumerate(theirs.layers)],
        v=[diff(cache.v[i], layer.values) for i, layer in enumerate(theirs.layers)],
    )
