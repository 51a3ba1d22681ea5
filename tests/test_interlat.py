"""Interlat (`translator.kind="interlat"`): the reference's shapes, defaults and refusals, the adapter and the loss
terms against a numpy transcription and closed forms, the target's own token embeddings as the native cache and
generation, and a tiny run that trains, resumes and evaluates."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as nr
import pytest
import torch
from flax import nnx
from helpers import hf_model, load_config, small_config, whole_and_resumed

from mot_jax.errors import MotJaxError
from mot_jax.evals import run
from mot_jax.evals.methods import method_name
from mot_jax.jit import jit
from mot_jax.models import tiny
from mot_jax.models.generation import generate_from_cache, prefill
from mot_jax.models.hooks import Forward
from mot_jax.translate import channels, kinds
from mot_jax.translate.align import encode_texts, identity_alignment
from mot_jax.translate.config import TranslatorConfig
from mot_jax.translate.kinds import interlat
from mot_jax.translate.pipeline import source_prefill, translate_jit
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, mixture_config, source_read, translate

TINY = dict(kind="interlat", heads=4)


def spec_for(ls, lt, **kw):
    return TranslationSpec.build("direct", None, ls, lt, kind="interlat", **kw)


def adapter_params(ds, d):
    """The reference's HiddenStateProcessor's parameter count, from its modules."""
    projector = ds * d + d if ds != d else 0
    norms = 3 * 2 * d
    attention = (d * 3 * d + 3 * d) + (d * d + d)
    return projector + norms + attention + 2 + 2 * (d * d + d)


def test_reference_shapes_defaults_and_refusals():
    config = SimpleNamespace(num_kv_heads=1, head_dim=8, hidden_size=32)  # E != D, as OPT-350m's
    model = lambda width: SimpleNamespace(embedding_width=width, config=config)  # noqa: E731
    spec = spec_for(6, 4)
    assert spec.source_reads is kinds.LAST_HIDDEN and spec.outputs == "embeddings" and spec.mode == "direct"
    assert spec.source_layers == (5,) and spec.target_layers == (0, 1, 2, 3)  # the source's last layer; every layer
    cfg = mixture_config(spec, model(24), model(40), **TINY)
    assert (cfg.source_width, cfg.target_width) == (24, 40)  # a hidden state in, an input embedding out
    translator = KVTranslator(spec, cfg, rngs=nnx.Rngs(0))
    adapter = translator.adapter
    assert not hasattr(translator, "key") and not hasattr(translator, "value")
    params = nnx.state(adapter, nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(params)) == adapter_params(24, 40)
    assert adapter.heads == 4 and adapter.input_proj.kernel.shape == (24, 40)
    assert (float(adapter.scale[...]), float(adapter.output_scale[...])) == pytest.approx((0.2, 0.1))
    for linear in (adapter.input_proj, adapter.in_proj, adapter.out_proj, adapter.fc1, adapter.fc2):
        assert not np.any(np.asarray(linear.bias[...]))
    assert np.asarray(adapter.fc2.kernel[...]).std() < 0.01 * np.asarray(adapter.out_proj.kernel[...]).std()
    same = KVTranslator(spec, mixture_config(spec, model(40), model(40), **TINY), rngs=nnx.Rngs(0)).adapter
    assert same.input_proj is None  # no projector between equal widths
    # the reference's head count: the largest divisor of the width up to the requested heads
    assert [interlat.attention_heads(w, 8) for w in (640, 12, 7, 5)] == [8, 6, 7, 5]
    named = load_config("smollm2_gemma3.py", "interlat")
    t = named.translator
    assert (t.kind, t.mode, t.heads, named.loss.correction_weight, named.loss.ce_weight) == (
        "interlat",
        "direct",
        8,
        0.0,
        1.0,
    )
    assert method_name(named) == "Interlat"

    for bad, why in (
        (TranslationSpec.build("replay", channels.terminal(6, 4, 0.5), 6, 4, kind="interlat"), "set mode='direct'"),
        (spec_for(6, 4, native_bottom=1), "set native_bottom=0"),
        (spec_for(6, 4, rotary=True), "set rotary=False"),
        (spec_for(6, 4, inputs=("source", "embeddings")), "set inputs='source'"),
        (TranslationSpec.build("direct", None, 6, 4), "kind='interlat'"),
    ):
        with pytest.raises(MotJaxError, match=f"^kind='interlat' .*{why}.*\\.$"):
            KVTranslator(bad, cfg, rngs=nnx.Rngs(0))
    with pytest.raises(MotJaxError, match="^kind='interlat' has no linear skip"):
        KVTranslator(spec, TranslatorConfig(24, 40, 4, **TINY, linear_skip=True), rngs=nnx.Rngs(0))
    with pytest.raises(MotJaxError, match="^kind='interlat' writes the target's input embeddings"):
        spec_for(6, 4, outputs="hidden")
    with pytest.raises(MotJaxError, match="set kind='interlat'"):
        KVTranslator(spec, TranslatorConfig(24, 40, 4, dim=16, heads=2), rngs=nnx.Rngs(0))
    for arg in ("interlat,replay", "interlat,c2c"):
        with pytest.raises(MotJaxError, match="Bad config argument"):
            load_config("smollm2_gemma3.py", arg)


def numpy_adapter(p, x, mask, heads):
    """The reference's HiddenStateProcessor (eval mode) in float64 numpy; padding keys hidden."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    x = nr.linear(x, p["input_proj"])
    n = nr.layer_norm(x, p["pre_norm"], 1e-6)
    d = n.shape[-1]
    split = lambda a: a.reshape(*a.shape[:2], heads, d // heads)  # noqa: E731
    q, k, v = (split(a) for a in np.split(nr.linear(n, p["in_proj"]), 3, -1))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
    logits = np.where(mask[:, None, None, :], logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attended = nr.linear(np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(n.shape), p["out_proj"])
    residual = nr.layer_norm(n + attended, p["post_norm"], 1e-6) * p["scale"]
    y = (residual + nr.linear(nr.layer_norm(nr.gelu(nr.linear(residual, p["fc1"])), p["norm"]), p["fc2"])) * p[
        "output_scale"
    ]
    return np.clip(y, -10, 10)


def numpy_terms(logits, plan_logits, random_logits, mask):
    """The reference's compute_plan_similarity_loss, compute_random_contrast_loss and adjust_interlat_loss_weights
    (torch's kl_div(input, target) = sum target * (log target - input), batch mean) on the valid positions."""

    def softmax(a):
        e = np.exp(a - a.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    pick = lambda a: np.asarray(a, np.float64)[np.asarray(mask, bool)]  # noqa: E731
    q_logits, plan, rand = pick(logits), pick(plan_logits), pick(random_logits)
    n = len(q_logits)
    log_q = q_logits - np.log(np.exp(q_logits).sum(-1, keepdims=True))
    target = np.maximum(softmax(plan), 1e-8)
    kl = (target * (np.log(target) - log_q)).sum() / n
    a, b = np.maximum(softmax(q_logits), 1e-8).ravel(), np.maximum(softmax(plan), 1e-8).ravel()
    cosine = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
    plan_loss = 0.7 * kl + 0.3 * (1 - cosine)
    p, r = np.maximum(softmax(q_logits), 1e-8), np.maximum(softmax(rand), 1e-8)
    m = 0.5 * (p + r)
    js = 0.5 * (m * (np.log(m) - np.log(p))).sum() / n + 0.5 * (m * (np.log(m) - np.log(r))).sum() / n
    contrast = max(0.69 - js, 0.0)
    plan_w = 0.01 + min(max(plan_loss / 4, 0), 1) * 0.04
    random_w = 0.01 + min(max(contrast / 0.69, 0), 1) * 0.49
    return plan_loss, contrast, plan_w, random_w, plan_w * plan_loss + random_w * contrast


@jit
def adapter_and_terms(adapter, x, mask, key, logits, plan, rand, label_mask):
    """One program: the adapter without and with dropout, the loss terms, their closed forms."""
    terms = interlat.auxiliary_loss(logits, plan, rand, label_mask)
    same_plan, _ = interlat.plan_similarity(logits, logits, label_mask)
    same_random = interlat.random_contrast(logits, logits, label_mask)
    weights = interlat.dynamic_weights(jnp.array([0.0, 100.0]), jnp.array([0.0, 100.0]))
    return adapter(x, mask), adapter(x, mask, key), terms, same_plan, same_random, weights


def test_adapter_and_loss_terms_against_numpy():
    cfg = TranslatorConfig(12, 8, 1, **TINY)
    adapter = interlat.Adapter(cfg, rngs=nnx.Rngs(1))
    for name, value in (("scale", 1.5), ("output_scale", 3.0)):  # larger than at init, so some outputs clip
        getattr(adapter, name).set_value(jnp.asarray(value))
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(2, 5, 12)) * 3, jnp.float32)
    mask = jnp.asarray([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    logits, plan, rand = (jnp.asarray(r.normal(size=(2, 3, 11)) * 2, jnp.float32) for _ in range(3))
    label_mask = jnp.asarray([[1, 1, 0], [1, 1, 1]], jnp.float32)
    y, dropped, (total, metrics), same_plan, same_random, weights = adapter_and_terms(
        adapter, x, mask, jax.random.key(0), logits, plan, rand, label_mask
    )
    params = nnx.to_pure_dict(nnx.state(adapter, nnx.Param))
    want = numpy_adapter(params, np.asarray(x, np.float64), np.asarray(mask), 4)
    valid = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(y)[valid], want[valid], atol=1e-5, rtol=1e-4)
    assert np.abs(want).max() == 10.0 and np.abs(np.asarray(y)).max() == pytest.approx(10.0)  # the clip acted
    assert not np.allclose(np.asarray(dropped)[valid], want[valid], atol=1e-3)  # training dropout changes outputs

    plan_loss, contrast, plan_w, random_w, weighted = numpy_terms(logits, plan, rand, label_mask)
    got = [metrics[k] for k in ("plan", "random_contrast", "plan_weight", "random_weight")] + [total]
    np.testing.assert_allclose(np.asarray(got, np.float64), [plan_loss, contrast, plan_w, random_w, weighted], 1e-5)
    # closed forms: the same distributions are KL 0 and cosine 1, JS 0 (the hinge at its margin)
    assert float(same_plan) == pytest.approx(0.0, abs=1e-6) and float(same_random) == pytest.approx(0.69)
    np.testing.assert_allclose(np.asarray(weights), [[0.01, 0.05], [0.01, 0.5]], rtol=1e-6)


class TokenEmbeddings(nnx.Module):
    """An identity adapter: the latents are what the source handed over."""

    def __call__(self, x, mask, key=None):
        return x


@jit
def latent_cache(model, ids, embeddings):
    return model.run_layers(Forward(ids, embeddings=embeddings)).cache


@jit(static_argnames=("capacity",))
def handed_and_native(translator, model, own, alignment, ids, mask, *, capacity):
    """One program, so that the same computation is not compiled twice (two programs may round differently): what
    the source hands over beside the final stream, and the cache from `own` latents beside native's."""
    handed, _ = source_read(model, ids, mask, last_hidden=True)
    final, _ = model.hidden_states(ids, mask)
    same, _ = translate(translator, model, model, own, alignment, ids, mask, None, capacity)
    return handed, final, same, prefill(model, ids, mask, capacity=capacity)[1]


@pytest.mark.parametrize("name", ["random:gemma3", "random:opt"])
def test_the_target_own_token_embeddings_give_the_native_cache_and_generation(name, tmp_path):
    """The injection is transformers' `inputs_embeds` (every layer's K/V within 1e-4 for random latents; Gemma's
    embedding scale and OPT's projection and position embeddings on the model's side). Source = target, the same
    tokens and an identity adapter fed the target's own token embeddings: the cache and greedy continuation are
    native's exactly. What the source hands over is its final-normed last hidden states; the untrained adapter's
    cache is not native."""
    model, hf, tokenizer = hf_model(name, tmp_path)
    latents = np.asarray(jax.random.normal(jax.random.key(1), (1, 12, model.embedding_width)), np.float32)
    ours = latent_cache(model, jnp.zeros((1, 12), jnp.int32), jnp.asarray(latents))
    with torch.no_grad():
        out = hf(inputs_embeds=torch.tensor(latents), use_cache=True)
    theirs = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    for layer, hf_layer in enumerate(theirs.layers):  # Gemma-3's sliding layers keep their window's last slots
        kept = slice(12 - hf_layer.keys.shape[2], 12)
        np.testing.assert_allclose(hf_layer.keys.numpy(), np.asarray(ours.k[layer, :, :, kept]), atol=1e-4)
        np.testing.assert_allclose(hf_layer.values.numpy(), np.asarray(ours.v[layer, :, :, kept]), atol=1e-4)

    ids, mask = encode_texts(tokenizer, ["The cat sat on the mat by the door.", "Hello world, again"])
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    suffix = jnp.asarray(tokenizer.encode(" Question: who? Answer:", add_special_tokens=False).ids)[None].repeat(2, 0)
    capacity = ids.shape[1] + suffix.shape[1] + 4
    layers = model.config.num_layers
    spec = spec_for(layers, layers)
    alignment = identity_alignment(*ids.shape, np.asarray(mask))
    untrained = KVTranslator(spec, mixture_config(spec, model, model, **TINY), rngs=nnx.Rngs(0))
    embeddings = model.token_embeddings(ids)[None, :, None]  # what an exact adapter would write
    translator = nnx.clone(untrained)
    translator.adapter = TokenEmbeddings()
    own = source_prefill(model, ids, mask, last_hidden=True)[0]
    own = own.replace(k=embeddings, v=embeddings[..., :0])
    handed, final, same, native = handed_and_native(translator, model, own, alignment, ids, mask, capacity=capacity)
    valid = np.asarray(mask, bool)
    np.testing.assert_array_equal(np.asarray(handed.k[0, :, 0])[valid], np.asarray(final)[valid])
    assert handed.v.shape[-1] == 0 and handed.k.shape[-1] == model.embedding_width
    translated, _ = translate_jit(untrained, model, model, handed, alignment, ids, mask, None, capacity=capacity)
    assert not np.allclose(translated.k[0], native.k[0], atol=1e-3)
    for a, b in ((same.positions, native.positions), (same.valid, native.valid), (same.index, native.index)):
        np.testing.assert_array_equal(a, b)
    slots = np.asarray(native.valid)[None, :, None, :, None]  # padding slots: never read, garbage on both sides
    for a, b in ((same.k, native.k), (same.v, native.v)):
        np.testing.assert_array_equal(np.where(slots, a, 0), np.where(slots, b, 0))
    generated = [generate_from_cache(model, c, suffix, max_new_tokens=4) for c in (same, native)]
    np.testing.assert_array_equal(*generated)


@pytest.mark.slow
def test_a_tiny_run_trains_resumes_and_evaluates(tmp_path, monkeypatch):
    """smollm2_gemma3.py:interlat,tiny: 3 steps at once and 3 stopped after step 1 and resumed give the same adapter
    (the dropout keys included); the loss logs the reference's terms; the evaluation names it Interlat, beside its
    shuffled-source control, times the target's forward over the latents in its TTFT and counts the hidden states
    handed over."""
    config = load_config("smollm2_gemma3.py", "interlat,tiny", steps=3, checkpoint_every=1)
    whole, trained = whole_and_resumed(config, tmp_path, monkeypatch, stop_after=1)
    assert isinstance(trained[0].adapter, interlat.Adapter) and trained[0].spec.source_reads is kinds.LAST_HIDDEN
    for a, b in zip(*(jax.tree.leaves(nnx.state(t, nnx.Param)) for t in trained), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    final = whole["final_validation"]
    assert {"plan", "random_contrast", "plan_weight", "random_weight"} <= set(final) and np.isfinite(final["loss"])

    evaluation = small_config(tasks="extractive_qa", methods="native", ttft_lengths="32", memory=False)
    results = run.evaluate(tmp_path / "whole", evaluation, compare=[tmp_path / "resumed"], out=tmp_path / "eval")
    rows = results["tasks"]["extractive_qa"]["methods"]
    names = [
        "native",
        "source alone",
        "Interlat",
        "Interlat, shuffled source",
        "Interlat [resumed]",
        "Interlat [resumed], shuffled source",
    ]
    assert list(rows) == names
    assert rows["Interlat"]["predictions"] == rows["Interlat [resumed]"]["predictions"]
    timed = {r["method"]: r for r in results["latency"]}
    assert set(timed["Interlat"]["stages"]) == {"source_prefill", "translation", "answer"}
    source = tiny.load(config.source)[0]
    assert timed["Interlat"]["handed_bytes"] % (source.embedding_width * 4) == 0  # fp32 hidden states per token
