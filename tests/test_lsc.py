"""The LSC baseline (`translator.kind="lsc"`): the reference's shapes and defaults and a closed-form parameter count,
the forward against an independent numpy LSC, the switches it refuses, and a tiny run that trains and resumes."""

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as nr
import pytest
from flax import nnx
from helpers import load_config, perturb, whole_and_resumed

from mot_jax.errors import MotJaxError
from mot_jax.evals.methods import method_name
from mot_jax.jit import jit
from mot_jax.translate import channels, kinds
from mot_jax.translate.config import TranslatorConfig
from mot_jax.translate.kinds import lsc
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, mixture_config

# 3 source layers of K width 12 into 2 target layers of width 8, through a latent of 3 slots x 4 per token
TINY = dict(kind="lsc", dim=16, heads=2, mlp_ratio=2, shared_slots=3, shared_dim=4)


@jit
def forward(module, x, mask):
    return module(x, mask)


@jit
def outputs(module, x, other):
    """x's latent and output with every token visible, then x's and `other`'s outputs with tokens 3 and up hidden."""
    every = jnp.ones(x.shape[:2], bool)
    first = every.at[:, 3:].set(False)
    return module.to_shared(x, every[:, None, :]), module(x, every)[0], module(x, first)[0], module(other, first)[0]


def block_params(d, r):
    """One cross-attention block: 3 LayerNorms, the packed q/k/v and output projections, the FFN (all with bias)."""
    return 3 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * r * d + r * d) + (r * d * d + d)


def lsc_params(ls, ds, lt, dt, d, r, slots, dim):
    """The reference's LocalToSharedTranslator (source) plus SharedToLocalTranslator (target), from the layer shapes."""
    latent = slots * dim
    encoder = 2 * ds + (ds * d + d) + ls * block_params(d, r) + 2 * ls * d + (ls * d * latent + latent)
    decoder = (
        2 * latent + (latent * lt * d + lt * d) + lt * block_params(d, r) + 2 * lt * d + (lt * d * lt * dt + lt * dt)
    )
    return encoder + decoder


def numpy_lsc(p, x, heads, output_gelu=True):
    """The reference's local -> shared then shared -> local (alg/lsc/train.py) written out in float64 numpy, unmasked:
    x [B, T, Ls, ds] -> (latent [B, T, slots * dim], y [B, T, Lt * dt])."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    gelu, ln, lin = nr.gelu, nr.layer_norm, nr.linear
    block = functools.partial(nr.cross_attention_block, heads=heads)

    def layer_chain(blocks, context):  # the hidden state starts at layer 0; block l reads layer l
        hidden, collected = context[:, :, 0], []
        for layer in range(context.shape[2]):
            hidden = block(jax.tree.map(lambda a, i=layer: a[i], blocks), hidden, context[:, :, layer])
            collected.append(hidden)
        return np.concatenate(collected, -1)

    enc, dec = p["to_shared"], p["from_shared"]
    projected = gelu(lin(ln(x, enc["input_norm"]), enc["input_proj"]))
    latent = gelu(lin(ln(layer_chain(enc["blocks"], projected), enc["output_norm"]), enc["output_proj"]))
    expanded = gelu(lin(ln(latent, dec["input_norm"]), dec["input_proj"]))
    expanded = expanded.reshape(*expanded.shape[:2], dec["blocks"]["norm_q"]["scale"].shape[0], -1)
    y = lin(ln(layer_chain(dec["blocks"], expanded), dec["output_norm"]), dec["output_proj"])
    return latent, gelu(y) if output_gelu else y


def test_reference_defaults_shapes_and_parameter_count():
    cfg = TranslatorConfig(12, 8, 2, **TINY)  # 3 source layers
    defaults = kinds.translator_config(1, 1, 1, kind="lsc")  # the kind's own fields at their defaults
    assert (defaults.shared_slots, defaults.shared_dim) == (32, 128)
    module = lsc.LatentTranslator(cfg, 3, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 3, 12))
    visible = jnp.ones((2, 1, 5), bool)
    assert module.to_shared(x, visible).shape == (2, 5, 3, 4)  # slots x dim per token
    y, aux = forward(module, x, jnp.ones((2, 5), bool))
    assert y.shape == (2, 5, 2, 8) and aux == {}
    assert module.to_shared.blocks.in_proj.kernel.shape == (3, 16, 48)  # one un-shared block per source layer
    assert module.from_shared.blocks.in_proj.kernel.shape == (2, 16, 48)  # and per target layer
    count = sum(a.size for a in jax.tree.leaves(nnx.state(module, nnx.Param)))
    assert count == lsc_params(3, 12, 2, 8, d=16, r=2, slots=3, dim=4)
    # the reference's sizes: translator dim 512, ratio 4, 32 x 128, on SmolLM2 (30 x 192) -> Gemma-3 (18 x 256)
    big = kinds.translator_config(192, 256, 18, kind="lsc", dim=512, heads=16, mlp_ratio=4)
    abstract = nnx.eval_shape(lambda: lsc.LatentTranslator(big, 30, rngs=nnx.Rngs(0)))
    count = sum(a.size for a in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert count == lsc_params(30, 192, 18, 256, d=512, r=4, slots=32, dim=128)
    # the spec reads every source layer and writes every target layer; the config knows both depths
    for ls, lt in ((6, 4), (4, 6)):
        spec = TranslationSpec.build("direct", None, ls, lt, kind="lsc")
        assert spec.source_layers == tuple(range(ls)) and spec.target_layers == tuple(range(lt))
    model = lambda kv_heads, head_dim: SimpleNamespace(
        config=SimpleNamespace(num_kv_heads=kv_heads, head_dim=head_dim, hidden_size=32)
    )
    source, target = model(3, 4), model(1, 8)
    tcfg = mixture_config(spec, source, target, kind="lsc")  # 4 source layers, 6 target layers
    assert (tcfg.source_width, tcfg.target_width, tcfg.window, tcfg.shared_slots) == (12, 8, 6, 32)
    assert "shared_slots" not in mixture_config(spec, source, target).to_dict()  # the other kinds: not theirs
    translator = nnx.eval_shape(lambda: KVTranslator(spec, tcfg, rngs=nnx.Rngs(0)))
    assert translator.key.to_shared.blocks.in_proj.kernel.shape[0] == 4  # a block per source layer the spec reads
    named = load_config("smollm2_gemma3.py", "lsc").translator  # the reference's sizes
    assert [named[k] for k in ("dim", "heads", "mlp_ratio", "shared_slots", "shared_dim")] == [512, 16, 4, 32, 128]
    assert method_name(load_config("smollm2_gemma3.py", "lsc")) == "LSC"


@pytest.mark.parametrize("output_activation", ["gelu", "none"])
def test_forward_equals_the_reference_in_numpy(output_activation):
    cfg = TranslatorConfig(12, 8, 2, **TINY, output_activation=output_activation)
    module = lsc.LatentTranslator(cfg, 3, rngs=nnx.Rngs(0))
    perturb(module, seed=1)
    x = jax.random.normal(jax.random.key(2), (2, 5, 3, 12))
    latent, want = numpy_lsc(
        nnx.to_pure_dict(nnx.state(module, nnx.Param)), np.asarray(x), 2, output_activation == "gelu"
    )
    other = x.at[:, 3:].set(jax.random.normal(jax.random.key(3), (2, 2, 3, 12)))  # other values at tokens 3, 4
    got_latent, got, padded, other_padded = outputs(module, x, other)
    np.testing.assert_allclose(got_latent.reshape(2, 5, -1), latent, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got, want.reshape(2, 5, 2, 8), atol=1e-5, rtol=1e-5)
    # padding is hidden: with tokens 3, 4 masked, the others do not see them
    np.testing.assert_allclose(padded[:, :3], other_padded[:, :3], atol=1e-6, rtol=0)
    assert not np.allclose(padded[:, :3], got[:, :3], atol=1e-4)


def test_refused_switches_in_one_line():
    cfg = TranslatorConfig(8, 8, 4, **TINY)
    build = lambda **kw: TranslationSpec.build("direct", None, 4, 4, kind="lsc", **kw)
    replay = TranslationSpec.build("replay", channels.terminal(4, 4, 0.5), 4, 4)
    for spec, why in (
        (replay, "no replay"),
        (build(native_bottom=1), "native_bottom=0"),
        (build(outputs="hidden"), "outputs='kv'"),
        (build(inputs=("source", "embeddings")), "inputs='source'"),
        (TranslationSpec.build("direct", None, 6, 4), "kind='lsc'"),  # the full-depth map: 4 of 6
    ):
        with pytest.raises(MotJaxError, match=f"^kind='lsc' .*{why}.*\\.$"):
            KVTranslator(spec, cfg, rngs=nnx.Rngs(0))
    with pytest.raises(MotJaxError, match="^kind='lsc' has no linear skip"):
        KVTranslator(build(), TranslatorConfig(8, 8, 4, **(TINY | dict(linear_skip=True))), rngs=nnx.Rngs(0))
    for arg in ("lsc,replay", "lsc,c2c"):
        with pytest.raises(MotJaxError, match="Bad config argument"):
            load_config("smollm2_gemma3.py", arg)


@pytest.mark.slow
def test_a_tiny_run_trains_and_resumes(tmp_path, monkeypatch):
    """smollm2_gemma3.py:lsc,tiny: 3 steps at once and 3 stopped after step 1 and resumed give the same
    translators."""
    config = load_config("smollm2_gemma3.py", "lsc,tiny", steps=3, checkpoint_every=1)
    t = config.translator
    assert (t.kind, t.mode, config.loss.correction_weight) == ("lsc", "direct", 0)
    whole, trained = whole_and_resumed(config, tmp_path, monkeypatch, stop_after=1)
    assert isinstance(trained[0].key, lsc.LatentTranslator)
    read = trained[0].key.to_shared.blocks.in_proj.kernel.shape[0]  # a block per source layer read
    assert trained[0].spec.source_layers == tuple(range(read)) and read == 4  # every layer of the tiny source
    for a, b in zip(*(jax.tree.leaves(nnx.state(t, nnx.Param)) for t in trained), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert np.isfinite(whole["final_validation"]["loss"])
