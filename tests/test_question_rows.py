"""Question-shaped training rows (`training/questions.py`): each row's answer is a span of its own context, read back
from the row's text; the labels cover the answer alone; the rows share neither names nor templates with the
evaluation's generators."""

from __future__ import annotations

import re

import numpy as np
import pytest

from mot_jax.errors import MotJaxError
from mot_jax.evals import code_reading, prompts, synthetic
from mot_jax.models.gguf import load_tokenizer
from mot_jax.training import data, questions
from mot_jax.translate.align import adapter

P, T, B = 192, 256, 8  # the dial's split: a 191-token context, a 64-token prompt
RECORD = re.compile(
    r"The (\w+) (\w+) left (\w+ harbour) in (\w+) on its maiden voyage, skippered by (\w+)\. Its hold was full "
    r"of (.+?), and from its mast flew (.+?)\. "
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")  # ChatML turns


@pytest.fixture(scope="module")
def chunks(tokenizer):
    rng = np.random.default_rng(0)
    text = " ".join(f"word{int(i)}" for i in rng.integers(0, 500, size=4000))
    ids = adapter(tokenizer).backend.encode(text, add_special_tokens=False).ids
    return np.array(ids[: 16 * T], np.int32).reshape(16, T)


def batches(chunks, tokenizer, **shares):
    return data.Batches(chunks, B, 7, tokenizer, tokenizer, 2 * T, prefix_tokens=P, **shares)


def answer_of(batch, b):
    """The labelled tokens of row b (the answer and its end token) and the prompt tokens before them."""
    mask = batch.label_mask[b]
    first = int(np.argmax(mask))
    assert mask[first:].sum() == mask.sum() == np.argmin(np.append(mask[first:], False)), "one run of labels"
    return batch.labels[b][mask].tolist(), batch.prompt[b, : first + 1].tolist()


def test_span_rows_answer_with_the_tokens_after_the_quoted_ones(chunks, tokenizer):
    rows = questions.QuestionRows(tokenizer, P, T)
    end = rows.ids("<|im_end|>")
    batch = batches(chunks, tokenizer, question_fraction=1.0).batch(2)
    head, tail = (rows.ids(t) for t in (questions.SPAN_QUESTION[0], questions.SPAN_QUESTION[1] + rows.close))
    for b in range(B):
        context = batch.context[b].tolist()
        assert context[: len(rows.head)] == rows.head and len(context) == P - 1 and batch.context_mask[b].all()
        answer, request = answer_of(batch, b)
        assert answer[-len(end) :] == end and len(answer) == questions.SPAN_TOKENS + len(end)
        cue = request[len(head) : len(head) + questions.CUE_TOKENS]
        assert request[: len(head)] == head and request[len(head) + len(cue) :] == tail
        spots = [s for s in range(len(rows.head), P - 1) if context[s - len(cue) : s] == cue]
        assert any(context[s : s + questions.SPAN_TOKENS] == answer[: -len(end)] for s in spots), b
        np.testing.assert_array_equal(batch.labels[b, :-1], batch.prompt[b, 1:])  # labels: the next tokens


def test_fact_rows_answer_the_field_their_request_names(chunks, tokenizer):
    backend = adapter(tokenizer).backend
    requests = {field: re.compile(re.escape(t).replace(r"\{ship\}", r"(\w+)")) for field, t in questions.FACTS.items()}
    columns = ["vessel", "ship", "harbour", "month", "skipper", "cargo", "pennant"]
    asked = set()
    for position in range(3):
        batch = batches(chunks, tokenizer, fact_fraction=1.0).batch(position)
        for b in range(B):
            answer, request = answer_of(batch, b)
            text = backend.decode(batch.context[b].tolist(), skip_special_tokens=False)
            ships = {m.group(2): dict(zip(columns, m.groups())) for m in RECORD.finditer(text)}
            request_text = backend.decode(request, skip_special_tokens=False)
            ((field, name),) = [(f, m.group(1)) for f, r in requests.items() if (m := r.search(request_text))]
            asked.add(field)
            assert backend.decode(answer, skip_special_tokens=True) == ships[name][field]
            assert len(batch.context[b]) == P - 1
    assert asked == set(questions.FACTS)


def test_question_rows_leave_the_retrieval_rows_and_the_rest_as_they_were(chunks, tokenizer):
    """Adding question shares turns only rows past the retrieval share into question rows: the retrieval rows and
    the plain rows of each position are those of the run without them."""
    copied = batches(chunks, tokenizer, copy_fraction=0.4)
    mixed = batches(chunks, tokenizer, copy_fraction=0.4, question_fraction=0.2, fact_fraction=0.2)
    changed = []
    for position in range(6):
        want, got = copied.batch(position), mixed.batch(position)
        for b in range(B):
            same = np.array_equal(got.context[b], want.context[b]) and np.array_equal(got.prompt[b], want.prompt[b])
            changed.append(not same)
            if same:
                np.testing.assert_array_equal(got.label_mask[b], want.label_mask[b])
    assert 0.2 < np.mean(changed) < 0.6


def test_question_shares_are_refused_when_they_do_not_fit(chunks, tokenizer):
    with pytest.raises(MotJaxError, match="add up to at most 1"):
        batches(chunks, tokenizer, copy_fraction=0.5, question_fraction=0.3, fact_fraction=0.3)
    with pytest.raises(MotJaxError, match="raise data.prefix_tokens"):
        data.Batches(chunks, B, 7, tokenizer, tokenizer, 2 * T, prefix_tokens=16, fact_fraction=0.5)


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def five_grams(text: str) -> set[tuple]:
    w = words(text)
    return {tuple(w[i : i + 5]) for i in range(len(w) - 4)}


def test_fact_rows_share_no_name_or_template_with_the_evaluation(chunks, tokenizer):
    """No invented name of the training rows is a name of the evaluation's held-out examples (nor can be: each
    holds a "w" or "y"), and no five-word run of the training rows' text is one of the evaluation's (its passages,
    questions and instructions of every task, and the code-reading set)."""
    rng = np.random.default_rng(0)
    ships = [questions._ship(rng) for _ in range(300)]
    training = [questions.record(s) for s in ships]
    training += [t.format(ship=questions.invented_name(rng)) for t in questions.FACTS.values()]
    training += [questions.INSTRUCTION, "".join(questions.SPAN_QUESTION)]
    evaluation = list(prompts.INSTRUCTIONS.values()) + [code_reading.INSTRUCTION]
    for task in synthetic.TASKS:
        for e in synthetic.examples(task, 256):
            evaluation += [e["context"], *e.get("questions", [e.get("question", "")])]
    evaluation += [e["context"] + " " + e["question"] for e in code_reading.examples(64)]
    names = {s[k].split()[0] for s in ships for k in ("ship", "harbour", "skipper")}
    assert len(names) > 800 and all(re.search("[wy]", n.lower()) for n in names)
    evaluation_words = {w for t in evaluation for w in re.findall(r"\b[A-Z][a-z]+\b", t)}
    assert not names & evaluation_words
    shared = set().union(*map(five_grams, training)) & set().union(*map(five_grams, evaluation))
    assert not shared, sorted(shared)[:5]
    syllables = synthetic._ONSETS + synthetic._VOWELS + synthetic._CODAS
    assert not any(c in "wy" for s in syllables for c in s)  # so no evaluation name can hold a "w" or "y"


def test_a_prompt_too_short_for_the_request_is_refused(chunks, tokenizer):
    with pytest.raises(MotJaxError, match="chunk holds after its context; raise data.total_tokens"):
        data.Batches(chunks[:, :200], B, 7, tokenizer, tokenizer, 2 * T, prefix_tokens=P, fact_fraction=0.5)
