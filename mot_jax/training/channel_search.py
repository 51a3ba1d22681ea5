"""Which source layers feed which target layers (the channel map) for a run: the config's fixed map, or the
depth-ratio proxy search that trains a single translator per candidate window and keeps the best."""

from __future__ import annotations

import json

import jax
import ml_collections
from absl import logging
from etils import epath

from mot_jax.files import strict_json
from mot_jax.models.model_pair import ModelPair
from mot_jax.training.setup import translation
from mot_jax.training.trainer import Trainer, fit
from mot_jax.translate import channels


def search_channels(config, pair: ModelPair, datasets, mesh, workdir: epath.Path) -> channels.ChannelMap:
    """The depth-ratio proxy search: every candidate window trains a single translator with the training step for
    `search_steps` and is scored by its validation loss; the scores go to workdir/channel_search.json."""
    c = config.translator.channels
    steps = c.search_steps
    search_config = ml_collections.ConfigDict(config.to_dict())
    search_config.optim.warmup_steps = min(config.optim.warmup_steps, max(steps // 4, 1))
    results = []

    def score(channel_map):
        spec, tcfg = translation(search_config, channel_map, pair, num_experts=1, top_k=1)
        trainer = Trainer(search_config, pair, spec, tcfg, mesh, steps)
        fit(trainer, datasets.train, 0, steps)
        loss = trainer.evaluate(datasets.validation[: c.search_eval_batches])["loss"]
        logging.info(
            "channel search: source %s -> target %s: validation loss %.4f", channel_map.source, channel_map.target, loss
        )
        results.append(dict(source=list(channel_map.source), target=list(channel_map.target), loss=loss))
        return loss

    chosen = channels.resolve(
        pair.source.config.num_layers,
        pair.target.config.num_layers,
        "depth_ratio",
        min_ratio=c.min_ratio,
        max_ratio=c.max_ratio,
        score=score,
        grow_only_if_better=c.grow_only_if_better,
    )
    if jax.process_index() == 0:
        record = dict(scores=results, chosen=json.loads(chosen.to_json()), steps_per_window=steps)
        (workdir / "channel_search.json").write_text(strict_json(record, indent=2))
    return chosen


def resolve_channels(config, pair: ModelPair, datasets=None, mesh=None, workdir=None) -> channels.ChannelMap:
    """The config's channel map. Only the depth-ratio search uses `datasets`, `mesh` and `workdir` (it trains on
    them and writes its scores there); every other mode needs the pair alone."""
    c = config.translator.channels
    source_layers, target_layers = pair.source.config.num_layers, pair.target.config.num_layers
    if config.translator.mode == "direct":
        return channels.terminal(source_layers, target_layers, 1.0)  # unused: direct writes every target layer
    mode = str(c.mode).replace("-", "_")
    if mode == "depth_ratio":
        return search_channels(config, pair, datasets, mesh, workdir)
    return channels.resolve(
        source_layers,
        target_layers,
        mode,
        ratio=c.ratio,
        source_layers=list(c.source_layers) or None,
        target_layers=list(c.target_layers) or None,
    )
