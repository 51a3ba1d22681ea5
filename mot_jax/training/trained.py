"""A trained translator read back from a training workdir, without loading the LLMs (export and evaluation).

Everything needed to rebuild it is in the checkpoint: the translator's shape and wiring (the experiment identity),
the source and target model configs, and the config the run used.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from mot_jax.errors import MotJaxError
from mot_jax.models.base import ModelConfig
from mot_jax.paths import as_path
from mot_jax.training.checkpoint import Checkpoints
from mot_jax.training.optim import adamw
from mot_jax.translate.config import TranslatorConfig
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator


@dataclasses.dataclass
class Trained:
    translator: KVTranslator
    config: ml_collections.ConfigDict  # the training config
    source_config: ModelConfig
    target_config: ModelConfig
    step: int
    meta: dict


def _tuples(value):
    """JSON lists back to the (nested) tuples a frozen ModelConfig holds."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _model_config(fields: dict) -> ModelConfig:
    return ModelConfig(**{k: _tuples(v) for k, v in fields.items()})


def load_trained(workdir, which: str | int = "last", **spec_changes) -> Trained:
    """The translator of the latest (`which="last"`), best-validation (`"best"`) or a given step's checkpoint in
    `workdir`. `spec_changes` replace fields of its TranslationSpec that hold no weights (the replay's attention)."""
    step = int(which) if str(which).isdigit() else None
    if step is None and which not in ("last", "best"):
        raise MotJaxError(f"which={which!r} is not last, best or a step number; pass one of those.")
    which = "last" if step is not None else which
    path = as_path(workdir)
    checkpoints = Checkpoints(path, keep=1, create=False)
    manager = checkpoints.best if which == "best" else checkpoints.last
    steps = list(manager.all_steps()) if (path / manager.directory.name).exists() else []
    if not steps:
        raise MotJaxError(
            f"{path} holds no finished checkpoint ({which}); train there first with python -m mot_jax.train "
            "--config=... --workdir=DIR, or pass the workdir of a run that saved one."
        )
    if step is not None and step not in steps:
        raise MotJaxError(
            f"{path} keeps no checkpoint of step {step}; pick one of steps {', '.join(map(str, sorted(steps)))}, "
            "last or best."
        )
    step = max(steps) if step is None else step
    meta = checkpoints.read_meta(step, which)
    identity = meta["identity"]
    spec = dataclasses.replace(TranslationSpec.from_dict(identity["spec"]), **spec_changes)
    tcfg = TranslatorConfig.from_dict(identity["translator"])
    config = ml_collections.ConfigDict(json.loads(meta["config"]))
    abstract = nnx.eval_shape(lambda: KVTranslator(spec, tcfg, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    tx, _ = adamw(config.optim, config.steps)
    state = dict(
        params=params,
        opt_state=jax.eval_shape(tx.init, params),
        rng=jax.ShapeDtypeStruct((2,), jnp.uint32),
    )
    restored = checkpoints.restore(state, step, which)
    checkpoints.close()
    if not all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(restored["params"])):
        earlier = sorted(s for s in steps if s < step)
        pick = f"pass an earlier step ({', '.join(map(str, earlier))})" if earlier else "train again"
        raise MotJaxError(
            f"The checkpoint of step {step} in {path} holds non-finite weights (NaN or inf: the run diverged); {pick}, "
            "e.g. with a lower --config.optim.learning_rate."
        )
    return Trained(
        translator=nnx.merge(graphdef, restored["params"]),
        config=config,
        source_config=_model_config(identity["source_model"]),
        target_config=_model_config(identity["target_model"]),
        step=step,
        meta=meta,
    )
