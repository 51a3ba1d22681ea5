"""Test set-up: 8 simulated CPU devices and cheaper XLA compiles (set before jax is imported), offline hub, fp32
matmuls, compiled programs released after each test module."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
# Cheaper compiles: the tests spend most of their time compiling small programs. LLVM's -O0 codegen without its
# expensive passes, and XLA's elemental emitters for fused loops in place of the MLIR ones, each halve that (the
# multi-process tests train this way too). XLA's HLO optimizations stay as users get them: the same fused programs,
# their results equal to rounding (~1e-7). XLA_FLAGS naming a flag keeps its value, e.g.
# --xla_backend_optimization_level=2 for the default codegen. No persistent compilation cache: an executable built
# with the elemental emitters aborts the process when loaded back from one (and the suite ran faster without it).
CHEAP_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
)
for flag in CHEAP_COMPILE_FLAGS:
    if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + flag
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"  # no test may download from a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # also in the commands the tests start (see above)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import gc  # noqa: E402

import pytest  # noqa: E402


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

    from test_train_run import load_config

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
