"""A KVTranslator's weights and config as plain numpy / JSON, for `mot_jax.export.torch_translator`.

`export(translator, source, target, folder)` writes `folder/config.json` and `folder/model.safetensors`; the torch
side loads them with `KVTranslator.from_pretrained(folder)` and imports no JAX. Every registered kind exports but one
that states why not (`Kind.no_export`; today none), with the dial's switches (`translator_config` says what it
refuses).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx

from mot_jax.errors import MotJaxError
from mot_jax.models import decoder
from mot_jax.models.base import ModelConfig
from mot_jax.translate import kinds

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
FORMAT = "mot_jax.kv_translator"
TOOL = "mot_jax.export"  # the writer its output folders name (mot_jax.outputs)


def _config(model) -> ModelConfig:
    return model if isinstance(model, ModelConfig) else model.config


def _rope(model):
    """[L, head_dim / 2] inverse frequencies of a rotary model (or its config), None for other families."""
    cfg = _config(model)
    return np.asarray(decoder.rope_table(cfg), np.float32) if cfg.rotary else None


def _rotary(translator, source, target) -> bool:
    """Whether `translate_window` un/re-rotates keys: the spec asks for it and both models use RoPE."""
    return bool(translator.spec.rotary) and _config(source).rotary and _config(target).rotary


def translator_tensors(translator, source=None, target=None) -> dict[str, np.ndarray]:
    """{dotted parameter name: fp32 array} of a KVTranslator, plus `rope.source_inv_freq` [Ls, ds/2] and
    `rope.target_inv_freq` [Lt, dt/2] when its spec is rotary and both models (or configs) use RoPE."""
    state = nnx.to_flat_state(nnx.state(translator, nnx.Param))
    tensors = {".".join(map(str, path)): np.asarray(var[...], np.float32) for path, var in state}
    if translator.spec.rotary:
        if source is None or target is None:
            raise MotJaxError("A rotary translator exports RoPE tables; pass its source and target models or configs.")
        if _rotary(translator, source, target):
            tensors["rope.source_inv_freq"], tensors["rope.target_inv_freq"] = _rope(source), _rope(target)
    return {name: np.require(array, requirements="C") for name, array in tensors.items()}  # 0-d stays 0-d


def translator_config(translator, source, target) -> dict:
    """JSON-serialisable: the TranslatorConfig and TranslationSpec fields and the two models' cache shapes. Refuses,
    in one line, what the PyTorch side cannot serve: a kind that says it has no export (`Kind.no_export`), a
    translator with nothing to translate (native_bottom = the target's layers), one that adapted the target's queries
    (`receiver_rank`), and layer-input outputs
    (outputs='hidden') for a target other than a rotary decoder."""
    spec = translator.spec
    why = kinds.get(translator.cfg.kind).no_export
    if why:
        raise MotJaxError(
            f"kind={translator.cfg.kind!r} has no PyTorch export ({why}); evaluate it in JAX (python -m "
            "mot_jax.evaluate)."
        )
    if not spec.target_layers:
        raise MotJaxError(
            f"native_bottom={spec.native_bottom} is every target layer: nothing is translated, so there is nothing "
            "to export; serve the target reading its context itself (native)."
        )
    if translator.cfg.receiver_rank:
        raise MotJaxError(
            "This translator adapted the target's query projections (receiver_rank="
            f"{translator.cfg.receiver_rank}), which the PyTorch export does not carry yet; evaluate it in JAX "
            "(python -m mot_jax.evaluate)."
        )
    target_cfg = _config(target)
    if spec.kv_from_hidden and not target_cfg.rotary:
        raise MotJaxError(
            f"The PyTorch export of outputs='hidden' covers rotary targets (Llama, Qwen2, Qwen3, Gemma-3), not "
            f"{target_cfg.family!r}; evaluate this translator in JAX or train it with outputs='kv'."
        )
    kind = kinds.get(translator.cfg.kind)
    own = dict(translator.cfg.options)  # the kind's own fields: under "options", where the torch side reads them
    out = {"format": FORMAT, "format_version": 2}
    out |= {k: v for k, v in translator.cfg.to_dict().items() if k not in own} | spec.to_dict()
    # what the torch side builds and calls, as the kind declares it
    out |= dict(modules=kind.torch, call=kind.torch_call, options=own)
    out |= dict(source_reads=spec.source_reads.name, kv_from_hidden=spec.kv_from_hidden)
    for side, model in (("source", source), ("target", target)):
        cfg = _config(model)
        out |= {f"{side}_num_layers": cfg.num_layers, f"{side}_kv_heads": cfg.num_kv_heads}
        out |= {f"{side}_head_dim": cfg.head_dim, f"{side}_rotary": cfg.rotary}
    out["target_hidden_size"], out["source_hidden_size"] = target_cfg.hidden_size, _config(source).hidden_size
    out["apply_rotary"] = _rotary(translator, source, target)
    return out


def export(translator, source, target, folder, extra: dict | None = None) -> Path:
    """Write `config.json` (plus the `extra` entries, e.g. model names) and `model.safetensors` (no pickle) of a
    KVTranslator to `folder`, all or nothing, replacing only an earlier output (`mot_jax.outputs`); returns it."""
    from safetensors.numpy import save_file

    from mot_jax.outputs import written_folder

    folder = Path(folder)
    config = translator_config(translator, source, target) | (extra or {})
    tensors = translator_tensors(translator, source, target)
    with written_folder(folder, TOOL) as staging:
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return folder
