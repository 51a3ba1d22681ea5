"""The trained Mixture-of-Translators in PyTorch, to serve beside Hugging Face transformers models.

Imports only torch, safetensors and the standard library (no JAX): this file may be copied on its own. It loads
the folder written by `mot_jax.export.weights.export` (`config.json` + `model.safetensors`, no pickle, no code)
and computes the same numbers as the JAX modules (`mot_jax.translate`), fp32 to about 1e-6:

    translator = KVTranslator.from_pretrained("exported/")
    k, v = translator.translate_window(source_k, source_v, alignment_weights, target_mask)

`source_k` / `source_v` are the source model's cache, per layer [B, Ks, S, ds] as transformers holds it (e.g.
`[layer.keys for layer in cache.layers]`) or stacked [Ls, B, Ks, S, ds]; `alignment_weights` [B, T, S] map the
source tokens onto the target's T tokens (the `Alignment.weights` of `mot_jax.translate.align`); the result is the
translated K and V of the window's target layers (`config.target_layers`), each [W, B, Kt, T, dt].

Every parameter keeps the JAX layout and name: leading [expert] or [expert, block] axes, Linear kernels [in, out].
Each expert runs on every token (dense): the JAX sparse dispatch is dropless, so it gives the same numbers. A translator
of `kind="projector"` (the C2C-Project baseline) holds a `Projector` per K and V instead of a `Mixture`; one of
`kind="linear"` only its linear skips (`NoMixture` beside them); one of `kind="lsc"` a `LatentTranslator` per K and V
(every source layer through the shared latent into every target layer); one of `kind="c2c"` (the C2C fuser) a `Fuser`
per K and V, called through `fuse_window` with the target's own cache of the context (its gate hard, as at
evaluation). Two kinds translate no K/V: `kind="mot_h"` (MoT-h) holds one `Mixture`, `hidden`, that `translate_streams`
runs on the source's window-layer input residual streams, and `kind="interlat"` an `Adapter` that `embed_latents` runs
on the source's last hidden states; what they write replaces the target's window-layer inputs or its input embeddings
in the target's forward over its context (`torch_pipeline.CachePipeline`).

The dial's switches (`config.native_bottom`, `inputs`, `outputs`): a translator that reads the target's own input
embeddings or its residual stream after its native bottom layers takes them as `translate_window(...,
embeddings=, hidden=)` [B, T, D] (RMS-normalised here, as in JAX); without "source" in `inputs` it reads no source
cache; with `outputs="hidden"` it returns the window layers' inputs [W, B, T, D], which the target's own layers turn
into K/V. Running the target's bottom layers and its K/V projections needs the target model:
`torch_pipeline.CachePipeline` does both.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
FORMAT = "mot_jax.kv_translator"
EPS = 1e-5  # the translator's LayerNorm epsilon
MASK_VALUE = -1e30  # finite: a query with no visible key gets a uniform softmax instead of NaN, as in JAX


# What the export writes of each kind (its `Kind.torch` and `torch_call`, format_version 2) and what an export of
# format_version 1, which named its kind only, meant by it: {kind: ({attribute: module class}, the method serving it)}
V1_KINDS = {
    "mot": ({"key": "Mixture", "value": "Mixture"}, "translate_window"),
    "projector": ({"key": "Projector", "value": "Projector"}, "translate_window"),
    "linear": ({"key": "NoMixture", "value": "NoMixture"}, "translate_window"),
    "c2c": ({"key": "Fuser", "value": "Fuser"}, "fuse_window"),
    "lsc": ({"key": "LatentTranslator", "value": "LatentTranslator"}, "translate_window"),
    "mot_h": ({"hidden": "Mixture"}, "translate_streams"),
    "interlat": ({"adapter": "Adapter"}, "embed_latents"),
}
V1_OPTIONS = {"lsc": ("shared_slots", "shared_dim")}  # the kinds' own fields that format_version 1 wrote at the top
# format_version 1's outputs -> (what the source hands over, whether the target's projections make K/V of them)
V1_OUTPUTS = {
    "kv": ("kv", False),
    "hidden": ("kv", True),
    "residual": ("layer_inputs", False),
    "embeddings": ("last_hidden", False),
}
CALLS = ("translate_window", "fuse_window", "translate_streams", "embed_latents")
# per token and layer, the width of what the source hands over (`source_reads`) and of what the translator writes
# (`outputs`) where the config holds it (the models' embedding widths, Interlat's, it does not)
READ_WIDTHS = {"kv": lambda c: c.source_kv_heads * c.source_head_dim, "layer_inputs": lambda c: c.source_hidden_size}
WRITE_WIDTHS = {
    "kv": lambda c: c.target_kv_heads * c.target_head_dim,
    "hidden": lambda c: c.target_hidden_size,
    "residual": lambda c: c.target_hidden_size,
}


@dataclasses.dataclass(frozen=True)
class TorchTranslatorConfig:
    """The exported config.json: TranslatorConfig and TranslationSpec fields and the two models' cache shapes.

    Mirrors the JAX fields and their defaults (tests/test_export_torch.py checks that they agree).
    """

    source_width: int  # source kv_heads * head_dim
    target_width: int  # target kv_heads * head_dim
    window: int  # W window layers
    source_layers: tuple  # per window slot, the source layer read
    target_layers: tuple  # per window slot, the target layer written
    source_num_layers: int
    source_kv_heads: int
    source_head_dim: int
    target_num_layers: int
    target_kv_heads: int
    target_head_dim: int
    source_rotary: bool = False  # the source model uses RoPE
    target_rotary: bool = False
    target_hidden_size: int = 0  # the target's residual width: its features' and hidden outputs' (0: unused)
    source_hidden_size: int = 0  # the source's residual width: what kind='mot_h' reads (0: unused)
    kind: str = "mot"  # its kind in mot_jax (names it; what it is, the next four fields say)
    # {attribute: module class of this file}, as the kind builds its modules in JAX (`MODULES`)
    modules: dict = dataclasses.field(default_factory=lambda: {"key": "Mixture", "value": "Mixture"})
    call: str = "translate_window"  # the method that serves it (`CALLS`)
    source_reads: str = "kv"  # what the source hands over: its K/V, "layer_inputs" (its window layers' input
    # residual streams) or "last_hidden" (its last layer's final-normed hidden states)
    kv_from_hidden: bool = False  # it writes layer inputs that the target's own layers turn into K/V
    options: dict = dataclasses.field(default_factory=dict)  # the kind's own fields (LSC's shared_slots, shared_dim)
    dim: int = 1024
    heads: int = 16
    depth: int = 2
    mlp_ratio: int = 4
    output_activation: str = "gelu"
    fused_output: bool = True
    causal: bool = False
    num_experts: int = 2
    top_k: int = 1
    dispatch: str = "sparse"
    capacity_factor: float = 1.25
    linear_skip: bool = False  # a linear map per window layer beside the mixture or projector, output added
    # the target's adapted queries (JAX's `receiver_rank`): an export refuses them (`export.weights`), so always 0 here
    receiver_rank: int = 0
    receiver_width: int = 0
    receiver_query_width: int = 0
    mode: str = "replay"
    layer_map: tuple = ()
    sparse_attention: bool = True
    k_attn: int = 32
    dense_bottom: int = 2
    rotary: bool = False
    native_bottom: int = 0  # direct: the target's own layers below this read the context (CachePipeline runs them)
    inputs: tuple = ("source",)  # per token: the source's K/V, the target's embeddings, its residual stream
    outputs: str = "kv"  # K/V, or layer inputs that the target's own K/V projections turn into K/V ("hidden")

    def __post_init__(self):
        for name in ("source_layers", "target_layers", "layer_map"):
            object.__setattr__(self, name, tuple(int(i) for i in getattr(self, name)))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        classes = [MODULES.get(name) for name in self.modules.values()]
        mixture = Mixture in classes  # only a mixture reads the routing fields
        read_width, write_width = READ_WIDTHS.get(self.source_reads), WRITE_WIDTHS.get(self.outputs)
        features = sum(i in ("embeddings", "hidden") for i in self.inputs) * self.target_hidden_size
        checks = [
            (
                self.modules and None not in classes,
                f"modules={self.modules} must name classes of this file: {', '.join(MODULES)}",
            ),
            (self.call in CALLS, f"call={self.call!r} must be one of {', '.join(CALLS)}"),
            (
                bool(self.inputs) and set(self.inputs) <= {"source", "embeddings", "hidden"},
                f"inputs={list(self.inputs)} must be a subset of source, embeddings, hidden",
            ),
            (
                0 <= self.native_bottom < self.target_num_layers and (self.mode == "direct" or not self.native_bottom),
                f"native_bottom={self.native_bottom} must be 0, or below the target's layers in mode='direct'",
            ),
            ("hidden" not in self.inputs or self.native_bottom, "the 'hidden' input needs native_bottom > 0"),
            (not mixture or 1 <= self.top_k <= self.num_experts, f"top_k={self.top_k} must be in 1..num_experts"),
            (
                not mixture or self.dispatch in ("dense", "sparse"),
                f"dispatch={self.dispatch!r} must be dense or sparse",
            ),
            (self.output_activation in ("gelu", "none"), f"output_activation={self.output_activation!r} is unknown"),
            (
                not any(getattr(c, "heads_split_dim", False) for c in classes) or self.dim % self.heads == 0,
                f"dim={self.dim} must be divisible by heads={self.heads}",
            ),
            (not self.rotary or self.output_activation == "none", "rotary=true needs output_activation='none'"),
            (
                self.window >= 1 and len(self.target_layers) == self.window and self.source_layers,
                f"window={self.window} must equal the number of target_layers, and source_layers must not be empty",
            ),
            (
                read_width is None or self.source_width == read_width(self) * ("source" in self.inputs) + features,
                "source_width must equal the width the source hands over per layer (source_kv_heads * "
                "source_head_dim, or source_hidden_size for its layer inputs; when it reads the source) plus "
                "target_hidden_size per target-side input",
            ),
            (
                write_width is None or self.target_width == write_width(self),
                "target_width must equal target_kv_heads * target_head_dim (outputs='hidden' or 'residual': "
                "target_hidden_size)",
            ),
            (
                all(0 <= i < self.source_num_layers for i in self.source_layers)
                and all(0 <= i < self.target_num_layers for i in self.target_layers),
                "source_layers / target_layers must be layers of the source / target model",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"Invalid translator config: {message}; fix config.json or re-export the translator.")

    @property
    def router_hidden(self) -> int:
        return max(64, min(self.dim, self.window * self.source_width))

    @property
    def apply_rotary(self) -> bool:
        """Keys are un-rotated before and re-rotated after translation (the spec asks and both models use RoPE)."""
        return self.rotary and self.source_rotary and self.target_rotary

    @classmethod
    def from_dict(cls, d: dict) -> TorchTranslatorConfig:
        """From the exported config.json dict; keys that are not fields (format, format_version, ...) are ignored."""
        if not isinstance(d, dict):
            raise ValueError("The translator config is not a JSON object; use the config.json written by the export.")
        if d.get("format", FORMAT) != FORMAT:
            raise ValueError(f"The config's format is {d['format']!r}, not {FORMAT!r}; load an exported translator.")
        if "modules" not in d:  # format_version 1: its kind's name says what it is
            d = cls.upgrade_v1(d)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
        missing = [n for n in required if n not in d]
        if missing:
            raise ValueError(f"The translator config lacks {', '.join(missing)}; re-export the translator.")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in fields})

    @staticmethod
    def upgrade_v1(d: dict) -> dict:
        """An export of format_version 1 (its kind's name, the kind's own fields at the top) as version 2 writes it."""
        kind = d.get("kind", "mot")
        if kind not in V1_KINDS or d.get("outputs", "kv") not in V1_OUTPUTS:
            raise ValueError(f"kind={kind!r} must be one of {', '.join(V1_KINDS)}; fix config.json or re-export it.")
        modules, call = V1_KINDS[kind]
        reads, kv_from_hidden = V1_OUTPUTS[d.get("outputs", "kv")]
        options = {k: d[k] for k in V1_OPTIONS.get(kind, ()) if k in d}
        upgraded = dict(modules=modules, call=call, source_reads=reads, kv_from_hidden=kv_from_hidden, options=options)
        return d | upgraded

    def to_dict(self) -> dict:
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        return {"format": FORMAT, "format_version": 2, **d}


def gelu(x):
    return F.gelu(x)  # exact (erf), as the JAX translator


def layer_norm(x, scale, bias, stacked, eps=EPS):
    """LayerNorm over the last axis, in fp32. stacked: scale/bias [E, ..., d] line up with x [E, ..., d]'s trailing
    axes after the expert axis (x [E, B, T, W, d] with scale [E, W, d] or [E, d]); else plain broadcasting."""
    x32 = x.float()
    mean = x32.mean(-1, keepdim=True)
    var = (x32 - mean).square().mean(-1, keepdim=True)
    y = ((x32 - mean) * torch.rsqrt(var + eps)).to(x.dtype)
    if stacked:
        shape = (scale.shape[0],) + (1,) * (x.ndim - scale.ndim) + tuple(scale.shape[1:])
        scale, bias = scale.reshape(shape), bias.reshape(shape)
    return y * scale + bias


def linear(x, kernel, bias):
    """Per expert: x [E, ..., din] @ kernel [E, din, dout] + bias [E, dout]."""
    e = kernel.shape[0]
    y = torch.matmul(x.reshape(e, -1, x.shape[-1]), kernel)
    return y.reshape(*x.shape[:-1], -1) + bias.reshape(e, *(1,) * (x.ndim - 2), -1)


class LayerNorm(nn.Module):
    def __init__(self, *shape):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(shape))
        self.bias = nn.Parameter(torch.zeros(shape))


class Linear(nn.Module):
    """Kernel [*lead, din, dout] (the JAX layout, transposed from nn.Linear's weight) and bias [*lead, dout]."""

    def __init__(self, *lead, din, dout):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(*lead, din, dout) * (3 * din) ** -0.5)
        self.bias = nn.Parameter(torch.zeros(*lead, dout))


class CrossAttentionBlocks(nn.Module):
    """The R x W un-shared cross-attention blocks of every expert: parameters [expert, block, ...]."""

    def __init__(self, cfg: TorchTranslatorConfig, experts=True, count=None):
        """`experts=False`: no expert axis, the blocks of one chain (a Fuser's); `count` blocks (default R x W)."""
        super().__init__()
        lead, d, hidden = (count or cfg.depth * cfg.window,), cfg.dim, cfg.mlp_ratio * cfg.dim
        lead = (cfg.num_experts, *lead) if experts else lead
        self.heads, self.experts = cfg.heads, experts
        self.norm_q, self.norm_ctx = LayerNorm(*lead, d), LayerNorm(*lead, d)
        self.in_proj = Linear(*lead, din=d, dout=3 * d)  # packed q, k, v
        self.out_proj = Linear(*lead, din=d, dout=d)
        self.norm_ffn = LayerNorm(*lead, d)
        self.fc1 = Linear(*lead, din=d, dout=hidden)
        self.fc2 = Linear(*lead, din=hidden, dout=d)

    def forward(self, g, ctx, visible, i):
        """Block i of every expert: g [E, B, T, D] queries, ctx [E, B, T, D] one window layer, visible [B, T|1, T]
        (without an expert axis E = 1)."""
        pick = (lambda a: a[:, i]) if self.experts else (lambda a: a[i][None])
        p = lambda m: (pick(m.kernel), pick(m.bias)) if isinstance(m, Linear) else (pick(m.scale), pick(m.bias))
        q_in, c = layer_norm(g, *p(self.norm_q), True), layer_norm(ctx, *p(self.norm_ctx), True)
        kernel, bias = p(self.in_proj)
        d, h = g.shape[-1], self.heads
        q = linear(q_in, kernel[..., :d], bias[..., :d])
        k = linear(c, kernel[..., d : 2 * d], bias[..., d : 2 * d])
        v = linear(c, kernel[..., 2 * d :], bias[..., 2 * d :])
        split = lambda a: a.reshape(*a.shape[:3], h, d // h)
        logits = torch.einsum("ebchd,ebthd->ebhct", split(q).float(), split(k).float())
        logits = torch.where(visible[None, :, None], logits * (d // h) ** -0.5, MASK_VALUE)
        probs = torch.softmax(logits, dim=-1).to(v.dtype)
        attn = torch.einsum("ebhct,ebthd->ebchd", probs, split(v)).reshape(q.shape)
        g = g + linear(attn, *p(self.out_proj))
        return g + linear(gelu(linear(layer_norm(g, *p(self.norm_ffn), True), *p(self.fc1))), *p(self.fc2))


class Experts(nn.Module):
    """The N translator experts of one mixture (K or V), all parameters with a leading [expert] axis."""

    def __init__(self, cfg: TorchTranslatorConfig):
        super().__init__()
        self.cfg = cfg
        n, d, w = cfg.num_experts, cfg.dim, cfg.window
        self.input_norm = LayerNorm(n, cfg.source_width)
        self.input_proj = Linear(n, din=cfg.source_width, dout=d)
        self.blocks = CrossAttentionBlocks(cfg)
        if cfg.fused_output:  # one projection of all W states to all W layers
            self.output_norm = LayerNorm(n, w * d)
            self.output_proj = Linear(n, din=w * d, dout=w * cfg.target_width)
        else:  # one per window layer: [expert, W, ...]
            self.output_norm = LayerNorm(n, w, d)
            self.output_proj = Linear(n, w, din=d, dout=cfg.target_width)

    def forward(self, x, token_mask):
        """x [B, T, W, ds], token_mask [B, T] bool -> every expert's output on every token [E, B, T, W, dt]."""
        cfg = self.cfg
        b, t, w, _ = x.shape
        x = x.unsqueeze(0).expand(cfg.num_experts, *x.shape)
        norm = self.input_norm
        context = gelu(linear(layer_norm(x, norm.scale, norm.bias, True), self.input_proj.kernel, self.input_proj.bias))
        visible = token_mask[:, None, :]  # [B, 1, T]
        if cfg.causal:
            positions = torch.arange(t, device=x.device)
            visible = visible & (positions[None, None, :] <= positions[None, :, None])
        g, last_stage = context[:, :, :, 0], []  # the chain starts from P_0 [E, B, T, D]
        for r in range(cfg.depth):
            for layer in range(w):  # block r * W + l reads window layer l
                g = self.blocks(g, context[:, :, :, layer], visible, r * w + layer)
                if r == cfg.depth - 1:
                    last_stage.append(g)
        states = torch.stack(last_stage, dim=3)  # [E, B, T, W, D]
        norm, proj = self.output_norm, self.output_proj
        if cfg.fused_output:
            y = linear(
                layer_norm(states.reshape(*states.shape[:3], -1), norm.scale, norm.bias, True), proj.kernel, proj.bias
            )
        else:
            y = torch.einsum("ebtwd,ewdo->ebtwo", layer_norm(states, norm.scale, norm.bias, True), proj.kernel)
            y = y + proj.bias[:, None, None]
        if cfg.output_activation == "gelu":
            y = gelu(y)
        return y.reshape(cfg.num_experts, b, t, w, cfg.target_width)


class Router(nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear to N logits, per token, on the flattened window [B, T, W * ds]."""

    def __init__(self, cfg: TorchTranslatorConfig):
        super().__init__()
        width = cfg.window * cfg.source_width
        self.norm = LayerNorm(width)
        self.hidden = Linear(din=width, dout=cfg.router_hidden)
        self.out = Linear(din=cfg.router_hidden, dout=cfg.num_experts)

    def forward(self, x):
        """x [B, T, W, ds] -> logits [B, T, N] (fp32)."""
        h = layer_norm(x.reshape(*x.shape[:2], -1), self.norm.scale, self.norm.bias, False)
        h = gelu(h @ self.hidden.kernel + self.hidden.bias)
        return (h @ self.out.kernel + self.out.bias).float()


class Mixture(nn.Module):
    """One mixture of translators (K or V): top-k routing, softmax over the top-k logits, weighted sum."""

    heads_split_dim = True  # its attention splits `dim` into `heads` (the config checks they divide)

    def __init__(self, cfg: TorchTranslatorConfig):
        super().__init__()
        self.cfg = cfg
        self.experts = Experts(cfg)
        self.router = Router(cfg) if cfg.num_experts > 1 else None

    def routing_weights(self, logits, mask):
        """[B, T, N] combination weights: softmax over the top-k logits (ties: lower expert first, as
        jax.lax.top_k), zero outside the top k and for padding tokens."""
        cfg = self.cfg
        top_logits, top_experts = torch.sort(logits, dim=-1, descending=True, stable=True)
        top_logits, top_experts = top_logits[..., : cfg.top_k], top_experts[..., : cfg.top_k]
        weights = torch.zeros_like(logits).scatter(-1, top_experts, torch.softmax(top_logits, dim=-1))
        return weights * mask[..., None]

    def forward(self, x, token_mask=None):
        """x [B, T, W, ds] (source K or V on the target token grid), token_mask [B, T] -> y [B, T, W, dt]."""
        b, t = x.shape[:2]
        mask = torch.ones(b, t, dtype=torch.bool, device=x.device) if token_mask is None else token_mask.bool()
        out = self.experts(x, mask)  # [N, B, T, W, dt]
        if self.router is None:  # N = 1: no routing (padding tokens get a translation too, as in JAX)
            return out[0]
        weights = self.routing_weights(self.router(x), mask)
        return torch.einsum("btn,nbtwd->btwd", weights.to(out.dtype), out)


class Projector(nn.Module):
    """The C2C-Project baseline (JAX: `mot_jax.translate.kinds.projector`): per window layer, on every token,
    LayerNorm -> Linear(ds -> max(dim, dt)) -> GELU -> Linear(-> dt); parameters [W, ...]."""

    def __init__(self, cfg: TorchTranslatorConfig):
        super().__init__()
        self.cfg = cfg
        w, hidden = cfg.window, max(cfg.dim, cfg.target_width)
        self.norm = LayerNorm(w, cfg.source_width)
        self.hidden = Linear(w, din=cfg.source_width, dout=hidden)
        self.out = Linear(w, din=hidden, dout=cfg.target_width)

    def forward(self, x, token_mask=None):
        """x [B, T, W, ds] -> y [B, T, W, dt]; every token is projected on its own (`token_mask` is unused)."""
        per_layer = lambda a, m: torch.einsum("btwi,wio->btwo", a, m.kernel) + m.bias
        y = per_layer(gelu(per_layer(layer_norm(x, self.norm.scale, self.norm.bias, False), self.hidden)), self.out)
        return gelu(y) if self.cfg.output_activation == "gelu" else y


class Fuser(nn.Module):
    """C2C's K or V fuser (JAX: `mot_jax.translate.kinds.c2c.ResidualCacheFuser`, the formulas in its docstring) with
    its evaluation gate: receiver + 1[sigmoid(logit) >= 0.5] * residual per window layer."""

    heads_split_dim = True  # its attention splits `dim` into `heads` (the config checks they divide)

    def __init__(self, cfg: TorchTranslatorConfig):
        super().__init__()
        self.cfg = cfg
        d, w, dr, ds, hidden = cfg.dim, cfg.window, cfg.target_width, cfg.source_width, cfg.mlp_ratio * cfg.dim
        self.receiver_norm, self.receiver_proj = LayerNorm(dr), Linear(din=dr, dout=d)
        self.sharer_norm, self.sharer_proj = LayerNorm(ds), Linear(din=ds, dout=d)
        self.feature_norm, self.feature_proj = LayerNorm(2 * d), Linear(din=2 * d, dout=d)
        self.fusion_norm = LayerNorm(d)
        self.fusion_fc1, self.fusion_fc2 = Linear(din=d, dout=hidden), Linear(din=hidden, dout=d)
        self.weight_norm, self.weight_proj = LayerNorm(d), Linear(din=d, dout=d)
        self.blocks = CrossAttentionBlocks(cfg, experts=False)
        if cfg.fused_output:
            self.output_norm, self.output_proj = LayerNorm(w * d), Linear(din=w * d, dout=w * dr)
        else:
            self.output_norm, self.output_proj = LayerNorm(w, d), Linear(w, din=d, dout=dr)
        self.gate_logits = nn.Parameter(torch.full((w,), 1.5))

    def forward(self, receiver, sharer, token_mask):
        """receiver [B, T, W, dt], sharer [B, T, W, ds], token_mask [B, T] bool -> fused [B, T, W, dt]."""
        cfg = self.cfg
        b, t, w, _ = receiver.shape
        norm = lambda x, n: layer_norm(x, n.scale, n.bias, False)
        lin = lambda x, m: x @ m.kernel + m.bias
        r = gelu(lin(norm(receiver, self.receiver_norm), self.receiver_proj))
        s = gelu(lin(norm(sharer, self.sharer_norm), self.sharer_proj))
        x = gelu(lin(norm(torch.cat([r, s], -1), self.feature_norm), self.feature_proj))
        fused = x + lin(gelu(lin(norm(x, self.fusion_norm), self.fusion_fc1)), self.fusion_fc2)
        context = fused * torch.sigmoid(lin(norm(fused, self.weight_norm), self.weight_proj))
        g, visible, last_stage = r[None, :, :, 0], token_mask[:, None, :], []  # the chain starts from R_0
        for stage in range(cfg.depth):
            for layer in range(w):
                g = self.blocks(g, context[None, :, :, layer], visible, stage * w + layer)
                if stage == cfg.depth - 1:
                    last_stage.append(g[0])
        states = torch.stack(last_stage, dim=2)  # [B, T, W, D]
        if cfg.fused_output:
            y = lin(norm(states.reshape(b, t, -1), self.output_norm), self.output_proj)
        else:
            y = torch.einsum("btwd,wdo->btwo", norm(states, self.output_norm), self.output_proj.kernel)
            y = y + self.output_proj.bias
        y = (gelu(y) if cfg.output_activation == "gelu" else y).reshape(b, t, w, -1)
        gate = (torch.sigmoid(self.gate_logits) >= 0.5).to(receiver.dtype)
        return receiver + gate[:, None] * y.to(receiver.dtype)


class NoMixture(nn.Module):
    """kind='linear': nothing beside the linear skip (zeros of the target width), as JAX's `NoMixture`."""

    def __init__(self, cfg: TorchTranslatorConfig):
        super().__init__()
        self.width = cfg.target_width

    def forward(self, x, token_mask=None):
        return x.new_zeros(*x.shape[:-1], self.width)


def one_stage_chain(blocks, context, visible):
    """One stage of un-shared blocks over context [B, T, L, D], from its layer 0 (block l reads layer l): the L states
    [B, T, L, D]."""
    g, states = context[None, :, :, 0], []
    for layer in range(context.shape[2]):
        g = blocks(g, context[None, :, :, layer], visible, layer)
        states.append(g[0])
    return torch.stack(states, dim=2)


class LocalToShared(nn.Module):
    """LSC: a model's K (or V) at all its `layers` layers [B, T, layers, width] to the latent [B, T, slots * dim]
    (JAX: `mot_jax.translate.kinds.lsc.LocalToShared`)."""

    def __init__(self, cfg: TorchTranslatorConfig, layers: int, width: int):
        super().__init__()
        d = cfg.dim
        self.input_norm, self.input_proj = LayerNorm(width), Linear(din=width, dout=d)
        self.blocks = CrossAttentionBlocks(cfg, experts=False, count=layers)
        self.output_norm = LayerNorm(layers * d)
        self.output_proj = Linear(din=layers * d, dout=cfg.options["shared_slots"] * cfg.options["shared_dim"])

    def forward(self, x, visible):
        norm = lambda x, n: layer_norm(x, n.scale, n.bias, False)
        context = gelu(norm(x, self.input_norm) @ self.input_proj.kernel + self.input_proj.bias)
        states = one_stage_chain(self.blocks, context, visible)
        flat = norm(states.reshape(*x.shape[:2], -1), self.output_norm)
        return gelu(flat @ self.output_proj.kernel + self.output_proj.bias)


class SharedToLocal(nn.Module):
    """LSC: the latent [B, T, slots * dim] to a model's K (or V) at all its `layers` layers [B, T, layers, width]
    (JAX: `mot_jax.translate.kinds.lsc.SharedToLocal`)."""

    def __init__(self, cfg: TorchTranslatorConfig, layers: int, width: int):
        super().__init__()
        d, latent = cfg.dim, cfg.options["shared_slots"] * cfg.options["shared_dim"]
        self.input_norm, self.input_proj = LayerNorm(latent), Linear(din=latent, dout=layers * d)
        self.blocks = CrossAttentionBlocks(cfg, experts=False, count=layers)
        self.output_norm, self.output_proj = LayerNorm(layers * d), Linear(din=layers * d, dout=layers * width)
        self.layers, self.output_gelu = layers, cfg.output_activation == "gelu"

    def forward(self, z, visible):
        b, t = z.shape[:2]
        norm = lambda x, n: layer_norm(x, n.scale, n.bias, False)
        context = gelu(norm(z, self.input_norm) @ self.input_proj.kernel + self.input_proj.bias)
        states = one_stage_chain(self.blocks, context.reshape(b, t, self.layers, -1), visible)
        y = norm(states.reshape(b, t, -1), self.output_norm) @ self.output_proj.kernel + self.output_proj.bias
        return (gelu(y) if self.output_gelu else y).reshape(b, t, self.layers, -1)


class LatentTranslator(nn.Module):
    """LSC's K or V translator (JAX: `mot_jax.translate.kinds.lsc.LatentTranslator`): every source layer through the
    shared latent into every window (target) layer."""

    heads_split_dim = True  # its attention splits `dim` into `heads` (the config checks they divide)

    def __init__(self, cfg: TorchTranslatorConfig):
        super().__init__()
        self.causal = cfg.causal
        self.to_shared = LocalToShared(cfg, len(cfg.source_layers), cfg.source_width)
        self.from_shared = SharedToLocal(cfg, cfg.window, cfg.target_width)

    def forward(self, x, token_mask):
        """x [B, T, Ls, ds], token_mask [B, T] bool -> y [B, T, W, dt]."""
        t = x.shape[1]
        visible = token_mask.bool()[:, None, :]
        if self.causal:
            positions = torch.arange(t, device=x.device)
            visible = visible & (positions[None, None, :] <= positions[None, :, None])
        return self.from_shared(self.to_shared(x, visible), visible)


class Adapter(nn.Module):
    """Interlat's adapter (JAX: `mot_jax.translate.kinds.interlat.Adapter`, the formulas in its module docstring), in
    eval mode: the source's last hidden states [B, T, Es] on the target grid -> the target's input embeddings
    [B, T, Et]."""

    def __init__(self, cfg: TorchTranslatorConfig):
        super().__init__()
        ds, d = cfg.source_width, cfg.target_width
        self.heads = next(h for h in range(min(cfg.heads, d), 0, -1) if d % h == 0)  # the largest divisor up to heads
        self.input_proj = Linear(din=ds, dout=d) if ds != d else None
        self.pre_norm, self.post_norm, self.norm = LayerNorm(d), LayerNorm(d), LayerNorm(d)
        self.in_proj, self.out_proj = Linear(din=d, dout=3 * d), Linear(din=d, dout=d)  # packed q, k, v
        self.scale, self.output_scale = nn.Parameter(torch.tensor(0.2)), nn.Parameter(torch.tensor(0.1))
        self.fc1, self.fc2 = Linear(din=d, dout=d), Linear(din=d, dout=d)

    def forward(self, x, token_mask):
        """x [B, T, Es], token_mask [B, T] bool (padding keys are hidden from the attention) -> [B, T, Et]."""
        lin = lambda x, m: x @ m.kernel + m.bias
        norm = lambda x, n, eps: layer_norm(x, n.scale, n.bias, False, eps)
        if self.input_proj is not None:
            x = lin(x, self.input_proj)
        n = norm(x, self.pre_norm, 1e-6)
        b, t, d = n.shape
        q, k, v = (a.reshape(b, t, self.heads, -1) for a in lin(n, self.in_proj).chunk(3, -1))
        logits = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * (d // self.heads) ** -0.5
        logits = torch.where(token_mask[:, None, None, :], logits, MASK_VALUE)  # every token to every token
        attended = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(logits, -1).to(v.dtype), v).reshape(b, t, d)
        residual = norm(n + lin(attended, self.out_proj), self.post_norm, 1e-6) * self.scale
        y = (residual + lin(norm(gelu(lin(residual, self.fc1)), self.norm, EPS), self.fc2)) * self.output_scale
        return y.clamp(-10.0, 10.0)  # the reference's clip


class Rope(nn.Module):
    """Per-layer RoPE inverse frequencies of the source [Ls, ds/2] and target [Lt, dt/2] models (buffers)."""

    def __init__(self, cfg: TorchTranslatorConfig):
        super().__init__()
        self.register_buffer("source_inv_freq", torch.zeros(cfg.source_num_layers, cfg.source_head_dim // 2))
        self.register_buffer("target_inv_freq", torch.zeros(cfg.target_num_layers, cfg.target_head_dim // 2))


def apply_rope(x, positions, inv_freq):
    """Rotate-half RoPE (the HF layout). x [B, T, H, d]; positions [B, T]; inv_freq [d/2]."""
    angles = positions.float()[..., None] * inv_freq.float()  # [B, T, d/2]
    cos = torch.cat([angles.cos()] * 2, -1)[:, :, None, :].to(x.dtype)
    sin = torch.cat([angles.sin()] * 2, -1)[:, :, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def target_positions(mask):
    """The target's RoPE positions of its (any-side padded) tokens: valid tokens counted from 0."""
    return torch.clamp(torch.cumsum(mask.long(), dim=1) - 1, min=0)


class LinearSkip(nn.Module):
    """Per window layer, x [B, T, W, ds] @ kernel [W, ds, dt] + bias [W, dt]; `shared` [B, T, F]: inputs every
    layer reads after its own x, multiplied once for all layers (the JAX `LinearSkip`'s)."""

    def __init__(self, cfg: TorchTranslatorConfig):
        super().__init__()
        self.kernel = nn.Parameter(torch.zeros(cfg.window, cfg.source_width, cfg.target_width))
        self.bias = nn.Parameter(torch.zeros(cfg.window, cfg.target_width))

    def forward(self, x, shared=None):
        width = x.shape[-1]
        y = torch.einsum("btwi,wio->btwo", x, self.kernel[:, :width]) + self.bias
        return y if shared is None else y + torch.einsum("btf,wfo->btwo", shared, self.kernel[:, width:])


def resample(weights, x):
    """Source-token vectors x [B, S, ...] onto the target tokens by the alignment weights [B, T, S]: [B, T, ...]."""
    b, s = x.shape[:2]
    y = torch.einsum("bts,bsf->btf", weights.float(), x.reshape(b, s, -1).float())
    return y.reshape(b, -1, *x.shape[2:])


def rms_normalized(x):
    """A target-side input per token, RMS-normalised in fp32 (as JAX's `translator.rms_normalized`)."""
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)


class KVTranslator(nn.Module):
    """A K and a V mixture, projector, fuser or LSC translator (`key`, `value`; none for kind='linear'), with
    `linear_skip` a linear map beside each (`key_skip`, `value_skip`) and, for rotary translators, the RoPE tables
    (`rope`)."""

    def __init__(self, config: TorchTranslatorConfig | dict):
        super().__init__()
        cfg = config if isinstance(config, TorchTranslatorConfig) else TorchTranslatorConfig.from_dict(config)
        self.config = cfg
        self.rope = Rope(cfg) if cfg.apply_rotary else None
        for attribute, name in cfg.modules.items():  # as its kind builds them in JAX (`Kind.torch`)
            setattr(self, attribute, MODULES[name](cfg))
        if cfg.linear_skip:
            self.key_skip, self.value_skip = LinearSkip(cfg), LinearSkip(cfg)

    @classmethod
    def from_pretrained(cls, folder, device="cpu", dtype=torch.float32) -> KVTranslator:
        """The translator exported to `folder` (config.json + model.safetensors), on `device`, in eval mode."""
        folder = Path(folder)
        config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
        for path in (config_path, weights_path):
            if not path.is_file():
                raise ValueError(f"{path} does not exist; pass a folder written by mot_jax.export.weights.export.")
        try:
            config = json.loads(config_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{config_path} is not valid JSON ({e}); export the translator again.") from None
        cfg = TorchTranslatorConfig.from_dict(config)
        try:
            from safetensors.torch import load_file

            tensors = load_file(str(weights_path), device=str(device))
        except Exception as e:  # a truncated or foreign file
            raise ValueError(f"Cannot read {weights_path} ({e}); export the translator again.") from None
        with torch.device("meta"):
            model = cls(cfg)
        expected = model.state_dict()
        missing = [name for name in expected if name not in tensors]
        if missing:
            raise ValueError(
                f"{weights_path} lacks tensor {missing[0]!r} (and {len(missing) - 1} more) that {config_path} "
                "implies; export config.json and model.safetensors together from the same translator."
            )
        unexpected = [name for name in tensors if name not in expected]
        if unexpected:
            raise ValueError(
                f"{weights_path} holds tensor {unexpected[0]!r} (and {len(unexpected) - 1} more) that {config_path} "
                "does not describe; export config.json and model.safetensors together from the same translator."
            )
        for name, tensor in expected.items():
            if tuple(tensors[name].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"Tensor {name!r} in {weights_path} has shape {tuple(tensors[name].shape)} but {config_path} "
                    f"implies {tuple(tensor.shape)}; export config.json and model.safetensors together."
                )
        state = {k: t if k.startswith("rope.") else t.to(dtype) for k, t in tensors.items()}
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval()

    @property
    def dtype(self):
        return next(self.parameters()).dtype

    def _stack(self, cache, name):
        """Per-layer list of [B, K, S, d] or stacked [L, B, K, S, d] -> the window's layers [B, S, W, K, d]."""
        cfg = self.config
        if isinstance(cache, torch.Tensor) and cache.ndim == 5:
            cache = list(cache.unbind(0))
        if not isinstance(cache, (list, tuple)) or len(cache) != cfg.source_num_layers:
            raise ValueError(
                f"{name} must hold the source model's {cfg.source_num_layers} layers, per layer [B, K, S, d] or "
                f"stacked [L, B, K, S, d]; pass every layer of the source cache."
            )
        shape = tuple(cache[cfg.source_layers[0]].shape)
        if len(shape) != 4 or shape[1] != cfg.source_kv_heads or shape[3] != cfg.source_head_dim:
            raise ValueError(
                f"{name} layers are {shape} but the translator reads [B, {cfg.source_kv_heads}, S, "
                f"{cfg.source_head_dim}]; pass the cache of the source model it was trained for."
            )
        if any(tuple(cache[i].shape) != shape for i in cfg.source_layers):
            raise ValueError(
                f"{name} layers {list(cfg.source_layers)} differ in shape (e.g. a sliding-window cache); pass a "
                "full-length cache of every layer."
            )
        x = torch.stack([cache[i] for i in cfg.source_layers], dim=0)  # [W, B, K, S, d]
        return x.permute(1, 3, 0, 2, 4).to(self.dtype)

    def translate_window(
        self,
        source_k=None,
        source_v=None,
        alignment_weights=None,
        target_mask=None,
        source_positions=None,
        embeddings=None,
        hidden=None,
    ):
        """The translated K and V of the window's target layers, each [W, B, Kt, T, dt]; with outputs='hidden' the
        window layers' inputs for keys and for values, each [W, B, T, D], which the target's own layers turn into K/V
        (`torch_pipeline.layer_key_values`).

        source_k, source_v: the source cache, per layer [B, Ks, S, ds] or stacked [Ls, B, Ks, S, ds] (keys after
        RoPE, as transformers caches them); alignment_weights [B, T, S]; target_mask [B, T] (default all valid);
        source_positions [B, S], the RoPE positions of the source slots (default 0..S-1, right padding). Only
        when `config.inputs` names them: the source's arguments ('source'), the target's input embeddings of the
        context [B, T, D] (`embeddings`) and its residual stream before layer `native_bottom` [B, T, D] (`hidden`).
        """
        cfg = self.config
        self._check_call("translate_window")
        k_in = v_in = shared = None  # each window layer's own inputs [B, T, W, ds], those all share [B, T, F]
        mask = target_mask
        if "source" in cfg.inputs:
            k_in, v_in, mask = self._aligned(source_k, source_v, alignment_weights, target_mask, source_positions)
        given = {"embeddings": embeddings, "hidden": hidden}
        features = []
        for name in (i for i in cfg.inputs if i != "source"):
            if given[name] is None:
                raise ValueError(f"The translator reads the target's {name} (config inputs); pass {name}=[B, T, D].")
            features.append(rms_normalized(torch.as_tensor(given[name])).to(self.dtype))
        if features:
            shared = torch.cat(features, -1)
        b, t = (k_in if k_in is not None else shared).shape[:2]
        if "source" not in cfg.inputs:
            mask = self._mask(target_mask, b, t, shared.device)
            k_in = v_in = shared.new_zeros(b, t, cfg.window, 0)
        joined = lambda x: x if shared is None else torch.cat([x, shared[:, :, None].expand(b, t, cfg.window, -1)], -1)
        k = v = 0  # kind='linear': the skips alone (eager PyTorch would build the joined copy for nothing)
        if not isinstance(self.key, NoMixture):
            k, v = self.key(joined(k_in), mask), self.value(joined(v_in), mask)
        if cfg.linear_skip:
            k, v = k + self.key_skip(k_in, shared), v + self.value_skip(v_in, shared)
        if cfg.kv_from_hidden:
            return k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)
        return self._to_cache(k, v, mask)

    def _check_call(self, call: str):
        if self.config.call != call:
            raise ValueError(
                f"A kind={self.config.kind!r} translator is not served by {call}; call {self.config.call}."
            )

    @staticmethod
    def _mask(target_mask, b, t, device):
        if target_mask is None:
            return torch.ones(b, t, dtype=torch.bool, device=device)
        mask = torch.as_tensor(target_mask, device=device).bool()
        if tuple(mask.shape) != (b, t):
            raise ValueError(f"target_mask is {tuple(mask.shape)}, not [B={b}, T={t}]; pass one flag per target token.")
        return mask

    def fuse_window(self, target_k, target_v, source_k, source_v, alignment_weights, target_mask=None):
        """kind='c2c': the window layers' K and V of the target's own cache of the context (`target_k`, `target_v`:
        per layer [B, Kt, T, dt] or stacked [Lt, B, Kt, T, dt], right-padded as the alignment) fused with the
        source's, each [W, B, Kt, T, dt]; the other arguments as `translate_window`'s."""
        cfg = self.config
        self._check_call("fuse_window")
        k, v, mask = self._aligned(source_k, source_v, alignment_weights, target_mask)
        own = lambda cache: torch.stack([cache[i] for i in cfg.target_layers], 0).permute(1, 3, 0, 2, 4)
        own_k, own_v = (own(c).reshape(*k.shape[:3], -1).to(self.dtype) for c in (target_k, target_v))
        return self._to_cache(self.key(own_k, k, mask), self.value(own_v, v, mask), mask)

    def translate_streams(self, source_streams, alignment_weights, target_mask=None):
        """kind='mot_h': the source's input residual streams of its window layers (`config.source_layers`), per
        window slot [B, S, Ds] -> the target window layers' (`config.target_layers`) inputs [W, B, T, Dt], which
        replace the target's own in its forward over the context (`torch_pipeline.CachePipeline` does that)."""
        self._check_call("translate_streams")
        x = torch.stack(list(source_streams), 2).to(self.dtype)  # [B, S, W, Ds]
        weights = self._weights(alignment_weights, *x.shape[:2], x.device)
        x = resample(weights, x).to(self.dtype)
        return self.hidden(x, self._mask(target_mask, *x.shape[:2], x.device)).permute(2, 0, 1, 3)

    def embed_latents(self, source_hidden, alignment_weights, target_mask=None):
        """kind='interlat': the source's final-normed last hidden states [B, S, Es] (transformers' last_hidden_state)
        -> the target's input embeddings of its context [B, T, Et] (its `inputs_embeds`)."""
        self._check_call("embed_latents")
        x = torch.as_tensor(source_hidden).to(self.dtype)
        weights = self._weights(alignment_weights, *x.shape[:2], x.device)
        x = resample(weights, x).to(self.dtype)
        return self.adapter(x, self._mask(target_mask, *x.shape[:2], x.device))

    @staticmethod
    def _weights(alignment_weights, b, s, device):
        weights = torch.as_tensor(alignment_weights, device=device)
        if weights.ndim != 3 or weights.shape[0] != b or weights.shape[2] != s:
            raise ValueError(
                f"alignment_weights are {tuple(weights.shape)}, not [B={b}, T, S={s}]; pass the alignment of this "
                "source context onto the target tokens."
            )
        return weights

    def _aligned(self, source_k, source_v, alignment_weights, target_mask=None, source_positions=None):
        """The source window's K and V on the target token grid, each [B, T, W, Ks * ds], and the target mask."""
        cfg = self.config
        k, v = self._stack(source_k, "source_k"), self._stack(source_v, "source_v")  # [B, S, W, K, d]
        b, s = k.shape[:2]
        weights = self._weights(alignment_weights, b, s, k.device)
        t = weights.shape[1]
        mask = self._mask(target_mask, b, t, k.device)
        if cfg.apply_rotary:  # un-rotate the source keys by their own positions
            if source_positions is None:
                positions = torch.arange(s, device=k.device).expand(b, s)
            else:
                positions = torch.as_tensor(source_positions, device=k.device)
            freq = self.rope.source_inv_freq
            k = torch.stack(
                [apply_rope(k[:, :, i], -positions, freq[li]) for i, li in enumerate(cfg.source_layers)], dim=2
            )
        w = len(cfg.source_layers)  # the window's (LSC: every source layer)
        k = resample(weights, k).reshape(b, t, w, -1).to(self.dtype)  # [B, T, W, Ks * ds]
        v = resample(weights, v).reshape(b, t, w, -1).to(self.dtype)
        return k, v, mask

    def _to_cache(self, k, v, mask):
        """Translated k, v [B, T, W, Kt * dt] -> each [W, B, Kt, T, dt], keys rotated at the target positions when
        the translator is rotary."""
        cfg = self.config
        b, t = k.shape[:2]
        k = k.reshape(b, t, cfg.window, cfg.target_kv_heads, cfg.target_head_dim)
        v = v.reshape(b, t, cfg.window, cfg.target_kv_heads, cfg.target_head_dim)
        if cfg.apply_rotary:  # rotate the translated keys at the target positions
            positions, freq = target_positions(mask), self.rope.target_inv_freq
            k = torch.stack(
                [apply_rope(k[:, :, i], positions, freq[li]) for i, li in enumerate(cfg.target_layers)], dim=2
            )
        return k.permute(2, 0, 3, 1, 4), v.permute(2, 0, 3, 1, 4)

    forward = translate_window


# the module classes a config's `modules` may name (a new kind's torch module: its class here and in this table)
MODULES = {cls.__name__: cls for cls in (Mixture, Projector, NoMixture, Fuser, LatentTranslator, Adapter)}


def load(folder, device="cpu", dtype=torch.float32) -> KVTranslator:
    """`KVTranslator.from_pretrained(folder)`."""
    return KVTranslator.from_pretrained(folder, device=device, dtype=dtype)


__all__ = [
    "KVTranslator",
    "Mixture",
    "Experts",
    "Router",
    "Projector",
    "Fuser",
    "NoMixture",
    "LatentTranslator",
    "Adapter",
    "LinearSkip",
    "TorchTranslatorConfig",
    "load",
    "apply_rope",
]
