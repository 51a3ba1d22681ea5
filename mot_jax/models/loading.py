"""Model names -> models and tokenizers: a tiny random model (`random:FAMILY`), an embedded model or GGUF file, a
Hugging Face hub id or a local checkpoint directory, each sent to the module that builds it (`tiny`, `gguf`,
`registry`).
"""

from __future__ import annotations

import os
from pathlib import Path

from mot_jax import sharding
from mot_jax.errors import MotJaxError
from mot_jax.models import gguf, registry, tiny, tokenizers


def resolve_model_dir(name_or_path: str) -> Path:
    """A local directory as is; otherwise a Hugging Face hub id, fetched (config, weights, tokenizer) if possible."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    looks_like_path = name_or_path.startswith((".", "/", "~")) or os.sep in name_or_path.strip("/").split("/", 1)[-1]
    if path.exists() or looks_like_path or name_or_path.count("/") > 1:
        raise MotJaxError(f"Model path {name_or_path!r} is not a directory; pass an existing checkpoint directory.")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]
        return Path(snapshot_download(name_or_path, allow_patterns=patterns))
    except Exception as e:  # no network, unknown id, gated repo ...
        raise MotJaxError(
            f"Model {name_or_path!r} is neither a local directory nor downloadable from the Hugging Face hub "
            f"({type(e).__name__}); pass a local checkpoint directory."
        ) from None


def load_model(name_or_path: str, dtype="float32", mesh=None, rules=sharding.RULES):
    """(model, config dict) from an embedded model name, a GGUF file, a hub id, a checkpoint directory or a tiny
    random model (`random:FAMILY`, see `mot_jax.models.tiny`). With a `mesh`, the weights are created directly in
    their shardings by `rules` (`mot_jax.sharding`), never whole on one device; without, on the default device."""
    if tiny.is_random(name_or_path):
        model, config, _ = tiny.load(name_or_path, dtype, mesh=mesh, rules=rules)
        return model, config

    gguf_path = gguf.resolve_gguf(name_or_path)
    if gguf_path is not None:
        embedded = name_or_path if name_or_path in gguf.EMBEDDED else None
        model, config, _ = gguf.convert(gguf_path, embedded, dtype, mesh=mesh, rules=rules)
        return model, config
    return registry.load_dir(resolve_model_dir(name_or_path), dtype, mesh, rules)


def load_tokenizer(name_or_path: str):
    """The tokenizer of a model name as `load_model` takes it: a `tokenizers.Tokenizer` (tokenizer.json) where the
    checkpoint has one, else transformers' `AutoTokenizer` (e.g. GPT-2's vocab.json + merges.txt)."""
    if tiny.is_random(name_or_path):
        return tiny.load_tokenizer(name_or_path)
    if gguf.resolve_gguf(name_or_path) is not None:
        return gguf.load_tokenizer(name_or_path)
    model_dir = resolve_model_dir(name_or_path)
    if (model_dir / "tokenizer.json").is_file():
        return tokenizers.from_folder(model_dir)
    try:
        import transformers

        return transformers.AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:
        raise MotJaxError(f"{model_dir} has no usable tokenizer ({type(e).__name__}); add its tokenizer files.") from e
