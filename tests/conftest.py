"""Test set-up: 8 simulated CPU devices and cheaper XLA compiles, offline hub, fp32
matmuls, a persistent compilation cache for the session, compiled programs released after each test module."""

import atexit
import functools
import glob
import mmap
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # JAX_PLATFORMS=cuda runs the suite on a GPU
ON_CPU = os.environ["JAX_PLATFORMS"] == "cpu"
# On the CPU: 8 simulated devices (the sharded tests), and cheaper compiles: the tests spend most of their time
# compiling small programs, and LLVM's -O0 codegen without its expensive passes halves that (the multi-process tests
# train this way too), and one LLVM module per program instead of one per core saves more (the two test processes keep
# the cores busy already; the machine code is the same). XLA's HLO optimizations stay as users get them: the same fused
# programs, their results equal to rounding (~1e-7). XLA_FLAGS naming one of these flags keeps its value, e.g.
# --xla_backend_optimization_level=2 for the default codegen. One-device programs also skip XLA's MLIR fusion emitters
# (below, after jax is imported).
CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
CHEAP_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_parallel_codegen_split_count=1",
)


@functools.cache
def xla_libraries() -> list:
    """The installed jaxlib's XLA libraries (its large shared objects), mapped read-only."""
    import jaxlib  # not jax: its backend must start after XLA_FLAGS is set

    libraries = []
    for path in glob.glob(os.path.join(os.path.dirname(jaxlib.__file__), "**", "*.so"), recursive=True):
        if os.path.getsize(path) > 50 << 20:
            with open(path, "rb") as f:
                libraries.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    return libraries


def xla_knows(flag: str) -> bool:
    """Whether the installed XLA defines `flag`: XLA aborts the process on an unknown flag in XLA_FLAGS, a release may
    drop one, and each flag it defines is a string in its libraries (~1 s to scan). Unsure (none found): yes."""
    name = flag.lstrip("-").split("=")[0].encode()
    return not xla_libraries() or any(library.find(name) >= 0 for library in xla_libraries())


os.environ.setdefault("XLA_FLAGS", "")
if ON_CPU:
    for flag in (CPU_DEVICES_FLAG, *CHEAP_COMPILE_FLAGS):
        if flag.split("=")[0] not in os.environ["XLA_FLAGS"] and xla_knows(flag):
            os.environ["XLA_FLAGS"] += " " + flag
os.environ["HF_HUB_OFFLINE"] = "1"  # no test may download from a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One persistent compilation cache for the session, shared with the commands the tests start: every tiny training
# run builds a new Trainer (new jitted functions) and recompiled the same programs (~40 s of each run on a 2-core CPU);
# a hit loads the same XLA executable. A fresh folder per session (unless one is given), so nothing outlives the run.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="mot_jax_tests_xla_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# No size limit (JAX's default, so no JAX_COMPILATION_CACHE_MAX_SIZE): with one, every write rescans the whole folder to
# evict (quadratic in the programs of a session) while holding a lock the other test processes wait on; the folder is
# the session's own. Without the lock, an entry read while another process writes it fails to decompress (a truncated
# stream), and JAX warns and compiles it again.

import jax  # noqa: E402

# float32 matmuls in float32 on every backend (a GPU's default TF32 rounds to ~1e-3): the tests compare with references
jax.config.update("jax_default_matmul_precision", "highest")


def _single_device_programs_use_elemental_emitters():
    """Compile every one-device program with XLA's elemental CPU emitter instead of its MLIR fusion emitters, which
    halves the compile time that dominates these tests. Programs over several devices keep the fusion emitters: with
    the elemental emitter their collectives sometimes wait on each other in different orders (rendezvous.cc: devices
    in different collectives) and XLA aborts the process. A one-device program has no collectives.

    JAX has no public way to do this: XLA_FLAGS (--xla_cpu_use_fusion_emitters=false) sets it for every program,
    multi-device ones included, and `jax.jit(..., compiler_options=...)` for one function at a time, while the choice
    here depends on each program's device count. So this wraps JAX's private `get_compile_options`; where a JAX
    release no longer has it, the tests compile with the fusion emitters (slower, the same results)."""
    from jax._src import compiler

    get_compile_options = getattr(compiler, "get_compile_options", None)
    if get_compile_options is None:
        return

    def compile_options(num_replicas, num_partitions, *args, env_options_overrides=None, **kwargs):
        if num_replicas * num_partitions == 1:
            env_options_overrides = {"xla_cpu_use_fusion_emitters": False, **(env_options_overrides or {})}
        kwargs["env_options_overrides"] = env_options_overrides
        return get_compile_options(num_replicas, num_partitions, *args, **kwargs)

    compiler.get_compile_options = compile_options


# A CPU compile option: another backend (JAX_PLATFORMS=cuda, to run the tests on a GPU) refuses it by name.
FUSION_EMITTERS = "xla_cpu_use_fusion_emitters"
if ON_CPU and FUSION_EMITTERS not in os.environ["XLA_FLAGS"] and xla_knows(FUSION_EMITTERS):
    _single_device_programs_use_elemental_emitters()


import gc  # noqa: E402

import pytest  # noqa: E402


def pytest_runtest_setup(item):
    """`@pytest.mark.devices(n)`: a test that needs n devices is skipped, with the reason, on a backend with fewer."""
    for mark in item.iter_markers("devices"):
        if jax.device_count() < mark.args[0]:
            pytest.skip(f"needs {mark.args[0]} devices, {jax.default_backend()} has {jax.device_count()}")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop each test module's compiled programs when it ends: XLA's CPU executables hold memory mappings, and a
    whole suite in one process would otherwise pass the kernel's limit (vm.max_map_count, 65530) and crash XLA."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """`configs/quickstart.py:replay,tiny` trained for 2 steps (validated and checkpointed at step 2), once per session:
    (workdir, summary). The tests that need a finished tiny run read it (training, export, evaluation); a test that
    changes it works on a copy (shutil.copytree)."""
    import fcntl
    import json

    from helpers import load_config

    from mot_jax.training import loop

    # Under pytest-xdist every worker is its own session: the first to ask trains in the folder the workers share,
    # the others wait for it (a file lock) and read the same run.
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    workdir, done = root / "tiny_run" / "run", root / "tiny_run" / "done.json"
    workdir.parent.mkdir(exist_ok=True)
    with open(root / "tiny_run.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            done.write_text(json.dumps(loop.train_and_evaluate(load_config(steps=2), workdir)))
    return workdir, json.loads(done.read_text())


@pytest.fixture(scope="module")
def random_pair():
    """The tiny random llama source and gemma3 target (mot_jax.models.tiny) and their tokenizers:
    (source, target, source tokenizer, target tokenizer)."""
    from mot_jax.models import tiny

    source, _, source_tok = tiny.load("random:llama")
    target, _, target_tok = tiny.load("random:gemma3")
    return source, target, source_tok, target_tok


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """A 3-layer Qwen2 source and a 3-layer Gemma-3 target with the same (tiny) vocabulary, each saved by
    transformers and loaded by mot_jax, and the target's transformers model: (source, target, target reference)."""
    from hf_reference import CONFIGS, save_tiny

    from mot_jax.models.loading import load_model

    models = []
    for family, name in [("qwen2", "untied_sliding"), ("gemma3", "sliding_softcap")]:
        path = tmp_path_factory.mktemp(family)
        reference = save_tiny(CONFIGS[family][name](), path)
        models.append(load_model(str(path))[0])
    return (*models, reference)
