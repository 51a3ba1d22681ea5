"""Weights loaded onto a mesh: each device receives only its slice of each weight (never a whole FSDP-split weight on
one device), the model computes what the unsharded load computes, and a source that is the target loads once."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from hf_reference import CONFIGS, padded_batch, save_tiny

from mot_jax import sharding
from mot_jax.models import model_pair
from mot_jax.models.loading import load_model
from mot_jax.models.registry import flat_params

FSDP = sharding.FSDP_RULES


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random HF checkpoint (untied head, so every kind of weight is there)."""
    path = tmp_path_factory.mktemp("qwen2")
    save_tiny(CONFIGS["qwen2"]["untied_sliding"](), path)
    return str(path)


def split_shapes(model, mesh):
    """{shape: name} of the weights FSDP splits over `data` on `mesh`: none of them may sit whole on one device."""
    split = {}
    for name, var in flat_params(model).items():
        if "data" in sharding.param_sharding(var, mesh, FSDP).spec:
            split[tuple(var.shape)] = name
    return split


def whole_weights_on_one_device(monkeypatch, shapes):
    """Spies on the ways an array reaches a device (`jax.device_put`, `jnp.asarray`, `jnp.array`): the list they
    fill with the name of each array of one of `shapes` they put whole on a single device (traced values, those of
    the abstract model the loader fills, are on none)."""
    seen = []

    def spy(module, name):
        put = getattr(module, name)

        def wrapped(*args, **kwargs):
            out = put(*args, **kwargs)
            for x in jax.tree.leaves(out):
                placed = isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                if placed and tuple(x.shape) in shapes and len(x.sharding.device_set) < 2:
                    seen.append(shapes[tuple(x.shape)])
            return out

        monkeypatch.setattr(module, name, wrapped)

    for module, name in ((jax, "device_put"), (jnp, "asarray"), (jnp, "array")):
        spy(module, name)
    return seen


def test_checkpoint_loads_onto_the_mesh_without_a_whole_weight_on_one_device(checkpoint, monkeypatch):
    mesh = sharding.make_mesh()  # 8 devices on `data`
    unsharded, _ = load_model(checkpoint)
    shapes = split_shapes(unsharded, mesh)
    assert len(shapes) >= 5  # embeddings, attention, MLP, head, norm

    with monkeypatch.context() as patch:
        seen = whole_weights_on_one_device(patch, shapes)
        load_model(checkpoint)
        assert set(seen) == set(shapes.values())  # the spy sees the unsharded load's puts
    with monkeypatch.context() as patch:
        seen = whole_weights_on_one_device(patch, shapes)
        model, _ = load_model(checkpoint, mesh=mesh, rules=FSDP)
        assert seen == []

    for name, var in flat_params(model).items():
        value, placed = var[...], sharding.param_sharding(var, mesh, FSDP)
        assert value.sharding.is_equivalent_to(placed, value.ndim), name
        shard_shapes = {s.data.shape for s in value.addressable_shards}
        assert len(value.addressable_shards) == 8 and shard_shapes == {placed.shard_shape(value.shape)}, name
        if "data" in placed.spec:  # an eighth of it on each device
            assert [math.prod(s) * 8 for s in shard_shapes] == [value.size], name
        np.testing.assert_array_equal(np.asarray(value), np.asarray(flat_params(unsharded)[name][...]), err_msg=name)

    ids, mask = padded_batch(model.config.vocab_size)
    want, _ = unsharded(jnp.asarray(ids), jnp.asarray(mask))
    got, _ = model(jnp.asarray(ids), jnp.asarray(mask))
    # the same weights; the sharded matmuls only sum in another order
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_the_trainers_placement_leaves_weights_loaded_onto_the_mesh_in_place(checkpoint, monkeypatch):
    """`sharding.shard` (the Trainer places the LLMs with it) moves nothing loaded onto the mesh: a bfloat16 load,
    its values those of the unsharded bfloat16 load (converted on the host as on a device)."""
    mesh = sharding.make_mesh()
    model, _ = load_model(checkpoint, "bfloat16", mesh=mesh, rules=FSDP)
    unsharded = flat_params(load_model(checkpoint, "bfloat16")[0])
    before = {name: var[...] for name, var in flat_params(model).items()}
    for name, value in before.items():
        assert value.dtype == unsharded[name][...].dtype == jnp.bfloat16, name
        np.testing.assert_array_equal(np.asarray(value), np.asarray(unsharded[name][...]), err_msg=name)
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: pytest.fail("a weight was moved"))
    sharding.shard(model, mesh, FSDP)
    assert all(var[...] is before[name] for name, var in flat_params(model).items())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_random_model_on_a_mesh_has_the_unsharded_weights_in_their_shardings(dtype):
    mesh = sharding.make_mesh()
    unsharded, _ = load_model("random:llama", dtype)
    model, _ = load_model("random:llama", dtype, mesh=mesh, rules=FSDP)
    for name, var in flat_params(model).items():
        value = var[...]
        placed = sharding.param_sharding(var, mesh, FSDP)
        assert value.sharding.is_equivalent_to(placed, value.ndim) and len(value.addressable_shards) == 8, name
        assert {s.data.shape for s in value.addressable_shards} == {placed.shard_shape(value.shape)}, name
        want = flat_params(unsharded)[name][...]
        assert value.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(value), np.asarray(want), err_msg=name)
    assert any("data" in v[...].sharding.spec for v in flat_params(model).values())


def test_a_source_that_is_the_target_is_loaded_once(monkeypatch):
    loads = []
    load = model_pair.load_model
    monkeypatch.setattr(model_pair, "load_model", lambda name, *a, **k: loads.append(name) or load(name, *a, **k))
    config = ml_collections.ConfigDict(dict(source="random:qwen2", target="random:qwen2", dtype="float32"))
    config.mesh = dict(fsdp=True)
    pair = model_pair.load_pair(config, sharding.make_mesh())
    assert loads == ["random:qwen2"] and pair.source is pair.target
    assert "data" in pair.target.embed_tokens.embedding[...].sharding.spec  # on the mesh by the config's FSDP rules
    other = model_pair.load_pair(ml_collections.ConfigDict(dict(config.to_dict(), target="random:llama")))
    assert other.source is not other.target and loads[1:] == ["random:qwen2", "random:llama"]


def test_the_rules_put_the_llms_heads_and_mlp_on_tensor_and_the_translator_where_the_config_says():
    """A (data 2, expert 1, tensor 4) mesh: q/k/v/gate/up split by their output columns, o/down by their input rows,
    the vocabulary over `tensor`; the translator's own `heads` / `mlp` never on `tensor`, its `embed` over the axis
    `mesh.translator_fsdp` names (`data` with `mesh.fsdp`), none otherwise; a name that is no axis refused."""
    mesh = sharding.make_mesh(data=2, expert=1, tensor=4)
    assert dict(mesh.shape) == {"data": 2, "expert": 1, "tensor": 4}
    config = ml_collections.ConfigDict(dict(mesh=dict(fsdp=False, translator_fsdp="")))
    rules = sharding.llm_rules(config)
    spec = lambda names, rules: tuple(sharding.spec(names, rules, (28, 512, 512), mesh))
    assert spec(("layers", "embed", "heads"), rules) == (None, None, "tensor")
    assert spec(("layers", "embed", "kv"), rules) == (None, None, "tensor")
    assert spec(("layers", "mlp", "embed"), rules) == (None, "tensor", None)
    assert tuple(sharding.spec(("vocab", "embed"), rules, (512, 64), mesh)) == ("tensor", None)
    assert tuple(sharding.spec(("vocab", "embed"), rules, (510, 64), mesh)) == (None, None)  # 510 does not split
    config.mesh.fsdp = True
    assert spec(("layers", "embed", "heads"), sharding.llm_rules(config)) == (None, "data", "tensor")
    translator = lambda: spec(("expert", "embed", "mlp"), sharding.translator_rules(config))
    assert translator() == (None, "data", None)  # an expert axis of 1 splits nothing
    config.mesh.fsdp, config.mesh.translator_fsdp = False, "tensor"
    assert translator() == (None, "tensor", None)
    config.mesh.translator_fsdp = ""
    assert translator() == (None, None, None)
    config.mesh.translator_fsdp = "model"
    with pytest.raises(sharding.MotJaxError, match="not a mesh axis"):
        sharding.translator_rules(config)
