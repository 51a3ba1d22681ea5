"""The source and target models of a run and their tokenizers, loaded by name (training, evaluation, the benches)."""

from __future__ import annotations

import dataclasses

from absl import logging

from mot_jax import sharding
from mot_jax.models.loading import load_model, load_tokenizer


@dataclasses.dataclass
class ModelPair:
    source: object
    target: object
    source_tokenizer: object
    target_tokenizer: object


def load_pair(config, mesh=None) -> ModelPair:
    """The pair a config names (`config.source`, `config.target`, in `config.dtype`). With a `mesh`, the weights are
    created directly in the shardings the run's rules give them (`sharding.llm_rules`). A source that is the target
    (one name) is loaded once: both are the same model object."""
    logging.info("Loading source %s and target %s (%s)", config.source, config.target, config.dtype)
    rules = sharding.llm_rules(config) if mesh is not None else sharding.RULES
    source, _ = load_model(config.source, config.dtype, mesh, rules)
    if config.target == config.source:
        tokenizer = load_tokenizer(config.source)
        return ModelPair(source, source, tokenizer, tokenizer)
    target, _ = load_model(config.target, config.dtype, mesh, rules)
    return ModelPair(source, target, load_tokenizer(config.source), load_tokenizer(config.target))
