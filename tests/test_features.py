"""The feature cache (`data.feature_cache`, training/features.py): the stored features equal the ones computed live,
a step from them gives the live step's loss and gradients, a cached run resumes exactly, and the refusals."""

import hashlib
import json
from typing import NamedTuple

import jax
import numpy as np
import pytest
from helpers import load_config, whole_and_resumed

from mot_jax.errors import MotJaxError
from mot_jax.jit import jit
from mot_jax.models.model_pair import load_pair
from mot_jax.training import config as config_lib
from mot_jax.training import features, setup
from mot_jax.training.channel_search import resolve_channels
from mot_jax.training.trainer import Trainer

# the B=1 dial reading the source, the target's embeddings and hidden states, with the K/V MSE and the attention loss
KV_SPACE = {
    "translator.mode": "direct",
    "translator.native_bottom": 1,
    "translator.inputs": "source,embeddings,hidden",
    "translator.channels.mode": "terminal",
    "loss.ce_weight": 0.0,
    "loss.attention_weight": 1.0,
    "data.feature_cache": True,
    "data.train_chunks": 6,
}


def kv_config(**overrides):
    return load_config("smollm2_gemma3.py", "direct,tiny", **(KV_SPACE | overrides))


def test_cached_features_and_step_equal_live(tmp_path, monkeypatch):
    """The stored features of a validation batch equal `frozen_inputs` computed live (exactly, fp32), the training
    table's rows equal their own batches' live features, and the loss and gradients from them equal the live step's
    (the frozen forwards inside it)."""
    monkeypatch.setattr(features, "cache_root", lambda: tmp_path)  # the corpus stays in the shared cache
    config = kv_config()
    pair = load_pair(config)
    datasets = setup.make_datasets(config, pair)
    mesh = setup.make_mesh(config)
    spec, tcfg = setup.translation(config, resolve_channels(config, pair, datasets, mesh, None), pair)
    trainer = Trainer(config, pair, spec, tcfg, mesh, config.steps)
    validation = datasets.validation[:1]
    stream, cached = features.attach_features(config, pair, spec, tcfg.kind, datasets.train, validation)
    assert len(list((tmp_path / "features").glob("[!.]*"))) == 2  # the training and the validation table
    layout = cached[0].features.layout
    assert layout.batch_axes[0] == 1 and layout.target_layers == tuple(range(1, pair.target.config.num_layers))

    live = jit(lambda s, t, b: layout.trim(features.frozen_inputs(s, t, b, spec, tcfg.kind, reads=True)))
    unpack = jax.jit(lambda f: layout.trim(f.unpack()))
    for batch, stored in (
        (validation[0], cached[0]),
        (datasets.train.batch(1), stream.batch(1)),  # rows of the training table, in the stream's order
    ):
        want, got = live(pair.source, pair.target, batch), unpack(stored.features)
        assert jax.tree.structure(want) == jax.tree.structure(got)
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))

    def loss_and_grads(batch):
        fn = trainer._loss(trainer.state["params"], trainer.llm_states, batch)
        return jax.value_and_grad(fn, has_aux=True)(trainer.state["params"])

    step = jax.jit(loss_and_grads)
    (loss, metrics), grads = step(trainer.place(validation[0], micro=False))
    (cached_loss, cached_metrics), cached_grads = step(trainer.place(cached[0], micro=False))
    assert "ce" not in metrics and metrics["attention"] > 0  # a KV-space objective: no forward over the prompt
    for key in metrics:
        np.testing.assert_allclose(cached_metrics[key], metrics[key], rtol=1e-6, err_msg=key)
    for w, g in zip(jax.tree.leaves(grads), jax.tree.leaves(cached_grads)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-9)
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads)) > 0


@pytest.mark.slow
def test_a_cached_run_resumes_exactly(tmp_path, monkeypatch):
    """The tiny K/V-space run from the feature cache: 3 steps at once and 3 stopped after step 1 and resumed give the
    same translator (the second run builds nothing: the cache is shared)."""
    monkeypatch.setattr(features, "cache_root", lambda: tmp_path / "cache")
    config = kv_config(steps=3, checkpoint_every=1)
    whole, trained = whole_and_resumed(config, tmp_path, monkeypatch, stop_after=1)
    assert "ce" in whole["final_validation"]  # validation still reports the CE
    assert len(list((tmp_path / "cache" / "features").glob("[!.]*"))) == 2  # built once, for both runs
    for a, b in zip(*(jax.tree.leaves(t) for t in trained)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_refusals():
    """feature_cache with the prompt CE, the KL, retrieval or question rows on is refused in one line saying why."""
    for overrides, why in (
        ({"loss.ce_weight": 1.0}, "the prompt CE / KL run the target over the prompt"),
        ({"loss.distill_weight": 0.5}, "the prompt CE / KL run the target over the prompt"),
        ({"data.copy_fraction": 0.5}, "data.copy_fraction rewrites prompts per step"),
        ({"data.fact_fraction": 0.5}, "data.fact_fraction rewrites prompts per step"),
    ):
        with pytest.raises(MotJaxError, match=f"^data.feature_cache=True .*{why}.*\\.$"):
            config_lib.check(kv_config(**overrides))
    config_lib.check(kv_config())  # the K/V-space objective passes
    config_lib.check(kv_config(**{"loss.ce_weight": 1.0, "data.feature_cache": False}))


class Rows(NamedTuple):  # a batch as `features.build` reads it: rows on the first axis of `context`
    context: np.ndarray


def build_doubled(root):
    """A feature table of two batches of two rows whose stored leaf is twice the rows (no models)."""
    values = np.arange(8.0, dtype=np.float32).reshape(4, 2)
    batches = [Rows(values[:2]), Rows(values[2:])]
    return features.build(root, dict(test=1), lambda b: [b.context * 2], batches, len(values), "test rows")


def test_a_killed_build_leaves_nothing_behind_the_next_build(tmp_path):
    name = hashlib.sha256(json.dumps(dict(test=1)).encode()).hexdigest()[:24]  # the entry's name, as build makes it
    killed = tmp_path / "features" / f".{name}.4242.0123abcd.partial"  # as atomic_folder names its staging
    (killed / "leaf_0.npy").parent.mkdir(parents=True)
    (killed / "leaf_0.npy").write_bytes(b"half")
    other = tmp_path / "features" / f".{name}x.4242.0123abcd.partial"  # another entry's, maybe being built
    other.mkdir()
    path = build_doubled(tmp_path)
    assert path.name == name and not killed.exists() and other.exists()
    assert sorted(p.name for p in (tmp_path / "features").iterdir()) == sorted([name, other.name, f".{name}.lock"])


@pytest.mark.parametrize("damage", ["cut", "meta"])
def test_a_damaged_entry_is_built_again(tmp_path, damage, caplog):
    path = build_doubled(tmp_path)
    leaf = path / "leaf_0.npy"
    if damage == "cut":
        leaf.write_bytes(leaf.read_bytes()[:-8])
    else:
        (path / "meta.json").write_text("{")
    assert build_doubled(tmp_path) == path
    assert f"The feature cache entry {path} is damaged" in caplog.text
    table = features.FeatureTable(path, layout=None)
    np.testing.assert_array_equal(table.take([3]).leaves[0], [[12.0, 14.0]])


def test_non_finite_values_on_disk_are_refused_naming_the_file(tmp_path):
    path = build_doubled(tmp_path)
    leaf = np.load(path / "leaf_0.npy", mmap_mode="r+")
    leaf[2, 1] = np.float32(np.nan).view(leaf.dtype)  # stored as raw uint32
    leaf.flush()
    table = features.FeatureTable(path, layout=None)
    table.take([0, 1])  # rows without the damage read
    with pytest.raises(MotJaxError, match=rf"^The feature cache file {path / 'leaf_0.npy'} holds non-finite values"):
        table.take([1, 2])
