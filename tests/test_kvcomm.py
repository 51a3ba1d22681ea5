"""The kvcomm baseline (mot_jax/evals/kvcomm.py) against independent references: one full forward of the target,
transformers decoding after the reference's own per-layer caches (one token at the layers not sent), transformers'
attention weights for the calibration's measure, hand-worked layer choices, and an end-to-end evaluation."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_reference import TINY, save_tiny

from mot_jax.errors import MotJaxError
from mot_jax.evals import run
from mot_jax.evals.config import defaults
from mot_jax.evals.kvcomm import (
    Calibration,
    KVComm,
    attention_mass,
    calibration_rows,
    check_pair,
    handover,
    layer_count,
    select_layers,
)
from mot_jax.evals.methods import Stopwatch, held_bytes
from mot_jax.evals.prompts import Contexts
from mot_jax.jit import jit
from mot_jax.models.generation import prefill
from mot_jax.models.loading import load_model
from mot_jax.models.tiny import load as load_tiny

LAYERS = 4


@jit
def suffix_logits(model, cache, ids, mask):
    hidden, _ = model.hidden_states(ids, mask, cache=cache)
    return model.unembed(hidden)


@jit
def full_logits(model, ids):
    return model(ids)[0]


@dataclasses.dataclass
class Pair:  # what KVComm reads of evaluate's model pair
    source: object
    target: object
    source_tokenizer: object = None
    target_tokenizer: object = None


def contexts_of(rows, width):
    ids, mask = np.zeros((len(rows), width), np.int32), np.zeros((len(rows), width), bool)
    for b, row in enumerate(rows):
        ids[b, : len(row)], mask[b, : len(row)] = row, True
    return Contexts([{}] * len(rows), False, ids, mask, [""] * len(rows))


def kvcomm_with(layers, num_layers):
    """The method with its layers chosen (no calibration)."""
    method = KVComm()
    method.calibration = Calibration(tuple(layers), num_layers)
    return method


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A 4-layer random Llama (GQA) saved by transformers, and our load of it."""
    config = transformers.LlamaConfig(
        num_hidden_layers=LAYERS,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        tie_word_embeddings=False,
        **TINY,
    )
    path = tmp_path_factory.mktemp("llama")
    reference = save_tiny(config, path, seed=3)
    return reference, load_model(str(path))[0]


def test_every_layer_sent_from_the_target_itself_is_one_full_forward(hf_llama):
    # sender = receiver, every layer sent: the target's attention over [source K/V of the context; its own suffix]
    # is its attention over the whole prompt, so the suffix logits are those of one forward over context + suffix
    _, model = hf_llama
    rng = np.random.default_rng(0)
    rows = [rng.integers(3, 97, 9).tolist(), rng.integers(3, 97, 6).tolist()]  # right padding in the second row
    suffix = [rng.integers(3, 97, 4).tolist() for _ in rows]
    contexts = contexts_of(rows, 12)
    method = kvcomm_with(range(LAYERS), LAYERS)
    cache, handed = method.build(Pair(model, model), contexts, 12 + 4, Stopwatch())
    got = np.asarray(suffix_logits(model, cache, jnp.asarray(suffix, jnp.int32), jnp.ones((2, 4), bool)))
    for b, row in enumerate(rows):
        want = np.asarray(full_logits(model, jnp.asarray([row + suffix[b]], jnp.int32)))[0, len(row) :]
        np.testing.assert_allclose(got[b], want, atol=1e-5)
    c = model.config
    np.testing.assert_array_equal(handed, [2 * LAYERS * n * c.num_kv_heads * c.head_dim * 4 for n in (9, 6)])


def test_every_layer_sent_on_gemma3_keeps_its_sliding_windows_and_one_layer_not_sent_changes_the_answer():
    # random:gemma3: sliding window 32 on every other layer, a context longer than it; sender = receiver
    model = load_tiny("random:gemma3")[0]
    rng = np.random.default_rng(5)
    rows, suffix = [rng.integers(3, 448, 40).tolist()], rng.integers(3, 448, (1, 3))
    ids, mask = jnp.asarray(suffix, jnp.int32), jnp.ones((1, 3), bool)
    want = np.asarray(full_logits(model, jnp.asarray([rows[0] + suffix[0].tolist()], jnp.int32)))[0, 40:]
    layers = model.config.num_layers
    for sent, same in ((range(layers), True), ([i for i in range(layers) if i != 3], False)):
        cache, _ = kvcomm_with(sent, layers).build(Pair(model, model), contexts_of(rows, 40), 43, Stopwatch())
        got = np.asarray(suffix_logits(model, cache, ids, mask))[0]
        assert np.allclose(got, want, atol=1e-5) == same


def test_layers_not_sent_read_only_the_first_token_as_the_reference_builds_it(hf_llama):
    # the reference's construction in transformers: the source's cache with layers 1 and 3 cut to their first token
    # (layer 0 is always sent; layer 2 is the calibration's), then the target decodes the suffix token by token
    reference, model = hf_llama
    rng = np.random.default_rng(1)
    rows = [rng.integers(3, 97, 10).tolist(), rng.integers(3, 97, 7).tolist()]
    suffix = [rng.integers(3, 97, 5).tolist() for _ in rows]
    method = kvcomm_with([2], LAYERS)
    assert method.calibration.sent == (0, 2)
    cache, handed = method.build(Pair(model, model), contexts_of(rows, 12), 12 + 5, Stopwatch())
    got = np.asarray(suffix_logits(model, cache, jnp.asarray(suffix, jnp.int32), jnp.ones((2, 5), bool)))
    for b, row in enumerate(rows):
        with torch.no_grad():
            source = reference(input_ids=torch.tensor([row]), use_cache=True).past_key_values
            layers = []
            for i, layer in enumerate(source.layers):
                keep = slice(None) if i in (0, 2) else slice(0, 1)
                layers.append((layer.keys[:, :, keep].clone(), layer.values[:, :, keep].clone()))
            past = transformers.DynamicCache(ddp_cache_data=layers)
            assert [past.layers[i].keys.shape[2] for i in range(LAYERS)] == [len(row), 1, len(row), 1]
            want = []
            reference.set_attn_implementation("sdpa")  # one query, no padding: no mask, so no per-layer mask sizes
            for i, token in enumerate(suffix[b]):
                out = reference(
                    input_ids=torch.tensor([[token]]),
                    position_ids=torch.tensor([[len(row) + i]]),
                    cache=past,
                    use_cache=True,
                )
                want.append(out.logits[0, -1].numpy())
            reference.set_attn_implementation("eager")
        np.testing.assert_allclose(got[b], np.stack(want), atol=1e-4)
        # and it is not the native answer: the unsent layers' context is really gone
        native = np.asarray(full_logits(model, jnp.asarray([row + suffix[b]], jnp.int32)))[0, len(row) :]
        assert np.abs(got[b] - native).max() > 1e-2
    # handed over: layers 0 and 2 at every context token, layers 1 and 3 at one
    per_token = 2 * model.config.num_kv_heads * model.config.head_dim * 4
    np.testing.assert_array_equal(handed, [per_token * (2 * n + 2) for n in (10, 7)])
    assert held_bytes(model, cache) == per_token * (2 * 10 + 2)


def test_the_unsent_layers_values_are_not_read():
    # the hidden slots' K/V are zeroed, and what they held before makes no difference to the target
    model = load_tiny("random:llama")[0]
    ids = jnp.asarray(np.random.default_rng(2).integers(3, 400, (1, 8)), jnp.int32)
    _, cache = prefill(model, ids, capacity=12)
    sent = jnp.asarray([True, False, True, False])
    mine = handover(cache, sent)
    noisy = handover(cache.replace(k=cache.k.at[1, :, :, 3].set(9.0), v=cache.v.at[3, :, :, 5].set(-7.0)), sent)
    assert float(jnp.abs(mine.k[1, :, :, 1:8]).max()) == 0.0 and float(jnp.abs(mine.k[1, :, :, 0]).max()) > 0
    np.testing.assert_array_equal(mine.hidden[:, 0, :8], [[False] * 8, [False] + [True] * 7] * 2)
    suffix = jnp.asarray([[5, 6, 7]], jnp.int32)
    np.testing.assert_array_equal(
        suffix_logits(model, mine, suffix, jnp.ones((1, 3), bool)),
        suffix_logits(model, noisy, suffix, jnp.ones((1, 3), bool)),
    )


def test_calibration_measure_is_transformers_attention_mass(hf_llama):
    # per layer: the attention the queries after the prefix put on the prefix, summed over the prefix keys and
    # averaged over heads and queries (the reference's `attn[:, :, P:, :P].sum(-1).mean()` on output_attentions)
    reference, model = hf_llama
    ids = np.random.default_rng(4).integers(3, 97, (2, 12))
    with torch.no_grad():
        attentions = reference(input_ids=torch.tensor(ids), output_attentions=True).attentions
    want = np.stack([a[:, :, 5:, :5].sum(-1).mean(axis=(1, 2)).numpy() for a in attentions])  # [L, B]
    got = np.asarray(attention_mass(model, jnp.asarray(ids, jnp.int32), prefix=5))
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_layer_choice_follows_the_reference_rule_on_hand_worked_scores():
    raw = [0.1, 0.9, 0.5, 0.7, 0.2, 0.8]
    # alpha 1 (the default): the attention alone, top 3 of 6 = layers 1 (0.9), 5 (0.8), 3 (0.7)
    assert select_layers(raw, 0.5, alpha=1.0, mu=0.5, sigma=5.0).selected == (1, 3, 5)
    # alpha 0: the Gaussian prior alone, centred at 0.36 * 5 = 1.8: distances .2, .8, 1.2 -> layers 2, 1, 3
    assert select_layers(raw, 0.5, alpha=0.0, mu=0.36, sigma=1.0).selected == (1, 2, 3)
    # alpha 0.5, worked by hand: attention min-max [0, 1, .5, .75, .125, .875], prior min-max (sigma 1)
    # [.197, .739, 1, .494, .085, 0] -> combined [.10, .87, .75, .62, .10, .44]: the prior swaps layer 5 for 2
    mixed = select_layers(raw, 0.5, alpha=0.5, mu=0.36, sigma=1.0)
    assert mixed.selected == (1, 2, 3) and mixed.ranking[:3] == (1, 2, 3)
    np.testing.assert_allclose(mixed.scores, [0.099, 0.870, 0.75, 0.622, 0.105, 0.4375], atol=2e-3)
    # layer 0 is sent whether or not it was chosen
    assert select_layers(raw, 0.5, 1.0, 0.5, 5.0).sent == (0, 1, 3, 5)
    # how many: round(top_layers * L) (Python's round), at least one, all for top_layers <= 0 or >= 1
    assert [layer_count(0.5, n) for n in (30, 18, 5, 1)] == [15, 9, 2, 1]
    assert layer_count(0.01, 30) == 1 and layer_count(0.0, 30) == 30 and layer_count(1.0, 30) == 30
    # equal scores normalise to zeros (the reference's guard) and the reversed argsort puts the last layers first
    assert select_layers([0.3] * 4, 0.5, 1.0, 0.5, 5.0).selected == (2, 3)


def test_calibration_rows_pack_documents_with_eos():
    _, _, tokenizer = load_tiny("random:llama")
    texts = ["the quick brown fox " * 6, "", "jumps over the lazy dog " * 6, "never read"]
    encode = lambda t: tokenizer.encode(t, add_special_tokens=False).ids
    stream = encode(texts[0]) + [2] + encode(texts[2]) + [2]
    rows = calibration_rows(tokenizer, texts, count=len(stream) // 16, total_tokens=16, eos_id=2)
    np.testing.assert_array_equal(rows, np.reshape(stream[: rows.size], (-1, 16)))
    assert rows.shape == (len(stream) // 16, 16)
    with pytest.raises(MotJaxError, match="fewer than one 4096-token sequence"):
        calibration_rows(tokenizer, texts, count=1, total_tokens=4096, eos_id=2)


def test_a_heterogeneous_pair_is_refused_in_one_line(tmp_path):
    llama, gemma = load_tiny("random:llama")[0].config, load_tiny("random:gemma3")[0].config
    with pytest.raises(MotJaxError) as error:
        check_pair(llama, gemma, ("random:llama", "random:gemma3"))
    message = str(error.value)
    assert "\n" not in message and "one architecture, depth and vocabulary" in message
    assert "random:llama -> random:gemma3" in message and "family llama vs gemma3" in message
    with pytest.raises(MotJaxError, match="num_layers 4 vs 6"):
        check_pair(llama, dataclasses.replace(llama, num_layers=6))
    check_pair(llama, llama)
    # through the evaluation: refused after the models load, before any example
    config = defaults()
    config.update(dict(pair="random:llama,random:gemma3", methods="native,kvcomm", tasks="extractive_qa"))
    with pytest.raises(MotJaxError, match="differ in family llama vs gemma3"):
        run.evaluate(tmp_path, config)


@pytest.mark.slow
def test_kvcomm_row_in_an_evaluation_of_a_homogeneous_pair(tmp_path):
    config = defaults()
    config.update(
        dict(
            pair="random:llama,random:llama",
            methods="native,kvcomm",
            tasks="extractive_qa,multi_agent",
            examples=2,
            batch_size=2,
            max_new_tokens=4,
            agents=2,
            ttft_lengths="32",
            ttft_runs=1,
        )
    )
    config.kvcomm.calib_size, config.kvcomm.total_tokens, config.kvcomm.prefix_tokens = 4, 32, 16
    out = tmp_path / "eval"
    run.evaluate(tmp_path, config, out=out)
    saved = json.loads((out / "results.json").read_text())
    calibration = saved["meta"]["kvcomm"]
    (name,) = calibration  # 2 calibrated layers of 4, and layer 0 unless it is one of them
    assert name in ("KVComm (2 of 4 layers)", "KVComm (3 of 4 layers)")
    chosen = calibration[name]
    assert len(chosen["selected"]) == 2 and len(chosen["attention"]) == 4
    assert list(saved["tasks"]["extractive_qa"]["methods"]) == ["native", name]
    assert saved["tasks"]["multi_agent"]["methods"][name]["shares_one_cache"]
    rows = {r["method"]: r for r in saved["latency"]}
    assert rows[name]["handed_bytes"] > 0 and rows[name]["ttft_with_source_s"] > rows[name]["ttft_s"] > 0
    assert rows[name]["planned_bytes"] > 0 and rows[name]["target_kv_bytes"] < rows["native"]["target_kv_bytes"]
    assert f"| {name} |" in (out / "results.md").read_text()


def test_no_calibration_sequence_is_refused_in_one_line(tmp_path):
    # calib_size=0 was reported as a calibration text too short for one sequence
    command = [sys.executable, "-m", "mot_jax.evaluate", f"--workdir={tmp_path}", "--config.kvcomm.calib_size=0"]
    result = subprocess.run(command, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "error: kvcomm.calib_size=0 leaves the kvcomm calibration no sequence to measure; pass "
        "--config.kvcomm.calib_size=N with N >= 1."
    ], result.stderr[-2000:]
