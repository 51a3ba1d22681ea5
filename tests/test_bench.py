"""`python -m mot_jax.bench`: the whole page end to end on tiny models (--quick), bad input, the goal notes."""

import math
import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT, TINY_MODEL_CONFIG, one_device_command_env

from mot_jax.bench import common, page, train, ttft

SECTIONS = (
    "## Model prefill and decode: mot_jax against transformers",
    "### Random-init shapes",
    "### The offline pair",
    "## Mixture: sparse dispatch against the dense (reference) path",
    "## Alignment: vectorised against the per-token reference",
    "## Time to first token: every method",
    "## Training step: configs/smollm2_gemma3.py",
    "## Feature cache: K/V-space training steps, configs/smollm2_gemma3.py",
    "## Evaluation rate against its compute bound",
)
NUMBER = re.compile(r"^-?\d+(\.\d+)?(e[+-]?\d+)?[x%]?$")


def run_bench(*args, timeout=1200):  # the quick page takes ~340 s alone on 2 cores, more beside another test
    # every --quick part runs on one device (its tiny configs' mesh, or none): compiled as the suite's commands
    env = dict(one_device_command_env(), PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
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
    assert len(found) == 10  # models: 2 prefill + 1 decode; mixture, align, ttft (2), train, features, eval
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
    ttft_rows = [row[0] for row in found[5]]  # every method, side by side
    assert ttft_rows[:3] == ["native", "text_relay", "MoT replay"] and "MoT replay, dense attention" in ttft_rows
    for name in (
        "MoT direct",
        "linear translator (direct), B=2",
        "C2C-Project (replay)",
        "C2C",
        "LSC",
        "MoT-h",
        "Interlat",
    ):
        assert name in ttft_rows, name
    assert sum(name.startswith("KVComm (") for name in ttft_rows) == 2  # Gemma-3 -> Gemma-3 and Llama -> Llama
    for heading in ("## Mixture", "## Time to first token"):  # the sections are printed as they finish
        assert heading in result.stdout


@pytest.mark.parametrize(
    "args, said",
    [
        (["modles"], ["unknown part 'modles'", "models"]),
        (["ttft", "--recompute=0.1"], ["--recompute", "--workdirs"]),
        (["train", "--train_step=8,0,2048"], ["--train_step takes three whole numbers", "'8,0,2048'"]),
        (["train", "--train_variants=replay"], ["--train_variants takes some of replay-sparse", "'replay'"]),
    ],
)
def test_bad_arguments_are_one_line(args, said):
    result = run_bench(*args, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert all(part in lines[0] for part in said), lines[0]


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


def test_ttft_tables_ratios_to_each_targets_native():
    def row(method, source, target, tokens, ttft_s, with_source_s):
        stages = dict(source_prefill=with_source_s - ttft_s, answer=ttft_s)
        return dict(
            method=method,
            source=source,
            target=target,
            context_tokens=tokens,
            ttft_s=ttft_s,
            ttft_with_source_s=with_source_s,
            stages=stages,
            handed_bytes=2**20,
            target_kv_bytes=3 * 2**20,
        )

    rows = [
        row("native", "s", "t", 128, 0.2, 0.2),
        row("MoT direct", "s", "t", 128, 0.1, 0.3),
        row("native", "s", "t", 2048, 4.0, 4.0),
        row("MoT direct", "s", "t", 2048, 2.0, 5.0),
        row("native", "s", "s", 128, 0.4, 0.4),
        row("KVComm (2 of 4 layers)", "s", "s", 128, 0.1, 0.5),
        row("native", "s", "s", 2048, 8.0, 8.0),
        row("KVComm (2 of 4 layers)", "s", "s", 2048, 1.0, 9.0),
    ]
    (detail, _, every), ratios = ttft.ttft_tables(rows)
    assert [r[:6] for r in detail.rows] == [
        ("native", "t", "4000", "1.00", "4000", "1.00"),
        ("MoT direct", "s -> t", "2000", "0.50", "5000", "1.25"),
        ("native", "s", "8000", "1.00", "8000", "1.00"),
        ("KVComm (2 of 4 layers)", "s -> s", "1000", "0.12", "9000", "1.12"),
    ]
    assert detail.rows[1][6:] == ("source_prefill 3000, answer 2000", "1.00", "3.00")
    assert every.header[2:5] == ["128: TTFT (ms)", "128: / native", "128: incl. source / native"]
    assert every.rows[1] == ["MoT direct", "s -> t", "100", "0.50", "1.50", "2000", "0.50", "1.25"]
    assert ratios["KVComm (2 of 4 layers)", "s"] == [0.25, 0.125]


def test_ttft_only_times_native_and_the_methods_it_names():
    import dataclasses

    from mot_jax.errors import MotJaxError

    plan = dataclasses.replace(common.QUICK, only=("linear",))
    (group,), _ = ttft.groups(plan)  # no KVComm group: "linear" does not name it
    assert [m.name for m in group.methods] == ["native", "linear translator (direct), B=2"]
    (main, *kvcomm), _ = ttft.groups(dataclasses.replace(plan, only=("KVComm", "relay")))
    assert [m.name for m in main.methods] == ["native", "text_relay"] and kvcomm
    with pytest.raises(MotJaxError, match="--only linaer names no method"):
        ttft.groups(dataclasses.replace(plan, only=("linaer",)))


def test_ttft_of_trained_translators_times_the_source_alone_and_refuses_recomputing_a_replay(tiny_run):
    import dataclasses

    from mot_jax.errors import MotJaxError

    plan = dataclasses.replace(common.QUICK, workdirs=(str(tiny_run[0]),), only=("MoT",))
    (group,), _ = ttft.groups(plan)
    assert [m.name for m in group.methods] == ["native", "source alone", "MoT replay"]
    with pytest.raises(MotJaxError, match="none of these translators is direct"):
        ttft.groups(dataclasses.replace(plan, recompute=(0.0, 0.1)))


def test_models_table_reports_gflops_against_the_matmul_rate():
    """`bench models`' prefill table: each side's GFLOP/s (closed-form FLOPs over its time) and share of the matmul
    rate in the row's dtype; the FLOPs by hand on a tiny config."""
    from mot_jax.bench import flops, models

    cfg = TINY_MODEL_CONFIG
    # 3 tokens: per token and layer q 8x8, k and v 8x4, o 8x8, gate/up/down 8x16 (2 x 576 multiply-adds); causal
    # attention over 1 + 2 + 3 keys, QK and PV, 2 heads of 4; the last position's logits 8 x 32
    one = 2 * 3 * 2 * (64 + 64 + 64 + 384) + 2 * 4 * 2 * 4 * (1 + 2 + 3) + 2 * 8 * 32
    assert flops.prefill_flops(cfg, 3) == one == 7808 and flops.prefill_flops(cfg, 3, batch=2) == 2 * one
    rows = [
        ("m", "float32", 2048, 1, 0.5, 1.0, 3.0, 40e9, 0.75),  # mot_jax 80 GFLOP/s, transformers 40
        ("m", "bfloat16", 128, 8, 2.0, 1.0, 1.0, 10e9, None),
    ]
    rates = {"float32": 100e9, "bfloat16": 50e9}
    table = models.prefill_table(rows, rates)
    assert table.header[6:11] == (
        "speed-up",
        "mot_jax GFLOP/s",
        "transformers GFLOP/s",
        "mot_jax / matmul rate",
        "transformers / matmul rate",
    )
    assert table.rows[0][6:] == ("2.00x", "80.0", "40.0", "80%", "40%", "3.0", "750", "1.50x")
    assert table.rows[1][6:] == ("0.50x", "5.0", "10.0", "10%", "20%", "1.0", "n/a", "n/a")
    assert models.shares(rows, rates, 2048) == [0.8] and models.speedups(rows, "bfloat16") == [0.5]
    assert models.speed_goals(rows, ("float32", "bfloat16")) == [
        "Goal (float32 prefill faster than transformers in every cell): **met, 2.00x at the least**.",
        "Goal (bfloat16 prefill faster than transformers in every cell): **not met, 0.50x at the least**.",
    ]


@pytest.mark.parametrize("theirs_delay, their_runs", [(0.0, 1 + 3), (1.0, 1)])
def test_prefill_runs_a_far_slower_transformers_once(theirs_delay, their_runs):
    """`bench models` times transformers by its warm-up run alone where that is over ONE_RUN times mot_jax's prefill
    (bf16 on a CPU without bf16 instructions takes minutes a run); otherwise by the median of its interleaved runs."""
    import time

    import numpy as np

    from mot_jax.bench import models
    from mot_jax.models.registry import build_model

    class Theirs:  # a stand-in for the transformers model: counts its calls, each `theirs_delay` seconds long
        device, calls = "cpu", 0

        def __call__(self, ids, **kwargs):
            self.calls += 1
            time.sleep(theirs_delay)

    theirs = Theirs()
    ids = np.zeros((1, 4), np.int32)
    _, theirs_s, _, _ = models.bench_prefill(build_model(TINY_MODEL_CONFIG), theirs, ids, runs=3)
    assert theirs.calls == their_runs and theirs_s >= theirs_delay


def test_matmul_rate_is_measured_in_each_dtype():
    from mot_jax.bench import flops

    for dtype in ("float32", "bfloat16"):
        rate = flops.matmul_rate(64, dtype, 2)
        assert math.isfinite(rate) and rate > 0
