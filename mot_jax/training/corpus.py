"""Training documents, prepared once as TFDS array_record files for random access without TensorFlow.

`documents(corpus)` returns {"train", "validation"} sequences of strings. Corpora:

- "docs_prose" (the default): English prose paragraphs from the docstrings of the Python standard library and the
  installed ML packages. Every machine has it after set-up, with no download, and it is the same text on the same
  package versions.
- a local folder or file: .txt (one document per file; files over 20k characters split into paragraph groups),
  .jsonl (field "text" per line) and .parquet (column "text") files, in sorted path order.
- "tfds:NAME" (a TFDS catalog dataset) or "huggingface:NAME" (TFDS's Hugging Face builder, needs `datasets`):
  downloaded by TFDS, so they need network access; their "text" feature is used.

Validation is the corpus's own "validation" split when it has one, else every 50th document of "train" (the rest
stay in train). Local and docs_prose corpora are written as one TFDS "train" split under a config named by a
fingerprint of the source files (paths, sizes, mtimes) and of this module's code, so they are rebuilt exactly when
their text may have changed and reused otherwise.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import inspect
import io
import json
import re
import sys
import sysconfig
import textwrap
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from mot_jax.errors import MotJaxError, cause
from mot_jax.files import json_lines
from mot_jax.paths import cache_lock, cache_root
from mot_jax.progress import Progress

DEFAULT_CORPUS = "docs_prose"
VALIDATION_EVERY = 50  # without a validation split, document i is validation when i % 50 == 49
DOCUMENT_CHARS = 4000  # consecutive paragraphs are grouped into documents of about this many characters
SPLIT_TXT_CHARS = 20_000  # a local .txt file longer than this is split into paragraph groups
SUFFIXES = (".jsonl", ".parquet", ".txt")
PROSE_PACKAGES = ("numpy", "jax", "flax", "optax", "orbax", "absl", "ml_collections", "transformers", "torch")
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


def documents(corpus: str = DEFAULT_CORPUS, data_dir=None) -> dict[str, Documents]:
    """{"train", "validation"} documents of `corpus`, prepared into `data_dir` (default: the mot_jax cache) on the
    first call and reused afterwards."""
    data_dir = Path(data_dir or cache_root() / "tfds").expanduser()
    if corpus == DEFAULT_CORPUS:
        files, read = _prose_sources()
        return _splits(_prepare(DEFAULT_CORPUS, files, read, data_dir), data_dir)
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


@contextlib.contextmanager
def _quiet():
    """No TFDS progress bars, absl warnings or stdout lines (we print our own one line)."""
    import tensorflow_datasets as tfds
    from absl import logging
    from tensorflow_datasets.core.utils import tqdm_utils

    bar, verbosity = getattr(tqdm_utils, "_active", True), logging.get_verbosity()
    tfds.display_progress_bar(False)
    logging.set_verbosity(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        tfds.display_progress_bar(bar)
        logging.set_verbosity(verbosity)


def one_split_builder(builder_name: str, split: str, feature: str, config: str, data_dir: Path, metadata=False):
    """An unregistered TFDS builder `builder_name`/`config` under `data_dir` of one `split` of {`feature`: text}
    records, unshuffled, in the order of `builder.records` (texts; set it before `download_and_prepare`): the form of
    the datasets this project writes itself (local and docs_prose corpora, synthetic evaluation sets). `metadata`: the
    info carries a MetadataDict to fill before preparing."""
    import tensorflow_datasets as tfds

    class OneSplitBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        name = builder_name
        VERSION = tfds.core.Version("1.0.0")
        code_path = None  # no checksums file to look for (TFDS's lookup needs importlib_resources in a package)
        records: Iterable[str] = ()

        def _info(self):
            features = tfds.features.FeaturesDict({feature: tfds.features.Text()})
            extra = dict(metadata=tfds.core.MetadataDict()) if metadata else {}
            return tfds.core.DatasetInfo(builder=self, features=features, disable_shuffling=True, **extra)

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples()}

        def _generate_examples(self):
            yield from enumerate({feature: text} for text in self.records)

    return OneSplitBuilder(
        config=tfds.core.BuilderConfig(name=config), data_dir=str(data_dir), file_format="array_record"
    )


def _builder(config: str, data_dir: Path):
    """The builder of our own corpora: one "train" split of {"text"} records in document order (unshuffled: the
    validation rule relies on it)."""
    return one_split_builder("mot_text", "train", "text", config, data_dir, metadata=True)


def _with_progress(texts: list[str]):
    with Progress("Writing the corpus", "doc", total=len(texts)) as progress:
        for text in texts:
            yield text
            progress.update()


def prepared(make: Callable[[], object], build: Callable[[object], None]):
    """The TFDS builder `make()` returns, prepared by `build(builder)` when it is not yet: safe for any number of
    processes at once. The build holds the dataset's own lock (TFDS writes to a temporary folder and renames it);
    a process that waited makes a fresh builder, whose info holds the splits the other process wrote."""
    with _quiet():
        builder = make()
        if builder.is_prepared():
            return builder
    with cache_lock(builder.data_dir):
        with _quiet():
            builder = make()
            ready = builder.is_prepared()
        if not ready:
            build(builder)
    return builder


def _prepare(kind: str, files: list[Path], read: Callable[[], tuple[list[str], dict]], data_dir: Path):
    """The builder of a local or docs_prose corpus, written on the first call for this fingerprint of `files`."""
    stats = sorted((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    fingerprint = hashlib.sha256(json.dumps([kind, code, stats]).encode()).hexdigest()[:16]

    def build(builder):
        print(f"Preparing the {kind} corpus into {builder.data_dir} (once; later runs reuse it)", file=sys.stderr)
        texts, sources = read()
        text_sha = hashlib.sha256("\0".join(texts).encode()).hexdigest()
        builder.info.metadata.update(
            sources=sources, documents=len(texts), characters=sum(map(len, texts)), text_sha256=text_sha
        )
        builder.records = _with_progress(texts)
        with _quiet():
            builder.download_and_prepare()

    return prepared(lambda: _builder(f"{kind}_{fingerprint}", data_dir), build)


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
        builder = prepared(make, build)
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
    with _quiet():
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


# -------------------------------------------------------------------------------------------------- docs_prose

_SKIP_DIRS = {"test", "tests", "testing", "idlelib", "site-packages", "dist-packages", "__pycache__"}
_MARKUP = [  # reST / Markdown inline markup -> its text
    (re.compile(r":(?:\w+:)+`~?([^`<]*?)\s*(?:<[^>]*>)?`"), r"\1"),  # :role:`text <target>`
    (re.compile(r"\[`~?([^`]+)`\]"), r"\1"),  # [`Name`] (transformers)
    (re.compile(r"``([^`]+)``"), r"\1"),
    (re.compile(r"`([^`<]*?)\s*(?:<[^>]*>)?`_{0,2}"), r"\1"),  # `text`, `text <url>`_
    (re.compile(r"\*\*?([A-Za-z][^*\n]*?)\*\*?"), r"\1"),  # *emphasis*, **strong**
    (re.compile(r"\[([^\]]+)\]\((?:https?://|#)[^)\s]*\)"), r"\1"),  # [text](url)
]
_NOT_PROSE_LINE = re.compile(  # matched at the start of each line of a paragraph
    r"""
      >>> | \.\.\. | \$\  | % | \# | @                # doctest and shell prompts, comments, decorators
    | \.\.\  | :\w[\w\ ]*:(\s|$)                     # reST directives, field lists
    | [-=~^*+\#_`]{3,} | \|                          # rules, fences, tables
    | [\w.\[\]]+(,\ *[\w.\[\]]+)*\ =[^=]              # an assignment
    | [\w.]+\(.*\)$                                  # a bare call
    | from\ [\w.]+\ import\  | import\ [\w.]+$ | def\ \w+\( | class\ \w+[(:] | print\(
    """,
    re.VERBOSE,
)
_PROSE_CHAR = re.compile(r"[\w\s.,;:'\"!?()\-]")


def _prose_roots() -> list[tuple[str, Path]]:
    """The standard library and the installed PROSE_PACKAGES (found without importing them)."""
    roots = [("python", Path(sysconfig.get_paths()["stdlib"]))]
    for package in PROSE_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec and spec.submodule_search_locations:
            roots += [(package, Path(p)) for p in sorted(spec.submodule_search_locations)]
    return roots


def _python_files(root: Path) -> list[Path]:
    return [
        p
        for p in sorted(root.rglob("*.py"))
        if not _SKIP_DIRS & set(p.relative_to(root).parts[:-1])
        and not p.name.startswith("test_")
        and not p.name.endswith("_test.py")
    ]


def _statements(node):
    """`node` and, recursively, the statements nested in it (expressions are not visited: ast.walk is 3x slower)."""
    yield node
    for field in ("body", "orelse", "finalbody", "handlers", "cases"):
        for child in getattr(node, field, None) or ():
            yield from _statements(child)


def _docstrings(source: str):
    """Docstrings of the module, classes and functions, and attribute docstrings (a string after an assignment)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in _statements(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        attributes = isinstance(node, (ast.Module, ast.ClassDef))
        for i, statement in enumerate(node.body):
            value = getattr(statement, "value", None)
            if isinstance(statement, ast.Expr) and isinstance(value, ast.Constant) and isinstance(value.value, str):
                if i == 0 or attributes and isinstance(node.body[i - 1], (ast.Assign, ast.AnnAssign)):
                    yield value.value


def _prose(paragraph: str) -> str | None:
    """The paragraph as one line of prose, or None when it looks like code, markup, a table or a fragment."""
    lines = [line.rstrip() for line in textwrap.dedent(paragraph).strip().split("\n")]
    if any(not line or line[0].isspace() or _NOT_PROSE_LINE.match(line) for line in lines):
        return None  # relatively indented lines: code, parameter tables, hanging lists
    text = " ".join(line.strip() for line in lines)
    for pattern, replacement in _MARKUP:
        text = pattern.sub(replacement, text)
    text = text[:-1] if text.endswith("::") else text
    letters = sum(c.isalpha() or c.isspace() or c == "_" for c in text)
    if letters < 0.75 * len(text) or len(_PROSE_CHAR.findall(text)) < 0.95 * len(text):
        return None  # mostly symbols, numbers or math
    if len(text) < 40 or len(text.split()) < 6 or not text[0].isalpha():
        return None
    return text if text[-1].isalnum() or text[-1] in ".!?:)" else None


def _paragraphs(docstring: str, seen: set[str]) -> list[str]:
    """New prose paragraphs of one docstring (reST literal blocks after "::" skipped; exact duplicates dropped)."""
    kept, previous = [], ""
    for paragraph in re.split(r"\n[ \t]*\n", inspect.cleandoc(docstring)):
        paragraph = "\n".join(line.rstrip() for line in paragraph.strip("\n").split("\n"))
        if paragraph[:1].isspace() and previous.endswith("::"):
            continue
        previous = previous if paragraph[:1].isspace() else paragraph
        text = _prose(paragraph)
        if text and text not in seen:
            seen.add(text)
            kept.append(text)
    return kept


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(importlib.metadata.packages_distributions().get(package, [package])[0])
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _prose_sources() -> tuple[list[Path], Callable[[], tuple[list[str], dict]]]:
    """The files docs_prose reads (for the fingerprint), and the function that extracts its documents and the
    versions of what it read."""
    roots = _prose_roots()
    files = [(name, path) for name, root in roots for path in _python_files(root)]

    def read():
        from pydoc_data.topics import topics

        seen, texts = set(), []
        with Progress("Reading docstrings", "file", total=len(files)) as progress:
            for _, path in files:
                progress.update()
                try:
                    source = path.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                texts += _group([p for d in _docstrings(source) for p in _paragraphs(d, seen)])
        for key in sorted(topics):
            texts += _group(_paragraphs(topics[key], seen))
        return texts, {"python": sys.version.split()[0]} | {name: _version(name) for name, _ in roots[1:]}

    return [path for _, path in files], read
