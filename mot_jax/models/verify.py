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
    scale: dict  # largest |theirs| of "logits", ("K", layer), ("V", layer): the bound of a relative tolerance

    def worst(self):
        """(what, layer, diff) of the largest difference."""
        candidates = [("logits", None, self.logits)]
        candidates += [("K", i, d) for i, d in enumerate(self.k)] + [("V", i, d) for i, d in enumerate(self.v)]
        return max(candidates, key=lambda c: c[2])

    def ok(self, atol, rtol=0.0):
        """Every difference within atol + rtol * (largest magnitude of that tensor)."""
        pairs = [(self.logits, self.scale["logits"])]
        pairs += [(d, self.scale["K", i]) for i, d in enumerate(self.k)]
        pairs += [(d, self.scale["V", i]) for i, d in enumerate(self.v)]
        return all(d <= atol + rtol * s for d, s in pairs)

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
    diff = lambda a, b: float(np.max(np.abs(np.asarray(a, np.float32) - b.float().numpy())))
    size = lambda b: float(b.float().abs().max())
    scale = {"logits": size(out.logits)}
    scale |= {
        (name, i): size(getattr(layer, attr))
        for i, layer in enumerate(theirs.layers)
        for name, attr in (("K", "keys"), ("V", "values"))
    }
    return Comparison(
        logits=diff(logits, out.logits),
        k=[diff(cache.k[i], layer.keys) for i, layer in enumerate(theirs.layers)],
        v=[diff(cache.v[i], layer.values) for i, layer in enumerate(theirs.layers)],
        scale=scale,
    )


def greedy_agreement(model, torch_model, input_ids, new_tokens):
    """How many of the `new_tokens` greedy tokens after `input_ids` [1, T] agree before the first difference."""
    import torch

    from mot_jax.models.generation import generate

    ours = np.asarray(generate(model, jnp.asarray(input_ids), max_new_tokens=new_tokens, eos_ids=()))[0]
    with torch.no_grad():
        ids = torch.tensor(np.asarray(input_ids))
        theirs = torch_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, ids.shape[1] :].numpy()
    differ = np.flatnonzero(ours != theirs)
    return int(differ[0]) if differ.size else new_tokens
