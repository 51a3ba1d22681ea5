"""CPU kernels (XLA FFI custom calls) and their build: fused attention (`attention.cc`) and a single row times a
bfloat16 matrix (`rows.cc`).

XLA:CPU has no fused attention: it writes every [T, S] score array out, masks and softmaxes it in separate passes,
which on long prefills takes about twice attention's share of the FLOPs. The kernel keeps a query block's scores
in a small buffer and softmaxes them online (flash style), skipping key tiles no query of the block can see.

Decoding multiplies one row per sequence by every weight. XLA:CPU's bf16 kernel repacks the whole matrix for such a
product; `rows.cc` streams the matrix once as stored (prefetched ahead), widening bf16 to float32 in registers.

The kernels are compiled on first use with the machine's C++ compiler (`-march=native`) into the shared cache
(`$MOT_JAX_CACHE/kernels`, keyed by the sources, the compiler and its flags, jaxlib and the CPU), under a lock and
renamed into place, its size and sha256 recorded beside it and checked before each load (a damaged one is
rebuilt). Without a compiler (after one warning) XLA's paths run; `MOT_JAX_ATTENTION=xla` chooses XLA's
attention (`layers.attention_reference`). On other backends XLA's paths are the ones lowered, and so they are in
multi-process runs (the custom calls have no partitioning rule). Gradients go through XLA's paths (the kernels are
forward only).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib.metadata
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mot_jax.errors import MotJaxError, cause
from mot_jax.files import atomic_file, remove_leftovers, sha256_of
from mot_jax.paths import cache_lock, cache_root

SOURCES = [Path(__file__).with_name(name) for name in ("common.h", "attention.cc", "rows.cc")]
TARGET = "mot_jax_attention"
ROWS_TARGET = "mot_jax_rows"
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
    """The compiled library for these sources, compiler, jaxlib and CPU, built once into the shared cache. Its size
    and sha256 are recorded beside it (`.so.sha256`) and checked before it is returned: a library cut short (a full
    disk, a killed copy) would crash the process that loads it (SIGBUS), so a damaged one is built again."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC"]
    texts = [source.read_text() for source in SOURCES]
    key = "\0".join([*texts, version, *flags, importlib.metadata.version("jaxlib"), _cpu_signature()])
    key = hashlib.sha256(key.encode()).hexdigest()[:16]
    library = cache_root() / "kernels" / f"kernels-{key}.so"
    if _damage(library) is None:
        return library
    with cache_lock(library):
        damage = _damage(library)
        if damage is None:
            return library
        if library.exists() and _record(library).exists():  # neither a first build nor one from before the records
            warnings.warn(f"mot_jax: the cached CPU kernel library {library} {damage}; building it again", stacklevel=3)
        for entry in (library, _record(library)):
            remove_leftovers(entry)  # a killed build's
        with atomic_file(library) as built:
            sources = [str(source) for source in SOURCES if source.suffix == ".cc"]
            command = [compiler, *flags, "-I", jax.ffi.include_dir(), *sources, "-o", str(built)]
            subprocess.run(command, capture_output=True, text=True, check=True)
            with atomic_file(_record(library)) as record:  # first the record, then the library it describes
                record.write_text(f"{built.stat().st_size} {sha256_of(built)}\n")
    return library


def _record(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _damage(library: Path) -> str | None:
    """None when `library` is whole (its size and sha256 those recorded beside it), else what is wrong with it."""
    if not library.exists():
        return "is missing"
    try:
        size, digest = _record(library).read_text().split()
    except (OSError, ValueError):
        return "has no readable record of its size and hash"
    if library.stat().st_size != int(size):
        return f"is damaged ({library.stat().st_size} bytes, {size} recorded)"
    if sha256_of(library) != digest:
        return "is damaged (its sha256 differs from the one recorded)"
    return None


@functools.cache
def available() -> bool:
    """Whether the kernels are built and registered (once a process; warns once when they cannot be)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    try:
        if compiler is None:
            raise RuntimeError("no C++ compiler found (set CXX or install g++)")
        library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.MotAttention), platform="cpu")
        jax.ffi.register_ffi_target(ROWS_TARGET, jax.ffi.pycapsule(library.MotRows), platform="cpu")
    except (OSError, RuntimeError, AttributeError, subprocess.CalledProcessError) as e:
        warnings.warn(f"mot_jax: the CPU kernels are unavailable, using XLA's paths: {_reason(e)}", stacklevel=2)
        return False
    return True


def _reason(e: Exception) -> str:
    """Why the kernels could not be had, in one line: a failed compile's first error line (its cause, e.g. a full
    disk), its whole output saved to a log file the line names."""
    output = getattr(e, "stderr", None)
    if not output:
        return cause(e)
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    first = next((line for line in lines if re.search(r"\b(error|failed)\b", line, re.IGNORECASE)), lines[-1])
    try:
        fd, log = tempfile.mkstemp(prefix="mot_jax_kernels_build_", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(f"{shlex.join(e.cmd)}\n\n{output}")
        where = f"the compiler's full output is in {log}"
    except OSError as log_error:
        where = f"its full output could not be saved ({cause(log_error)})"
    return f"{first} ({where})"


ATTENTION_CHOICES = ("fused", "xla")  # MOT_JAX_ATTENTION: the kernel where it applies (default), or XLA's always


def attention_choice() -> str:
    """MOT_JAX_ATTENTION, refused in one line when it names no choice (rather than taken as the default)."""
    choice = os.environ.get("MOT_JAX_ATTENTION", "fused")
    if choice not in ATTENTION_CHOICES:
        raise MotJaxError(
            f"MOT_JAX_ATTENTION={choice!r} is not one of {', '.join(ATTENTION_CHOICES)}; unset it (the kernel) or "
            "set MOT_JAX_ATTENTION=xla (XLA's attention)."
        )
    return choice


def supports(q, k, v, softcap) -> bool:
    """Whether `attention` can take these inputs (else the caller uses the reference path)."""
    dtype, choice = q.dtype, attention_choice()
    return (
        k.dtype == dtype
        and v.dtype == dtype
        and any(dtype == d for d in DTYPES)
        and k.shape[-1] == v.shape[-1] == q.shape[-1]
        and (softcap is None or softcap > 0)
        and not _xla_only
        and choice != "xla"
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


def rows_supported(x, w) -> bool:
    """Whether `row_product` can take these operands (else the caller runs XLA's product)."""
    both_bf16 = x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16
    return both_bf16 and x.ndim == w.ndim == 2 and jax.process_count() == 1 and available()


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def row_product(x, w, transposed):
    """x [M, K] @ w [K, N] (or @ w.T for w [N, K] when `transposed`) in float32 sums: [M, N] float32, by the kernel
    on CPU. Meant for a single row (decoding one sequence): by 8 rows XLA's own kernel is the faster."""
    n = w.shape[0] if transposed else w.shape[1]

    def kernel(x, w):
        out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
        return jax.ffi.ffi_call(ROWS_TARGET, out, vmap_method="sequential")(x, w, transposed=transposed)

    return jax.lax.platform_dependent(x, w, cpu=kernel, default=functools.partial(_xla_row_product, transposed))


def _xla_row_product(transposed, x, w):
    spec = "mk,nk->mn" if transposed else "mk,kn->mn"
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)


def _row_product_fwd(x, w, transposed):
    return row_product(x, w, transposed), (x, w)


def _row_product_bwd(transposed, residuals, grad):
    return jax.vjp(functools.partial(_xla_row_product, transposed), *residuals)[1](grad)


row_product.defvjp(_row_product_fwd, _row_product_bwd)
