"""User JSONL evaluation files: valid files read back, malformed lines named by file and line number."""

import json

import pytest

from mot_jax.errors import MotJaxError
from mot_jax.evals.jsonl import read_jsonl
from mot_jax.evals.synthetic import examples


@pytest.mark.parametrize("task", ["extractive_qa", "closed_qa"])
def test_generated_examples_round_trip(task, tmp_path):
    items = examples(task, 10, seed=0)
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in items) + "\n\n")
    assert read_jsonl(path, task) == items


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "2: not valid JSON"),
        ('{"context": "c", "question": "q"}', "2: the example has no 'answers'"),
        ('{"context": "c", "question": "q", "answers": "Paris"}', "2: the example has 'answers' of type str"),
        ('{"context": "c", "question": "q", "answers": []}', "2: the example needs a non-empty list"),
        ('["a list"]', "2: the example is not a JSON object"),
    ],
)
def test_malformed_extractive_lines(line, message, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(examples("extractive_qa", 1)[0]) + "\n" + line + "\n")
    with pytest.raises(MotJaxError, match=f"bad.jsonl:{message}"):
        read_jsonl(path, "extractive_qa")


def test_closed_set_answer_must_be_a_choice_and_errors_for_files(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(dict(context="c", question="q", choices=["yes", "no"], answer="maybe")) + "\n")
    with pytest.raises(MotJaxError, match="c.jsonl:1: .*'maybe', which is not one of its choices"):
        read_jsonl(path, "closed_qa")
    with pytest.raises(MotJaxError, match="does not exist"):
        read_jsonl(tmp_path / "missing.jsonl", "closed_qa")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(MotJaxError, match="holds no example"):
        read_jsonl(tmp_path / "empty.jsonl", "closed_qa")
    with pytest.raises(MotJaxError, match="Unknown task"):
        read_jsonl(path, "summarization")
