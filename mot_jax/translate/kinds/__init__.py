"""The translator kinds: one registered `Kind` per file of this package, and the registry every other module asks.

A kind says what its translator is (its modules, `build`), what it reads and writes (the spec it needs: `outputs`,
`window`), how it translates when that is not the window path (`translate`), what it refuses (`check`), its own
config fields and the settings its reference trains with (`fields`, `recipe`), and its optional training noise and
extra loss. Training, evaluation, the TTFT bench and export ask `get(name)`; none of them tests a kind's name. Adding
a kind is one file here that calls `register` (docs/architecture.md, "Adding a kind"); the package imports every
module in it.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable

from mot_jax.errors import MotJaxError


def _no_check(spec, cfg):
    pass


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
    # what the translator writes, forced on the spec: None (the config's `outputs`: kv or hidden), "residual" (the
    # window layers' input residual streams: the source hands over its layer inputs) or "embeddings" (the target's
    # input embeddings: the source hands over its last hidden states)
    outputs: str | None = None
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
    no_export: str = ""  # why the PyTorch export does not serve it ("": it does; `torch_translator.EXPORTED_KINDS`)

    def name_of(self, t) -> str:
        return self.label(t) if self.label else self.name


_REGISTRY: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    """Add a kind (each file of this package calls it once); a name already taken is refused."""
    if kind.name in _REGISTRY:
        raise MotJaxError(f"A translator kind named {kind.name!r} is already registered; pick another name.")
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


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
