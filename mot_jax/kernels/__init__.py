"""A fused CPU attention kernel (`attention.cc`, an XLA FFI custom call) and its build.

XLA:CPU has no fused attention: it writes every [T, S] score array out, masks and softmaxes it in separate passes,
which on long prefills takes about twice attention's share of the FLOPs. The kernel keeps a query block's scores
in a small buffer and softmaxes them online (flash style), skipping key tiles no query of the block can see.

The kernel is compiled on first use with the machine's C++ compiler (`-march=native`) into the shared cache
(`$MOT_JAX_CACHE/kernels`, keyed by the source, the compiler and its flags, jaxlib and the CPU), under a lock and
renamed into place. Without a compiler (after one warning), or with `MOT_JAX_ATTENTION=xla`, attention runs through
XLA (`layers.attention_reference`); on other backends that path is the one lowered, and so it is in multi-process
runs (the custom call has no partitioning rule). Gradients go through it too (the kernel is forward only).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mot_jax.paths import cache_lock, cache_root

SOURCE = Path(__file__).with_name("attention.cc")
TARGET = "mot_jax_attention"
DTYPES = (jnp.float32, jnp.bfloat16)
_xla_only = False  # set by `xla_attention()`


@contextlib.contextmanager
def xla_attention():
    """Functions traced inside this block attend through XLA, not the kernel (a benchmark's side-by-side)."""
    global _xla_only
    before, _xla_only = _xla_only, True
    try:
        yield
    finally:
        _xla_only = before


def _cpu_signature() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _build(compiler: str) -> Path:
    """The compiled library for this source, compiler, jaxlib and CPU, built once into the shared cache."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC"]
    key = "\0".join([SOURCE.read_text(), version, *flags, importlib.metadata.version("jaxlib"), _cpu_signature()])
    key = hashlib.sha256(key.encode()).hexdigest()[:16]
    library = cache_root() / "kernels" / f"attention-{key}.so"
    if library.exists():
        return library
    with cache_lock(library):
        if library.exists():
            return library
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
            built = Path(scratch) / library.name
            command = [compiler, *flags, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", str(built)]
            subprocess.run(command, capture_output=True, text=True, check=True)
            os.replace(built, library)
    return library


@functools.cache
def available() -> bool:
    """Whether the fused kernel is built and registered (once a process; warns once when it cannot be)."""
    if os.environ.get("MOT_JAX_ATTENTION", "fused") == "xla":
        return False
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    try:
        if compiler is None:
            raise RuntimeError("no C++ compiler found (set CXX or install g++)")
        library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.MotAttention), platform="cpu")
    except (OSError, RuntimeError, AttributeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or e
        warnings.warn(f"mot_jax: the fused CPU attention kernel is unavailable, using XLA's ({detail})", stacklevel=2)
        return False
    return True


def supports(q, k, v, softcap) -> bool:
    """Whether `attention` can take these inputs (else the caller uses the reference path)."""
    dtype = q.dtype
    return (
        k.dtype == dtype
        and v.dtype == dtype
        and any(dtype == d for d in DTYPES)
        and k.shape[-1] == v.shape[-1] == q.shape[-1]
        and (softcap is None or softcap > 0)
        and not _xla_only
        and jax.process_count() == 1  # it has no partitioning rule: across processes XLA's collectives stay XLA's
        and available()
    )


def attention(q, k, v, q_pos, k_pos, k_valid, window, scale, *, softcap, reference):
    """`reference(q, k, v, q_pos, k_pos, k_valid, window, scale)` -> [B, T, H * d], computed by the kernel on CPU.

    q [B, T, H, d]; k, v [B, K, S, d]; q_pos [B, T]; k_pos, k_valid [B, S]; window and scale scalars (traced or not).
    """
    ints = (q_pos.astype(jnp.int32), k_pos.astype(jnp.int32), k_valid.astype(bool), jnp.asarray(window, jnp.int32))
    return _fused(
        q, k, v, *ints, jnp.asarray(scale, jnp.float32), 0.0 if softcap is None else float(softcap), reference
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _fused(q, k, v, q_pos, k_pos, k_valid, window, scale, softcap, reference):
    def kernel(*args):
        out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, v.dtype), vmap_method="sequential")(
            *args, softcap=np.float32(softcap)
        )
        return out.reshape(*q.shape[:2], -1)

    args = (q, k, v, q_pos, k_pos, k_valid, window, scale)
    return jax.lax.platform_dependent(*args, cpu=kernel, default=reference)


def _fused_fwd(q, k, v, q_pos, k_pos, k_valid, window, scale, softcap, reference):
    out = _fused(q, k, v, q_pos, k_pos, k_valid, window, scale, softcap, reference)
    return out, (q, k, v, q_pos, k_pos, k_valid, window, scale)


def _fused_bwd(softcap, reference, residuals, grad):
    q, k, v, q_pos, k_pos, k_valid, window, scale = residuals
    _, pull = jax.vjp(lambda q, k, v, scale: reference(q, k, v, q_pos, k_pos, k_valid, window, scale), q, k, v, scale)
    dq, dk, dv, dscale = pull(grad)
    return dq, dk, dv, None, None, None, None, dscale


_fused.defvjp(_fused_fwd, _fused_bwd)
