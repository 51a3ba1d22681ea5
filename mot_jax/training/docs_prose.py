"""The offline default training corpus, "docs_prose": English prose paragraphs from the docstrings of the Python
standard library and the installed ML packages (PACKAGES, found without importing them) and from pydoc's topics.
Every machine has it after set-up, with no download, and it is the same text on the same package versions.

A paragraph is kept when it reads as prose (not code, markup, a table or a fragment), as one line with its inline
reST / Markdown markup reduced to its text; exact duplicates are dropped. `corpus.documents("docs_prose")` groups
the paragraphs into documents and writes them as a TFDS dataset.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
import re
import sys
import sysconfig
import textwrap
from collections.abc import Callable
from pathlib import Path

from mot_jax.progress import Progress

PACKAGES = ("numpy", "jax", "flax", "optax", "orbax", "absl", "ml_collections", "transformers", "torch")
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
    """The standard library and the installed PACKAGES (found without importing them)."""
    roots = [("python", Path(sysconfig.get_paths()["stdlib"]))]
    for package in PACKAGES:
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


def sources() -> tuple[list[Path], Callable[[], tuple[list[list[str]], dict]]]:
    """The files docs_prose reads (for the fingerprint), and the function that extracts its prose (the paragraphs of
    each file and of each pydoc topic, in order, as one list per file or topic; the corpus groups each list into
    documents) and the versions of what it read."""
    roots = _prose_roots()
    files = [(name, path) for name, root in roots for path in _python_files(root)]

    def read():
        from pydoc_data.topics import topics

        seen, parts = set(), []
        with Progress("Reading docstrings", "file", total=len(files)) as progress:
            for _, path in files:
                progress.update()
                try:
                    source = path.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                parts.append([p for d in _docstrings(source) for p in _paragraphs(d, seen)])
        for key in sorted(topics):
            parts.append(_paragraphs(topics[key], seen))
        return parts, {"python": sys.version.split()[0]} | {name: _version(name) for name, _ in roots[1:]}

    return [path for _, path in files], read
