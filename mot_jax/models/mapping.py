"""Hugging Face tensor names <-> our parameter paths: one table per family serves both directions."""

from __future__ import annotations

import dataclasses

import numpy as np

TRANSFORMS = {
    # name: (HF -> ours, ours -> HF)
    "identity": (lambda x: x, lambda x: x),
    "transpose": (lambda x: x.T, lambda x: x.T),  # torch Linear stores [out, in]; we store [in, out]
}


@dataclasses.dataclass(frozen=True)
class Rule:
    """One tensor: `hf` may contain `{i}` for the layer index, in which case `ours` is stacked over layers."""

    hf: str
    ours: str
    transform: str = "identity"

    @property
    def per_layer(self):
        return "{i}" in self.hf

    def to_ours(self, x):
        return TRANSFORMS[self.transform][0](x)

    def to_hf(self, x):
        return TRANSFORMS[self.transform][1](x)


def linear(hf, ours, bias=True, transform="transpose"):
    """Rules of a Linear layer: weight -> kernel (transposed for torch Linear), bias -> bias."""
    rules = [Rule(f"{hf}.weight", f"{ours}.kernel", transform)]
    return rules + ([Rule(f"{hf}.bias", f"{ours}.bias")] if bias else [])


def norm(hf, ours, bias=True):
    return [Rule(f"{hf}.weight", f"{ours}.scale")] + ([Rule(f"{hf}.bias", f"{ours}.bias")] if bias else [])


def to_hf_state_dict(params: dict, table, num_layers) -> dict[str, np.ndarray]:
    """Our flat params {dotted path: array} -> HF tensors {name: array} (the reverse of loading)."""
    out = {}
    for rule in table:
        value = np.asarray(params[rule.ours])
        if rule.per_layer:
            for i in range(num_layers):
                out[rule.hf.format(i=i)] = rule.to_hf(value[i])
        else:
            out[rule.hf] = rule.to_hf(value)
    return out
