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
from pathlib import Path

import numpy as np

from mot_jax.errors import MotJaxError
from mot_jax.hlo import biggest_buffers, collectives, ici_traffic

GiB = 2**30
INSTALL = "bash launch/setup.sh --tpu-compile"
PROGRAMS = ("train", "prefill", "decode")
DEFAULT_TOKENS = 1024  # a prefill's prompt tokens unless told


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm: int  # bytes a chip holds
    peak_flops: float  # bf16 dense FLOP/s
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s a chip exchanges with the others


# Cloud TPU's published per-chip figures: bf16 peak, HBM capacity and bandwidth, ICI bandwidth (2,400 / 1,600 /
# 4,800 / 3,584 Gbps), from https://cloud.google.com/tpu/docs/v4, .../v5e, .../v5p and .../v6e (system architecture)
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
    # off a TPU VM libtpu asks the metadata server for the workers' names and logs its failure as an error (three
    # lines before every report or refusal); this machine is the one worker, and nothing connects to it
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
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
    weights: list  # (name, shape, dtype, spec, bytes per chip) of what the program uses whole: models, translator
    optimizer: list = dataclasses.field(default_factory=list)  # the AdamW state, the same way (updated in place)
    tokens: int | None = None  # prefill and decode: the prompt tokens, or those a decode step follows
    rows: int | None = None  # and the rows

    @property
    def total(self) -> int:
        return self.arguments + self.outputs + self.temporaries - self.aliased + self.code


def compile_program(config, topology_name: str, program: str, tokens: int | None = None, batch: int | None = None):
    """(Chip, devices, Compiled) of `program` compiled for the topology: `train`, the config's training step
    (`trace_train`, in the config's shapes); `prefill` of `tokens` tokens (default 1,024, or the target's positions
    if fewer) of the config's target, or one `decode` step after them, `batch` rows (default one a chip)."""
    from mot_jax.training import config as config_lib

    if program not in PROGRAMS:
        raise MotJaxError(f"Unknown program {program!r}; choose one of {', '.join(PROGRAMS)}.")
    config_lib.check(config)  # what training would refuse (a missing key, a count of 0), in one line
    if program == "train" and (tokens, batch) != (None, None):
        raise MotJaxError(
            "The training step takes its shapes from the config; drop --tokens and --batch and set "
            "--config.data.total_tokens, --config.batch_size or --config.grad_accum instead."
        )
    if program != "train":
        tokens = prompt_tokens(model_config(config.target), program, tokens)
        if batch is not None and batch < 1:
            raise MotJaxError(f"--batch={batch} must be at least 1 (or left out: one row a chip).")
    chip, devices = topology(topology_name)
    from mot_jax.bench.flops import matmul_flops

    if program == "train":
        traced, weights, optimizer = trace_train(config, devices)
    else:
        batch = batch or len(devices)
        check_rows(batch, tokens, len(devices))
        traced, weights = _trace_generation(config, devices, program, tokens, batch)
        optimizer = []
    compiled = _compile(traced, program, chip)
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
            weight_bytes=sum(math.prod(shape) * np.dtype(dtype).itemsize for _, shape, dtype, *_ in weights),
            hlo=compiled.as_text(),
            weights=weights,
            optimizer=optimizer,
            tokens=tokens,
            rows=batch,
        ),
    )


def prompt_tokens(cfg, program: str, tokens: int | None) -> int:
    """The prefill's prompt tokens (or the tokens a decode step follows): `tokens`, or by default 1,024 or as many
    as the target's positions hold; refused in one line outside them (past them a program is meaningless, and
    XLA aborts the process on shapes whose size overflows)."""
    room = cfg.max_positions - (program == "decode")  # the decode step writes one more position
    tokens = min(DEFAULT_TOKENS, room) if tokens is None else tokens
    if not 1 <= tokens <= room:
        raise MotJaxError(
            f"--tokens={tokens} is outside 1..{room}, what the target's {cfg.max_positions} positions hold for a "
            f"{program}; pass a number in that range."
        )
    return tokens


def check_rows(rows: int, tokens: int, chips: int) -> None:
    """Refuse, in one line, rows that do not split over the chips, or a program of more tokens than int32 indexes
    (jax refuses such a shape with a traceback)."""
    if rows % chips:
        raise MotJaxError(f"--batch={rows} does not split over {chips} chips; use a multiple of it.")
    if rows * tokens >= 2**31:
        raise MotJaxError(
            f"--batch={rows} rows of {tokens} tokens are {rows * tokens:,} tokens, more than a program indexes "
            f"(2**31 - 1); pass fewer rows or tokens."
        )


def _compile(traced, program: str, chip: Chip):
    """XLA's compile of a traced program; its refusal of a program a chip cannot hold (past some size XLA stops
    before planning) as one sentence."""
    try:
        return traced.lower().compile()
    except Exception as e:  # jax.errors.JaxRuntimeError
        text = _first_line(e)
        if "RESOURCE_EXHAUSTED" not in text:
            raise
        said = text.split("RESOURCE_EXHAUSTED:", 1)[1].strip().rstrip(".")
        raise MotJaxError(
            f"The {program} does not fit a {chip.name} chip: XLA says {said}; compile fewer tokens or rows, or for a "
            "larger slice."
        ) from None


def placement(prefix: str, tree) -> list:
    """(name, shape, dtype, spec, bytes a chip) of each leaf of a tree of sharded ShapeDtypeStructs (an nnx State's
    variables, or any pytree), named by its path under `prefix`."""
    import jax
    from flax import nnx

    if isinstance(tree, nnx.State):
        leaves = [(".".join(map(str, path)), var.get_value()) for path, var in nnx.to_flat_state(tree)]
    else:
        keys = lambda path: ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)
        leaves = [(keys(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]
    rows = []
    for name, value in leaves:
        per_chip = math.prod(value.sharding.shard_shape(value.shape)) * np.dtype(value.dtype).itemsize
        name = f"{prefix}.{name}" if prefix else name
        rows.append((name, value.shape, np.dtype(value.dtype).name, value.sharding.spec, per_chip))
    return rows


def compile_channels(config, pair):
    """The config's channel map for a compile: the depth-ratio search (which trains) replaced by the largest window
    it may choose (`max_ratio`), at the top; the translator's shapes and the step's work depend on the window's
    size only."""
    from mot_jax.training.channel_search import resolve_channels
    from mot_jax.translate import channels

    c = config.translator.channels
    if config.translator.mode != "direct" and str(c.mode).replace("-", "_") == "depth_ratio":
        return channels.terminal(pair.source.config.num_layers, pair.target.config.num_layers, c.max_ratio)
    return resolve_channels(config, pair)


def trace_train(config, devices):
    """(traced, weights, optimizer) of the config's training step (`Trainer._train_step`: translator forward, the
    frozen source and target forwards, the loss and its gradient over the micro-batches, the AdamW update) traced
    on `devices` from abstract state: abstract models in the config's real shapes, the trainer's mesh and
    shardings, a batch of the config's shapes. `weights` lists the frozen models and the translator, `optimizer`
    the AdamW state (`placement`)."""
    from flax import nnx

    from mot_jax.models.model_pair import ModelPair
    from mot_jax.models.registry import build_model, resolve_dtype
    from mot_jax.training import setup
    from mot_jax.training.trainer import Trainer, abstract_batch

    mesh = setup.make_mesh(config, devices)
    build = lambda name: build_model(model_config(name), resolve_dtype(config.dtype), abstract=True)
    source = build(config.source)
    target = source if config.target == config.source else build(config.target)  # one model, as `load_pair`
    pair = ModelPair(source, target, None, None)
    setup.check_lengths(config, pair)
    spec, tcfg = setup.translation(config, compile_channels(config, pair), pair)
    trainer = Trainer(config, pair, spec, tcfg, mesh, config.steps, abstract=True)
    traced = trainer.trace_train_step(abstract_batch(config, config.grad_accum))
    models = [("model", source)] if source is target else [("source", source), ("target", target)]
    models = models if trainer.runs_source else [("target", target)]  # the step takes no weights of a source unread
    weights = [row for name, m in models for row in placement(name, nnx.state(m, nnx.Param))]
    weights += placement("translator", trainer.state["params"])
    return traced, weights, placement("adamw", trainer.state["opt_state"])


def _trace_generation(config, devices, program: str, tokens: int, batch: int):
    """(traced, weights) of the target's prefill or decode step (`compile_program`)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding

    from mot_jax import sharding
    from mot_jax.models import generation
    from mot_jax.models.cache import KVCache
    from mot_jax.models.registry import build_model, resolve_dtype

    cfg = model_config(config.target)
    mesh = sharding.make_mesh(devices=list(devices))  # every chip on `data`: rows, and FSDP when the config asks
    rules = sharding.llm_rules(config)
    model = sharding.shard(build_model(cfg, resolve_dtype(config.dtype), abstract=True), mesh, rules)
    graphdef, state = nnx.split(model)

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
    with jax.set_mesh(mesh):  # the model's attention reads the chips' platform and the mesh from it
        traced = jax.jit(step, donate_argnums=donate).trace(*args)
    return traced, placement("", nnx.state(model, nnx.Param))


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


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A roofline estimate of one step on real chips (none ran): each bound's seconds and the slowest."""

    compute: float  # the FLOPs spread evenly over the chips at their peak
    weights: float  # every weight read once from HBM
    ici: float  # the collectives' bytes a chip moves (`ici_traffic`) at its ICI bandwidth
    traffic: int  # those bytes

    @property
    def seconds(self) -> float:
        return max(self.compute, self.weights, self.ici)

    @property
    def mfu(self) -> float:
        """The model FLOPs utilisation if the step ran at that time: an upper bound."""
        return self.compute / self.seconds


def estimate(compiled: Compiled, chip: Chip, chips: int) -> Estimate:
    """The step's roofline: the slowest of its FLOPs at the chips' peak, each chip reading every weight once at its
    HBM bandwidth, and its collectives' traffic over ICI, everything else perfectly overlapped. Activations' HBM
    traffic is left out, so the time is a lower bound and the MFU an upper one."""
    traffic = ici_traffic(compiled.hlo)
    return Estimate(
        compute=compiled.flops / (chips * chip.peak_flops),
        weights=compiled.weight_bytes / chip.hbm_bandwidth,
        ici=traffic / chip.ici_bandwidth,
        traffic=traffic,
    )


def report(compiled: Compiled, chip: Chip, chips: int, topology_name: str, title: str) -> str:
    """The compile report as text (Markdown tables)."""
    gib = lambda b: f"{b / GiB:.2f}"
    est = estimate(compiled, chip, chips)
    ms = lambda seconds: f"{seconds * 1e3:.2f} ms"
    lines = [
        f"{title} compiled for {topology_name} ({chips} x {chip.name}, {gib(chip.hbm)} GiB HBM a chip).",
        "",
        "| per chip (XLA's memory plan) | GiB |",
        "|---|---|",
        f"| arguments | {gib(compiled.arguments)} |",
        f"| temporaries | {gib(compiled.temporaries)} |",
        f"| outputs | {gib(compiled.outputs)} |",
        f"| aliased (donated) | {gib(compiled.aliased)} |",
        f"| code | {gib(compiled.code)} |",
        f"| total | {gib(compiled.total)} of {gib(chip.hbm)} ({compiled.total / chip.hbm:.0%}) |",
        "",
        f"Step matmul FLOPs (counted in the jaxpr, loops times their trip counts, recomputation included): "
        f"{compiled.flops / 1e12:.3f} TFLOP in all, {compiled.flops / chips / 1e12:.3f} a chip if spread evenly.",
        f"Estimated step time (a roofline, no TPU ran): {ms(est.seconds)}, the slowest of: the FLOPs at "
        f"{chip.peak_flops / 1e12:.0f} TFLOP/s a chip: {ms(est.compute)}; every weight ({gib(compiled.weight_bytes)} "
        f"GiB) read once from HBM at {chip.hbm_bandwidth / 1e9:.0f} GB/s: {ms(est.weights)}; the collectives' "
        f"{gib(est.traffic)} GiB a chip moves a step (below; an all-reduce twice) at {chip.ici_bandwidth / 1e9:.0f} "
        f"GB/s over ICI: {ms(est.ici)}. Estimated MFU at most {est.mfu:.0%} (activations' HBM traffic left out, "
        "everything else perfectly overlapped).",
        "",
        "| collective (per chip, by result bytes) | in the program text: count | MiB | a step (loops times their "
        "trip counts): count | MiB |",
        "|---|---|---|---|---|",
    ]
    text, step = collectives(compiled.hlo), collectives(compiled.hlo, per_step=True)
    mib = lambda b: f"{b / 2**20:,.1f}"
    lines += [
        f"| {kind} | {n} | {mib(size)} | {step[kind][0]} | {mib(step[kind][1])} |"
        for kind, (n, size) in sorted(text.items())
    ] or ["| none | 0 | 0 | 0 | 0 |"]
    lines += ["", "| weight | shape | dtype | sharding | MiB a chip |", "|---|---|---|---|---|"]
    for name, shape, dtype, spec, per_chip in compiled.weights:
        lines.append(f"| {name} | {list(shape)} | {dtype} | {_spec_text(spec)} | {per_chip / 2**20:.1f} |")
    replicated = sum(b for *_, spec, b in compiled.weights if not any(spec))
    lines.append(f"\nReplicated on every chip: {gib(replicated)} GiB of {gib(compiled.weight_bytes)} GiB of weights.")
    if compiled.optimizer:
        whole = sum(math.prod(shape) * np.dtype(dtype).itemsize for _, shape, dtype, *_ in compiled.optimizer)
        per_chip = sum(b for *_, b in compiled.optimizer)
        lines.append(f"AdamW state: {gib(whole)} GiB in all, {gib(per_chip)} GiB a chip.")
    return "\n".join(lines)


def _spec_text(spec) -> str:
    return "replicated" if not any(spec) else str(tuple(spec))


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def run(config, topology_name: str, program: str = "prefill", tokens: int | None = None, batch: int | None = None):
    """Compile and report (what `python -m mot_jax.compile` prints); refuses when a chip would not hold it."""
    chip, devices, compiled = compile_program(config, topology_name, program, tokens, batch)
    check_fits(compiled, chip)
    return report(compiled, chip, len(devices), topology_name, title(config, program, compiled.tokens, compiled.rows))


def title(config, program: str, tokens: int | None, rows: int | None) -> str:
    """What the report says was compiled (`tokens` and `rows`: the prefill's or decode's, as compiled)."""
    from mot_jax import sharding

    if program == "train":
        over = lambda split: "FSDP-split over `data`" if split else "replicated over `data`"
        tensor = config.mesh.get("tensor", 1)
        heads = f", heads and MLP over `tensor` ({tensor})" if tensor > 1 else ""
        axis = sharding.translator_rules(config).get("embed")
        translator = f"FSDP-split over `{axis}`" if axis else "replicated"
        return (
            f"The training step of {config.source} -> {config.target} ({config.batch_size} x {config.grad_accum} "
            f"sequences of {config.data.total_tokens} tokens, {config.dtype}, remat {config.remat!r}; the frozen "
            f"models {over(config.mesh.fsdp)}{heads}; the translator and its AdamW state {translator}, the "
            "experts over `expert`)"
        )
    if program == "prefill":
        return f"{config.target}'s prefill ({rows} rows x {tokens} tokens, {config.dtype})"
    return f"{config.target}'s decode step ({rows} rows after {tokens} tokens, {config.dtype})"
