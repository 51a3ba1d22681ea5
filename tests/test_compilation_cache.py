"""The persistent compilation cache a training run uses: under the cache folder by default, JAX's own folder when
one is given (a test session's), off on request."""

import os
import subprocess
import sys

from helpers import ROOT

SHOW = "import jax; from mot_jax.paths import use_compilation_cache as use; print(use({}), jax.config.{})"


def cache_in(tmp_path, enabled: bool, **env) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"} | env
    environ["MOT_JAX_CACHE"] = str(tmp_path)
    script = SHOW.format(enabled, "jax_enable_compilation_cache")
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()


def test_compiled_programs_are_kept_under_the_cache_folder_unless_turned_off(tmp_path):
    assert cache_in(tmp_path, True) == [str(tmp_path / "xla"), "True"]
    assert cache_in(tmp_path, True, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "mine")) == [
        str(tmp_path / "mine"),
        "True",
    ]
    assert cache_in(tmp_path, False) == ["None", "False"]


def test_the_training_command_has_the_opt_out_flag():
    result = subprocess.run(
        [sys.executable, "-m", "mot_jax.train", "--helpfull"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert "--[no]compilation_cache" in result.stdout, result.stdout[-2000:]
