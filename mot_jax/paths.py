"""Where things live on disk: the shared cache (GGUF conversions, datasets, chunk tables) and workdir paths."""

from __future__ import annotations

import os
from pathlib import Path

from etils import epath

from mot_jax.locks import file_lock


def cache_root() -> Path:
    """`$MOT_JAX_CACHE`, default `~/.cache/mot_jax`."""
    return Path(os.environ.get("MOT_JAX_CACHE") or Path.home() / ".cache" / "mot_jax").expanduser()


def cache_lock(entry):
    """The lock that serialises building one shared-cache entry (a file or folder) among any number of processes,
    on any hosts sharing the disk: the first builds it (to a temporary name, then renamed), the others wait and then
    find it complete. Each entry has its own lock, so unrelated caches do not wait on each other."""
    entry = Path(entry)
    return file_lock(entry.parent / f".{entry.name}.lock")


def as_path(workdir) -> epath.Path:
    """A local or cloud (gs://) directory path."""
    path = epath.Path(workdir)
    return path if "://" in str(workdir) else epath.Path(Path(workdir).absolute())


def use_compilation_cache(enabled: bool = True) -> Path | None:
    """JAX's persistent compilation cache in `cache_root()/xla`: a second run loads its compiled steps from there
    instead of compiling them again. A folder JAX was already given (`JAX_COMPILATION_CACHE_DIR`, as a test session
    sets) stays; `enabled=False` turns the cache off. Returns the folder in use (None when off)."""
    import jax  # here: importing jax is slow, and most of this module's users need no JAX

    if not enabled:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(cache_root() / "xla"))
    return Path(jax.config.jax_compilation_cache_dir)
