"""The registry of translator kinds: the `Kind` record, what a kind may declare (`SourceRead`, `Outputs`), and the
functions every other module asks (through the package, `mot_jax.translate.kinds`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from mot_jax.errors import MotJaxError
from mot_jax.translate.config import TranslatorConfig


def _no_check(spec, cfg):
    pass


def refuse(name: str, refusals):
    """A kind's refusals, `(refused, why)` pairs in order: the first that holds raises "kind=NAME why." (one line)."""
    for refused, why in refusals:
        if refused:
            raise MotJaxError(f"kind={name!r} {why}.")


@dataclasses.dataclass(frozen=True)
class SourceRead:
    """What the source hands a translator per token and layer read, as `translator.source_read` produces it."""

    name: str  # "kv": its K and V; "layer_inputs": its layers' input residual streams; "last_hidden": its last layer's
    # final-normed hidden states
    width: Callable  # (source model) -> values per handed vector: the translator's input width per window layer
    vectors: int  # vectors per token and layer: K and V, or one

    @property
    def flags(self) -> dict:
        """`source_read`'s switches for this read."""
        return dict(layer_inputs=self.name == "layer_inputs", last_hidden=self.name == "last_hidden")

    def handed_bytes(self, source, tokens, layers: int):
        """Bytes the source hands over for `tokens` tokens (a number or an array) over `layers` layers read."""
        itemsize = np.dtype(source.param_dtype).itemsize
        return tokens * layers * self.vectors * self.width(source) * itemsize


KV = SourceRead("kv", lambda model: model.config.num_kv_heads * model.config.head_dim, 2)
LAYER_INPUTS = SourceRead("layer_inputs", lambda model: model.config.hidden_size, 1)
LAST_HIDDEN = SourceRead("last_hidden", lambda model: model.embedding_width, 1)


@dataclasses.dataclass(frozen=True)
class Outputs:
    """What a translator writes per token and window layer (`TranslationSpec.outputs`), and what it reads for it."""

    name: str  # the spec's `outputs`
    what: str  # for messages: "K/V", "the window layers' input residual streams", ...
    width: Callable  # (target model) -> values per token and layer written: the translator's output width
    reads: SourceRead = KV  # what the source hands over
    kv: bool = True  # it becomes the window layers' K/V (so a replay can attend sparsely over them)
    projected: bool = False  # layer inputs that the target's own projections, k-norm and RoPE turn into K/V


# what the window path writes, chosen by the config (`--config.translator.outputs`); a kind may force its own
WINDOW_OUTPUTS = {
    "kv": Outputs("kv", "K/V", KV.width),
    "hidden": Outputs("hidden", "layer inputs", lambda model: model.config.hidden_size, projected=True),
}


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str  # TranslatorConfig.kind / --config.translator.kind
    # `build(spec, cfg, rngs, dtype)` -> {attribute: module} of `KVTranslator`: "key" and "value" (the window path
    # calls them as `module(x [B, T, W, ds], mask)` -> (y [B, T, W, dt], aux)), or modules its `translate` calls
    build: Callable
    # how reports name a trained translator of this kind, from the config's translator block (before the source-free
    # prefix and the B suffix, which every kind shares)
    label: Callable = None
    # the context's target cache when the kind has a path of its own (else None: the window path of
    # `translator.translate`, which writes K/V of the window layers from the source's): `translate(translator,
    # source, target, source_cache, alignment, target_ids, mask, capacity, receiver, noise)` -> (cache, aux);
    # `receiver` the target's own prefill of the context where the caller has it
    translate: Callable | None = None
    check: Callable = _no_check  # `check(spec, cfg)`: refuse what means nothing for the kind, one line each
    # what the translator writes, forced on the spec: None (the config's `outputs`: `WINDOW_OUTPUTS`), or its own
    # (MoT-h: the window layers' input residual streams, read from the source's layer inputs)
    outputs: Outputs | None = None
    # direct mode's window, where it is not the full-depth map's: `window(num_source, num_target)` -> (source
    # layers read, target layers written)
    window: Callable | None = None
    receiver: bool = False  # its translation reads the target's own prefill of the context (`receiver`)
    fields: dict = dataclasses.field(default_factory=dict)  # its own TranslatorConfig fields and their defaults
    counts: dict = dataclasses.field(default_factory=dict)  # of those, the whole numbers and their least values
    # its reference's training settings, {dotted config key: value}, applied by `apply_recipe` (experiment configs)
    recipe: dict = dataclasses.field(default_factory=dict)
    # training noise per micro-batch, `noise(key, step, total_steps, micro_batches)` (None: the kind has none)
    noise: Callable | None = None
    # an extra training loss (None: the kind has none), called with keywords -> (loss, metrics): `cfg` the
    # translator's config (its own fields too); `translated(
    # source_cache, alignment, noise)` rebuilds the cache; `target`, `batch`, `source_cache`, `noise`; `cache` the
    # translated cache and `native` the target's own of the context (K/V [L, B, K, T, d]), `first` the first layer
    # the translator writes; `logits` the prompt's after the translated cache and `teacher` after the native one,
    # where computed (the CE, the KL, or `teacher=True`), else None
    extra_loss: Callable | None = None
    teacher: bool = False  # its extra loss reads the prompt's logits after the translated and the native caches
    # how the target computes new tokens after this kind's cache, where that is not as itself: `reader_hook(translator)`
    # -> a hook (`mot_jax.models.hooks`, an nnx module) every forward of the reading target runs with, or None
    # (`KVTranslator.receiver`: in the training prompt, the evaluation's question and answer, the pipeline's reader)
    reader_hook: Callable | None = None
    no_export: str = ""  # why the PyTorch export does not serve it ("": it does, through `torch`)
    # its PyTorch side (`torch_translator.py`): {attribute: module class name} as `build` names its modules, and the
    # method that serves it (`translate_window`, `fuse_window`, `translate_streams`, `embed_latents`)
    torch: dict = dataclasses.field(default_factory=lambda: {"key": "Mixture", "value": "Mixture"})
    torch_call: str = "translate_window"

    def name_of(self, t) -> str:
        return self.label(t) if self.label else self.name


_REGISTRY: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    """Add a kind (each file of this package calls it once); a name already taken is refused."""
    if kind.name in _REGISTRY:
        raise MotJaxError(f"A translator kind named {kind.name!r} is already registered; pick another name.")
    if kind.outputs and (kind.outputs.name in WINDOW_OUTPUTS or written_by(kind.outputs.name)):
        raise MotJaxError(f"kind={kind.name!r} declares outputs {kind.outputs.name!r}, which are taken; rename them.")
    taken = set(fields()) & set(kind.fields)  # those of every translator: tests/test_kinds.py
    if taken:
        raise MotJaxError(
            f"kind={kind.name!r} declares fields another kind has already ({', '.join(sorted(taken))}); rename them."
        )
    _REGISTRY[kind.name] = kind
    return kind


def unregister(name: str):
    """Remove a kind (tests that register a throwaway one)."""
    _REGISTRY.pop(name, None)


def get(name: str) -> Kind:
    if name not in _REGISTRY:
        raise MotJaxError(f"Unknown translator kind {name!r}; use one of {', '.join(_REGISTRY)}.")
    return _REGISTRY[name]


def names() -> tuple:
    return tuple(_REGISTRY)


def fields() -> dict:
    """Every kind's own config fields and their defaults (what `training.config.base()` adds)."""
    return {k: v for kind in _REGISTRY.values() for k, v in kind.fields.items()}


def counts() -> dict:
    """Of every kind's own fields, the whole numbers and their least values (what `training.config.check` holds
    the config to)."""
    return {k: v for kind in _REGISTRY.values() for k, v in kind.counts.items()}


def written_by(outputs: str) -> Kind | None:
    """The kind that forces `outputs` on its spec (None: the window path's, any kind's)."""
    return next((k for k in _REGISTRY.values() if k.outputs and k.outputs.name == outputs), None)


def outputs(name: str) -> Outputs:
    """What a spec's `outputs` are: the window path's or the kind's that forces them."""
    if name in WINDOW_OUTPUTS:
        return WINDOW_OUTPUTS[name]
    owner = written_by(name)
    if owner is None:
        raise MotJaxError(f"Unknown translator outputs {name!r}; use one of {', '.join(WINDOW_OUTPUTS)}.")
    return owner.outputs


def check(spec, cfg):
    """Refuse a translator config and spec that do not go together: the kind's own refusals first (they say why a
    switch means nothing for it), then outputs that another kind forces, or other than the kind forces."""
    kind = get(cfg.kind)
    kind.check(spec, cfg)
    owner = written_by(spec.outputs)
    if owner and owner is not kind:
        raise MotJaxError(f"outputs={spec.outputs!r} is kind={owner.name!r}'s; set kind={owner.name!r}.")
    if kind.outputs and spec.outputs != kind.outputs.name:
        raise MotJaxError(f"kind={kind.name!r} writes {kind.outputs.what}; build its spec with kind={kind.name!r}.")


def translator_config(source_width, target_width, window, **kwargs) -> TranslatorConfig:
    """A `TranslatorConfig` of the kind `kwargs["kind"]` (default "mot") with its own fields (`Kind.fields`) at their
    defaults where not given; a field neither shared nor the kind's is refused in one line."""
    kind = get(kwargs.get("kind", "mot"))
    shared = {f.name for f in dataclasses.fields(TranslatorConfig)}
    unknown = sorted(set(kwargs) - shared - set(kind.fields))
    if unknown:
        one = len(unknown) == 1
        raise MotJaxError(
            f"{', '.join(unknown)} {'is not a field' if one else 'are not fields'} of a kind={kind.name!r} "
            f"translator; drop {'it' if one else 'them'} or change the kind."
        )
    return TranslatorConfig(source_width, target_width, window, **(kind.fields | kwargs))


def check_foreign_fields(name: str, values: dict):
    """Refuse, in one line, a training config's value of another kind's field (`values`: {field: value}) that is not
    its default: it would change nothing (a config holds every kind's fields, `training.config.base`)."""
    for kind in _REGISTRY.values():
        for field, default in kind.fields.items():
            if kind.name != name and field in values and values[field] != default:
                raise MotJaxError(
                    f"translator.{field}={values[field]!r} is kind={kind.name!r}'s and means nothing for "
                    f"kind={name!r}; drop --config.translator.{field} or set --config.translator.kind={kind.name}."
                )


def apply_recipe(c, name: str):
    """Set `c.translator.kind = name` and the kind's reference settings (`Kind.recipe`) on a training config."""
    c.translator.kind = name
    for key, value in get(name).recipe.items():
        *path, leaf = key.split(".")
        block = c
        for part in path:
            block = block[part]
        block[leaf] = value
    return c
