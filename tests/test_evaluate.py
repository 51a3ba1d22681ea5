"""The evaluation engine against independent computations, the report files, and `python -m mot_jax.evaluate`."""

import dataclasses
import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from helpers import one_device_command_env, small_config
from tolerances import assert_float32_close

from mot_jax.errors import Interrupted, MotJaxError, Terminated
from mot_jax.evals import datasets, metrics, report, run, synthetic
from mot_jax.evals.config import defaults
from mot_jax.evals.methods import (
    Native,
    NoContext,
    ShuffledSource,
    SourceAlone,
    Stopwatch,
    Translated,
    method_name,
    regrid,
)
from mot_jax.evals.prompts import (
    CHAT_TURNS,
    INSTRUCTIONS,
    Settings,
    batches,
    context_cuts,
    decode_answers,
    donor_indices,
    is_closed,
    line_flags,
    prefix_text,
    suffix_text,
    target_chat,
    token_ids,
)
from mot_jax.evals.tasks import add_paired_controls, add_retention, evaluate_agents, evaluate_examples
from mot_jax.jit import jit
from mot_jax.models.generation import LINE_BREAK, LINE_TEXT, generate
from mot_jax.models.model_pair import load_pair
from mot_jax.progress import Progress
from mot_jax.training.config import base, tiny
from mot_jax.translate import align as alignment_lib
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, mixture_config

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = Settings(batch_size=2, max_new_tokens=6)


def tiny_pair(source="llama", target="gemma3"):
    config = base()
    tiny(config, source, target)
    return load_pair(config)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@jit
def log_probs(model, ids):
    """Log-softmax of a full forward's logits over one sequence, [length, vocab], as one program per length (run
    eagerly, each operation of the forward compiled anew for every length)."""
    return jax.nn.log_softmax(model(ids)[0][0], axis=-1)


def assert_answer_kept(generation: str, reference: str) -> None:
    """The evaluation's generation stops at the end of the answer's line (`prompts.line_flags`): it is how the
    uninterrupted generation begins, with the same answer."""
    assert reference.startswith(generation), (generation, reference)
    assert metrics.first_line(generation) == metrics.first_line(reference)


def test_line_flags_mark_each_tokens_breaks_and_text(pair):
    """From each token's own text: a word is text, a line break is a break without text, an id past the tokenizer's
    is neither."""
    tokenizer = pair.target_tokenizer
    size = alignment_lib.adapter(tokenizer).backend.get_vocab_size(with_added_tokens=True)
    flags = line_flags(tokenizer, size + 2)
    (word,), (line_break,) = (token_ids(tokenizer, [text], False)[0] for text in ("the", "\n"))
    assert (flags[word], flags[line_break], *flags[size:]) == (LINE_TEXT, LINE_BREAK, 0, 0)


# a chat format whose markers the tiny tokenizers read as plain text (their vocabularies have no chat tokens)
TURNS = ("<user>\n", "</user>\n<assistant>\n")


@pytest.mark.parametrize("chat", [None, TURNS], ids=["plain", "chat"])
def test_native_answers_equal_the_target_reading_the_whole_prompt(pair, chat):
    """The engine's native path (padded batch, prefix cache, suffix, greedy decoding) gives the tokens of the target
    generating from prefix + suffix in one unpadded sequence; option likelihoods equal a full forward's. With a chat
    format the prompt is the user turn (instruction, passage, question) and the assistant's opening."""
    examples = synthetic.examples("extractive_qa", 3, seed=1) + synthetic.examples("closed_qa", 3, seed=2)[:2]
    settings = dataclasses.replace(SETTINGS, chat=chat)
    for subset in (examples[:3], examples[3:]):
        got = evaluate_examples(pair, [Native()], subset, settings)["native"]["predictions"]
        closed = is_closed(subset)
        eos = pair.target.config.eos_ids
        for example, prediction in zip(subset, got):
            text = f"{INSTRUCTIONS['closed' if closed else 'extractive']}\nPassage: {example['context']}"
            assert prefix_text(example, closed, chat=chat) == (chat[0] if chat else "") + text
            question = f"\nQuestion: {example['question']}"
            assert suffix_text(example, options=False, chat=chat) == question + (chat[1] if chat else "\nAnswer:")
            prefix = token_ids(pair.target_tokenizer, [prefix_text(example, closed, chat=chat)], True)[0]
            suffix = token_ids(pair.target_tokenizer, [suffix_text(example, chat=chat)], False)[0]
            prefix = prefix[: 512 - len(suffix) - SETTINGS.max_new_tokens]  # what fits the tiny model's 512 positions
            ids = jnp.asarray([prefix + suffix], jnp.int32)
            out = generate(pair.target, ids, max_new_tokens=SETTINGS.max_new_tokens)
            assert_answer_kept(prediction["generation"], decode_answers(pair.target_tokenizer, out, eos)[0])
            gold = example["answers"] if "answers" in example else [example["answer"]]
            assert (prediction["question"], prediction["gold"]) == (example["question"], gold)
            if closed:  # the likelihood choice from full forwards over prompt (without the options) + " choice"
                means = []
                plain = token_ids(pair.target_tokenizer, [suffix_text(example, options=False, chat=chat)], False)[0]
                for choice in example["choices"]:
                    tokens = token_ids(pair.target_tokenizer, [" " + choice], False)[0]
                    logp = np.asarray(log_probs(pair.target, jnp.asarray([prefix + plain + tokens], jnp.int32)))
                    start = len(prefix) + len(plain)
                    means.append(np.mean([logp[start - 1 + j, t] for j, t in enumerate(tokens)]))
                assert prediction["likelihood_choice"] == example["choices"][int(np.argmax(means))]


def test_contexts_cut_to_fit_the_target_are_counted_and_reported(pair):
    """An extractive context longer than the target's positions is cut (as before); the report says how many
    examples were and by how many tokens, counted from each prompt's own tokens and the model's limit."""
    examples = synthetic.examples("extractive_qa", 3, seed=1)
    examples[1] = examples[1] | {"context": " ".join([examples[1]["context"]] * 200)}  # far past the positions
    limit = pair.target.config.max_positions
    over = []
    for example in examples:
        prefix = token_ids(pair.target_tokenizer, [prefix_text(example, False)], True)[0]
        suffix = token_ids(pair.target_tokenizer, [suffix_text(example)], False)[0]
        over.append(max(0, len(prefix) - (limit - len(suffix) - SETTINGS.max_new_tokens)))
    assert over[1] > 0 and over[0] == over[2] == 0
    cuts = context_cuts(pair, examples, SETTINGS)
    assert cuts == dict(examples=1, of=3, most_tokens=over[1], mean_tokens=float(over[1]))
    assert context_cuts(pair, [examples[0], examples[2]], SETTINGS) is None
    note = report.cut_note(cuts)
    assert note.startswith("1 of 3 examples' contexts were cut to fit the target's positions") and str(over[1]) in note
    scores = add_paired_controls(add_retention(evaluate_examples(pair, [Native()], examples, SETTINGS), "f1"))
    meta = dict(methods={}, source="s", target="t", dtype="float32", data="synthetic", machine="m", seconds=1.0)
    task = dict(examples=3, methods=scores, cut=cuts)
    assert note in report.markdown(dict(meta=meta | dict(config=dict(max_new_tokens=6)), tasks={"extractive_qa": task}))


def test_gold_log_probability_and_the_source_alone_equal_full_forwards(pair):
    """The gold answer's mean log-probability per token after the native cache equals a full forward's over prefix +
    suffix + " answer"; the source alone (the pair swapped) answers as the source generating from its own prompt in
    one sequence, and its log-probability is the source's full forward's. Progress counts answers, of both passes."""
    examples = synthetic.examples("extractive_qa", 3, seed=1)
    calls = []
    results = evaluate_examples(pair, [Native(), SourceAlone()], examples, SETTINGS, lambda *c: calls.append(c))
    assert calls == [(4, 6), (6, 6)]  # batches of 2, each answered by the target's pass and the source's
    readers = (("native", pair.target, pair.target_tokenizer), ("source alone", pair.source, pair.source_tokenizer))
    for name, model, tokenizer in readers:
        for example, prediction in zip(examples, results[name]["predictions"], strict=True):
            prefix = token_ids(tokenizer, [prefix_text(example, False)], True)[0]
            suffix = token_ids(tokenizer, [suffix_text(example)], False)[0]
            prefix = prefix[: model.config.max_positions - len(suffix) - SETTINGS.max_new_tokens]
            answer = token_ids(tokenizer, [" " + example["answers"][0]], False)[0]
            logp = np.asarray(log_probs(model, jnp.asarray([prefix + suffix + answer], jnp.int32)))
            start = len(prefix) + len(suffix)
            expected = np.mean([logp[start - 1 + j, t] for j, t in enumerate(answer)])
            assert prediction["logprob"] == pytest.approx(expected, abs=1e-4), name
            out = generate(model, jnp.asarray([prefix + suffix], jnp.int32), max_new_tokens=SETTINGS.max_new_tokens)
            assert_answer_kept(prediction["generation"], decode_answers(tokenizer, out, model.config.eos_ids)[0])
    assert results["native"]["logprob"] == pytest.approx(
        np.mean([p["logprob"] for p in results["native"]["predictions"]])
    )


class Same(nnx.Module):
    """An identity translator mixture: the K or V it reads is the K or V it writes."""

    def __call__(self, x, mask):
        return x, {}


def test_direct_identity_translation_reproduces_native_scores_exactly():
    """Source = target model and an identity translator in `direct` mode: every prediction equals native's."""
    pair = tiny_pair("gemma3", "gemma3")
    layers = pair.target.config.num_layers
    spec = TranslationSpec.build("direct", None, layers, layers)
    translator = KVTranslator(
        spec, mixture_config(spec, pair.source, pair.target, dim=8, heads=1, depth=1), rngs=nnx.Rngs(0)
    )
    translator.key, translator.value = Same(), Same()
    methods = [Native(), Translated("identity", translator, "-", 0)]
    for task in ("extractive_qa", "closed_qa"):
        results = evaluate_examples(pair, methods, synthetic.examples(task, 4, seed=3), SETTINGS)
        # the log-probability to float rounding: the identity's cache is computed by other operations
        got, native = ([dict(p, logprob=None) for p in results[m.name]["predictions"]] for m in methods)
        assert got == native
        for a, b in zip(results["identity"]["predictions"], results["native"]["predictions"]):
            assert a.get("logprob", 0) == pytest.approx(b.get("logprob", 0), abs=1e-5)
        metric = "accuracy" if task == "closed_qa" else "f1"
        assert results["identity"][metric] == results["native"][metric]


def test_budgets_truncate_the_context_and_a_question_that_cannot_fit_is_refused(pair):
    example = synthetic.examples("long_context", 1, seed=0, distractors=8)[0]
    short = Settings(batch_size=1, max_new_tokens=4, budget=160)
    contexts, _, _ = next(batches(pair, [example], short))
    assert contexts.mask.sum() == 160 and 20 < len(contexts.passages[0]) < len(example["context"]) / 2
    assert example["context"].startswith(contexts.passages[0].rstrip("\ufffd"))  # a cut may split a character
    too_long = dict(example, question="why " * 600)
    with pytest.raises(MotJaxError, match="cannot fit"):
        next(batches(pair, [too_long], short))


def test_no_context_leaves_the_room_it_was_asked_for(pair):
    """Its cache holds the instruction and room for `capacity - contexts.length` more tokens even where the
    instruction is longer than a budget-cut context (it had less room, and the gold answer's read after the question
    overwrote its last slots)."""
    examples = synthetic.examples("extractive_qa", 2, seed=1)
    contexts, _, _ = next(batches(pair, examples, Settings(batch_size=2, budget=24)))
    cache, _ = NoContext().build(pair, contexts, contexts.length + 40, Stopwatch())
    assert int(cache.index) > contexts.length and cache.capacity - int(cache.index) == 40


@pytest.fixture(scope="module")
def trained_workdir(tiny_run):
    """A tiny training run (the translator only needs to exist): the session's quickstart:tiny run, a replay mixture
    of 2 experts between random:llama and random:gemma3 with one checkpoint, of step 2; the tests only read it."""
    return tiny_run[0]


@pytest.mark.slow
def test_report_files_are_written_and_parse(trained_workdir, tmp_path):
    out = tmp_path / "report"
    results = run.evaluate(trained_workdir, small_config(), out=out)
    saved = json.loads((out / "results.json").read_text())
    assert set(saved["tasks"]) == {"extractive_qa", "closed_qa", "long_context", "multi_agent"}
    names = ["no_context", "native", "text_relay", "source alone", "MoT replay", "MoT replay, shuffled source"]
    assert list(saved["tasks"]["extractive_qa"]["methods"]) == names
    assert saved["tasks"]["closed_qa"]["methods"]["native"]["retention"] in (None, 100.0)
    assert list(saved["tasks"]["long_context"]["budgets"]) == ["48", "96"]
    assert {r["context_tokens"] for r in saved["latency"]} == {32, 64}
    assert len(saved["routing"]["MoT replay"]["key"]) == 2  # tokens per expert
    assert "predictions" not in saved["tasks"]["extractive_qa"]["methods"]["native"]
    assert results["tasks"]["extractive_qa"]["methods"]["native"]["predictions"]  # they go to predictions.jsonl
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    # 2 examples: two tasks and long_context at two budgets; 2 documents with 2 agents each (no source alone there)
    assert len(rows) == len(names) * 2 * (2 + 2) + (len(names) - 1) * 2 * 2
    markdown = (out / "results.md").read_text()
    assert markdown == report.markdown(saved) and "| MoT replay |" in markdown
    assert saved["meta"]["chat_template"] is False and "; plain prompts;" in markdown  # tiny random: no chat format
    # the shuffled-source control: a row on every task, none in the TTFT table (its cost is its method's)
    assert "| MoT replay, shuffled source |" in markdown
    assert list(saved["tasks"]["multi_agent"]["methods"]) == [n for n in names if n != "source alone"]
    assert saved["tasks"]["multi_agent"]["methods"][names[-1]]["context_seconds"] is None
    timed = {r["method"] for r in saved["latency"]}
    assert {"MoT replay", "source alone"} <= timed and names[-1] not in timed
    # the paired differences of the translated row against every control, on every open-answer task and budget
    controls = ["no_context", "native", "source alone", "MoT replay, shuffled source"]
    for methods in (saved["tasks"]["extractive_qa"]["methods"], *saved["tasks"]["long_context"]["budgets"].values()):
        assert list(methods["MoT replay"]["paired"]) == controls
        assert set(methods["MoT replay"]["paired"]["native"]) >= {"f1", "exact_match", "logprob"}
    assert "| MoT replay | source alone |" in markdown and not (out.parent / "report.partial").exists()
    for plot in ("quality_vs_budget.png", "ttft_vs_length.png", "routing_load.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failed_final_write_keeps_the_results_so_far_and_says_where(trained_workdir, tmp_path, monkeypatch):
    """Issue 38: a full disk at the end lost every result in a traceback. The rows are written as they are computed
    (OUT.partial: each batch's predictions, each finished task's scores), a failed report names them in one
    sentence, and a written report removes them."""
    config = small_config(tasks="extractive_qa", examples=4, ttft_lengths="", methods="no_context,native")
    out = tmp_path / "eval"
    real = run.report.write

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run.report, "write", full)
    with pytest.raises(
        MotJaxError, match=rf"No space left on device.*the results are in {re.escape(str(out))}.partial"
    ):
        run.evaluate(trained_workdir, config, out=out)
    partial = tmp_path / "eval.partial"
    rows = [json.loads(line) for line in (partial / "predictions.jsonl").read_text().splitlines()]
    names = ["no_context", "native", "source alone", "MoT replay", "MoT replay, shuffled source"]
    assert sorted((r["method"], r["index"]) for r in rows) == sorted((m, i) for m in names for i in range(4))
    assert all({"f1", "exact_match", "logprob"} <= set(r) for r in rows)  # scored as they are written
    # batch by batch, every row in step (the source alone, answered with the pair swapped, too): a run stopped after
    # the first batch has every row of it
    order = [(r["method"], r["index"]) for r in rows]
    assert max(order.index((m, i)) for m in names for i in (0, 1)) < min(order.index((m, 2)) for m in names)
    saved = json.loads((partial / "results.json").read_text())
    assert list(saved["tasks"]["extractive_qa"]["methods"]) == names and saved["meta"]["target"] == "random:gemma3"
    assert not out.exists()
    monkeypatch.setattr(run.report, "write", real)
    run.evaluate(trained_workdir, config, out=out)
    assert (out / "results.json").exists() and not partial.exists()


def evaluate_cli(*flags):
    command = [sys.executable, "-m", "mot_jax.evaluate", *flags]
    return subprocess.run(command, cwd=ROOT, env=one_device_command_env(), capture_output=True, text=True, timeout=600)


def test_cli_errors_are_one_line(trained_workdir, tmp_path):
    result = evaluate_cli(f"--workdir={tmp_path}")
    assert result.returncode == 2 and "holds no finished checkpoint" in result.stderr.splitlines()[-1]
    result = evaluate_cli(f"--workdir={trained_workdir}", "--config.exampels=3")
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith("error: the config has no key")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(dict(context="c", question="q", answers=["a"])) + "\n{not json\n")
    result = evaluate_cli(f"--workdir={trained_workdir}", "--task=extractive_qa", f"--data={bad}")
    assert result.returncode == 2 and f"{bad}:2: not valid JSON" in result.stderr
    result = evaluate_cli(f"--workdir={trained_workdir}", f"--data={bad}")
    assert result.returncode == 2 and "--data needs --task" in result.stderr


def test_user_jsonl_through_the_command(trained_workdir, tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in synthetic.examples("closed_qa", 2, seed=5)))
    out = tmp_path / "out"
    flags = ["--task=closed_qa", f"--data={data}", f"--out={out}", "--config.ttft_lengths=", "--config.methods=native"]
    result = evaluate_cli(f"--workdir={trained_workdir}", *flags, "--config.max_new_tokens=4")
    assert result.returncode == 0, result.stderr[-2000:]
    saved = json.loads((out / "results.json").read_text())
    assert list(saved["tasks"]) == ["closed_qa"] and saved["tasks"]["closed_qa"]["examples"] == 2
    assert "## closed_qa (2 examples)" in result.stdout


def test_compared_runs_must_share_the_model_pair(trained_workdir, monkeypatch):
    real = run.load_trained

    def load(workdir, which, **changes):
        trained = real(trained_workdir, which, **changes)
        if workdir == "other":
            trained.config.target = "random:qwen2"
        return trained

    monkeypatch.setattr(run, "load_trained", load)
    with pytest.raises(MotJaxError, match="compare runs of one model pair"):
        run.trained_methods([str(trained_workdir), "other"], "last")


def test_replay_attention_and_checkpoint_step_are_chosen_at_evaluation(trained_workdir, pair):
    """`replay_attention` evaluates a replay translator again with another attention and the same weights, and
    the caches it builds change with it (the layers below the translated window stay the native prefill's); `which`
    takes a step number."""
    names = ["MoT replay", "MoT replay, dense attention", "MoT replay, top-2 attention"]
    methods, _ = run.trained_methods([str(trained_workdir)], "2", "trained,dense,2,dense,trained")
    assert [m.name for m in methods] == names
    assert [m.translator.spec.attention_topk for m in methods] == [4, 0, 2]
    weights = [nnx.state(m.translator, nnx.Param) for m in methods]
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), weights[0], weights[1]))
    contexts, _, _ = next(batches(pair, synthetic.examples("extractive_qa", 2, seed=4), SETTINGS))
    native, _ = Native().build(pair, contexts, contexts.length, Stopwatch())
    caches = [m.build(pair, contexts, contexts.length, Stopwatch())[0].k for m in methods]
    below = min(methods[0].translator.spec.target_layers)
    for k in caches:
        np.testing.assert_allclose(k[:below], native.k[:below], atol=1e-5)
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert not np.allclose(caches[a][below:], caches[b][below:], atol=1e-3), (a, b)
    with pytest.raises(MotJaxError, match="keeps no checkpoint of step 7; pick one of steps 2, last or best"):
        run.trained_methods([str(trained_workdir)], "7")
    with pytest.raises(MotJaxError, match="replay_attention has 'sparse'"):
        run.trained_methods([str(trained_workdir)], "last", "sparse")


def test_multi_agent_predictions_name_each_agent_question_and_gold_answers(pair):
    """predictions.jsonl had no multi-agent rows: one per document and agent, and its F1 is their mean (its standard
    error theirs). Each native answer is the target's reading the document and that agent's question in one sequence
    (the methods' caches answer as one batch), the document cut to leave room for its longest question (it was cut
    for the first agent's, so a longer one ran past the model's positions)."""
    documents = synthetic.examples("multi_agent", 3, seed=6, questions_per_example=2)
    scores = evaluate_agents(pair, [NoContext(), Native()], documents, SETTINGS)
    _, rows = report.split_predictions(dict(tasks=dict(multi_agent=dict(examples=3, methods=scores))))
    rows = [r for r in rows if r["method"] == "native"]
    assert [(r["index"], r["agent"]) for r in rows] == [(d, k) for d in range(3) for k in range(2)]
    for row in rows:
        document, agent = documents[row["index"]], row["agent"]
        assert (row["task"], row["method"]) == ("multi_agent", "native")
        assert (row["question"], row["gold"]) == (document["questions"][agent], document["answers"][agent])
        example = dict(context=document["context"], question=row["question"])
        prefix = token_ids(pair.target_tokenizer, [prefix_text(example, False)], True)[0]
        suffix, *others = (
            token_ids(pair.target_tokenizer, [suffix_text(example, q)], False)[0]
            for q in [row["question"], *document["questions"]]
        )
        prefix = prefix[: 512 - max(map(len, others)) - SETTINGS.max_new_tokens]  # the tiny model's 512 positions
        out = generate(pair.target, jnp.asarray([prefix + suffix], jnp.int32), max_new_tokens=SETTINGS.max_new_tokens)
        assert_answer_kept(row["generation"], decode_answers(pair.target_tokenizer, out, pair.target.config.eos_ids)[0])
    per_row = [metrics.f1(r["answer"], r["gold"]) for r in rows]
    assert [r["f1"] for r in rows] == per_row
    assert scores["native"]["f1"] == pytest.approx(np.mean(per_row))
    assert scores["native"]["f1_se"] == pytest.approx(np.std(per_row, ddof=1) / np.sqrt(len(per_row)))


def test_progress_is_a_bar_on_a_terminal_and_periodic_lines_otherwise(monkeypatch):
    """It was a hand-written log line after every batch."""

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for terminal in (False, True):
        stream = Terminal() if terminal else io.StringIO()
        monkeypatch.setattr(sys, "stderr", stream)
        progress = Progress("extractive_qa", "example", every=3600)
        for done in range(2, 13, 2):
            progress(done, 12)
        lines = [line for line in stream.getvalue().replace("\r", "\n").splitlines() if line.strip()]
        assert "12/12" in lines[-1] and "example" in lines[-1], lines
        if not terminal:  # one line at the end (the batches came faster than `every`)
            assert len(lines) == 1, lines


def test_bad_counts_and_output_folders_are_refused_before_any_work(tmp_path):
    """batch_size=0 raised ValueError (range step 0) after loading the models; --out=WORKDIR ran the evaluation and
    then deleted the workdir."""
    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    (workdir / "config.json").write_text("{}")
    with pytest.raises(MotJaxError, match=r"batch_size=0; pass a positive whole number \(--config.batch_size=N\)"):
        run.evaluate(workdir, small_config(batch_size=0))
    with pytest.raises(MotJaxError, match="is a training workdir"):
        run.evaluate(workdir, small_config(), out=workdir)
    with pytest.raises(MotJaxError, match=r"recompute='0,1.5' is not a list of shares in \[0, 1\]"):
        run.evaluate(workdir, small_config(recompute="0,1.5"))
    assert sorted(p.name for p in workdir.iterdir()) == ["checkpoints", "config.json"]


def test_a_jsonl_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    good = json.dumps(dict(context="c", question="q", answers=["a"]))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(f"{good}\n".encode() + b'{"context": "caf\xe9", "question": "q", "answers": ["a"]}\n')
    with pytest.raises(MotJaxError, match=f"{re.escape(str(bad))}:2: not UTF-8 text"):
        datasets.load_examples("extractive_qa", str(bad), 4, 0, "")
    native = tmp_path / "rows.json"
    native.write_bytes(b'[\n{"a": 1},\n{"b": "\xff"}]\n')
    with pytest.raises(MotJaxError, match=f"{re.escape(str(native))}:3: not UTF-8 text"):
        datasets._local_rows("squad", native)


class Zero(nnx.Module):
    """A translator mixture whose output does not depend on what it reads."""

    def __init__(self, width):
        self.width = width

    def __call__(self, x, mask):
        return jnp.zeros((*x.shape[:-1], self.width), x.dtype), {}


def direct_translator(pair, seed=0):
    spec = TranslationSpec.build("direct", None, pair.source.config.num_layers, pair.target.config.num_layers)
    config = mixture_config(spec, pair.source, pair.target, dim=8, heads=1, depth=1)
    return KVTranslator(spec, config, rngs=nnx.Rngs(seed))


def test_shuffled_source_equals_the_translation_when_the_translator_ignores_the_source(pair):
    """With a translator that reads nothing, another example's source changes nothing: this row's own target grid
    (positions, mask, first token) is kept, whatever the lengths of the two examples."""
    translator = direct_translator(pair)
    width = pair.target.config.num_kv_heads * pair.target.config.head_dim
    translator.key, translator.value = Zero(width), Zero(width)
    method = Translated("zero", translator, "-", 0)
    examples = synthetic.examples("extractive_qa", 3, seed=7)
    contexts, _, _ = next(batches(pair, examples, Settings(batch_size=3), donors=True))
    assert len(set(contexts.mask.sum(1))) > 1  # the rows differ in length: the donor's grid is not this row's
    normal, _ = method.build(pair, contexts, contexts.length, Stopwatch())
    shuffled, _ = ShuffledSource(method).build(pair, contexts, contexts.length, Stopwatch())
    for field in ("k", "v", "positions", "valid"):
        np.testing.assert_array_equal(getattr(shuffled, field), getattr(normal, field))
    results = add_paired_controls(evaluate_examples(pair, [method, ShuffledSource(method)], examples, SETTINGS))
    assert results["zero, shuffled source"]["predictions"] == results["zero"]["predictions"]
    against = results["zero"]["paired"]["zero, shuffled source"]
    assert [(against[m]["diff"], against[m]["se"]) for m in ("f1", "exact_match", "logprob")] == [(0, 0)] * 3


def test_shuffled_source_row_is_the_translation_of_another_examples_source(pair, monkeypatch):
    """Row b's cache is the normal translation of its donor's (the next example's) context, built here on its own
    through CacheTranslator; the prefixes are cut to one length so both grids agree. A batch's translated row and
    its control run one source prefill (over the batch's rows and the donors not among them) and the target's bottom
    layers over the batch once."""
    from mot_jax.evals import methods
    from mot_jax.translate import pipeline
    from mot_jax.translate.pipeline import CacheTranslator

    translator = direct_translator(pair, seed=1)
    method = Translated("MoT direct", translator, "-", 0)
    examples = synthetic.examples("extractive_qa", 3, seed=8)
    settings = Settings(batch_size=2, budget=120)  # the last batch holds one row: its donor is example 0
    translate = CacheTranslator(pair.source, pair.target, pair.source_tokenizer, pair.target_tokenizer, translator)
    # every example's donor translated in one CacheTranslator batch (row i: example i's donor), one program for all
    # (one call per donor compiled the source's prefill and the translation again for each one's source length)
    donors = [examples[(i + 1) % len(examples)] for i in range(len(examples))]
    ids = np.array([token_ids(pair.target_tokenizer, [prefix_text(d, False)], True)[0][:120] for d in donors])
    own = translate.from_target_ids(ids, np.ones((len(donors), 120), bool))
    checked, calls = 0, []
    counted = lambda name, f: lambda *a, **k: calls.append((name, len(a[1]))) or f(*a, **k)
    monkeypatch.setattr(pipeline, "source_prefill", counted("source", pipeline.source_prefill))
    monkeypatch.setattr(methods, "bottom_run_jit", counted("target", methods.bottom_run_jit))
    for contexts, _, _ in batches(pair, examples, settings, donors=True):
        assert (contexts.mask.sum(1) == 120).all()
        calls.clear()
        shuffled, _ = ShuffledSource(method).build(pair, contexts, contexts.length, Stopwatch())
        normal, _ = method.build(pair, contexts, contexts.length, Stopwatch())
        # batch [0, 1] with donors [1, 2]: the source reads 0, 1, 2; batch [2] with donor [0]: it reads 2, 0
        assert calls == [("source", 3 if len(contexts.examples) == 2 else 2), ("target", len(contexts.examples))]
        for b, example in enumerate(contexts.examples):
            i = examples.index(example)
            np.testing.assert_allclose(shuffled.k[:, b, :, :120], own.k[:, i], atol=1e-5)
            np.testing.assert_allclose(shuffled.v[:, b, :, :120], own.v[:, i], atol=1e-5)
            assert not np.allclose(shuffled.v[:, b, :, 60:120], normal.v[:, b, :, 60:120], atol=1e-3)
            checked += 1
    assert checked == 3


def test_a_swapped_band_takes_those_layers_from_the_donors_native_cache(pair, monkeypatch):
    """Layers [lo, hi) of the band row's cache are the donor's (the next example's) own native prefill, the others
    this row's: checked against the two prefills run on their own, the prefixes cut to one length (carry is then
    the identity); the bands are the target's quarters; a batch's native row and all its bands run two prefills
    (the rows', the donors'); a bad diagnose is refused in one line."""
    from mot_jax.evals import methods
    from mot_jax.evals.methods import SwappedBand, band_spans, bands
    from mot_jax.models.generation import prefill

    examples = synthetic.examples("extractive_qa", 2, seed=8)
    contexts, _, _ = next(batches(pair, examples, Settings(batch_size=2, budget=120), donors=True))
    assert (contexts.mask.sum(1) == 120).all()
    layers = pair.target.config.num_layers
    cache, _ = SwappedBand(1, layers).build(pair, contexts, contexts.length, Stopwatch())
    own = prefill(pair.target, contexts.ids, contexts.mask)[1]
    donor = prefill(pair.target, contexts.ids[::-1], contexts.mask[::-1])[1]  # each row's donor is the other row
    assert_float32_close(cache.k[:1, :, :, :120], own.k[:1, :, :, :120])
    assert_float32_close(cache.k[1:, :, :, :120], donor.k[1:, :, :, :120])
    assert_float32_close(cache.v[1:, :, :, :120], donor.v[1:, :, :, :120])
    assert [(b.lo, b.hi) for b in bands(8)] == [(0, 2), (2, 4), (4, 6), (6, 8)] and bands(8)[0].needs_donors
    calls = []
    monkeypatch.setattr(methods, "prefill", lambda *a, **k: calls.append(a[1]) or prefill(*a, **k))
    contexts, _, _ = next(batches(pair, examples, Settings(batch_size=2, budget=120), donors=True))
    for method in [Native(), *bands(layers)]:
        method.build(pair, contexts, contexts.length, Stopwatch())
    assert [ids is contexts.ids for ids in calls] == [True, False]
    assert bands(2)[0].name == "native, layers 0-0 from another example" and len(bands(2)) == 2
    # named bands: layers A to B as the rows name them, checked against the target's depth once it is loaded
    named = bands(8, band_spans("bands:0-5, 3-7,2-2"))
    assert [(b.lo, b.hi) for b in named] == [(0, 6), (3, 8), (2, 3)] and named[0].name.startswith("native, layers 0-5 ")
    assert band_spans("bands") is None
    with pytest.raises(MotJaxError, match=r"layers 6-8 is past the target's 8 layers \(0-7\); pass bands within"):
        bands(8, band_spans("bands:6-8"))
    for bad in ("layers", "bands:", "bands:3-1", "bands:1", "bands:0-2,x"):
        with pytest.raises(MotJaxError, match=rf"diagnose={re.escape(repr(bad))} is not a diagnostic; pass bands "):
            run.evaluate("/nonexistent", small_config(diagnose=bad))


def test_each_timed_run_reads_the_source_and_runs_the_bottom_anew(pair, monkeypatch):
    """A batch's shared reads (`Stopwatch.shared`) must not carry from one timed run to the next: the warm-up's
    compile time would then be charged to every run."""
    from mot_jax.evals import latency, methods
    from mot_jax.translate import pipeline

    calls = []
    counted = lambda name, f: lambda *a, **k: calls.append(name) or f(*a, **k)
    monkeypatch.setattr(pipeline, "source_prefill", counted("source", pipeline.source_prefill))
    monkeypatch.setattr(methods, "bottom_run_jit", counted("bottom", methods.bottom_run_jit))
    examples = synthetic.examples("extractive_qa", 2, seed=8)
    contexts, suffix_ids, suffix_mask = next(batches(pair, examples, Settings(batch_size=1), donors=True))
    method = Translated("MoT direct", direct_translator(pair), "-", 0)
    stages = latency.timed(pair, method, contexts, suffix_ids, suffix_mask, SETTINGS, runs=2)
    assert calls == ["source", "bottom"] * 3 and {"source_prefill", "target_bottom", "translation"} <= set(stages)


@pytest.mark.slow  # ~10 s; the fast subset has the recomputation's own tests (test_recompute.py)
def test_recomputing_every_token_answers_as_native_and_rows_follow_their_methods(pair):
    """A dial translator's row recomputing all of the context above its exact bottom holds the target's own cache
    (`mot_jax.translate.recompute`), so it answers exactly as native does, whatever the translator wrote; the rows
    come after their method, and only a direct translator on the window path takes them."""
    source, target = pair.source.config.num_layers, pair.target.config.num_layers
    spec = TranslationSpec.build("direct", None, source, target, native_bottom=2, inputs=("source", "hidden"))
    config = mixture_config(spec, pair.source, pair.target, dim=8, heads=1, depth=1)
    method = Translated("dial", KVTranslator(spec, config, rngs=nnx.Rngs(0)), "-", 0)
    rows = run.with_recomputation([method], [0, 0.1, 1.0])
    names = [m.name for m in rows]
    assert names == ["dial", "dial, recomputing 10%", "dial, recomputing 100%"]
    examples = synthetic.examples("extractive_qa", 4, seed=3)
    results = add_paired_controls(evaluate_examples(pair, [Native(), method, rows[2]], examples, SETTINGS))
    got, native = ([dict(p, logprob=None) for p in results[m]["predictions"]] for m in (names[2], "native"))
    assert got == native
    assert set(results[names[2]]["paired"]) == {"native", "dial"}  # its lever: paired against the dial alone
    other = SimpleNamespace(name="replay", window_path=False)  # e.g. a replay translator
    assert [m.name for m in run.with_recomputation([other, method], [0.1])] == ["replay", names[1]]
    assert run.with_recomputation([other], [0]) == [other]  # the default: every translator as translated
    with pytest.raises(MotJaxError, match="none of these translators is direct"):
        run.with_recomputation([other], [0, 0.1])
    for bad in ("0.1,1.5", ""):
        with pytest.raises(MotJaxError, match="not a list of shares"):
            run.recompute_fractions(bad)


def test_shuffled_source_alignment_is_carried_onto_this_rows_grid_by_position():
    """Row 0: 2 tokens from a donor's 4 take donor tokens 0 and 2; row 1: 6 tokens from 3 take 0, 0, 1, 1, 2, 2,
    and a source token aligned to donor token r goes to this row's first token that took r or later."""
    weights = np.zeros((2, 4, 3), np.float32)
    for b, t, s in [(0, 0, 0), (0, 1, 1), (0, 2, 2), (0, 3, 2), (1, 0, 0), (1, 1, 1), (1, 2, 2)]:
        weights[b, t, s] = 1
    donor = alignment_lib.Alignment(weights, np.array([[0, 1, 2, 2], [0, 1, 2, 0]]), np.array([[0, 1, 2], [0, 1, 2]]))
    donor_mask = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], bool)
    mask = np.array([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
    source_mask = np.array([[1, 1, 1], [1, 1, 1]], bool)
    got = regrid(donor, donor_mask, mask, source_mask)
    np.testing.assert_array_equal(got.weights[0, :2], weights[0, [0, 2]])
    assert not got.weights[0, 2:].any()
    np.testing.assert_array_equal(got.weights[1], weights[1, [0, 0, 1, 1, 2, 2]])
    np.testing.assert_array_equal(got.target_to_source, [[0, 2, 0, 0, 0, 0], [0, 0, 1, 1, 2, 2]])
    np.testing.assert_array_equal(got.source_to_target, [[0, 1, 1], [0, 2, 4]])


def test_shuffled_source_donors_skip_examples_with_the_same_context():
    a, b = dict(context="one", question="q1"), dict(context="two", question="q2")
    assert donor_indices([a, dict(a, question="q3"), b]) == [2, 2, 0]
    with pytest.raises(MotJaxError, match="at least two different contexts.*--config.shuffled_source=false"):
        donor_indices([a, dict(a, question="q3")])


def test_shuffled_source_rows_follow_their_methods_and_are_off_by_config():
    """The report side of the rows is checked in test_report_files_are_written_and_parse (slow)."""
    reads = lambda inputs: SimpleNamespace(spec=SimpleNamespace(reads_source="source" in inputs))  # noqa: E731
    a, b = (Translated(name, reads(("source",)), "w", 1) for name in ("A", "B"))
    free = Translated("C", reads(("embeddings",)), "w", 1)  # source-free: nothing to shuffle
    rows = run.with_controls([a, free, b], True)
    assert [m.name for m in rows] == ["A", "A, shuffled source", "C", "B", "B, shuffled source"]
    assert run.with_controls([a, b], False) == [a, b]
    assert defaults().shuffled_source is True


def test_dial_runs_are_named_by_their_bottom_and_source():
    def name(**translator):
        t = dict(mode="direct", kind="mot", num_experts=2, inputs="source", native_bottom=0) | translator
        return method_name(ml_collections.ConfigDict(dict(translator=t)))

    assert name() == "MoT direct"
    assert name(native_bottom=6, inputs="source,embeddings") == "MoT direct, B=6"
    assert name(native_bottom=6, inputs="embeddings,hidden") == "source-free MoT direct, B=6"
    assert name(kind="projector") == "C2C-Project (direct)"


def test_chat_format_follows_the_tokenizer_and_the_model_name():
    """auto: on for a chat-tuned target (by its name, or its embedded file's: SmolLM2-135M-Instruct) whose tokenizer
    has ChatML or Gemma turns; on with no known format is refused in one line; off is plain prompts."""
    from tokenizers import AddedToken

    from mot_jax.models import tiny

    chatml = alignment_lib.adapter(tiny.tokenizer.__wrapped__(tiny.HF_CONFIGS["llama"][1])).backend  # a fresh copy
    chatml.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    plain = tiny.tokenizer(tiny.HF_CONFIGS["llama"][1])
    assert target_chat("auto", "HuggingFaceTB/SmolLM2-135M-Instruct", chatml) == CHAT_TURNS["<|im_start|>"]
    assert target_chat("auto", "smollm2-135m", chatml) == CHAT_TURNS["<|im_start|>"]  # the embedded Instruct GGUF
    assert target_chat("auto", "gemma3-270m", chatml) is None  # a base model
    assert target_chat("on", "gemma3-270m", chatml) == CHAT_TURNS["<|im_start|>"]
    assert target_chat("off", "x-Instruct", chatml) is None and target_chat("auto", "x-Instruct", plain) is None
    with pytest.raises(MotJaxError, match="has no known chat format"):
        target_chat("on", "random:llama", plain)
    with pytest.raises(MotJaxError, match="chat_template='yes' is not one of auto, on, off"):
        run.evaluate("/nonexistent", small_config(chat_template="yes"))


@pytest.mark.parametrize("stop", [KeyboardInterrupt, Terminated])
def test_an_interrupted_evaluation_says_where_its_results_so_far_are(trained_workdir, tmp_path, monkeypatch, stop):
    """Ctrl-C and SIGTERM printed only "interrupted" / "terminated" though OUT.partial kept the predictions."""
    config = small_config(tasks="extractive_qa", examples=4, ttft_lengths="", methods="no_context")
    recorder = run.Partial.recorder

    def stop_after_the_first_batch(self, *args):
        record = recorder(self, *args)

        def first_then_stop(*row):
            record(*row)
            raise stop

        return first_then_stop

    monkeypatch.setattr(run.Partial, "recorder", stop_after_the_first_batch)
    out = tmp_path / "eval"
    with pytest.raises(Interrupted) as caught:
        run.evaluate(trained_workdir, config, out=out)
    partial = tmp_path / "eval.partial"
    assert f"the results so far are in {partial} (predictions.jsonl)" in str(caught.value)
    assert str(caught.value).startswith("terminated (SIGTERM)" if stop is Terminated else "interrupted")
    assert caught.value.exit_status == (143 if stop is Terminated else 130)
    rows = [json.loads(line) for line in (partial / "predictions.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1] and not out.exists()


def strict_json(text: str):
    """JSON as a strict parser reads it: a bare NaN or Infinity (not JSON) raises."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_scores_are_written_as_null_in_strict_json(tmp_path, monkeypatch):
    """A gold answer whose log-probability underflows (-inf), and a paired difference of two such (NaN), reached
    results.json and predictions.jsonl as bare -Infinity and NaN, which JSON does not allow. Every writer of the
    report (the final one, the results so far, the fallback copy) writes them as null."""
    prediction = dict(question="q", gold=["a"], generation="b", answer="b", f1=0.0, logprob=-math.inf)
    scores = dict(f1=0.0, logprob=-math.inf, paired=dict(native=dict(logprob=dict(diff=math.nan, se=None))))
    results = dict(meta=dict(target="t"), tasks=dict(extractive_qa=dict(methods=dict(native=scores))))
    expected_scores = dict(f1=0.0, logprob=None, paired=dict(native=dict(logprob=dict(diff=None, se=None))))
    expected_row = dict(task="extractive_qa", budget=None, method="native", index=0) | prediction | dict(logprob=None)
    monkeypatch.setattr(report, "plots", lambda results, folder: [])
    monkeypatch.setattr(report, "markdown", lambda results: "")

    def written(folder):
        saved = strict_json((folder / "results.json").read_text())
        rows = [strict_json(line) for line in (folder / "predictions.jsonl").read_text().splitlines()]
        assert saved["tasks"]["extractive_qa"]["methods"]["native"] == expected_scores
        assert rows == [expected_row]

    with_rows = lambda: dict(
        results, tasks=dict(extractive_qa=dict(methods=dict(native=scores | dict(predictions=[prediction]))))
    )
    report.write(tmp_path / "out", with_rows())
    written(tmp_path / "out")
    partial = run.Partial(tmp_path / "eval")
    partial.recorder("extractive_qa")("native", 0, [prediction])
    partial.results(with_rows())
    written(tmp_path / "eval.partial")
    written(Path(run.keep_elsewhere(with_rows())))
