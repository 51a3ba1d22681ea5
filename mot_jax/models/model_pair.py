"""The source and target models of a run and their tokenizers, loaded by name (training, evaluation, the benches)."""

from __future__ import annotations

import dataclasses

from absl import logging

from mot_jax.models.loading import load_model, load_tokenizer


@dataclasses.dataclass
class ModelPair:
    source: object
    target: object
    source_tokenizer: object
    target_tokenizer: object


def load_pair(config) -> ModelPair:
    """The pair a config names (`config.source`, `config.target`, in `config.dtype`)."""
    logging.info("Loading source %s and target %s (%s)", config.source, config.target, config.dtype)
    source, target = (load_model(name, config.dtype)[0] for name in (config.source, config.target))
    return ModelPair(source, target, load_tokenizer(config.source), load_tokenizer(config.target))
