"""The transformers folders and tokenizers of the models a mot_jax training run names (`CachePipeline.from_export`):
a folder as is, the folder mot_jax converted an embedded model or a GGUF file into (`$MOT_JAX_CACHE/<name>-<key>/`,
default `~/.cache/mot_jax`), or a hub id fetched as mot_jax fetches it. No JAX: pathlib, json and transformers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import transformers

from mot_jax.paths import cache_root

HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]  # what mot_jax fetches of a hub model


def converted_folder(name: str) -> Path | None:
    """The folder mot_jax converted an embedded model (`name`, e.g. "smollm2-135m") or a GGUF file (a `.gguf` path)
    into, a transformers folder (config.json, model.safetensors, tokenizer.json): `cache_root()/<name or file
    stem>-<key>/` (`mot_jax.models.gguf.convert`; the key follows the GGUF file's path, size and date). Of the
    complete ones (a conversion writes its manifest last), the newest whose GGUF file is still there (another
    install of the same package leaves a folder of its own), else the newest; None when there is none."""
    gguf_file = str(Path(name).expanduser()) if name.endswith(".gguf") else None
    stem = Path(name).stem if gguf_file else name
    pattern = re.compile(re.escape(stem) + "-[0-9a-f]{12}")
    found = []
    for folder in cache_root().glob("*-*"):
        manifest = folder / "manifest.json"
        if not (pattern.fullmatch(folder.name) and manifest.is_file()):
            continue
        source = json.loads(manifest.read_text()).get("source")
        if gguf_file is None or source == gguf_file:
            found.append((bool(source) and Path(source).is_file(), manifest.stat().st_mtime, folder))
    return max(found, default=(None, None, None))[2]


def model_folder(name: str) -> Path:
    """The transformers folder of a model as a mot_jax training config names it: a folder as is; an embedded model
    or GGUF file: its converted folder (`converted_folder`); else a hub id, fetched (or found in the hub's cache)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if name.startswith("random:"):
        raise ValueError(
            f"{name!r} is a tiny random mot_jax model, which has no transformers folder; pass the source and target "
            "folders (source=..., target=...)."
        )
    converted = converted_folder(name)
    if converted is not None:
        return converted
    convert = f"`python -m mot_jax.convert --model={name}` converts an embedded model or a GGUF file there once"
    if name.endswith(".gguf"):
        raise ValueError(f"{name} has no converted folder in {cache_root()}; {convert}.")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=HUB_FILES))
    except Exception as e:  # no network, unknown id, gated repo ...
        raise ValueError(
            f"Model {name!r} is neither a folder, a model converted into {cache_root()} ({convert}) nor a hub id "
            f"that can be fetched ({type(e).__name__}); pass its folder (source=... or target=...)."
        ) from None


def load_tokenizer(folder: Path):
    """A model folder's tokenizer as mot_jax reads it (`mot_jax.models.loading.load_tokenizer`), so that the ids and
    the alignment are the ones the translator was trained on: its tokenizer.json as a `tokenizers.Tokenizer`, else
    transformers' AutoTokenizer."""
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(folder / "tokenizer.json"))
    return transformers.AutoTokenizer.from_pretrained(str(folder))
