"""Advisory file locks (fcntl.flock) for work that several independent processes may start at once.

`file_lock(path)` waits for its turn (building a shared cache: the first process builds, the others then find it
ready); `file_lock(path, busy=message)` does not wait and raises MotJaxError(message) when another process holds
the lock (a workdir that one run owns for its whole life). The lock goes with the process: a killed process never
leaves a stale lock behind, and the lock file itself is never deleted (deleting it would let two processes hold
locks on two different files of one name).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from mot_jax.errors import MotJaxError, cause


@contextlib.contextmanager
def file_lock(path, *, busy: str | None = None):
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:  # a read-only disk (e.g. the default cache folder in a read-only home)
        raise MotJaxError(
            f"Cannot write the lock file {path} ({cause(e)}); make {path.parent} writable, or for the shared cache set "
            "MOT_JAX_CACHE to a writable folder."
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if busy is not None else 0))
        except BlockingIOError:
            raise MotJaxError(busy) from None
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
