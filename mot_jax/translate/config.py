"""The translator's config: its shape and switches (`TranslatorConfig`), the fields every kind shares plus the
kind's own (`Kind.fields`), and its dict form, the codec of checkpoints' identities and export configs.

Plain data: `kinds.translator_config` fills in a kind's own defaults and refuses other kinds' fields;
`mot_jax.training.saved` upgrades the dicts that older runs saved."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, init=False)
class TranslatorConfig:
    """Shape and switches of one K or V mixture. Paper defaults: dim 1024, 16 heads, depth 2, mlp_ratio 4, N=2, k=1.

    The fields every kind shares; a kind's own fields (`Kind.fields`, e.g. LSC's `shared_slots`) are passed and read
    like these (`cfg.shared_slots`) and held in `options` (`kinds.translator_config` adds their defaults). A
    projector (`kind="projector"`) reads only the widths,
    window, `dim` and `output_activation`.
    """

    source_width: int  # input width per window layer: source kv_heads * head_dim, plus any target-side features
    target_width: int  # target kv_heads * head_dim (kind='mot_h': both widths are the models' hidden sizes)
    window: int  # W: window layers translated together
    kind: str = "mot"  # a registered kind (`mot_jax/translate/kinds/`): "mot", the mixture, is the paper's
    dim: int = 1024  # projector: the hidden width is max(dim, target_width)
    heads: int = 16
    depth: int = 2  # R stages of W un-shared cross-attention blocks
    mlp_ratio: int = 4
    output_activation: str = "gelu"  # "gelu" (paper) | "none"
    fused_output: bool = True  # one projection of all W states to all W layers (paper, W^2 cost) or one per layer
    causal: bool = False  # translator attention over the context: bidirectional (paper) or causal
    num_experts: int = 2
    top_k: int = 1
    dispatch: str = "sparse"  # "sparse" (only routed tokens' queries) | "dense" (every expert on every token)
    capacity_factor: float = 1.25  # sparse: the first slot count per expert and row, ceil(factor * k * T / N)
    linear_skip: bool = False  # ours: a linear map per window layer beside the translator, fitted by least squares
    # ours: the rank of the trained change to the target's query projections in the written layers (0: the target
    # stays frozen; `receiver.py`), and the target's widths it needs (set from the target, `mixture_config`)
    receiver_rank: int = 0
    receiver_width: int = 0
    receiver_query_width: int = 0
    options: tuple = ()  # the kind's own fields, sorted (name, value) pairs, each read as an attribute

    def __init__(self, source_width, target_width, window, options=(), **own):
        """The shared fields by name; the kind's own as keywords (`own`) or `options` pairs, taken as given: a
        config with its kind's defaults and refusals is `kinds.translator_config(...)`."""
        for field in dataclasses.fields(self)[3:-1]:
            object.__setattr__(self, field.name, own.pop(field.name, field.default))
        widths = dict(source_width=source_width, target_width=target_width, window=window)
        for name, value in widths.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "options", tuple(sorted((dict(options) | own).items())))

    def __getattr__(self, name):  # only for names that are not fields: the kind's own
        for key, value in self.__dict__.get("options", ()):
            if key == name:
                return value
        raise AttributeError(f"TranslatorConfig has no field {name!r}")

    @property
    def router_hidden(self):
        return max(64, min(self.dim, self.window * self.source_width))

    def to_dict(self) -> dict:
        """Every field, the kind's own among them, JSON-ready: what a checkpoint's identity and an export's
        config.json hold."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "options"}
        return fields | dict(self.options)

    @classmethod
    def from_dict(cls, saved: dict) -> TranslatorConfig:
        """Back from `to_dict()` (a dict an older run saved: `mot_jax.training.saved` first)."""
        return cls(**saved)

    def capacities(self, length):
        """Sparse dispatch's query slot counts per expert and row below `length`, smallest first: the factor's
        ceil(factor * k * T / N), then twice that (a step whose busiest queue fits neither runs the dense path)."""
        first = -(-int(self.capacity_factor * self.top_k * length) // self.num_experts)
        return tuple(c for c in dict.fromkeys((first, 2 * first)) if 0 < c < length)
