"""The child side of `execution.run_program`, run as a script (`python -I -S -B THIS ROOT TIMEOUT`) in a fresh
interpreter whose working folder is ROOT (a temporary folder): it limits its own resources, installs an audit hook
that refuses sockets, new processes, native code (ctypes) and file changes outside ROOT, then runs ROOT/program.py
and, only if that raises nothing (SystemExit included), writes PASSED_MARK as stdout's last line.

Standard library only: it runs isolated (-I) without site-packages (-S). The hook guards against accidents of
generated code, not hostile code: CPython's audit hooks are no security boundary (see docs/evaluation.md)."""

import os
import resource
import sys

PASSED_MARK = "mot_jax: program passed"
MEMORY_BYTES = 4 * 2**30  # address space; a test that allocates more fails instead of swapping the machine
FILE_BYTES = 2**20  # largest file the program may write (its stdout and stderr are files too)

DENIED = (
    "socket.__new__",
    "socket.connect",
    "socket.bind",
    "socket.getaddrinfo",
    "socket.gethostbyname",
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "os.kill",
    "os.killpg",
    "ctypes.dlopen",
    "ctypes.dlsym",
    "ctypes.cdata",
)
PATH_EVENTS = {  # event -> (the positions of its path arguments, those of its dir_fd arguments)
    "os.remove": ((0,), (1,)),
    "os.rmdir": ((0,), (1,)),
    "os.mkdir": ((0,), (2,)),
    "os.rename": ((0, 1), (2, 3)),
    "os.chmod": ((0,), (2,)),
    "os.chown": ((0,), (3,)),
    "os.link": ((0, 1), (2, 3)),
    "os.symlink": ((0, 1), (2,)),
    "os.truncate": ((0,), ()),
    "os.utime": ((0,), (3,)),
    "os.setxattr": ((0,), ()),
    "os.removexattr": ((0,), ()),
    "shutil.rmtree": ((0,), (1,)),
}
WRITING_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def main(root: str, timeout: float) -> None:
    root = os.path.realpath(root)
    seconds = int(timeout) + 1
    for limit, value in (
        (resource.RLIMIT_CPU, seconds),
        (resource.RLIMIT_AS, MEMORY_BYTES),
        (resource.RLIMIT_FSIZE, FILE_BYTES),
        (resource.RLIMIT_CORE, 0),
    ):
        _, hard = resource.getrlimit(limit)
        resource.setrlimit(limit, (value if hard == resource.RLIM_INFINITY else min(value, hard), hard))
    with open(os.path.join(root, "program.py")) as f:
        code = compile(f.read(), "program.py", "exec")
    stdout = os.dup(1)  # where the mark goes, whatever the program does with sys.stdout

    def inside(path) -> bool:
        real = os.path.realpath(os.fsdecode(path))
        return os.path.commonpath([real, root]) == root

    def hook(event, args):
        if event in DENIED:
            raise PermissionError(f"{event} is not allowed while checking a completion")
        if event == "open":
            path, mode, flags = args
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & WRITING_FLAGS)
            # an int path wraps a descriptor already open (and checked when it was opened)
            if writes and not isinstance(path, int) and not inside(path):
                raise PermissionError(f"writing {path!r} outside the check's folder is not allowed")
        elif event in PATH_EVENTS:
            paths, folders = PATH_EVENTS[event]
            # a descriptor (of a file or of a folder paths are relative to) may point anywhere: refused
            if any(isinstance(args[i], int) or not inside(args[i]) for i in paths) or any(
                i < len(args) and args[i] not in (None, -1) for i in folders
            ):
                raise PermissionError(f"{event} outside the check's folder is not allowed")

    sys.addaudithook(hook)
    try:
        exec(code, {"__name__": "__main__"})
    except BaseException as e:  # noqa: BLE001 - SystemExit too: a program that exits early has not passed
        print(f"{type(e).__name__}: {e}"[:500], file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    os.write(stdout, f"\n{PASSED_MARK}\n".encode())
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
