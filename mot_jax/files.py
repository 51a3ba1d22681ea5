"""Writing and reading files whole: atomic writes (a reader never sees half a file or folder), modes that follow the
umask, and JSON Lines read with the file and line named on any error."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import math
import os
import re
import secrets
import shutil
from pathlib import Path

from absl import logging
from etils import epath

from mot_jax.errors import MotJaxError


def strict_json(value, **kwargs) -> str:
    """`json.dumps(value, **kwargs)` that any JSON parser reads: a non-finite float (NaN, +-inf), which json.dumps
    writes as a bare NaN or Infinity that JSON does not allow, is written as null."""
    return json.dumps(_finite(value), allow_nan=False, **kwargs)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _temporary_name(name: str) -> str:
    """A hidden name for staging `name` beside it, unique to this process and call."""
    return f".{name}.{os.getpid()}.{secrets.token_hex(4)}.partial"


def remove_leftovers(path):
    """Remove what writers of `path` that were killed left beside it (`atomic_file`'s and `atomic_folder`'s staging
    and moved-aside copies). Call it holding the lock that writers of `path` hold, so no live writer's go."""
    path = Path(path)
    ours = re.compile(rf"\.{re.escape(path.name)}\.\d+\.[0-9a-f]{{8}}\.(partial|old)")
    for leftover in path.parent.glob(f".{glob.escape(path.name)}.*"):
        if ours.fullmatch(leftover.name):
            logging.info("Removing %s, left by a killed writer", leftover)
            if leftover.is_dir():
                shutil.rmtree(leftover)
            else:
                leftover.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_file(path):
    """Yield a temporary path beside `path` (its folder is made when missing) for the block to write; when the block
    ends without error the file is renamed to `path`, so a reader finds the old file or the new one, never part of
    one. On an error the temporary file is removed and `path` is left as it was. No fsync: this guards against
    readers and crashed writers, not against a power cut."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(_temporary_name(path.name))
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_folder(path):
    """Yield an empty temporary folder beside `path` (local or cloud) for the block to fill; when the block ends
    without error the folder takes `path`'s place (a folder already there is first moved aside, then removed), so a
    reader finds the old folder, the new one or, for an instant, none, never part of one. On an error the temporary
    folder is removed and `path` is left as it was (an old folder moved aside is moved back)."""
    path = epath.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / _temporary_name(path.name)
    staging.mkdir()
    old = None
    try:
        yield staging
        if path.exists():
            old = path.parent / f"{staging.name.removesuffix('.partial')}.old"
            path.rename(old)  # the earlier folder moves aside, then the new one takes its name
        try:
            staging.rename(path)
        except BaseException:
            if old is not None:
                old.rename(path)
                old = None
            raise
    finally:
        for leftover in (staging, old):
            if leftover is not None and leftover.exists():
                leftover.rmtree()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(folder) -> None:
    """Give `folder` and everything under it the modes a plain mkdir / open would have made: temporary-file tools
    (safetensors) write 0600, which other users (of a shared cache, an output folder) cannot read."""
    if "://" in str(folder):
        return  # cloud storage has no modes
    mask = _umask()
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


def utf8(path, data: bytes, first_line: int = 1) -> str:
    """`data` (the file's text from line `first_line` on) decoded; bytes that are not UTF-8 are named by file:line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data[: e.start].count(b"\n")
        raise MotJaxError(f"{path}:{line}: not UTF-8 text ({e.reason}); save the file as UTF-8.") from None


def json_lines(path: Path):
    """(line number, parsed value) of each non-blank line of a JSONL file; a malformed line is named by file:line."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            line = utf8(path, raw, number)
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                raise MotJaxError(f"{path}:{number}: not valid JSON ({e.msg}); fix that line.") from None


def sha256_of(path) -> str:
    """The sha256 hex digest of a file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()
