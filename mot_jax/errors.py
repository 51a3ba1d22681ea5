"""The one exception type that entry points turn into a clear message and a non-zero exit."""


class MotJaxError(Exception):
    """Bad input from the user: the message names the problem and the fix in one sentence."""


def cause(e: Exception) -> str:
    """The first line of an exception's message (its type name when it has none), to quote inside one sentence."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def root_cause(e: BaseException) -> BaseException:
    """The innermost exception `e` was raised from or while handling: what a wrapper's message only points at
    (Orbax's "error while reading array index ... See full TensorStore details: <bound method ...>" over
    TensorStore's "OUT_OF_RANGE: ... byte range ... is not valid for value of size 1000")."""
    seen = {id(e)}
    while (inner := e.__cause__ or e.__context__) is not None and id(inner) not in seen:
        e = inner
        seen.add(id(e))
    return e


class Interrupted(MotJaxError):
    """Work stopped by Ctrl-C or SIGTERM (`stopped`, the KeyboardInterrupt), said in one line with what was kept; the
    exit status is the shell's for that signal."""

    def __init__(self, message: str, stopped: KeyboardInterrupt):
        terminated = isinstance(stopped, Terminated)
        super().__init__(f"{'terminated (SIGTERM)' if terminated else 'interrupted'} {message}")
        self.exit_status = 143 if terminated else 130


class Terminated(KeyboardInterrupt):
    """SIGTERM (what SLURM and TPU preemption send), raised like Ctrl-C's KeyboardInterrupt so that work stops the
    same way: checkpointed, said in one line (mot_jax.cli.run_or_exit)."""
