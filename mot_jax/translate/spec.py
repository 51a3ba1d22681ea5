"""The translation spec: where translated K/V come from and go to, and how the target uses them (static).

`TranslationSpec.build` makes it from a mode, a channel map and a kind; a checkpoint's identity and an export's
config.json hold it (`to_dict`).
"""

from __future__ import annotations

import dataclasses

from mot_jax.errors import MotJaxError
from mot_jax.translate import channels, kinds, window

MODES = ("replay", "direct")
INPUTS = ("source", "embeddings", "hidden")  # what the translator may read per token (TranslationSpec.inputs)
# what it writes per token and layer; a kind may force its own (`Kind.outputs`)
OUTPUTS = tuple(kinds.WINDOW_OUTPUTS)


@dataclasses.dataclass(frozen=True)
class TranslationSpec:
    """Where translated K/V come from and go to, and how the target uses them (static)."""

    mode: str  # "replay" | "direct"
    source_layers: tuple  # per window slot, the source layer read (direct: may repeat)
    target_layers: tuple  # per window slot, the target layer written (direct: every layer)
    layer_map: tuple  # per target layer, its source layer (sparse-attention indices; channel interpolation)
    sparse_attention: bool = True  # replay: top-k attention from the source's attention (paper) or dense
    k_attn: int = 32
    dense_bottom: int = 2  # replay: layers below this stay dense
    rotary: bool = False  # un-rotate source keys, translate, re-rotate at target positions
    native_bottom: int = 0  # direct: the target's own layers below this run over the context (their K/V native)
    inputs: tuple = ("source",)  # per token, a subset of INPUTS
    # K/V (paper), or layer inputs that the target's own K/V projections turn into K/V (ours, "hidden"), or what a
    # kind forces (`Kind.outputs`: MoT-h's residual streams, Interlat's input embeddings); `written` says what it is
    outputs: str = "kv"

    @property
    def reads_source(self) -> bool:
        return "source" in self.inputs

    @property
    def written(self) -> kinds.Outputs:
        """What the translator writes (`outputs`) as its kind declares it: widths, the source's read, ..."""
        return kinds.outputs(self.outputs)

    @property
    def source_reads(self) -> kinds.SourceRead:
        """What the source hands over: its K/V, its layers' input residual streams or its last hidden states."""
        return self.written.reads

    @property
    def source_hands(self) -> dict:
        """What the source hands over, as `source_read`'s flags."""
        return self.source_reads.flags

    @property
    def kv_from_hidden(self) -> bool:
        """The translator writes layer inputs that the target's own projections, k-norm and RoPE turn into K/V."""
        return self.written.projected

    @property
    def replays_kv(self) -> bool:
        """The target re-reads its context with translated K/V in its window layers (a replay, whose attention may
        be sparse); not a kind's forward with other inputs replaced."""
        return self.mode == "replay" and self.written.kv

    @property
    def attention_topk(self) -> int:
        """Keys per query the replay takes from the source's attention; 0 when the target attends densely."""
        return self.k_attn if self.mode == "replay" and self.sparse_attention else 0

    def to_dict(self) -> dict:
        """Every field, JSON-ready (tuples as lists): what a checkpoint's identity and an export's config.json hold."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, saved: dict) -> TranslationSpec:
        """Back from `to_dict()` (JSON lists to tuples; a dict an older run saved: `mot_jax.training.saved` first)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})

    @classmethod
    def build(
        cls,
        mode,
        channel_map,
        num_source_layers,
        num_target_layers,
        native_bottom=0,
        inputs=("source",),
        outputs="kv",
        kind="mot",
        **kwargs,
    ):
        """The spec of a `kind` translator (`mot_jax/translate/kinds/`): its forced `outputs` (MoT-h's residual
        streams, Interlat's input embeddings) and, in direct mode, its own window where it has one (C2C's top layers,
        LSC's every source layer, Interlat's last); else the full-depth map's, above the native bottom."""
        if mode not in MODES:
            raise MotJaxError(f"Unknown translation mode {mode!r}; use one of {', '.join(MODES)}.")
        if outputs not in OUTPUTS:
            raise MotJaxError(f"Unknown translator outputs {outputs!r}; use one of {', '.join(OUTPUTS)}.")
        kind = kinds.get(kind)
        if kind.outputs:
            if outputs != "kv":
                raise MotJaxError(
                    f"kind={kind.name!r} writes {kind.outputs.what}, not outputs={outputs!r}; leave outputs at "
                    "'kv' (its default)."
                )
            outputs = kind.outputs.name
        inputs = tuple(inputs)
        if not inputs or any(i not in INPUTS for i in inputs) or len(set(inputs)) < len(inputs):
            raise MotJaxError(f"Bad translator inputs {inputs!r}; pass a comma list of {', '.join(INPUTS)}.")
        window.check_native_bottom(native_bottom, num_target_layers, mode, inputs)
        kwargs |= dict(native_bottom=int(native_bottom), inputs=inputs, outputs=outputs)
        if mode == "direct":
            layer_map = tuple(int(s) for s in channels.full_depth(num_source_layers, num_target_layers))
            source, target = layer_map[native_bottom:], tuple(range(native_bottom, num_target_layers))
            if kind.window:
                source, target = (tuple(int(i) for i in x) for x in kind.window(num_source_layers, num_target_layers))
        else:
            channel_map.validate(num_source_layers, num_target_layers)
            source, target = tuple(channel_map.source), tuple(channel_map.target)
            layer_map = channels.target_to_source_layers(channel_map, num_target_layers, num_source_layers)
        return cls(mode, source, target, tuple(int(s) for s in layer_map), **kwargs)
