"""`python -m mot_jax.bench`: the whole page end to end on tiny models (--quick), bad input, the goal notes."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mot_jax.bench import common, page, train

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = (
    "## Model prefill and decode: mot_jax against transformers",
    "### Random-init shapes",
    "### The offline pair",
    "## Mixture: sparse dispatch against the dense (reference) path",
    "## Alignment: vectorised against the per-token reference",
    "## Time to first token: native, replay and direct",
    "## Training step: configs/smollm2_gemma3.py",
    "## Feature cache: K/V-space training steps, configs/smollm2_gemma3.py",
)
NUMBER = re.compile(r"^-?\d+(\.\d+)?(e[+-]?\d+)?[x%]?$")


def run_bench(*args, timeout=1200):  # the quick page takes ~340 s alone on 2 cores, more beside another test
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, "-m", "mot_jax.bench", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def tables(text: str) -> list[list[list[str]]]:
    """Each Markdown table of a page as its data rows (header and separator dropped), rows as lists of cells."""
    found, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif current:
            found.append(current[2:])
            current = []
    return found


@pytest.mark.slow
def test_quick_page(tmp_path):
    out = tmp_path / "BENCH.md"
    result = run_bench("--quick", f"--out={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    text = out.read_text()
    for heading in SECTIONS:
        assert heading in text.splitlines(), heading
    assert "- Command: `python -m mot_jax.bench --quick --out=" in text
    assert re.search(r"^- Machine: .+, \d+ cores.*; jax backend \w+", text, re.M)
    assert re.search(r"^- Versions: jax [\d.]+, jaxlib [\d.]+, flax [\d.]+, torch .+, transformers ", text, re.M)
    found = tables(text)
    assert len(found) == 8  # models: 2 prefill + 1 decode; mixture, align, ttft, train, features
    for rows in found:
        assert rows, "a table without data rows"
        for row in rows:
            numbers = [float(cell.rstrip("x%")) for cell in row if NUMBER.match(cell)]
            assert numbers and all(math.isfinite(n) for n in numbers), row
            assert not any(cell.lower() in ("nan", "inf", "-inf") for cell in row), row
    assert "Goal (N = 8, k = 1 sparse at least 3x faster than dense): **" in text
    assert "Goal (at least 50x when the ids are re-encodable): **" in text
    assert f"]({page.PLOT})" in text
    assert (tmp_path / page.PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")]  # no temporary file left
    for heading in ("## Mixture", "## Time to first token"):  # the sections are printed as they finish
        assert heading in result.stdout


def test_bad_part_is_one_line():
    result = run_bench("modles", timeout=120)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "unknown part 'modles'" in lines[0] and "models" in lines[0]


@pytest.mark.parametrize(
    "value, threshold, higher, expected",
    [
        (0.34, 0.5, False, "Goal (g): **met, 0.34**."),
        (0.58, 0.5, False, "Goal (g): **not met, 0.58**."),
        (0.5, 0.5, False, "Goal (g): **met, 0.50**."),
        (2.43, 3.0, True, "Goal (g): **not met, 2.43**."),
        (390.0, 50, True, "Goal (g): **met, 390.00**."),
    ],
)
def test_goal_note(value, threshold, higher, expected):
    assert common.goal_note("g", value, threshold, higher) == expected


def test_helpers():
    assert common.goal_note("g", 2.4, 3, True, "{:.1f}x") == "Goal (g): **not met, 2.4x**."
    assert common.span([1.06, 2.02, 1.4]) == "1.06x-2.02x" and common.span([2.0, 2.001]) == "2.00x"
    assert [common.ms(s) for s in (2.6843, 0.0123, 0.0004)] == ["2684", "12.3", "0.400"]
    assert train.peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and train.peak_flops("TPU v5 lite") == 197e12
    assert train.peak_flops("cpu") is None
    table = common.Table(("model", "ms", "speed-up"), [("gpt2", "12", "1.50x")])
    assert table.markdown() == "| model | ms | speed-up |\n| --- | ---: | ---: |\n| gpt2 | 12 | 1.50x |"


def test_matmul_flops_counts_scan_trips():
    import jax
    import jax.numpy as jnp

    def f(x, w):
        return jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=5)[0]

    x = jnp.ones((4, 8))
    w = jnp.ones((8, 8))
    jaxpr = jax.jit(f).trace(x, w).jaxpr.jaxpr
    assert train.matmul_flops(jaxpr) == 5 * 2 * 4 * 8 * 8
