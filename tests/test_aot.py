"""`python -m mot_jax.compile`: reading the compiled program's text and the refusal run anywhere; compiling for a
TPU topology needs libtpu (`bash launch/setup.sh --tpu-compile`) and is skipped without it."""

import dataclasses
import importlib.util
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec

from mot_jax import aot
from mot_jax.errors import MotJaxError
from mot_jax.training.config import base, tiny

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None

# a per-chip HLO excerpt in the form XLA prints it (shapes after partitioning), with an async all-gather pair
HLO = """
HloModule jit_step, entry_computation_layout={(bf16[8,64]{1,0})->f32[2,4]{1,0}}

ENTRY %main.1 (p0: bf16[8,64], p1: f32[2,4]) -> f32[2,4] {
  %p0 = bf16[8,64]{1,0} parameter(0)
  %all-gather-start = (bf16[8,64]{1,0}, bf16[32,64]{1,0}) all-gather-start(bf16[8,64]{1,0} %p0), dimensions={0}
  %all-gather-done = bf16[32,64]{1,0} all-gather-done((bf16[8,64]{1,0}, bf16[32,64]{1,0}) %all-gather-start)
  %fusion.7 = f32[4,1024,1024]{2,1,0} fusion(bf16[32,64]{1,0} %all-gather-done), kind=kLoop
  %all-reduce.3 = f32[2,4]{1,0} all-reduce(f32[2,4]{1,0} %p1), replica_groups={}, to_apply=%add
  %reduce-scatter = (f32[2,4]{1,0}, s32[2]{0}) reduce-scatter(f32[8,4]{1,0} %p1), dimensions={0}
  ROOT %all-reduce.4 = f32[2,4]{1,0} all-reduce(f32[2,4]{1,0} %all-reduce.3), replica_groups={}, to_apply=%add
}
"""


def test_collectives_counted_by_kind_with_their_result_bytes():
    assert aot.collectives(HLO) == {
        "all-gather": (1, 32 * 64 * 2),  # the pair counts once, by its gathered result
        "all-reduce": (2, 2 * 2 * 4 * 4),
        "reduce-scatter": (1, 2 * 4 * 4 + 2 * 4),
    }


def test_refusal_names_the_biggest_buffers_in_one_sentence():
    chip = aot.CHIPS["v5e"]
    fits = aot.Compiled("prefill", 2 * aot.GiB, 0, 10 * aot.GiB, 0, 0, 1e12, aot.GiB, HLO, [])
    aot.check_fits(fits, chip)  # 12 GiB of 16: no error
    too_big = aot.Compiled("prefill", 2 * aot.GiB, aot.GiB, 14 * aot.GiB, 0, 0, 1e12, aot.GiB, HLO, [])
    with pytest.raises(MotJaxError) as e:
        aot.check_fits(too_big, chip)
    message = str(e.value)
    assert "\n" not in message
    assert "17.00 GiB a chip" in message and "holds 16 GiB" in message
    assert message.index("fusion.7 f32[4,1024,1024] (0.02 GiB)") < message.index("all-gather")  # largest first


def test_estimate_is_the_slower_of_compute_and_reading_the_weights():
    chip = aot.Chip("test", aot.GiB, peak_flops=1e12, hbm_bandwidth=1e9, ici_bandwidth=1e9)
    compute_bound = aot.Compiled("prefill", 0, 0, 0, 0, 0, 8e12, 10**8, "", [])  # 8e12 / (4 chips x 1e12) = 2 s
    assert aot.estimate(compute_bound, chip, chips=4) == (2.0, 1.0)
    memory_bound = aot.Compiled("prefill", 0, 0, 0, 0, 0, 4e12, 4 * 10**9, "", [])  # 4e9 bytes at 1e9/s = 4 s
    assert aot.estimate(memory_bound, chip, chips=4) == (4.0, 0.25)
    fast_hbm = dataclasses.replace(chip, hbm_bandwidth=1e10)  # 6e9 bytes a chip lacks, at 1e9/s over ICI: 6 s
    weights = [("w", (4 * 10**9,), "bfloat16", PartitionSpec("data"), 2 * 10**9)]
    ici_bound = aot.Compiled("prefill", 0, 0, 0, 0, 0, 4e12, 8 * 10**9, "", weights)
    assert aot.estimate(ici_bound, fast_hbm, chips=4) == (6.0, 1 / 6)


def test_bad_topology_and_missing_libtpu_say_what_to_do(monkeypatch):
    with pytest.raises(MotJaxError, match="GENERATION:SHAPE"):
        aot.topology("v9x:2x2")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MotJaxError, match="launch/setup.sh --tpu-compile"):
        aot.topology("v5e:2x2")


def test_known_configs_give_the_published_shapes_offline():
    cfg = aot.model_config("Qwen/Qwen2.5-7B")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (28, 3584, 28, 4, 128)
    with pytest.raises(MotJaxError, match="unknown offline"):
        aot.model_config("someone/unknown-model")


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (bash launch/setup.sh --tpu-compile)")
def test_tiny_config_compiles_for_v5e_2x2_with_its_weights_split_over_fsdp():
    config = tiny(base(), "qwen2", "qwen2")
    config.dtype, config.mesh.fsdp = "bfloat16", True
    chip, devices, compiled = aot.compile_program(config, "v5e:2x2", "prefill", tokens=64)
    assert chip is aot.CHIPS["v5e"] and len(devices) == 4
    assert devices[0].device_kind == "TPU v5 lite"
    weights = {name: (spec, per_chip) for name, _, _, spec, per_chip in compiled.weights}
    spec, per_chip = weights["layers.mlp.up_proj.kernel"]  # [4 layers, 64 embed, 128], embed split over data
    assert tuple(spec) == (None, "data", None) and per_chip == 4 * 16 * 128 * 2
    assert compiled.arguments >= sum(b for *_, b in compiled.weights)  # the weights' shards, the ids and mask
    assert compiled.flops > 0
    assert "all-gather" in aot.collectives(compiled.hlo)  # FSDP gathers the weights
    text = aot.report(compiled, chip, len(devices), "v5e:2x2", "tiny")
    assert "| layers.mlp.up_proj.kernel | [4, 64, 128] | bfloat16 | (None, 'data', None) |" in text


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (bash launch/setup.sh --tpu-compile)")
def test_run_refuses_when_a_chip_would_not_hold_the_program(monkeypatch):
    config = tiny(base(), "qwen2", "qwen2")
    monkeypatch.setitem(aot.CHIPS, "v5e", aot.Chip("TPU v5e", 2**20, 197e12, 0.819e12, 200e9))  # a 1 MiB chip
    with pytest.raises(MotJaxError, match=r"a TPU v5e chip holds 0 GiB; the biggest buffers: \S+ \w+\["):
        aot.run(config, "v5e:2x2", "prefill", tokens=64)


def test_command_fails_in_one_line_with_exit_2():
    args = ["--config=configs/qwen2_5_7b.py:tiny", "--topology=v9x:2x2"]
    done = subprocess.run([sys.executable, "-m", "mot_jax.compile", *args], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Unknown TPU topology 'v9x:2x2'" in done.stderr.strip().splitlines()[-1]
