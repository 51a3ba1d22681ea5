"""The jitted training step: learning on tiny models, and the sharded step against the single-device step."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import Fixed, tiny_batch, tiny_config, trainer_for

from mot_jax.errors import MotJaxError
from mot_jax.training.setup import make_mesh
from mot_jax.training.trainer import NonFinite, fit
from mot_jax.translate.linear_skip import RIDGE_GRID, solve_linear_skip


@pytest.mark.parametrize("mode", ["replay", "direct"])
def test_loss_goes_down_on_tiny_models(mode):
    c = tiny_config(mode=mode)
    c.optim.learning_rate, c.optim.warmup_steps = 3e-3, 2
    trainer, pair = trainer_for(c, make_mesh(c), steps=24)
    batches = [tiny_batch(pair.source_tokenizer, pair.target_tokenizer, offset=2 * i) for i in range(3)]
    before = trainer.evaluate(batches)
    fit(trainer, Fixed(batches), 0, 24)
    after = trainer.evaluate(batches)
    assert after["loss"] < before["loss"] - 0.1, (before, after)
    assert after["mse_k"] + after["mse_v"] < 0.8 * (before["mse_k"] + before["mse_v"]), (before, after)


@pytest.mark.devices(4)
def test_translator_and_its_adamw_moments_are_split_where_the_frozen_models_are():
    """With `mesh.fsdp` the translator takes the frozen models' rules (split over `data`), and AdamW's moments live
    in their parameters' shardings (XLA left alone replicates them: zeros read no input)."""
    c = tiny_config(num_experts=2, top_k=1)
    c.batch_size, c.mesh.data, c.mesh.expert, c.mesh.fsdp = 4, 2, 2, True
    trainer, _ = trainer_for(c, make_mesh(c), steps=1)
    params = trainer.state["params"]
    assert any("data" in p.sharding.spec for p in jax.tree.leaves(params))
    for moment in ("mu", "nu"):
        moments = optax.tree_utils.tree_get(trainer.state["opt_state"], moment)
        placed = jax.tree.map(lambda p, m: m.sharding.is_equivalent_to(p.sharding, p.ndim), params, moments)
        assert all(jax.tree.leaves(placed)), moment


@pytest.mark.devices(8)
def test_sharded_step_equals_single_device_step():
    """data 4 x expert 2 over 8 CPU devices against one device: same parameters after two steps."""
    results = []
    for data, expert in ((1, 1), (4, 2)):
        c = tiny_config(num_experts=2, top_k=1, dispatch="sparse", capacity_factor=2.0)
        c.batch_size, c.mesh.data, c.mesh.expert = 4, data, expert
        # Adam's first steps are lr * g / |g|: for a gradient that is ~0 the summation order decides the sign.
        # A large eps makes the update ~ lr * g, so the comparison sees the gradients, not that noise.
        c.optim.learning_rate, c.optim.eps = 0.1, 1.0
        mesh = make_mesh(c)
        trainer, pair = trainer_for(c, mesh, steps=2)
        batches = [tiny_batch(pair.source_tokenizer, pair.target_tokenizer, batch=4, offset=4 * i) for i in range(4)]
        metrics = []
        fit(trainer, Fixed(batches), 0, 2, lambda step, m, s, metrics=metrics: metrics.append(m))
        if expert > 1:  # the experts really are split over the expert axis
            leaf = jax.tree.leaves(trainer.state["params"]["key"]["experts"])[0]
            assert leaf.sharding.spec[0] == "expert" and len(leaf.sharding.device_set) == 8
        results.append((jax.device_get(trainer.state["params"]), metrics))
    (single, single_metrics), (sharded, sharded_metrics) = results
    for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
    for a, b in zip(single_metrics, sharded_metrics, strict=True):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)


@pytest.mark.devices(4)
def test_a_step_with_heads_and_mlp_over_tensor_equals_the_step_without():
    """data 2 x tensor 2 (the frozen models' heads, KV heads, MLP and vocabulary over `tensor`, the translator over
    `data`) against data 4 on the same 4 devices: the same parameters and loss after two steps, and each weight where
    the rules put it. (With an expert axis of 2 beside them, 8 devices, XLA's CPU runtime deadlocks: its devices wait
    in different collectives.)"""
    results = []
    for data, tensor in ((4, 1), (2, 2)):
        c = tiny_config(num_experts=2, top_k=1, dispatch="sparse", capacity_factor=2.0)
        c.batch_size, c.mesh.data, c.mesh.expert, c.mesh.tensor, c.mesh.translator_fsdp = 4, data, 1, tensor, "data"
        c.optim.learning_rate, c.optim.eps = 0.1, 1.0  # the update ~ lr * g (test_sharded_step_equals_single_...)
        trainer, pair = trainer_for(c, make_mesh(c), steps=2)
        batches = [tiny_batch(pair.source_tokenizer, pair.target_tokenizer, batch=4, offset=4 * i) for i in range(4)]
        metrics = []
        fit(trainer, Fixed(batches), 0, 2, lambda step, m, s, metrics=metrics: metrics.append(m))
        results.append((jax.device_get(trainer.state["params"]), metrics))
        specs = [p.sharding.spec for p in jax.tree.leaves(trainer.state["params"])]
        assert any("data" in spec for spec in specs) and not any("tensor" in spec for spec in specs)
    for model in (pair.source, pair.target):  # [layers, in, out] kernels: q/k/v/gate/up by columns, o/down by rows
        layers = model.layers
        split = {
            "q": (layers.self_attn.q_proj.kernel, (None, None, "tensor")),
            "k": (layers.self_attn.k_proj.kernel, (None, None, "tensor")),
            "o": (layers.self_attn.o_proj.kernel, (None, "tensor", None)),
            "up": (layers.mlp.up_proj.kernel, (None, None, "tensor")),
            "down": (layers.mlp.down_proj.kernel, (None, "tensor", None)),
            "embed": (model.embed_tokens.embedding, ("tensor", None)),
        }
        for name, (var, want) in split.items():
            assert tuple(var[...].sharding.spec) == want, (type(model).__name__, name, var[...].sharding.spec)
    (whole, whole_metrics), (split, split_metrics) = results
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(split), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
    for a, b in zip(whole_metrics, split_metrics, strict=True):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)


@pytest.mark.devices(8)
def test_linear_skip_fit_is_the_same_on_a_sharded_mesh():
    """The least-squares start sums its statistics over the global batch: data 4 x expert 2 gives the one-device fit,
    and the fit lowers the K and V errors it reports."""
    fitted = []
    for data, expert in ((1, 1), (4, 2)):
        c = tiny_config(mode="direct", rotary=True, output_activation="none", linear_skip=True)
        c.batch_size, c.mesh.data, c.mesh.expert = 4, data, expert
        trainer, pair = trainer_for(c, make_mesh(c), steps=1)
        batches = [
            tiny_batch(pair.source_tokenizer, pair.target_tokenizer, batch=4, context=20, offset=4 * i)
            for i in range(3)
        ]
        results = trainer.fit_linear_skip(batches)
        for result in results.values():
            assert result["after"] < 0.9 * result["before"], results
        params = trainer.state["params"]
        fitted.append(jax.device_get({name: params[f"{name}_skip"] for name in ("key", "value")}))
    for a, b in zip(jax.tree.leaves(fitted[0]), jax.tree.leaves(fitted[1]), strict=True):
        assert np.abs(a).max() > 0
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-3)


def test_linear_skip_fit_takes_its_ridge_from_the_config():
    """translator.skip_ridge reaches the fit: a ridge far above the inputs' variance shrinks the kernels to ~0."""
    kernels = []
    for ridge in (1e-3, 1e9):
        c = tiny_config(mode="direct", rotary=True, output_activation="none", linear_skip=True)
        c.translator.skip_ridge = ridge
        trainer, pair = trainer_for(c, make_mesh(c), steps=1)
        trainer.fit_linear_skip([tiny_batch(pair.source_tokenizer, pair.target_tokenizer, context=20)])
        kernels.append(max(np.abs(trainer.state["params"][f"{n}_skip"]["kernel"][...]).max() for n in ("key", "value")))
    assert kernels[1] < 1e-6 * kernels[0], kernels


def test_linear_skip_fit_chooses_each_layers_ridge_on_held_out_batches_then_fits_on_all():
    """With held-out batches, each layer's ridge comes from the grid, and the skips are the fit on every batch at those
    ridges (the same as summing all the batches' statistics and solving)."""
    c = tiny_config(mode="direct", rotary=True, output_activation="none", linear_skip=True)
    trainer, pair = trainer_for(c, make_mesh(c), steps=1)
    batches = [tiny_batch(pair.source_tokenizer, pair.target_tokenizer, context=20, offset=2 * i) for i in range(3)]
    results = trainer.fit_linear_skip(batches[:2], held_out=batches[2:])
    totals = trainer.skip_statistics(batches)
    for name, result in results.items():
        assert set(result["ridge"]) <= set(c.translator.skip_ridge * RIDGE_GRID)
        assert result["held_out"].shape == (len(RIDGE_GRID), *result["ridge"].shape) and (result["held_out"] > 0).all()
        kernel, bias = solve_linear_skip(totals[name], result["ridge"])[:2]
        skip = trainer.state["params"][f"{name}_skip"]
        np.testing.assert_allclose(skip["kernel"][...], kernel, atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(skip["bias"][...], bias, atol=1e-5, rtol=1e-4)


def test_batch_not_divisible_by_data_axis_is_refused():
    c = tiny_config()
    c.batch_size, c.mesh.data = 3, 2
    with pytest.raises(MotJaxError, match="not divisible by the mesh's data axis"):
        make_mesh(c)


def test_bfloat16_compute_keeps_fp32_params_and_optimizer_state():
    c = tiny_config()
    c.dtype = "bfloat16"
    trainer, pair = trainer_for(c, make_mesh(c), steps=2)
    assert jax.tree.leaves(nnx.state(pair.target))[0].dtype == jnp.bfloat16
    batches = [tiny_batch(pair.source_tokenizer, pair.target_tokenizer)]
    before = jax.device_get(trainer.state["params"])
    fit(trainer, Fixed(batches), 0, 2)
    after = trainer.state["params"]
    assert {x.dtype for x in jax.tree.leaves(after)} == {jnp.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(trainer.state["opt_state"]) if x.ndim} == {jnp.dtype("float32")}
    assert any(np.abs(a - b).max() > 0 for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


def test_the_step_loop_reads_the_device_only_every_log_every_steps(monkeypatch):
    """Steps are dispatched back to back: their metrics come back to the host every `log_every` steps (one read of
    all of them), not after each step, and the batches are placed on the devices off the loop's thread."""
    from jax._src.array import ArrayImpl

    c = tiny_config()
    c.log_every = 4
    trainer, pair = trainer_for(c, make_mesh(c), steps=8)
    batches = [tiny_batch(pair.source_tokenizer, pair.target_tokenizer, offset=2 * i) for i in range(2)]
    dispatched, read_after, placed_on = [0], [], set()
    train, value, place = trainer._train, ArrayImpl._value, trainer.place

    def counted(*args):
        dispatched[0] += 1
        return train(*args)

    def placing(batch, micro):
        if not all(isinstance(x, jax.Array) for x in jax.tree.leaves(batch)):  # host arrays to place
            placed_on.add(threading.current_thread() is threading.main_thread())
        return place(batch, micro)

    trainer._train, trainer.place = counted, placing
    # every read of a device array's value (device_get, float(), np.asarray) goes through ArrayImpl._value
    monkeypatch.setattr(ArrayImpl, "_value", property(lambda x: read_after.append(dispatched[0]) or value.fget(x)))
    steps = []
    fit(trainer, Fixed(batches), 0, 8, lambda step, metrics, seconds: steps.append((step, float(metrics["loss"]))))
    assert dispatched[0] == 8 and sorted(set(read_after)) == [4, 8], read_after
    assert placed_on == {False}  # every step's batch was placed by the prefetch thread
    assert [s for s, _ in steps] == list(range(1, 9)) and all(np.isfinite([loss for _, loss in steps]))


def test_a_non_finite_step_inside_a_read_window_is_named(monkeypatch):
    """The metrics read back every 4 steps still name the first step that went bad: a huge rate from the third update
    on leaves parameters near 1e30, and the fourth step's loss is NaN."""
    from mot_jax.training import optim

    monkeypatch.setattr(optim, "warmup_cosine", lambda *a: lambda count: jnp.where(count < 2, 1e-3, 1e30))
    c = tiny_config()
    c.log_every = 4
    trainer, pair = trainer_for(c, make_mesh(c), steps=8)
    batches = [tiny_batch(pair.source_tokenizer, pair.target_tokenizer)]
    seen = []
    with pytest.raises(NonFinite, match="^The loss became nan at step 4$"):
        fit(trainer, Fixed(batches), 0, 8, lambda step, metrics, seconds: seen.append(step))
    assert seen == [1, 2, 3]  # the steps before it were reported


def test_a_rematerialised_step_trains_the_translator_as_the_plain_one_does():
    """Two steps with the layer scans rematerialised (`remat=dots`, set on both models) leave the translator where two
    plain steps do; a policy that does not exist is refused in one line."""
    from mot_jax.training import config as config_lib

    results = []
    for remat in ("none", "dots"):
        c = tiny_config()
        c.remat = remat
        trainer, pair = trainer_for(c, make_mesh(c), steps=2)
        assert pair.source.remat == pair.target.remat == remat
        batches = [tiny_batch(pair.source_tokenizer, pair.target_tokenizer, offset=2 * i) for i in range(2)]
        fit(trainer, Fixed(batches), 0, 2)
        results.append(jax.device_get(trainer.state["params"]))
    for plain, rematerialised in zip(*(jax.tree.leaves(r) for r in results), strict=True):
        np.testing.assert_allclose(rematerialised, plain, rtol=1e-5, atol=1e-6)
    c.remat = "everything"
    with pytest.raises(MotJaxError, match=r"^remat='everything' is not one of none, dots, nothing"):
        config_lib.check(c)


def test_a_translator_that_reads_no_source_trains_as_before_without_the_sources_weights(monkeypatch):
    """Self-prediction reads the target alone: its steps took the source's weights and ran its forward (nothing read
    it). Now they take the target's alone, and the linear skip's fit and two steps leave the translator where the
    steps that still ran the source (`runs_source` forced) leave it."""
    from helpers import load_config

    from mot_jax.training import trainer as trainer_lib

    c = load_config("smollm2_gemma3.py", "self_prediction,tiny")
    results = []
    for forced in (False, True):
        if forced:
            monkeypatch.setattr(trainer_lib, "runs_source", lambda spec: True)
        trainer, pair = trainer_for(c, make_mesh(c), steps=2)
        target_state = nnx.state(pair.target)
        assert len(trainer.llm_states) == 1 + forced and trainer.runs_source == forced
        assert jax.tree.leaves(trainer.llm_states[-1]) == jax.tree.leaves(target_state)
        batches = [tiny_batch(pair.source_tokenizer, pair.target_tokenizer, offset=2 * i) for i in range(2)]
        trainer.fit_linear_skip(batches[:1])
        fit(trainer, Fixed(batches), 0, 2)
        results.append((jax.device_get(trainer.state["params"]), trainer.evaluate(batches[:1])))
    (params, metrics), (params_before, metrics_before) = results
    for now, before in zip(jax.tree.leaves(params), jax.tree.leaves(params_before), strict=True):
        np.testing.assert_allclose(now, before, rtol=1e-6, atol=1e-7)
    assert metrics == pytest.approx(metrics_before, rel=1e-6, abs=1e-7)
