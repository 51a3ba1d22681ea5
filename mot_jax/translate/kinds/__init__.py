"""The translator kinds: one registered `Kind` per file of this package, and the registry every other module asks.

A kind says what its translator is (its modules, `build`), what it reads and writes (the spec it needs: `outputs`,
whose record says what the source hands over and the widths, and `window`), how it translates when that is not the
window path (`translate`), what it refuses (`check`, one line each through `refuse`), its own config fields and the
settings its reference trains with (`fields`, `recipe`; `translator_config` merges them), its optional training noise
and extra loss, and its PyTorch side (`torch`, `torch_call`). Training, evaluation, the TTFT bench and export ask
`get(name)`; none of them tests a kind's name. Adding a kind is one file here that calls `register`
(docs/architecture.md, "Adding a kind"); the package imports every module in it.
"""

from __future__ import annotations

import importlib
import pkgutil

from mot_jax.translate.kinds.registry import (
    KV,
    LAST_HIDDEN,
    LAYER_INPUTS,
    WINDOW_OUTPUTS,
    Kind,
    Outputs,
    SourceRead,
    apply_recipe,
    check,
    check_foreign_fields,
    counts,
    fields,
    get,
    names,
    outputs,
    refuse,
    register,
    translator_config,
    unregister,
    written_by,
)

__all__ = [
    "KV",
    "Kind",
    "LAST_HIDDEN",
    "LAYER_INPUTS",
    "Outputs",
    "SourceRead",
    "WINDOW_OUTPUTS",
    "apply_recipe",
    "check",
    "check_foreign_fields",
    "counts",
    "fields",
    "get",
    "names",
    "outputs",
    "refuse",
    "register",
    "translator_config",
    "unregister",
    "written_by",
]

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "registry":
        importlib.import_module(f"{__name__}.{_module.name}")
