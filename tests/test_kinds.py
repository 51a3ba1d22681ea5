"""Every registered translator kind (`mot_jax/translate/kinds/`) through the same checks: it builds and translates a
tiny batch into a cache of the target's shapes that depends on the source (on nothing else where the kind reads no
source); it trains, checkpoints, resumes and
evaluates; and it exports to PyTorch through its declarations (`Kind.torch`, `torch_call`) unless it states why not
(`Kind.no_export`). A new kind gets these tests by being registered; `throwaway`, a kind this module registers for its
tests alone, shows that nothing outside a kind's own file needs an edit (docs/architecture.md, "Adding a kind"), and
that its PyTorch side is its module class in `torch_translator.MODULES`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import load_config, perturb, small_config, tiny_batch, whole_and_resumed

from mot_jax.errors import MotJaxError
from mot_jax.evals import run
from mot_jax.evals.methods import method_name
from mot_jax.export import torch_translator
from mot_jax.export.__main__ import export_workdir
from mot_jax.export.weights import export
from mot_jax.models.model_pair import load_pair
from mot_jax.training import config as config_lib
from mot_jax.training import setup
from mot_jax.translate import channels, kinds
from mot_jax.translate.config import TranslatorConfig
from mot_jax.translate.translator import KVTranslator, source_read, translate

THROWAWAY = "throwaway"


class PerLayerMap(nnx.Module):
    """The throwaway kind's K or V module: one random linear map per window layer, nothing else."""

    def __init__(self, cfg, *, rngs, dtype=jnp.float32):
        shape = (cfg.window, cfg.source_width, cfg.target_width)
        scale = cfg.throwaway_scale / cfg.source_width**0.5
        self.kernel = nnx.Param(scale * jax.random.normal(rngs.params(), shape, dtype))

    def __call__(self, x, mask):
        return jnp.einsum("btwi,wio->btwo", x, self.kernel[...]), {}


class TorchPerLayerMap(torch.nn.Module):
    """The throwaway kind's K or V module on the PyTorch side: what a new kind adds to `torch_translator.py`."""

    def __init__(self, cfg):
        super().__init__()
        self.kernel = torch.nn.Parameter(torch.zeros(cfg.window, cfg.source_width, cfg.target_width))

    def forward(self, x, mask):
        return torch.einsum("btwi,wio->btwo", x, self.kernel)


def register_throwaway():
    return kinds.register(
        kinds.Kind(
            name=THROWAWAY,
            label=lambda t: f"throwaway x{t.throwaway_scale}",
            build=lambda spec, cfg, rngs, dtype: {
                p: PerLayerMap(cfg, rngs=rngs, dtype=dtype) for p in ("key", "value")
            },
            fields=dict(throwaway_scale=2),
            counts=dict(throwaway_scale=1),
            recipe={"translator.mode": "direct"},
            torch={"key": "PerLayerMap", "value": "PerLayerMap"},
        )
    )


@pytest.fixture(params=[*kinds.names(), THROWAWAY])
def kind(request, monkeypatch):
    """Each registered kind, and the throwaway one (registered for the test with its torch module, removed after)."""
    if request.param == THROWAWAY:
        register_throwaway()
        request.addfinalizer(lambda: kinds.unregister(THROWAWAY))
        monkeypatch.setitem(torch_translator.MODULES, "PerLayerMap", TorchPerLayerMap)
    return kinds.get(request.param)


def tiny_config(kind, **overrides):
    """configs/smollm2_gemma3.py for the kind at its reference's settings, on tiny random models."""
    return load_config("smollm2_gemma3.py", "replay,tiny" if kind.name == "mot" else f"{kind.name},tiny", **overrides)


def test_builds_and_translates_a_tiny_batch_into_the_targets_cache_from_the_source(kind):
    config = tiny_config(kind)
    assert config.translator.kind == kind.name and all(k in config.translator for k in kind.fields)
    pair = load_pair(config)
    ls, lt = pair.source.config.num_layers, pair.target.config.num_layers
    channel_map = channels.terminal(ls, lt, config.translator.channels.ratio)
    spec, tcfg = setup.translation(config, channel_map, pair)
    assert tcfg.kind == kind.name and all(getattr(tcfg, k) == config.translator[k] for k in kind.fields)
    translator = KVTranslator(spec, tcfg, rngs=nnx.Rngs(0))
    perturb(translator, seed=1)  # a zero-initialized part (the linear skip before its fit) reads nothing
    batch = jax.tree.map(jnp.asarray, tiny_batch(pair.source_tokenizer, pair.target_tokenizer, batch=3))
    capacity = batch.context.shape[1] + 4

    def cache_from(source_ids, source_mask):
        read, topk = source_read(pair.source, source_ids, source_mask, spec.attention_topk, **spec.source_hands)
        args = (translator, pair.source, pair.target, read, batch.alignment, batch.context, batch.context_mask, topk)
        return translate(*args, capacity=capacity)[0]

    cache = cache_from(batch.source_ids, batch.source_mask)
    t = pair.target.config
    assert cache.k.shape == cache.v.shape == (lt, 3, t.num_kv_heads, capacity, t.head_dim)
    assert np.isfinite(np.asarray(cache.k)).all() and np.isfinite(np.asarray(cache.v)).all()
    # another row's source (same length) changes what the translator writes, unless the kind reads no source
    # (self-prediction: the target's own state alone)
    rolled = cache_from(jnp.roll(batch.source_ids, 1, 0), jnp.roll(batch.source_mask, 1, 0))
    written = list(spec.target_layers)
    assert np.allclose(np.asarray(cache.k)[written], np.asarray(rolled.k)[written]) != spec.reads_source
    assert kind.name_of(config.translator) in method_name(config)  # after "source-free " where it reads none


@pytest.mark.slow
def test_trains_resumes_evaluates_and_exports(kind, tmp_path, monkeypatch):
    """3 steps at once and 3 stopped after step 1 and resumed give the same translator; the evaluation names it and
    its shuffled-source control; export writes a folder the torch side loads, or refuses in one line."""
    config = tiny_config(kind, steps=3, checkpoint_every=1)
    whole, trained = whole_and_resumed(config, tmp_path, monkeypatch, stop_after=1)
    assert np.isfinite(whole["final_validation"]["loss"])
    assert trained[0].cfg.to_dict() == trained[1].cfg.to_dict() and trained[0].cfg.kind == kind.name
    for a, b in zip(*(jax.tree.leaves(nnx.state(t, nnx.Param)) for t in trained), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)

    evaluation = small_config(tasks="extractive_qa", methods="native", ttft_lengths="32", memory=False)
    rows = run.evaluate(tmp_path / "whole", evaluation, out=tmp_path / "eval")["tasks"]["extractive_qa"]["methods"]
    name = method_name(config)
    reads_source = "source" in config.translator.inputs.split(",")  # else no source to shuffle
    assert {name, *[f"{name}, shuffled source"] * reads_source} <= set(rows) and all(rows[name]["predictions"])

    if not kind.no_export:
        folder, _ = export_workdir(tmp_path / "whole", tmp_path / "exported")
        exported = torch_translator.KVTranslator.from_pretrained(folder)
        assert exported.config.kind == kind.name
    else:
        with pytest.raises(MotJaxError, match=f"^kind={kind.name!r} has no PyTorch export \\({kind.no_export}\\); "):
            export_workdir(tmp_path / "whole", tmp_path / "exported")
        assert not (tmp_path / "exported").exists()


def test_no_kind_declares_a_field_every_translator_has():
    shared = {f.name for f in dataclasses.fields(TranslatorConfig)}
    assert not [k for k in kinds.names() if shared & set(kinds.get(k).fields)]


def test_the_torch_side_has_what_every_exported_kind_declares():
    for kind in (kinds.get(n) for n in kinds.names() if not kinds.get(n).no_export):
        assert set(kind.torch.values()) <= set(torch_translator.MODULES) and kind.torch_call in torch_translator.CALLS
        assert callable(getattr(torch_translator.KVTranslator, kind.torch_call))


def test_the_throwaway_kind_exports_through_its_declarations(kind, tmp_path):
    """Each kind (the throwaway one included) exports by what it declares: the torch side builds the modules it
    names and they compute what the JAX modules compute."""
    if kind.no_export:
        pytest.skip(f"kind={kind.name!r} has no export: {kind.no_export}")
    config = tiny_config(kind)
    pair = load_pair(config)
    channel_map = channels.terminal(pair.source.config.num_layers, pair.target.config.num_layers, 0.5)
    spec, tcfg = setup.translation(config, channel_map, pair)
    translator = KVTranslator(spec, tcfg, rngs=nnx.Rngs(0))
    perturb(translator, seed=1)
    folder = export(translator, pair.source, pair.target, tmp_path / "exported")
    exported = torch_translator.KVTranslator.from_pretrained(folder)
    assert exported.config.modules == kind.torch and exported.config.call == kind.torch_call
    assert exported.config.options == dict(tcfg.options)
    if kind.name == THROWAWAY:
        x = np.random.default_rng(0).normal(size=(2, 3, tcfg.window, tcfg.source_width)).astype(np.float32)
        with torch.no_grad():
            got = exported.key(torch.tensor(x), None).numpy()
        np.testing.assert_allclose(got, np.asarray(translator.key(jnp.asarray(x), None)[0]), atol=1e-5, rtol=1e-5)


def test_a_kind_is_one_registered_file():
    """A registered kind is reachable by name from the config, the translator and the reports, its own fields
    travel through the translator config (and a checkpoint's dict of it), and a second kind of the same name or
    with a taken field name is refused."""
    register_throwaway()
    try:
        assert THROWAWAY in kinds.names() and "throwaway_scale" in kinds.fields()
        config = load_config("smollm2_gemma3.py", f"{THROWAWAY},tiny", **{"translator.throwaway_scale": 3})
        assert method_name(config) == "throwaway x3"
        pair = load_pair(config)
        spec, tcfg = setup.translation(config, None, pair)
        assert tcfg.throwaway_scale == 3 and tcfg.to_dict()["throwaway_scale"] == 3
        assert type(tcfg).from_dict(tcfg.to_dict()) == tcfg
        with pytest.raises(MotJaxError, match="already registered"):
            register_throwaway()
        with pytest.raises(MotJaxError, match="declares fields .*throwaway_scale"):
            kinds.register(kinds.Kind(name="another", build=None, fields=dict(throwaway_scale=1)))
        with pytest.raises(MotJaxError, match="throwaway_scale is not a field of a kind='mot' translator"):
            kinds.translator_config(8, 8, 2, throwaway_scale=1)  # the fields merge in the registry
        with pytest.raises(MotJaxError, match="^translator.throwaway_scale=5 is kind='throwaway''s and means nothing "):
            config_lib.check(load_config(**{"translator.kind": "linear", "translator.throwaway_scale": 5}))
    finally:
        kinds.unregister(THROWAWAY)
    with pytest.raises(MotJaxError, match="Unknown translator kind 'throwaway'; use one of "):
        kinds.get(THROWAWAY)
