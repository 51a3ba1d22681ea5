"""Training documents, prepared once as TFDS array_record files for random access without TensorFlow.

`documents(corpus)` returns {"train", "validation"} sequences of strings. Corpora:

- "docs_prose" (the default): English prose paragraphs from the docstrings of the Python standard library and the
  installed ML packages (docs_prose.py). Every machine has it after set-up, with no download, and it is the same
  text on the same package versions.
- a local folder or file: .txt (one document per file; files over 20k characters split into paragraph groups),
  .jsonl (field "text" per line) and .parquet (column "text") files, in sorted path order.
- "tfds:NAME" (a TFDS catalog dataset) or "huggingface:NAME" (TFDS's Hugging Face builder, needs `datasets`):
  downloaded by TFDS, so they need network access; their "text" feature is used.

Validation is the corpus's own "validation" split when it has one, else every 50th document of "train" (the rest
stay in train). Local and docs_prose corpora are written as one TFDS "train" split under a config named by a
fingerprint of the source files (paths, sizes, mtimes) and of the code that writes them (this module, docs_prose.py
and tfds_builders.py), so they are rebuilt exactly when their text may have changed and reused otherwise.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from mot_jax import tfds_builders
from mot_jax.errors import MotJaxError, cause
from mot_jax.files import json_lines
from mot_jax.paths import cache_root
from mot_jax.progress import Progress
from mot_jax.training import docs_prose

DEFAULT_CORPUS = "docs_prose"
VALIDATION_EVERY = 50  # without a validation split, document i is validation when i % 50 == 49
DOCUMENT_CHARS = 4000  # consecutive paragraphs are grouped into documents of about this many characters
SPLIT_TXT_CHARS = 20_000  # a local .txt file longer than this is split into paragraph groups
SUFFIXES = (".jsonl", ".parquet", ".txt")
_CODE = (__file__, docs_prose.__file__, tfds_builders.__file__)  # what writes our corpora: in their fingerprint
ACCEPTED = (
    f'"{DEFAULT_CORPUS}" (offline default), a local folder or file of .txt/.jsonl/.parquet, "tfds:NAME" or '
    '"huggingface:NAME"'
)


class Documents(Sequence):
    """Random-access strings over a TFDS data source (`[i]` -> str, `[a:b]` -> list[str]), optionally through an
    index map. `fingerprint` names the corpus, version and split (the chunk cache key); `data_dir` is where the
    corpus lives."""

    def __init__(self, source, fingerprint: str, data_dir: Path, indices: np.ndarray | None = None):
        self.source, self.fingerprint, self.data_dir, self.indices = source, fingerprint, Path(data_dir), indices

    def __len__(self) -> int:
        return len(self.source) if self.indices is None else len(self.indices)

    def __getitem__(self, i):
        rows = range(len(self))[i]
        picked = [rows] if isinstance(rows, int) else list(rows)
        if self.indices is not None:
            picked = self.indices[picked].tolist()
        texts = [r["text"].decode("utf-8") for r in self.source.__getitems__(picked)] if picked else []
        return texts[0] if isinstance(rows, int) else texts

    def __iter__(self):
        for start in range(0, len(self), 1024):
            yield from self[start : start + 1024]

    def head(self, count: int) -> Documents:
        """The first `count` documents (all when there are fewer), read no further: what a chunk table of a large
        corpus tokenizes under `data.max_documents` (its own fingerprint, so its own cached table)."""
        if count >= len(self):
            return self
        indices = np.arange(count) if self.indices is None else self.indices[:count]
        return Documents(self.source, f"{self.fingerprint}/first{count}", self.data_dir, indices)


def documents(corpus: str = DEFAULT_CORPUS, data_dir=None) -> dict[str, Documents]:
    """{"train", "validation"} documents of `corpus`, prepared into `data_dir` (default: the mot_jax cache) on the
    first call and reused afterwards."""
    data_dir = Path(data_dir or cache_root() / "tfds").expanduser()
    if corpus == DEFAULT_CORPUS:
        files, read = docs_prose.sources()
        return _splits(_prepare(DEFAULT_CORPUS, files, lambda: _grouped(*read()), data_dir), data_dir)
    scheme, _, name = corpus.partition(":")
    if scheme in ("tfds", "huggingface") and name:
        return _splits(_catalog(corpus, data_dir), data_dir)
    path = Path(corpus).expanduser()
    if not path.exists():
        if name and re.fullmatch(r"[A-Za-z][\w.+-]+", scheme):
            raise MotJaxError(f"Unknown corpus scheme {scheme!r} in {corpus!r}; pass {ACCEPTED}.")
        raise MotJaxError(f"The corpus path {path} does not exist; pass an existing folder or file, or {ACCEPTED}.")
    files = _local_files(path)
    return _splits(_prepare("local", files, lambda: _read_local(files), data_dir), data_dir)


# ------------------------------------------------------------------------------------------------- TFDS plumbing


def _builder(config: str, data_dir: Path):
    """The builder of our own corpora: one "train" split of {"text"} records in document order (unshuffled: the
    validation rule relies on it)."""
    return tfds_builders.one_split_builder("mot_text", "train", "text", config, data_dir, metadata=True)


def _with_progress(texts: list[str]):
    with Progress("Writing the corpus", "doc", total=len(texts)) as progress:
        for text in texts:
            yield text
            progress.update()


def _prepare(kind: str, files: list[Path], read: Callable[[], tuple[list[str], dict]], data_dir: Path):
    """The builder of a local or docs_prose corpus, written on the first call for this fingerprint of `files`."""
    stats = sorted((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    code = hashlib.sha256(b"".join(Path(m).read_bytes() for m in _CODE)).hexdigest()
    fingerprint = hashlib.sha256(json.dumps([kind, code, stats]).encode()).hexdigest()[:16]

    def build(builder):
        print(f"Preparing the {kind} corpus into {builder.data_dir} (once; later runs reuse it)", file=sys.stderr)
        texts, sources = read()
        text_sha = hashlib.sha256("\0".join(texts).encode()).hexdigest()
        builder.info.metadata.update(
            sources=sources, documents=len(texts), characters=sum(map(len, texts)), text_sha256=text_sha
        )
        builder.records = _with_progress(texts)
        with tfds_builders.quiet_tfds():
            builder.download_and_prepare()

    return tfds_builders.prepared(lambda: _builder(f"{kind}_{fingerprint}", data_dir), build)


def _catalog(corpus: str, data_dir: Path):
    """A prepared TFDS catalog or Hugging Face builder; a failure becomes one MotJaxError that names the cause."""
    import tensorflow_datasets as tfds

    scheme, _, name = corpus.partition(":")
    if scheme == "huggingface" and importlib.util.find_spec("datasets") is None:
        raise MotJaxError(f"The corpus {corpus!r} needs the Hugging Face `datasets` package; `pip install datasets`.")

    def make():
        builder = tfds.builder(name if scheme == "tfds" else corpus, data_dir=str(data_dir), file_format="array_record")
        if "text" not in builder.info.features:
            raise MotJaxError(
                f"The corpus {corpus!r} has no 'text' feature (it has {', '.join(builder.info.features)}); pick a "
                "dataset with a 'text' feature."
            )
        return builder

    def build(builder):
        print(f"Preparing {corpus!r} with TFDS into {builder.data_dir} (once)", file=sys.stderr)
        builder.download_and_prepare()

    try:
        builder = tfds_builders.prepared(make, build)
    except MotJaxError:
        raise
    except ModuleNotFoundError as e:
        raise MotJaxError(f"The corpus {corpus!r} needs the Python package {e.name!r}; `pip install {e.name}`.") from e
    except Exception as e:
        raise MotJaxError(
            f"Could not prepare the corpus {corpus!r} ({cause(e)}); TFDS downloads it, which needs network access, "
            f'and the offline default corpus is "{DEFAULT_CORPUS}".'
        ) from e
    return builder


def _splits(builder, data_dir: Path) -> dict[str, Documents]:
    with tfds_builders.quiet_tfds():
        train = builder.as_data_source(split="train")
        validation = builder.as_data_source(split="validation") if "validation" in builder.info.splits else None
    name = builder.info.full_name
    if validation is not None:
        return {
            "train": Documents(train, f"{name}/train", data_dir),
            "validation": Documents(validation, f"{name}/validation", data_dir),
        }
    held_out = np.arange(len(train)) % VALIDATION_EVERY == VALIDATION_EVERY - 1
    return {
        "train": Documents(train, f"{name}/train", data_dir, np.flatnonzero(~held_out)),
        "validation": Documents(train, f"{name}/validation", data_dir, np.flatnonzero(held_out)),
    }


def _group(paragraphs: list[str], limit: int = DOCUMENT_CHARS) -> list[str]:
    """Consecutive paragraphs joined by blank lines into documents of about `limit` characters."""
    groups, current, size = [], [], 0
    for paragraph in paragraphs:
        if current and size + len(paragraph) > limit:
            groups.append("\n\n".join(current))
            current, size = [], 0
        current.append(paragraph)
        size += len(paragraph) + 2
    return groups + (["\n\n".join(current)] if current else [])


def _grouped(parts: list[list[str]], sources: dict) -> tuple[list[str], dict]:
    """The paragraphs of each part (docs_prose: one part per file or pydoc topic) grouped into documents."""
    return [document for part in parts for document in _group(part)], sources


# ---------------------------------------------------------------------------------------------- local corpora


def _local_files(path: Path) -> list[Path]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    files = [f for f in files if f.suffix in SUFFIXES]
    if not files:
        raise MotJaxError(
            f"{path} has no .txt, .jsonl or .parquet file; point the corpus at a folder or file of those formats."
        )
    return files


def _read_txt(file: Path) -> list[str]:
    text = file.read_text(encoding="utf-8")
    if len(text) <= SPLIT_TXT_CHARS:
        return [text]
    return _group([p.strip() for p in re.split(r"\n[ \t]*\n", text) if p.strip()])


def _read_jsonl(file: Path) -> list[str]:
    texts = []
    for number, record in json_lines(file):
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise MotJaxError(f"{file}:{number}: the line has no 'text' string field; give every line a 'text' field.")
        texts.append(record["text"])
    return texts


def _read_parquet(file: Path) -> list[str]:
    import pyarrow.parquet as pq

    if "text" not in pq.read_schema(file).names:
        raise MotJaxError(f"{file} has no 'text' column; name the parquet column holding the documents 'text'.")
    return [t or "" for t in pq.read_table(file, columns=["text"]).column("text").to_pylist()]


_READERS = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}


def _read_local(files: list[Path]) -> tuple[list[str], dict]:
    texts = []
    with Progress("Reading the corpus", "file", total=len(files)) as progress:
        for file in files:
            try:
                texts += _READERS[file.suffix](file)
            except UnicodeDecodeError:
                raise MotJaxError(f"{file} is not UTF-8 text; convert it to UTF-8 or remove it.") from None
            progress.update()
    return texts, {"files": len(files)}
