"""Running generated code's tests: `run_program(source, timeout)` runs a Python program in a child interpreter and
says whether it ran to its end without raising (`Outcome`).

The child (`execution_child.py`) is a fresh `python -I -S -B`: isolated from the user's environment and
site-packages, in a temporary folder of its own (its working folder, HOME and TMPDIR; removed afterwards), with
stdin empty, stdout and stderr to files there, an environment of PATH, HOME, TMPDIR and LANG only (no proxies, no
credentials), limits on CPU seconds, address space and written file size, and an audit hook that refuses sockets,
new processes, ctypes and file changes outside that folder. Where the machine lets an unprivileged process have a
network namespace of its own (`unshare -rn`), the child runs in one, without network interfaces. It starts a
session of its own, and on a timeout the whole process group is killed.

This guards the machine against accidents of generated code (a loop that never ends, a file written in the wrong
place, a stray request), not against code written to escape: an audit hook is no security boundary. Run models you
do not trust in a container or virtual machine without network."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mot_jax.evals import execution_child

CHILD = Path(execution_child.__file__)
TAIL_BYTES = 4096  # of the child's stdout and stderr read back
POLL_SECONDS = 0.005


@dataclasses.dataclass(frozen=True)
class Outcome:
    passed: bool
    result: str  # "passed", "timed out", or "failed: " and the error's last line


@functools.cache
def network_namespace() -> list[str]:
    """The command prefix that runs a program without network interfaces (`unshare -rn`), [] where this machine
    does not allow it (no util-linux, or user namespaces refused)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    try:
        probe = subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [unshare, "-rn"] if probe.returncode == 0 else []


def run_program(source: str, timeout: float) -> Outcome:
    """Run `source` as the child's program (see the module docstring); passed when it ran to its end."""
    with tempfile.TemporaryDirectory(prefix="mot_check_") as folder:
        root = Path(folder)
        (root / "program.py").write_text(source)
        env = dict(PATH=os.defpath, HOME=folder, TMPDIR=folder, LANG="C.UTF-8")
        command = [*network_namespace(), sys.executable, "-I", "-S", "-B", str(CHILD), folder, str(timeout)]
        with open(root / "stdout", "wb") as out, open(root / "stderr", "wb") as err:
            child = subprocess.Popen(
                command, cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
            )
            try:
                timed_out = not exited(child, timeout)
            finally:
                kill_group(child)
        if timed_out:
            return Outcome(False, "timed out")
        stdout, stderr = (tail(root / name) for name in ("stdout", "stderr"))
        if child.returncode == 0 and stdout.rstrip().endswith(execution_child.PASSED_MARK):
            return Outcome(True, "passed")
        lines = stderr.strip().splitlines() or [f"exit status {child.returncode}"]
        return Outcome(False, f"failed: {lines[-1]}")


def exited(child: subprocess.Popen, timeout: float) -> bool:
    """Whether the child exits within `timeout` seconds, left unreaped (its process group id cannot be reused before
    `kill_group`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(POLL_SECONDS)
    return False


def kill_group(child: subprocess.Popen) -> None:
    """Kill the child's process group (whatever it left running) and reap the child."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - TAIL_BYTES))
        return f.read().decode(errors="replace")
