"""Output folders a command writes whole (an exported translator, an evaluation report), and the Markdown table
writer of the reports and pages (`markdown_table`).

`written_folder(out, tool)` stages the files beside `out` and renames them into place once all are written
(`files.atomic_folder`), so a reader never sees half a folder. It only ever replaces what the same command wrote
there itself: each output folder gets a marker file naming the command and listing its files, and
`check_replaceable(out, tool)` refuses anything else (a file, a training workdir, another command's output, a folder
with files the marker does not list); an empty folder is fine.
Files follow the umask (`files.follow_umask`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import tempfile

from etils import epath

from mot_jax.errors import MotJaxError, cause
from mot_jax.files import atomic_folder, follow_umask

MARKER = ".mot_jax_output"


def _fix(out) -> str:
    return f"choose another output folder (--out), or remove {out} yourself"


def check_replaceable(out, tool: str) -> None:
    """Raise MotJaxError unless `out` is absent, an empty folder or an output folder that `tool` wrote, as written."""
    out = epath.Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise MotJaxError(f"{out} is a file, not a folder; {_fix(out)}.")
    names = {p.name for p in out.iterdir()}
    if not names:
        return
    if "checkpoints" in names or ("config.json" in names and MARKER not in names):
        raise MotJaxError(f"{out} is a training workdir (it has checkpoints/ or config.json); {_fix(out)}.")
    try:
        marker = json.loads((out / MARKER).read_text())
        listed, writer = set(marker["files"]) | {MARKER}, marker["tool"]
    except (OSError, ValueError, KeyError, TypeError):
        listed, writer = set(), tool
    if writer != tool:
        raise MotJaxError(f"{out} is an output of {writer}, which {tool} does not replace; {_fix(out)}.")
    foreign = sorted(names - listed)
    if foreign:
        raise MotJaxError(f"{out} holds files this project did not write there ({foreign[0]}); {_fix(out)}.")


def check_output(out, tool: str) -> None:
    """Raise MotJaxError unless `out` can be written by `tool`: replaceable (`check_replaceable`) and its parent
    folder (made when missing) writable, where the files are staged. Call it before the work whose output it is."""
    check_replaceable(out, tool)
    out = epath.Path(out)
    if "://" in str(out):
        return  # cloud storage: its permissions show only when written
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out.parent):
            pass
    except OSError as e:
        raise MotJaxError(
            f"Cannot write to {out.parent} ({cause(e)}); choose a writable output folder (--out)."
        ) from None


def write_fix(e: OSError) -> str:
    """What to do about a failed write, from its cause: a full disk is not a permission."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space"
    return "make the folder writable or choose another one (--out)"


@contextlib.contextmanager
def written_folder(out, tool: str):
    """Yield an empty staging folder; once the block ends without error, its files (and the marker naming `tool`)
    replace `out`, which `check_replaceable(out, tool)` allows. On an error nothing changes at `out`; an OSError (a
    full disk, a folder made unwritable since `check_output`) reaches the caller, to say what it kept."""
    out = epath.Path(out)
    check_replaceable(out, tool)
    with atomic_folder(out) as staging:
        yield staging
        files = sorted(p.name for p in staging.iterdir())
        (staging / MARKER).write_text(json.dumps(dict(tool=tool, files=files)) + "\n")
        follow_umask(staging)
        check_replaceable(out, tool)  # again: another process may have written there meanwhile


def markdown_table(header, rows, left: int = 1) -> str:
    """A Markdown table of `rows` (each cell through str()) under `header`: the first `left` columns are names
    (left-aligned), the others numbers (right-aligned)."""
    align = ["---"] * left + ["---:"] * (len(header) - left)
    return "\n".join("| " + " | ".join(map(str, row)) + " |" for row in [header, align, *rows])
