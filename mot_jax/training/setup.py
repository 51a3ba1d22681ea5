"""What a training run sets up before its first step: the model pair, the data, the mesh, the translator's spec and
config, and the identity a checkpoint must match to be resumed."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
from etils import epath

from mot_jax import sharding
from mot_jax.errors import MotJaxError
from mot_jax.models.model_pair import ModelPair
from mot_jax.training import chunk_table, corpus, data
from mot_jax.training import config as config_lib
from mot_jax.translate import kinds, window
from mot_jax.translate.config import TranslatorConfig
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import mixture_config

# the translator config keys every kind reads (a kind's own: `Kind.fields`)
TRANSLATOR_KEYS = [f.name for f in dataclasses.fields(TranslatorConfig) if f.name != "options"]


@dataclasses.dataclass
class Datasets:
    train: data.Batches  # the shuffled infinite stream; `batch(position)`
    validation: list  # fixed batches: the first `eval_batches` score checkpoints, the next ones are held out


def check_lengths(config, pair: ModelPair) -> None:
    """Refuse, in one line, chunks longer than the models' positions (a learned position table would be read past its
    end, silently; a TPU compile of such shapes can abort the process)."""
    d = config.data
    for key, value, side in (("total_tokens", d.total_tokens, "target"), ("source_length", d.source_length, "source")):
        positions = getattr(pair, side).config.max_positions
        if value > positions:
            raise MotJaxError(
                f"data.{key}={value} is more than the {side}'s {positions} positions; pass --config.data.{key}="
                f"{positions} or fewer (data.prefix_tokens and data.source_length scaled alike)."
            )


def make_datasets(config, pair: ModelPair, rows: slice = slice(None)) -> Datasets:
    """`rows`: the rows of each global batch this process builds (multihost.local_rows; all of them by default)."""
    check_lengths(config, pair)
    d = config.data
    documents = corpus.documents(d.corpus, d.data_dir or None)
    eos = pair.target.config.eos_ids
    if not eos:
        raise MotJaxError(f"The target {config.target!r} defines no EOS token id, which separates documents.")
    tokenizers = dict(source_tokenizer=pair.source_tokenizer, target_tokenizer=pair.target_tokenizer)
    lengths = dict(source_length=d.source_length, prefix_tokens=d.prefix_tokens)

    def chunks(split):
        texts = documents[split].head(d.max_documents) if d.get("max_documents") else documents[split]
        return chunk_table.TextChunks(
            texts,
            pair.target_tokenizer,
            eos_id=eos[0],
            total_tokens=d.total_tokens,
            **lengths,
            source_tokenizer=pair.source_tokenizer,
        )

    needed = max(config.eval_batches, config.translator.channels.search_eval_batches) + config.final_eval_batches
    train = chunks("train")
    if d.get("train_chunks"):  # the table's first N chunks only (a small table for the feature cache)
        train = np.asarray(train)[: d.train_chunks]
    return Datasets(
        data.Batches(
            train,
            config.batch_size,
            config.seed,
            **tokenizers,
            **lengths,
            rows=rows,
            copy_fraction=config.data.copy_fraction,
            question_fraction=config.data.get("question_fraction", 0.0),
            fact_fraction=config.data.get("fact_fraction", 0.0),
        ),
        data.validation_batches(
            chunks("validation"), config.batch_size, **tokenizers, **lengths, max_batches=needed, rows=rows
        ),
    )


def make_mesh(config, devices=None) -> jax.sharding.Mesh:
    """The run's (data, expert, tensor) mesh over `devices` (default: this run's; a TPU topology's abstract devices
    to compile for it, `mot_jax.aot`)."""
    data_axis, expert_axis, tensor_axis = config.mesh.data, config.mesh.expert, config.mesh.get("tensor", 1)
    every = jax.devices() if devices is None else list(devices)
    devices = every if data_axis == -1 else every[: data_axis * expert_axis * tensor_axis]
    if jax.process_count() > 1 and len(devices) != len(every):
        raise MotJaxError(
            f"A run of {jax.process_count()} processes uses all {jax.device_count()} devices; set "
            "--config.mesh.data=-1 (or data x expert x tensor to the device count)."
        )
    mesh = sharding.make_mesh(data_axis, expert_axis, devices, tensor_axis)
    if config.batch_size % mesh.shape["data"]:
        raise MotJaxError(
            f"batch_size={config.batch_size} is not divisible by the mesh's data axis ({mesh.shape['data']} devices); "
            "set --config.batch_size to a multiple of it or --config.mesh.data to a divisor of it."
        )
    return mesh


def translation(config, channel_map, pair: ModelPair, **overrides) -> tuple[TranslationSpec, TranslatorConfig]:
    """The config's translator for this pair and channel map; `overrides` replace TranslatorConfig fields."""
    settings = config.translator
    num_target_layers = pair.target.config.num_layers
    window.check_native_bottom(settings.native_bottom, num_target_layers, settings.mode, translates=True)
    spec = TranslationSpec.build(
        settings.mode,
        channel_map,
        pair.source.config.num_layers,
        num_target_layers,
        native_bottom=settings.native_bottom,
        inputs=tuple(i.strip() for i in settings.inputs.split(",") if i.strip()),
        outputs=settings.outputs,
        kind=overrides.get("kind", settings.kind),
        sparse_attention=settings.sparse_attention,
        k_attn=settings.k_attn,
        dense_bottom=settings.dense_bottom,
        rotary=settings.rotary,
    )
    keys = [*TRANSLATOR_KEYS, *kinds.get(overrides.get("kind", settings.kind)).fields]
    kwargs = {k: settings[k] for k in keys if k in settings} | overrides
    return spec, mixture_config(spec, pair.source, pair.target, **kwargs)


def identity(config, spec: TranslationSpec, tcfg: TranslatorConfig, pair: ModelPair) -> dict:
    """What a checkpoint must match to be resumed: the model pair and the translator's shape and wiring."""
    return json.loads(
        json.dumps(
            dict(
                source=config.source,
                target=config.target,
                source_model=dataclasses.asdict(pair.source.config),
                target_model=dataclasses.asdict(pair.target.config),
                translator=tcfg.to_dict(),
                spec=spec.to_dict(),
            ),
            default=str,
        )
    )


def check_identity(saved: dict, current: dict, workdir: epath.Path):
    """Refuse to resume a run whose identity (`Checkpoints.read_meta`'s, upgraded) differs from this config's."""
    differ = sorted(k for k in current if saved.get(k) != current[k])
    if differ:
        raise MotJaxError(
            f"{workdir} holds a run of another experiment (it differs in: {', '.join(differ)}); pass a new --workdir, "
            "or the config that made it."
        )


# what a resumed run may change: how long it trains, how it reports and where it runs, not what a step computes
RESUMABLE = {"steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "final_eval_batches"}
RESUMABLE |= {"data.data_dir", "mesh.data", "mesh.expert", "mesh.tensor", "mesh.fsdp", "mesh.translator_fsdp"}


def flat(tree: dict, prefix: str = "") -> dict:
    """A nested dict's leaves by dotted key."""
    out = {}
    for k, v in tree.items():
        out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def config_changes(saved: str, config, workdir, step: int) -> dict:
    """{key: [saved value, value now]} of the keys that resuming the run saved with config `saved` (JSON) at `step`
    changes; a change of any key outside RESUMABLE would make the run's record false, and is refused. Keys one side
    lacks (added since, or dropped) count as unchanged."""
    before, now = flat(json.loads(saved)), flat(json.loads(config_lib.to_json(config)))
    changed = {k: [before[k], now[k]] for k in sorted(before.keys() & now.keys()) if before[k] != now[k]}
    refused = [f"{k}={changed[k][0]!r} (now {changed[k][1]!r})" for k in changed if k not in RESUMABLE]
    if refused:
        raise MotJaxError(
            f"{workdir} was trained to step {step} with {', '.join(refused)}; resume with the values it was started "
            "with, or pass a new --workdir."
        )
    return changed
