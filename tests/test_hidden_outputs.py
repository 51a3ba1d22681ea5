"""Translator outputs as layer inputs (`outputs="hidden"`): the target's own frozen norm, K/V projections, k-norm and
RoPE turn them into its K/V."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import tiny_batch
from hf_reference import CONFIGS, padded_batch, positions_for, run_reference, save_tiny

from mot_jax.errors import MotJaxError
from mot_jax.jit import jit
from mot_jax.models.base import positions_from_mask
from mot_jax.models.hooks import Forward, LayerInputs
from mot_jax.models.loading import load_model
from mot_jax.training import objective
from mot_jax.translate.linear_skip import linear_skip_sums, solve_linear_skip
from mot_jax.translate.pipeline import source_prefill, translate_jit
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, mixture_config
from mot_jax.translate.window import rms_normalized, run_native_bottom, window_inputs

FAMILIES = [  # one variant each, the quirks of K: GQA, q/k norms, sliding local RoPE, llama3 RoPE, biases, post-LN
    ("llama", "llama3_rope"),
    ("qwen3", "tied_gqa_wide_heads"),
    ("gemma3", "sliding_softcap"),
    ("gpt2", "base"),
    ("opt", "post_ln_projected"),
]


@jit
def layer_key_values(model, x, positions):
    layers = tuple(range(model.config.num_layers))
    return model.layer_key_values(layers, x, x, positions)


@pytest.mark.parametrize("family, variant", FAMILIES)
def test_native_layer_inputs_give_the_targets_own_kv(tmp_path, family, variant):
    """Every layer's input residual stream from transformers (hidden_states[l]) through `layer_key_values` gives
    the K/V transformers caches at that layer."""
    reference = save_tiny(CONFIGS[family][variant](), tmp_path)
    model = load_model(str(tmp_path))[0]
    ids, mask = padded_batch(model.config.vocab_size)
    _, want_k, want_v = run_reference(reference, ids, mask)
    with torch.no_grad():
        out = reference(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions_for(mask)),
            output_hidden_states=True,
        )
    inputs = np.stack([h.numpy() for h in out.hidden_states[: model.config.num_layers]], 2)  # [B, T, L, D]
    k, v = layer_key_values(model, jnp.asarray(inputs), jnp.asarray(positions_for(mask)))
    valid = mask.astype(bool)
    for got, want in ((k, want_k), (v, want_v)):  # got [B, T, L, K, d], want [L, B, K, T, d]
        np.testing.assert_allclose(np.asarray(got)[valid], want.transpose(1, 3, 0, 2, 4)[valid], atol=1e-5)


class Fixed(nnx.Module):
    """A mixture whose output is fixed (the native layer inputs), whatever it reads."""

    def __init__(self, out):
        self.out = nnx.Variable(out)

    def __call__(self, x, mask):
        return self.out[...], {}


def direct_translator(source, target, native_bottom=0, **cfg):
    ls, lt = source.config.num_layers, target.config.num_layers
    spec = TranslationSpec.build("direct", None, ls, lt, native_bottom=native_bottom, outputs="hidden")
    cfg = dict(dim=16, heads=2, depth=1, num_experts=1, output_activation="none") | cfg
    return KVTranslator(spec, mixture_config(spec, source, target, **cfg), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("native_bottom", [0, 2])
def test_a_translation_writing_the_native_layer_inputs_is_the_native_cache(random_pair, native_bottom):
    """Through the whole direct path (window order, positions, cache layout, the native bottom): hidden outputs equal
    to the target's own layer inputs give the target's own prefill cache at every layer."""
    source, target, source_tok, target_tok = random_pair
    batch = tiny_batch(source_tok, target_tok)
    ids, mask = jnp.asarray(batch.context), jnp.asarray(batch.context_mask)
    translator = direct_translator(source, target, native_bottom)
    assert translator.cfg.target_width == target.config.hidden_size
    run = jax.jit(lambda ids, mask: target.run_layers(Forward(ids, mask), hooks=[LayerInputs()]))(ids, mask)
    native, inputs = run.cache, run.records["inputs"]
    window = inputs[jnp.asarray(translator.spec.target_layers)].transpose(1, 2, 0, 3)  # [B, T, W, D]
    translator.key, translator.value = Fixed(window), Fixed(window)
    source_cache, _ = source_prefill(source, jnp.asarray(batch.source_ids), jnp.asarray(batch.source_mask))
    cache, _ = translate_jit(translator, source, target, source_cache, batch.alignment, ids, mask, None)
    valid = np.asarray(mask)
    for got, want in ((cache.k, native.k), (cache.v, native.v)):
        got, want = (np.asarray(x).transpose(1, 3, 0, 2, 4)[valid] for x in (got, want))
        np.testing.assert_allclose(got, want, atol=2e-5)
    translator.key = Fixed(window * 2.0)  # RMS-normalised inputs: a scaled hidden state gives the same K
    scaled, _ = translate_jit(translator, source, target, source_cache, batch.alignment, ids, mask, None)
    np.testing.assert_allclose(np.asarray(scaled.k), np.asarray(cache.k), atol=1e-4)


def test_the_least_squares_start_fits_the_normalised_native_layer_inputs(random_pair):
    """With hidden outputs the linear skip's fit is least squares onto the window layers' RMS-normalised native
    inputs: numpy's lstsq of the same inputs and targets gives the same kernel."""
    source, target, source_tok, target_tok = random_pair
    batch = tiny_batch(source_tok, target_tok, batch=4, context=40, source_length=160)
    translator = direct_translator(source, target, 2, kind="linear", linear_skip=True)
    frozen = jit(objective.frozen_forwards, static_argnames=("topk",))(source, target, batch, topk=0)
    mask, context = jnp.asarray(batch.context_mask), jnp.asarray(batch.context)
    sums = jit(linear_skip_sums)(translator, source, target, frozen[0], batch.alignment, frozen[2], mask, context)
    kernel, bias, before, after = solve_linear_skip(sums["value"], ridge=0.0)
    assert after < before

    _, features = run_native_bottom(translator.spec, target, context, mask)
    x = np.asarray(window_inputs(translator.spec, source, target, frozen[0], batch.alignment, features)[1])
    inputs = target.run_layers(Forward(context, mask), hooks=[LayerInputs()]).records["inputs"]
    want = np.asarray(rms_normalized(inputs[jnp.asarray(translator.spec.target_layers)].transpose(1, 2, 0, 3)))
    rows = np.asarray(mask).copy()
    rows[np.arange(len(rows)), np.argmax(rows, 1)] = False  # each row's first token is the target's own
    layer = 0
    design = np.concatenate([x[rows][:, layer], np.ones((rows.sum(), 1))], 1).astype(np.float64)
    solution = np.linalg.lstsq(design, want[rows][:, layer].astype(np.float64), rcond=None)[0]
    np.testing.assert_allclose(kernel[layer], solution[:-1], atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(bias[layer], solution[-1], atol=2e-3, rtol=2e-3)


def test_positions_reach_the_targets_rope():
    """Shifting every position shifts the keys' rotation (RoPE is applied by the layer), not the values."""
    from mot_jax.models import tiny

    target = tiny.load("random:gemma3")[0]
    x = jax.random.normal(jax.random.key(0), (1, 5, 1, target.config.hidden_size))
    positions = positions_from_mask(jnp.ones((1, 5), bool))
    k0, v0 = target.layer_key_values((1,), x, x, positions)
    k1, v1 = target.layer_key_values((1,), x, x, positions + 3)
    np.testing.assert_array_equal(np.asarray(v0), np.asarray(v1))
    assert not np.allclose(np.asarray(k0), np.asarray(k1), atol=1e-3)


def test_bad_outputs_are_refused_and_old_specs_write_kv():
    with pytest.raises(MotJaxError, match="Unknown translator outputs 'logits'"):
        TranslationSpec.build("direct", None, 3, 3, outputs="logits")
    saved = TranslationSpec.build("direct", None, 3, 3).to_dict()
    del saved["outputs"]  # saved before the field existed
    assert TranslationSpec.from_dict(saved).outputs == "kv"
