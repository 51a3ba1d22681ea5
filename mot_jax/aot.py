"""Ahead-of-time compiles for Cloud TPU topologies on any machine (`python -m mot_jax.compile`).

With `libtpu` installed (`bash launch/setup.sh --tpu-compile`), `jax.experimental.topologies` describes a TPU slice
(e.g. `v5e:4x4`, 16 chips) without one; a program lowered with abstract, sharded arguments compiles for it, and XLA
says how much memory each chip needs. The model is built abstractly in the config's real shapes (`nnx.eval_shape`:
no weights) and sharded by `mot_jax.sharding`'s rules on a mesh of the topology's chips.

The report gives per chip: XLA's memory plan against the chip's HBM, the step's matmul FLOPs (counted in the jaxpr,
loops times their trip count: XLA's `cost_analysis()` counts a loop body once), a roofline estimate of the step time
and the MFU bound it implies (estimates: no TPU ran), the collectives in the compiled program, and where each weight
lives (a rule that misses silently replicates a whole model).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
from pathlib import Path

import numpy as np

from mot_jax.errors import MotJaxError

GiB = 2**30
INSTALL = "bash launch/setup.sh --tpu-compile"
PROGRAMS = ("prefill", "decode")


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm: int  # bytes a chip holds
    peak_flops: float  # bf16 dense FLOP/s
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s a chip exchanges with the others


# Cloud TPU's published per-chip figures (ICI: 2,400 / 1,600 / 4,800 / 3,584 Gbps)
CHIPS = {
    "v4": Chip("TPU v4", 32 * GiB, 275e12, 1.2e12, 300e9),
    "v5e": Chip("TPU v5e", 16 * GiB, 197e12, 0.819e12, 200e9),
    "v5p": Chip("TPU v5p", 95 * GiB, 459e12, 2.765e12, 600e9),
    "v6e": Chip("TPU v6e", 32 * GiB, 918e12, 1.64e12, 448e9),
}

# config.json fields of the hub models the paper's configs name, so their shapes are known offline (a local copy of
# the config in the Hugging Face cache, or a checkpoint directory, takes precedence)
_QWEN2 = dict(model_type="qwen2", vocab_size=151936, rope_theta=1e6, max_position_embeddings=32768, rms_norm_eps=1e-6)
KNOWN_CONFIGS = {
    "Qwen/Qwen2.5-7B": dict(
        _QWEN2,
        vocab_size=152064,
        num_hidden_layers=28,
        hidden_size=3584,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen2.5-0.5B": dict(
        _QWEN2,
        num_hidden_layers=24,
        hidden_size=896,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        tie_word_embeddings=True,
    ),
}


def topology(name: str):
    """(Chip, the topology's abstract devices) of a name like `v5e:4x4`; needs libtpu."""
    generation = name.split(":")[0].lower()
    if generation not in CHIPS or ":" not in name:
        raise MotJaxError(
            f"Unknown TPU topology {name!r}; name one as GENERATION:SHAPE, e.g. v5e:4x4 ({', '.join(CHIPS)})."
        )
    if importlib.util.find_spec("libtpu") is None:
        raise MotJaxError(f"Compiling for TPU needs libtpu, which is not installed; run `{INSTALL}`.")
    # libtpu only compiles here: let it load beside another process holding the chips' lock file
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        devices = topologies.get_topology_desc(topology_name=name, platform="tpu").devices
    except Exception as e:  # libtpu's message for a shape it does not know
        raise MotJaxError(f"libtpu does not know the topology {name!r} ({_first_line(e)}); check its shape.") from None
    return CHIPS[generation], devices


def model_config(name: str):
    """The ModelConfig of a model name as the configs give it, without weights: a tiny random model, a checkpoint
    directory, a hub id whose config.json is in the Hugging Face cache, or one of KNOWN_CONFIGS."""
    from mot_jax.models import registry, tiny

    if tiny.is_random(name):
        d = tiny.hf_config(name)
    elif Path(name).expanduser().is_dir():
        d = registry.read_config(Path(name).expanduser())[0]
    elif (cached := _cached_config(name)) is not None:
        d = json.loads(cached.read_text())
    elif name in KNOWN_CONFIGS:
        d = KNOWN_CONFIGS[name]
    else:
        raise MotJaxError(
            f"The shapes of {name!r} are unknown offline; pass a checkpoint directory (its config.json is enough) "
            f"or one of {', '.join(KNOWN_CONFIGS)}."
        )
    family = registry.FAMILIES.get(d.get("model_type"))
    if family is None:
        raise MotJaxError(f"Architecture {d.get('model_type')!r} of {name!r} is not supported.")
    return family[0].config_from_hf(d)


def _cached_config(name: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # not a repo id
        return None
    return Path(found) if isinstance(found, str) else None


@dataclasses.dataclass
class Compiled:
    """What a compile reports: XLA's per-chip memory plan, the program text and our FLOP count."""

    program: str
    arguments: int
    outputs: int
    temporaries: int
    aliased: int
    code: int
    flops: float  # the whole step, all chips
    weight_bytes: int  # the model's parameters, whole
    hlo: str
    weights: list  # (name, shape, dtype, spec, bytes per chip)

    @property
    def total(self) -> int:
        return self.arguments + self.outputs + self.temporaries - self.aliased + self.code

    @property
    def gathered(self) -> int:
        """Bytes of weights a chip does not hold: what it receives to use every weight whole once."""
        return sum(
            math.prod(shape) * np.dtype(dtype).itemsize - per_chip for _, shape, dtype, _, per_chip in self.weights
        )


def compile_program(config, topology_name: str, program: str, tokens: int, batch: int | None = None):
    """(Chip, devices, Compiled) of `program` (prefill of `tokens` tokens, or one decode step after them) of the
    config's target, `batch` rows (default one a chip), compiled for the topology."""
    if program not in PROGRAMS:
        raise MotJaxError(f"Unknown program {program!r}; choose one of {', '.join(PROGRAMS)}.")
    if tokens < 1:
        raise MotJaxError(f"--tokens={tokens} must be at least 1.")
    chip, devices = topology(topology_name)

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding

    from mot_jax import sharding
    from mot_jax.bench.flops import matmul_flops
    from mot_jax.models import generation
    from mot_jax.models.cache import KVCache
    from mot_jax.models.registry import build_model, resolve_dtype

    cfg = model_config(config.target)
    mesh = sharding.make_mesh(devices=list(devices))  # every chip on `data`: rows, and FSDP when the config asks
    rules = sharding.FSDP_RULES if config.mesh.fsdp else sharding.RULES
    batch = batch or len(devices)
    if batch % mesh.shape["data"]:
        raise MotJaxError(f"--batch={batch} does not split over {len(devices)} chips; use a multiple of it.")
    model = build_model(cfg, resolve_dtype(config.dtype), abstract=True)
    graphdef, state = nnx.split(model)
    weights, weight_bytes = [], 0
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        names = var.get_metadata().get("out_sharding")
        spec = sharding.spec(names, rules, value.shape, mesh)
        placed = NamedSharding(mesh, spec)
        var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=placed))
        size = math.prod(value.shape) * np.dtype(value.dtype).itemsize
        weight_bytes += size
        per_chip = math.prod(placed.shard_shape(value.shape)) * np.dtype(value.dtype).itemsize
        weights.append((".".join(map(str, path)), value.shape, np.dtype(value.dtype).name, spec, per_chip))

    def sds(shape, dtype, names):
        return jax.ShapeDtypeStruct(
            shape, dtype, sharding=NamedSharding(mesh, sharding.spec(names, rules, shape, mesh))
        )

    ids = sds((batch, tokens), jnp.int32, ("batch", "seq"))
    if program == "prefill":
        mask = sds((batch, tokens), bool, ("batch", "seq"))

        def step(state, ids, mask):
            return generation._prefill(nnx.merge(graphdef, state), ids, mask, tokens)

        args, donate = (state, ids, mask), ()
    else:
        cache = jax.eval_shape(lambda: model.init_cache(batch, tokens + 1))
        axes = KVCache.logical_axes()
        cache = jax.tree.map(
            lambda a, names: sds(a.shape, a.dtype, names), cache, axes, is_leaf=lambda x: isinstance(x, tuple)
        )
        last = sds((batch,), jnp.int32, ("batch",))

        def step(state, tokens, cache):
            logits, cache = nnx.merge(graphdef, state)(tokens[:, None], cache=cache)
            return logits[:, -1], cache

        args, donate = (state, last, cache), (2,)
    traced = jax.jit(step, donate_argnums=donate).trace(*args)
    compiled = traced.lower().compile()
    m = compiled.memory_analysis()
    return (
        chip,
        devices,
        Compiled(
            program=program,
            arguments=m.argument_size_in_bytes,
            outputs=m.output_size_in_bytes,
            temporaries=m.temp_size_in_bytes,
            aliased=m.alias_size_in_bytes,
            code=m.generated_code_size_in_bytes,
            flops=matmul_flops(traced.jaxpr.jaxpr),
            weight_bytes=weight_bytes,
            hlo=compiled.as_text(),
            weights=weights,
        ),
    )


# ---------------------------------------------------------------------------------------------- reading the HLO

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
_DTYPE_BYTES |= {"f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_ASSIGNMENT = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def shape_bytes(text: str) -> int:
    """Bytes of every array shape in an HLO result type (`bf16[8,128]{1,0}` or a tuple of them)."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in _DTYPE_BYTES:
            total += math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]
    return total


def instructions(hlo: str):
    """(name, result type, opcode) of each instruction of an HLO module's text."""
    found = []
    for line in hlo.splitlines():
        match = _ASSIGNMENT.match(line)
        if not match:
            continue
        name, rest = match.groups()
        if rest.startswith("("):  # a tuple type: up to its closing parenthesis
            end = _closing(rest)
            result, rest = rest[: end + 1], rest[end + 1 :]
        else:
            result, _, rest = rest.partition(" ")
        opcode = rest.strip().split("(", 1)[0]
        if opcode:
            found.append((name, result, opcode))
    return found


def _closing(text: str) -> int:
    """The index of the parenthesis that closes the one `text` starts with."""
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return i
    return len(text) - 1


def collectives(hlo: str) -> dict:
    """{kind: (count, bytes)} of the collectives in a compiled (per-chip) HLO text, by their results' bytes; an
    async pair (`-start` / `-done`) counts once. A loop body's collectives count once, as the text has them."""
    found = {}
    for _, result, opcode in instructions(hlo):
        kind = opcode.removesuffix("-start")
        if kind in COLLECTIVES and not opcode.endswith("-done"):
            count, size = found.get(kind, (0, 0))
            if opcode.endswith("-start"):  # its result is (operands, outputs[, context]): the outputs
                result = _tuple_items(result)[1] if len(_tuple_items(result)) > 1 else result
            found[kind] = (count + 1, size + shape_bytes(result))
    return found


def _tuple_items(result: str) -> list[str]:
    """The top-level items of a tuple type `(a, (b, c), d)`; a non-tuple as one item."""
    result = result.strip()
    if not result.startswith("("):
        return [result]
    items, depth, start = [], 0, 1
    for i, ch in enumerate(result):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or (depth == 0 and ch == ")"):
            items.append(result[start:i].strip())
            start = i + 1
        if depth == 0:
            break
    return items


def biggest_buffers(hlo: str, count: int = 3) -> list[tuple[str, str, int]]:
    """The `count` largest instruction results (name, type, bytes) of a compiled (per-chip) HLO text."""
    sized = [
        (name, result.split("{")[0], shape_bytes(result))
        for name, result, _ in instructions(hlo)
        if not result.startswith("(")  # a tuple holds other instructions' buffers
    ]
    return sorted(sized, key=lambda s: -s[2])[:count]


# ------------------------------------------------------------------------------------------------------ report


def check_fits(compiled: Compiled, chip: Chip) -> None:
    """Refuses (one sentence) when a chip would not hold the program, naming its biggest buffers."""
    if compiled.total <= chip.hbm:
        return
    gib = lambda b: f"{b / GiB:.2f}"
    buffers = ", ".join(f"{name} {shape} ({gib(size)} GiB)" for name, shape, size in biggest_buffers(compiled.hlo))
    raise MotJaxError(
        f"The {compiled.program} needs {gib(compiled.total)} GiB a chip ({gib(compiled.arguments)} arguments, "
        f"{gib(compiled.temporaries)} temporaries, {gib(compiled.outputs)} outputs) but a {chip.name} chip holds "
        f"{chip.hbm / GiB:.0f} GiB; the biggest buffers: {buffers}."
    )


def estimate(compiled: Compiled, chip: Chip, chips: int) -> tuple[float, float]:
    """(seconds, MFU bound): the roofline time of the step, the slowest of its FLOPs at the chips' peak, each chip
    reading every weight once at its HBM bandwidth (FSDP gathers them whole) and receiving the weights it does not
    hold over ICI; the MFU if it ran at that time. Activations' traffic and collectives are left out."""
    compute = compiled.flops / (chips * chip.peak_flops)
    seconds = max(compute, compiled.weight_bytes / chip.hbm_bandwidth, compiled.gathered / chip.ici_bandwidth)
    return seconds, compute / seconds


def report(compiled: Compiled, chip: Chip, chips: int, topology_name: str, title: str) -> str:
    """The compile report as text (Markdown tables)."""
    gib = lambda b: f"{b / GiB:.2f}"
    seconds, mfu = estimate(compiled, chip, chips)
    lines = [
        f"{title} compiled for {topology_name} ({chips} x {chip.name}, {gib(chip.hbm)} GiB HBM a chip).",
        "",
        "| per chip | GiB |",
        "|---|---|",
        f"| arguments | {gib(compiled.arguments)} |",
        f"| temporaries | {gib(compiled.temporaries)} |",
        f"| outputs | {gib(compiled.outputs)} |",
        f"| aliased (donated) | {gib(compiled.aliased)} |",
        f"| code | {gib(compiled.code)} |",
        f"| total | {gib(compiled.total)} of {gib(chip.hbm)} ({compiled.total / chip.hbm:.0%}) |",
        "",
        f"Step matmul FLOPs (jaxpr count): {compiled.flops / 1e12:.3f} TFLOP in all, "
        f"{compiled.flops / chips / 1e12:.3f} a chip.",
        f"Estimated step time (roofline, no TPU ran): {seconds * 1e3:.2f} ms, the slowest of the FLOPs at "
        f"{chip.peak_flops / 1e12:.0f} TFLOP/s a chip, every weight ({gib(compiled.weight_bytes)} GiB) read once at "
        f"{chip.hbm_bandwidth / 1e9:.0f} GB/s and the {gib(compiled.gathered)} GiB of weights a chip lacks received "
        f"at {chip.ici_bandwidth / 1e9:.0f} GB/s over ICI; MFU at most {mfu:.0%} (an estimate).",
        "",
        "| collective (in the program text; a loop body counts once) | count | MiB |",
        "|---|---|---|",
    ]
    found = collectives(compiled.hlo)
    lines += [f"| {kind} | {n} | {size / 2**20:.1f} |" for kind, (n, size) in sorted(found.items())] or [
        "| none | 0 | 0 |"
    ]
    lines += ["", "| weight | shape | dtype | sharding | MiB a chip |", "|---|---|---|---|---|"]
    for name, shape, dtype, spec, per_chip in compiled.weights:
        lines.append(f"| {name} | {list(shape)} | {dtype} | {_spec_text(spec)} | {per_chip / 2**20:.1f} |")
    replicated = sum(b for *_, spec, b in compiled.weights if not any(spec))
    lines.append(f"\nReplicated on every chip: {gib(replicated)} GiB of {gib(compiled.weight_bytes)} GiB of weights.")
    return "\n".join(lines)


def _spec_text(spec) -> str:
    return "replicated" if not any(spec) else str(tuple(spec))


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def run(config, topology_name: str, program: str = "prefill", tokens: int = 1024, batch: int | None = None) -> str:
    """Compile and report (what `python -m mot_jax.compile` prints); refuses when a chip would not hold it."""
    chip, devices, compiled = compile_program(config, topology_name, program, tokens, batch)
    check_fits(compiled, chip)
    rows = batch or len(devices)
    title = (
        f"{config.target}'s {program} ({rows} rows x {tokens} tokens, {config.dtype})"
        if program == "prefill"
        else f"{config.target}'s decode step ({rows} rows after {tokens} tokens, {config.dtype})"
    )
    return report(compiled, chip, len(devices), topology_name, title)
