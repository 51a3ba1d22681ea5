"""The C2C-Project baseline (`translator.kind="projector"`): its numbers, its training, its workdir and export."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
from flax import nnx
from helpers import Fixed, load_config, perturb, tiny_batch, tiny_config, trainer_for
from scipy.special import erf

from mot_jax.errors import MotJaxError
from mot_jax.export import torch_translator
from mot_jax.export.__main__ import export_workdir
from mot_jax.jit import jit
from mot_jax.training import loop, saved
from mot_jax.training.setup import check_identity, make_mesh
from mot_jax.training.trained import load_trained
from mot_jax.training.trainer import fit
from mot_jax.translate import channels
from mot_jax.translate.config import TranslatorConfig
from mot_jax.translate.kinds.projector import Projector
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator


@jit
def forward(module, x, mask):
    """A projector's forward as one program (run eagerly, each of its operations compiles on its own)."""
    return module(x, mask)


def numpy_projector(params, x, activation):
    """An independent per-layer MLP: for each window layer w, LN -> Linear -> GELU -> Linear on every token."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    gelu = lambda a: 0.5 * a * (1 + erf(a / np.sqrt(2)))  # noqa: E731
    out = []
    for w in range(x.shape[2]):
        h = x[:, :, w].astype(np.float64)
        h = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5)
        h = h * p["norm"]["scale"][w] + p["norm"]["bias"][w]
        h = gelu(h @ p["hidden"]["kernel"][w] + p["hidden"]["bias"][w])
        y = h @ p["out"]["kernel"][w] + p["out"]["bias"][w]
        out.append(gelu(y) if activation == "gelu" else y)
    return np.stack(out, axis=2)


@pytest.mark.parametrize("dim, activation", [(16, "none"), (48, "gelu")])
def test_projector_equals_a_per_layer_mlp_in_numpy(dim, activation):
    cfg = TranslatorConfig(12, 24, 3, kind="projector", dim=dim, output_activation=activation)
    projector = Projector(cfg, rngs=nnx.Rngs(0))
    perturb(projector, seed=1)
    assert projector.hidden.kernel.shape == (3, 12, max(dim, 24))  # the reference's max(projector_dim, d_t)
    x = 1.5 * np.asarray(jax.random.normal(jax.random.key(2), (2, 7, 3, 12)))
    y, aux = forward(projector, jnp.asarray(x), jnp.ones((2, 7), bool))
    assert aux == {}  # no router: no load-balancing or z-loss, no routing statistics
    expected = numpy_projector(nnx.to_pure_dict(nnx.state(projector, nnx.Param)), x, activation)
    np.testing.assert_allclose(y, expected, atol=1e-5, rtol=1e-5)


def test_kv_translator_builds_projectors_and_refuses_an_unknown_kind():
    spec = TranslationSpec.build("direct", channels.terminal(4, 4, 1.0), 4, 4)
    translator = KVTranslator(spec, TranslatorConfig(8, 8, 4, kind="projector", dim=16), rngs=nnx.Rngs(0))
    assert isinstance(translator.key, Projector) and isinstance(translator.value, Projector)
    with pytest.raises(MotJaxError, match="Unknown translator kind 'nope'"):
        KVTranslator(spec, TranslatorConfig(8, 8, 4, kind="nope"), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("mode", ["direct", "replay"])
def test_projector_loss_goes_down_on_tiny_models(mode):
    c = tiny_config(mode=mode, kind="projector", output_activation="none")
    c.optim.learning_rate, c.optim.warmup_steps = 3e-3, 2
    trainer, pair = trainer_for(c, make_mesh(c), steps=24)
    batches = [tiny_batch(pair.source_tokenizer, pair.target_tokenizer, offset=2 * i) for i in range(3)]
    before = trainer.evaluate(batches)
    assert before["load_balance"] == before["z_loss"] == 0 and "load_cv2" not in before
    fit(trainer, Fixed(batches), 0, 24)
    after = trainer.evaluate(batches)
    assert after["loss"] < before["loss"] - 0.1, (before, after)


def test_workdir_round_trip_export_and_resume_with_another_kind(tmp_path):
    """Train two steps, rebuild the projector from the workdir, export it to torch, and refuse a `mot` resume."""
    overrides = {"translator.kind": "projector", "translator.mode": "direct", "translator.output_activation": "none"}
    loop.train_and_evaluate(load_config(steps=2, **overrides), tmp_path / "run")
    trained = load_trained(tmp_path / "run")
    assert isinstance(trained.translator.key, Projector) and trained.translator.cfg.kind == "projector"
    saved = ocp.StandardCheckpointer().restore(tmp_path / "run" / "checkpoints" / "2" / "state")["params"]
    restored = jax.tree.leaves(nnx.state(trained.translator, nnx.Param))
    assert len(restored) == len(jax.tree.leaves(saved)) == 12  # K and V: norm, hidden and out, each weight and bias
    for a, b in zip(restored, jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(a, b)

    folder, _ = export_workdir(tmp_path / "run", tmp_path / "export")
    exported = torch_translator.KVTranslator.from_pretrained(folder)
    assert isinstance(exported.key, torch_translator.Projector) and exported.config.kind == "projector"
    cfg = trained.translator.cfg
    x = np.asarray(jax.random.normal(jax.random.key(3), (2, 5, cfg.window, cfg.source_width)))
    for name in ("key", "value"):
        y, _ = forward(getattr(trained.translator, name), jnp.asarray(x), None)
        with torch.no_grad():
            y_torch = getattr(exported, name)(torch.tensor(x)).numpy()
        np.testing.assert_allclose(y, y_torch, atol=1e-4, rtol=0)

    with pytest.raises(MotJaxError, match=r"another experiment \(it differs in: translator\)"):
        loop.train_and_evaluate(load_config(steps=4, **(overrides | {"translator.kind": "mot"})), tmp_path / "run")


def upgraded(identity: dict) -> dict:
    """A checkpoint identity as `Checkpoints.read_meta` hands it on."""
    return saved.upgrade_meta({"identity": identity})["identity"]


def test_runs_saved_before_the_kind_and_linear_skip_keys_still_resume_as_mixtures_without_skip(tmp_path):
    current = {"translator": {"dim": 32, "kind": "mot", "linear_skip": False}}
    lsc = dict(shared_slots=32, shared_dim=128, source_window=0)  # saved by every run before LSC held its own
    for old in ({"dim": 32}, {"dim": 32} | lsc):
        check_identity(upgraded({"translator": old}), current, tmp_path)  # no error
    for changed in ({"kind": "projector"}, {"linear_skip": True}):
        with pytest.raises(MotJaxError, match="differs in: translator"):
            check_identity(
                upgraded({"translator": {"dim": 32}}), {"translator": current["translator"] | changed}, tmp_path
            )
