"""Test set-up: 8 simulated CPU devices (set before jax is imported), offline hub, fp32 matmuls, compiled programs
released after each test module."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"  # no test may download from a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
