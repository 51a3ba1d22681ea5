"""`python -m mot_jax.compile`: reading the compiled program's text and the refusal run anywhere; compiling for a
TPU topology needs libtpu (`bash launch/setup.sh --tpu-compile`) and is skipped without it."""

import importlib.util
import json
import math
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_config, tiny_batch

from mot_jax import aot, hlo
from mot_jax.errors import MotJaxError
from mot_jax.models import accelerated, attention
from mot_jax.models import tiny as tiny_models
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
    assert hlo.collectives(HLO) == {
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


# a loop of 4 trips (the counter against constant(4)) whose body gathers 4 KiB, and an all-reduce of 64 bytes outside
LOOP = """
HloModule jit_step

%cond (p: (s32[], bf16[32,64])) -> pred[] {
  %p = (s32[], bf16[32,64]) parameter(0)
  %trips = s32[]{:T(128)} constant(4)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %trips), direction=LT
}

%body (p: (s32[], bf16[32,64])) -> (s32[], bf16[32,64]) {
  %p = (s32[], bf16[32,64]) parameter(0)
  %x = bf16[8,64]{1,0} fusion(%p), kind=kLoop, calls=%slice
  %all-gather = bf16[32,64]{1,0} all-gather(bf16[8,64]{1,0} %x), dimensions={0}
  ROOT %t = (s32[], bf16[32,64]) tuple(%i, %all-gather)
}

ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %loop = (s32[], bf16[32,64]) while(%init), condition=%cond, body=%body
  ROOT %all-reduce = f32[4,4]{1,0} all-reduce(f32[4,4]{1,0} %a), replica_groups={}, to_apply=%add
}
"""


def test_a_step_runs_each_loop_body_as_often_as_its_trip_count():
    assert hlo.executions(LOOP) == {"cond": 4, "body": 4, "main": 1}
    assert hlo.collectives(LOOP) == {"all-gather": (1, 32 * 64 * 2), "all-reduce": (1, 64)}
    assert hlo.collectives(LOOP, per_step=True) == {"all-gather": (4, 4 * 32 * 64 * 2), "all-reduce": (1, 64)}
    assert hlo.ici_traffic(LOOP) == 4 * 32 * 64 * 2 + 2 * 64  # a ring all-reduce moves its bytes twice


# a layer loop of 28 trips whose body runs XLA's windowed einsum as XLA prints it for an all-gather it turned into
# collective-permutes: a u32 counter up to 8 in steps of 2 (the loop unrolled by two), 4 trips, two permutes a trip,
# each moving a bf16[1,224,3584] block
WINDOWED = """
HloModule jit_step

%windowed_cond (p: (bf16[1,224,3584], u32[])) -> pred[] {
  %constant.971 = u32[]{:T(128)} constant(8)
  %p = (bf16[1,224,3584]{2,1,0}, u32[]{:T(128)}) parameter(0)
  %get-tuple-element.492 = u32[]{:T(128)} get-tuple-element(%p), index=1
  ROOT %compare.25 = pred[]{:T(512)} compare(%get-tuple-element.492, %constant.971), direction=LT
}

%windowed_body (p: (bf16[1,224,3584], u32[])) -> (bf16[1,224,3584], u32[]) {
  %p = (bf16[1,224,3584]{2,1,0}, u32[]{:T(128)}) parameter(0)
  %x = bf16[1,224,3584]{2,1,0} get-tuple-element(%p), index=0
  %counter = u32[]{:T(128)} get-tuple-element(%p), index=1
  %two = u32[]{:T(128)} constant(2)
  %next = u32[]{:T(128)S(6)} add(%counter, %two), metadata={op_name="dot_general"}
  %collective-permute-start = (bf16[1,224,3584], bf16[1,224,3584]{2,1,0}, u32[]) collective-permute-start(%x)
  %collective-permute-done = bf16[1,224,3584]{2,1,0} collective-permute-done(%collective-permute-start)
  %collective-permute.1 = bf16[1,224,3584]{2,1,0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}
  ROOT %t = (bf16[1,224,3584]{2,1,0}, u32[]{:T(128)}) tuple(%collective-permute-done, %next)
}

%layer_cond (p: (s32[], bf16[1,224,3584])) -> pred[] {
  %p = (s32[], bf16[1,224,3584]) parameter(0)
  %layers = s32[]{:T(128)} constant(28)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %layers), direction=LT
}

%layer_body (p: (s32[], bf16[1,224,3584])) -> (s32[], bf16[1,224,3584]) {
  %p = (s32[], bf16[1,224,3584]) parameter(0)
  %w = (bf16[1,224,3584], u32[]) while(%init), condition=%windowed_cond, body=%windowed_body
  ROOT %t = (s32[], bf16[1,224,3584]) tuple(%i, %w)
}

ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %loop = (s32[], bf16[1,224,3584]) while(%init), condition=%layer_cond, body=%layer_body
  ROOT %r = f32[4,4]{1,0} add(%a, %a)
}
"""


def test_xlas_own_loops_in_u32_and_steps_of_two_run_their_trip_count():
    """The windowed einsum's loop runs 4 times a layer: 28 x 4 x 2 permutes of 224 x 3,584 bf16 (1.53 MiB) a step
    (343 MiB), not once a layer (86 MiB: its u32 bound unread) nor 8 times (686 MiB: its step of 2 unread)."""
    assert hlo.executions(WINDOWED)["windowed_body"] == 28 * 4
    block = 224 * 3584 * 2
    assert hlo.collectives(WINDOWED) == {"collective-permute": (2, 2 * block)}
    assert hlo.collectives(WINDOWED, per_step=True) == {"collective-permute": (28 * 4 * 2, 28 * 4 * 2 * block)}


# a Pallas kernel's custom call (splash attention) whose backend config runs over several lines, one of them starting
# with `}}`, and an all-gather after it in the same computation
KERNEL = r"""
HloModule jit_step

ENTRY %main (a: bf16[8,64]) -> bf16[32,64] {
  %a = bf16[8,64]{1,0} parameter(0)
  %splash = bf16[8,64]{1,0} custom-call(%a), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":
"xprof_metadata":"{\"block_q\": 512, \
}}, metadata={op_name="splash"}
  ROOT %all-gather = bf16[32,64]{1,0} all-gather(bf16[8,64]{1,0} %splash), dimensions={0}
}
"""


def test_a_kernels_config_over_several_lines_does_not_end_its_computation():
    assert hlo.collectives(KERNEL, per_step=True) == {"all-gather": (1, 32 * 64 * 2)}


def test_estimate_is_the_slowest_of_compute_weights_and_collectives():
    chip = aot.Chip("test", aot.GiB, peak_flops=1e12, hbm_bandwidth=1e9, ici_bandwidth=16512.0)  # LOOP's traffic/s
    step = lambda flops, weight_bytes: aot.Compiled("train", 0, 0, 0, 0, 0, flops, weight_bytes, LOOP, [])
    compute_bound = aot.estimate(step(8e12, 10**8), chip, chips=4)  # 8e12 / (4 chips x 1e12) = 2 s
    assert (compute_bound.seconds, compute_bound.mfu) == (2.0, 1.0)
    memory_bound = aot.estimate(step(4e12, 4 * 10**9), chip, chips=4)  # 4e9 bytes at 1e9/s = 4 s
    assert (memory_bound.seconds, memory_bound.mfu) == (4.0, 0.25)
    ici_bound = aot.estimate(step(4e9, 0), chip, chips=4)  # 16,512 bytes a chip moves at 16,512 B/s: 1 s
    assert (ici_bound.seconds, ici_bound.mfu, ici_bound.traffic) == (1.0, 1e-3, 16512)


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
    assert "all-gather" in hlo.collectives(compiled.hlo)  # FSDP gathers the weights
    text = aot.report(compiled, chip, len(devices), "v5e:2x2", "tiny")
    assert "| layers.mlp.up_proj.kernel | [4, 64, 128] | bfloat16 | (None, 'data', None) |" in text
    # the causal prefill attends through splash, on each chip's row: a shard_map around the Pallas call in the
    # program, the Mosaic kernel in what XLA compiled for the chip
    traced, _ = aot._trace_generation(config, devices, "prefill", 64, len(devices))
    program = str(traced.jaxpr)
    assert re.search(r"shard_map\[.*?out_specs=\(P\('data'", program, re.S) and "pallas_call" in program
    kernels = [line for line in compiled.hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert kernels and all("splash_mha" in line for line in kernels)


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (bash launch/setup.sh --tpu-compile)")
def test_run_refuses_when_a_chip_would_not_hold_the_program(monkeypatch):
    config = tiny(base(), "qwen2", "qwen2")
    monkeypatch.setitem(aot.CHIPS, "v5e", aot.Chip("TPU v5e", 2**20, 197e12, 0.819e12, 200e9))  # a 1 MiB chip
    with pytest.raises(MotJaxError, match=r"a TPU v5e chip holds 0 GiB; the biggest buffers: \S+ \w+\["):
        aot.run(config, "v5e:2x2", "prefill", tokens=64)


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (bash launch/setup.sh --tpu-compile)")
def test_a_program_xla_will_not_plan_is_refused_in_one_line(tmp_path, monkeypatch):
    # 65,536 tokens through XLA's attention in one query block (splash declined): float32 scores of ~68 GiB a chip
    config = tiny(base(), "qwen2", "qwen2")
    long_context = tiny_models.hf_config("random:qwen2") | dict(max_position_embeddings=65536)  # the tiny model's 512
    (tmp_path / "config.json").write_text(json.dumps(long_context))
    config.target = str(tmp_path)
    monkeypatch.setattr(accelerated, "tpu_supports", lambda *a, **kw: False)
    monkeypatch.setattr(attention, "PREFILL_BLOCK", 65536)
    with pytest.raises(MotJaxError, match=r"does not fit a TPU v5e chip: XLA says .* exceeds available HBM") as e:
        aot.run(config, "v5e:2x2", "prefill", tokens=65536)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "program,tokens,batch,reason",
    [
        ("prefill", 0, None, r"--tokens=0 is outside 1..512, what the target's 512 positions hold for a prefill"),
        ("prefill", -5, None, r"--tokens=-5 is outside 1..512"),
        # past the target's positions: XLA aborted the process on the attention scores' size (int64 overflow), or
        # jax refused the shape with a traceback
        ("prefill", 3_000_000_000, None, r"--tokens=3000000000 is outside 1..512"),
        ("decode", 512, None, r"--tokens=512 is outside 1..511, what the target's 512 positions hold for a decode"),
        ("prefill", 64, 0, r"--batch=0 must be at least 1"),  # was compiled as one row a chip, silently
        ("decode", 64, -4, r"--batch=-4 must be at least 1"),  # was a TypeError's traceback
    ],
)
def test_tokens_and_rows_that_cannot_compile_are_refused_before_libtpu_loads(program, tokens, batch, reason):
    config = tiny(base(), "qwen2", "qwen2")
    with pytest.raises(MotJaxError, match=f"^{reason}"):
        aot.compile_program(config, "v5e:2x2", program, tokens=tokens, batch=batch)


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (bash launch/setup.sh --tpu-compile)")
def test_more_tokens_than_a_program_indexes_are_refused_in_one_line():
    config = tiny(base(), "qwen2", "qwen2")  # jax refused the int32 shape with a traceback
    with pytest.raises(MotJaxError, match=r"^--batch=33554432 rows of 64 tokens are 2,147,483,648 tokens, more "):
        aot.compile_program(config, "v5e:2x2", "prefill", tokens=64, batch=2**25)


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (bash launch/setup.sh --tpu-compile)")
def test_a_training_step_longer_than_the_models_positions_is_refused():
    config = tiny_train_config(fsdp=True)  # compiled past the positions; at 100,000,000 tokens XLA aborted the process
    config.data.total_tokens, config.data.prefix_tokens, config.data.source_length = 1024, 512, 512
    with pytest.raises(MotJaxError, match=r"^data.total_tokens=1024 is more than the target's 512 positions"):
        aot.compile_program(config, "v5e:2x2", "train")


def test_a_config_without_the_keys_it_needs_is_one_line(tmp_path):
    """A config file written from scratch (no base()): the compile read config.mesh and failed with a traceback."""
    (tmp_path / "mine.py").write_text(
        "import ml_collections\n\n"
        "def get_config():\n    return ml_collections.ConfigDict(dict(target='random:qwen2'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "mot_jax.compile", f"--config={tmp_path / 'mine.py'}", "--topology=v5e:2x2"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.splitlines() == [
        "error: The config has no key batch_size (and 17 more); start it from mot_jax.training.config.base(), which "
        "has every key at its default, as the files in configs/ do."
    ]


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (bash launch/setup.sh --tpu-compile)")
def test_the_default_prompt_fits_the_targets_positions():
    config = tiny(base(), "qwen2", "qwen2")  # 512 positions: the default 1,024 tokens compiled past them
    text = aot.run(config, "v5e:2x2", "decode")
    assert text.startswith("random:qwen2's decode step (4 rows after 511 tokens, float32) compiled for v5e:2x2"), text


def test_command_fails_in_one_line_with_exit_2():
    args = ["--config=configs/qwen2_5_7b.py:tiny", "--topology=v9x:2x2"]
    done = subprocess.run([sys.executable, "-m", "mot_jax.compile", *args], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Unknown TPU topology 'v9x:2x2'" in done.stderr.strip().splitlines()[-1]


def tiny_train_config(fsdp: bool):
    """The 7B recipe on tiny random Qwen2 models, 4 rows split over the chips, one micro-batch."""
    config = load_config("qwen2_5_7b.py", "tiny")
    config.batch_size, config.grad_accum, config.mesh.data, config.mesh.fsdp = 4, 1, -1, fsdp
    return config


@pytest.mark.parametrize(
    "key,value,reason",
    [
        ("batch_size", 0, r"batch_size=0 must be a whole number of at least 1"),  # was a ZeroDivisionError
        ("remat", "bogus", r"remat='bogus' is not one of none, dots, nothing"),  # was a KeyError
    ],
)
def test_the_training_step_of_a_config_training_would_refuse_is_refused_alike(key, value, reason):
    config = tiny_train_config(fsdp=True)
    config[key] = value
    with pytest.raises(MotJaxError, match=f"^{reason}"):
        aot.compile_program(config, "v5e:2x2", "train")


@pytest.mark.slow  # XLA's TPU compile of the whole step: 1.5 to 6 minutes on a 2-core machine
@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (bash launch/setup.sh --tpu-compile)")
def test_tiny_training_step_compiles_for_v5e_2x2_with_its_state_split_over_fsdp(monkeypatch):
    from flax import nnx

    from mot_jax.bench.flops import matmul_flops
    from mot_jax.models.model_pair import load_pair
    from mot_jax.training.setup import make_mesh, translation
    from mot_jax.training.trainer import Trainer, stack

    # both traces attend through XLA's path: the TPU one (traced under the slice's mesh) would take splash and this
    # CPU's its kernel, custom calls whose matmuls neither count sees
    monkeypatch.setattr(accelerated, "tpu_supports", lambda *a, **kw: False)
    monkeypatch.setattr(attention.kernels, "supports", lambda *a, **kw: False)
    config = tiny_train_config(fsdp=True)
    chip, devices, compiled = aot.compile_program(config, "v5e:2x2", "train")
    assert len(devices) == 4 and compiled.temporaries > 0
    # the FLOPs: the same step traced by the trainer on this CPU, real models and a real batch of the config's shapes
    one_device = tiny_train_config(fsdp=False)
    one_device.mesh.data = 1
    mesh = make_mesh(one_device)
    pair = load_pair(one_device, mesh)
    spec, tcfg = translation(one_device, aot.compile_channels(one_device, pair), pair)
    trainer = Trainer(one_device, pair, spec, tcfg, mesh, total_steps=1)
    d = config.data
    shapes = dict(context=d.prefix_tokens - 1, prompt=d.total_tokens - d.prefix_tokens, source_length=d.source_length)
    batch = tiny_batch(pair.source_tokenizer, pair.target_tokenizer, batch=config.batch_size, **shapes)
    assert compiled.flops == matmul_flops(trainer.trace_train_step(stack([batch])).jaxpr.jaxpr) > 0
    # the frozen model once (source and target are one), the translator and its AdamW moments split over `data`
    names = {name.split(".")[0] for name, *_ in compiled.weights}
    assert names == {"model", "translator"}
    translator = sum(math.prod(shape) for name, shape, *_ in compiled.weights if name.startswith("translator"))
    assert translator == sum(x.size for x in jax.tree.leaves(nnx.state(trainer.state["params"])))
    for name, shape, dtype, spec, per_chip in compiled.weights + compiled.optimizer:
        assert per_chip < math.prod(shape) * np.dtype(dtype).itemsize or "data" not in spec, name
    mu = {name.split(".mu.")[1]: spec for name, _, _, spec, _ in compiled.optimizer if ".mu." in name}
    params = {name.removeprefix("translator."): spec for name, _, _, spec, _ in compiled.weights}
    assert mu and all(spec == params[name.removesuffix(".value")] for name, spec in mu.items())
    assert any("data" in spec for spec in mu.values())
    step = hlo.collectives(compiled.hlo, per_step=True)
    assert step["all-gather"][0] > 0 and step["all-reduce"][0] > 0  # FSDP gathers; the gradients are summed
    text = aot.report(compiled, chip, len(devices), "v5e:2x2", aot.title(config, "train", None, 4))
    assert "AdamW state:" in text and "Estimated MFU at most" in text


@pytest.mark.slow  # as above, one chip: 1 to 2.5 minutes
@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (bash launch/setup.sh --tpu-compile)")
def test_tiny_training_step_on_one_chip_has_no_collectives():
    config = tiny_train_config(fsdp=True)
    config.mesh.data = 1
    _, devices = aot.topology("v5e:2x2")
    traced, _, _ = aot.trace_train(config, devices)  # the mesh takes the first chip only
    assert hlo.collectives(traced.lower().compile().as_text(), per_step=True) == {}


def test_a_training_step_that_reads_no_source_takes_none_of_its_weights():
    """Self-prediction reads the target alone: its compiled step counted the source model's weights among the frozen
    weights and its traced forward (dead code) among the step's FLOPs. It takes the target's alone now; a replay,
    which reads the source, still takes both."""
    from flax import nnx

    from mot_jax.models.registry import build_model

    size = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
    state = lambda name: nnx.state(build_model(aot.model_config(name), jnp.float32, abstract=True))
    for arg, frozen in (("self_prediction,tiny", ("target",)), ("replay,tiny", ("source", "target"))):
        config = load_config("smollm2_gemma3.py", arg)
        traced, weights, _ = aot.trace_train(config, jax.devices()[:1])
        assert {name.split(".")[0] for name, *_ in weights} == {*frozen, "translator"}
        llm_states = traced.args_info[0][1]
        assert size(llm_states) == sum(size(state(config[name])) for name in frozen), arg


def test_train_takes_its_shapes_from_the_config():
    with pytest.raises(MotJaxError, match="--config.data.total_tokens"):
        aot.compile_program(tiny_train_config(fsdp=True), "v5e:2x2", "train", tokens=4096)
