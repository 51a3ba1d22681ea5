"""A tokenizer from a folder's tokenizer.json (a converted GGUF model, a Hugging Face checkpoint, a `random:DIR`'s
shapes); model names go through `loading.load_tokenizer`."""

from __future__ import annotations

from pathlib import Path

from mot_jax.errors import MotJaxError


def from_folder(folder, why: str = "") -> object:
    """The `tokenizers.Tokenizer` of `folder`/tokenizer.json; refused in one line where there is none (`why`: what
    the folder is, for the message)."""
    from tokenizers import Tokenizer

    file = Path(folder) / "tokenizer.json"
    if not file.is_file():
        raise MotJaxError(f"{folder} has no tokenizer.json{why}; pass a model whose folder has one.")
    return Tokenizer.from_file(str(file))
