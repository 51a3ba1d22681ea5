"""Shared caches (the corpus, chunk tables, GGUF conversions, synthetic eval sets) built by independent processes at
once: every process succeeds, each cache is built once, and it equals a build by a process alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import gguf_tiny_config, write_gguf
from hf_reference import save_tiny

PHASES = ("_read_local", "_build", "read_gguf", "examples")

# One worker: builds every cache under ROOT/cache in turn, each phase started by all workers together (a file
# barrier), each build logged to ROOT/builds.log and slowed by half a second so that the others arrive mid-build.
WORKER = r"""
import hashlib, json, os, sys, time
from pathlib import Path

root, workers = Path(sys.argv[1]), int(sys.argv[2])
os.environ["MOT_JAX_CACHE"] = str(root / "cache")
from mot_jax.evals import datasets, synthetic
from mot_jax import progress
from mot_jax.models import gguf, tiny
from mot_jax.training import chunk_table, corpus, data

progress.EVERY = 0  # a progress line at every step (stderr is a pipe, not a terminal)


def counted(module, name, counts=lambda *a, **k: True):
    original = getattr(module, name)

    def build(*args, **kwargs):
        if counts(*args, **kwargs):
            with open(root / "builds.log", "a") as log:
                log.write(f"{name} {os.getpid()}\n")
            time.sleep(0.5)
        return original(*args, **kwargs)

    setattr(module, name, build)


counted(corpus, "_read_local")
counted(chunk_table, "_build")
counted(gguf, "read_gguf")
counted(synthetic, "examples", lambda task, n, *a, **k: n > 0)  # n=0: the options check every process makes


def barrier(phase):
    (root / f"{phase}.{os.getpid()}").touch()
    while len(list(root.glob(f"{phase}.*"))) < workers:
        time.sleep(0.02)


digest = lambda text: hashlib.sha256(text.encode()).hexdigest()
out = {}
barrier("corpus")
docs = corpus.documents(sys.argv[3])
out["corpus"] = digest("\0".join([*docs["train"], "\1", *docs["validation"]]))
barrier("chunks")
chunks = chunk_table.TextChunks(docs["train"], tiny.tokenizer(97), eos_id=0, total_tokens=16, prefix_tokens=8)
out["chunks"] = digest(chunks.chunks.tobytes().hex())
barrier("gguf")
_, _, cache_dir = gguf.convert(Path(sys.argv[4]), load=False)
out["gguf"] = json.loads((cache_dir / "manifest.json").read_text())["sha256"]
barrier("synthetic")
out["synthetic"] = digest(json.dumps(datasets.synthetic_set("extractive_qa", 4, seed=0)))
print(json.dumps(out))
"""


@pytest.mark.slow  # three processes that each import JAX and TFDS
def test_concurrent_processes_build_each_shared_cache_once(tmp_path):
    source = tmp_path / "corpus"
    source.mkdir()
    for i in range(12):
        (source / f"{i:02d}.txt").write_text(f"Document {i} tells of ships, lighthouses and harbours. " * (10 + i))
    gguf_file = tmp_path / "tiny.gguf"
    write_gguf(gguf_file, save_tiny(gguf_tiny_config("llama"), tmp_path / "hf"), "llama")
    (tmp_path / "worker.py").write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k != "MOT_JAX_CACHE"} | {"JAX_PLATFORMS": "cpu"}

    def start(root: Path, workers: int):
        root.mkdir(exist_ok=True)
        args = [sys.executable, str(tmp_path / "worker.py"), str(root), str(workers), str(source), str(gguf_file)]
        return subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    shared = [start(tmp_path / "shared", 2) for _ in range(2)]
    alone = start(tmp_path / "alone", 1)
    results = []
    for process in [*shared, alone]:
        stdout, stderr = process.communicate(timeout=600)
        assert process.returncode == 0 and "Traceback" not in stderr, stderr
        results.append((json.loads(stdout.strip().splitlines()[-1]), stderr))

    assert results[0][0] == results[1][0] == results[2][0]  # both shared runs read what a lone build makes
    builds = (tmp_path / "shared" / "builds.log").read_text().split()[::2]
    assert sorted(builds) == sorted(PHASES), builds  # each cache built once, by one of the two processes
    # progress of each long build, as tqdm's meter lines (stderr is not a terminal)
    for line in ("Reading the corpus: 100%", "Tokenizing the chunk table: 100%", "De-quantizing tiny.gguf: 100%"):
        assert line in results[2][1], results[2][1]


def test_long_cache_builds_report_progress_when_stderr_is_not_a_terminal(tmp_path, monkeypatch, capsys):
    from mot_jax import progress
    from mot_jax.models import tiny
    from mot_jax.training import chunk_table

    monkeypatch.setattr(progress, "EVERY", 0.0)
    texts = [f"Document {i} tells of ships, lighthouses and harbours." * 3 for i in range(5)]
    tokenizer = tiny.tokenizer(97)
    chunk_table.TextChunks(
        texts,
        tokenizer,
        eos_id=0,
        total_tokens=16,
        prefix_tokens=8,
        cache_dir=tmp_path,
        source_tokenizer=tokenizer.__class__.from_str(tokenizer.to_str()),
        source_length=64,
    )
    stderr = capsys.readouterr().err
    assert "Tokenizing the chunk table: 100%|" in stderr and "5/5" in stderr, stderr
    assert "Source lengths of the chunks: 100%|" in stderr, stderr
