"""The one place that reads what older versions saved: a checkpoint's meta (its identity: the translator's config
and spec; its training config) brought to today's fields at load time, each added field at the value the runs saved
before it had (fixed here: a later change of a default must not change an old run).

`Checkpoints.read_meta` applies `upgrade_meta`, so resuming, evaluation and export all see today's form.
"""

from __future__ import annotations

import dataclasses
import json

from mot_jax.translate import kinds
from mot_jax.translate.config import TranslatorConfig

# the translator fields added after runs were saved, at the value those runs had
TRANSLATOR_ADDED = dict(kind="mot", linear_skip=False)
SPEC_ADDED = dict(native_bottom=0, inputs=["source"], outputs="kv")
# the training config's `translator` keys added after runs were saved, and its top-level keys
TRAINING_ADDED = dict(skip_ridge=1e-3, skip_ridge_held_out=0)
TRAINING_TOP_ADDED = dict(remat="none")


def translator_dict(saved: dict) -> dict:
    """A saved `TranslatorConfig.to_dict()` with the added fields, less the fields of other kinds that runs saved
    before each kind held its own (LSC's, and its `source_window`, which its spec gives)."""
    saved = TRANSLATOR_ADDED | saved
    own = kinds.get(saved["kind"]).fields
    shared = {f.name for f in dataclasses.fields(TranslatorConfig)} - {"options"}
    return {k: v for k, v in (own | saved).items() if k in shared or k in own}


def spec_dict(saved: dict) -> dict:
    """A saved `TranslationSpec.to_dict()` with the added fields."""
    return SPEC_ADDED | saved


def training_config(saved: str) -> str:
    """A saved training config (JSON) with the keys added since."""
    config = TRAINING_TOP_ADDED | json.loads(saved)
    if "translator" in config:
        config["translator"] = TRAINING_ADDED | config["translator"]
    return json.dumps(config)


def upgrade_meta(meta: dict) -> dict:
    """A checkpoint's meta as today's version writes it (see the module's docstring)."""
    meta = dict(meta)
    identity = meta.get("identity")
    if identity is not None:
        identity = dict(identity)
        identity["translator"] = translator_dict(identity.get("translator", {}))
        identity["spec"] = spec_dict(identity.get("spec", {}))
        meta["identity"] = identity
    if "config" in meta:
        meta["config"] = training_config(meta["config"])
    if "initial_validation" in meta:  # runs from before the retrieval rows had no untrained retrieval CE
        meta["initial_validation"] = dict(held_out_retrieval_ce=None) | meta["initial_validation"]
    return meta
