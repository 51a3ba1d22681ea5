"""The test session's set-up on another backend: the CPU-only XLA flags stay off it, and a flag the installed XLA does
not define is never passed (XLA aborts the process on one)."""

import os
import subprocess
import sys

from helpers import ROOT

SHOW = "import os, sys; sys.path.insert(0, 'tests'); import conftest; print(os.environ['XLA_FLAGS'])"


def session_xla_flags(platforms: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | dict(JAX_PLATFORMS=platforms)
    result = subprocess.run(
        [sys.executable, "-c", SHOW], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


def test_cpu_only_xla_flags_are_set_on_the_cpu_alone():
    import conftest

    on_cpu = session_xla_flags("cpu").split()
    assert set(on_cpu) == {conftest.CPU_DEVICES_FLAG, *conftest.CHEAP_COMPILE_FLAGS}, on_cpu
    assert session_xla_flags("cuda") == ""


def test_a_flag_the_installed_xla_lacks_is_recognised():
    import conftest

    assert all(conftest.xla_knows(flag) for flag in (conftest.CPU_DEVICES_FLAG, *conftest.CHEAP_COMPILE_FLAGS))
    assert not conftest.xla_knows("--xla_cpu_no_such_flag_in_any_release=1")
