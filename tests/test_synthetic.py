"""Offline evaluation examples: deterministic, answerable from the context only, no favoured choice position."""

import collections
import re

import pytest

from mot_jax.evals.synthetic import examples


@pytest.mark.parametrize("task", ["extractive_qa", "closed_qa"])
def test_examples_are_deterministic_and_seeded(task):
    assert examples(task, 20, seed=3) == examples(task, 20, seed=3)
    assert examples(task, 20, seed=3) != examples(task, 20, seed=4)
    assert examples(task, 5, seed=3) == examples(task, 20, seed=3)[:5]  # example i does not depend on n


def test_extractive_answers_are_spans_of_the_context():
    for e in examples("extractive_qa", 200, seed=0, distractors=3):
        assert set(e) == {"context", "question", "answers"}
        assert all(a in e["context"] for a in e["answers"])
        assert e["context"].count(e["question"].split()[-1].rstrip("?").split("'")[0]) >= 1  # the entity is named


def test_closed_set_labels_are_right_and_positions_unbiased():
    items = examples("closed_qa", 400, seed=0)
    positions = collections.Counter()
    for e in items:
        assert set(e) == {"context", "question", "choices", "answer"} and e["answer"] in e["choices"]
        assert len(set(e["choices"])) == len(e["choices"])
        if e["choices"] == ["yes", "no"]:
            continue
        assert e["answer"] in e["context"] and len(e["choices"]) == 4
        positions[e["choices"].index(e["answer"])] += 1
    assert len(positions) == 4 and min(positions.values()) > 0.15 * sum(positions.values())
    labels = collections.Counter(e["answer"] for e in items if e["choices"] == ["yes", "no"])
    assert min(labels.values()) > 0.35 * sum(labels.values())


def test_yes_no_claims_match_the_context():
    """A yes/no question names one of the passage's stated values exactly when its answer is "yes"."""
    facts = re.compile(
        r"born in (\w+) in (\d+)\. \w+ works as an? [\w ]+ for (the \w+ Guild) and keeps an? \w+ "
        r"named (\w+)\. The door of \w+'s house is painted (\w+)\."
    )
    for e in examples("closed_qa", 300, seed=1, distractors=0):
        if e["choices"] != ["yes", "no"]:
            continue
        values = facts.search(e["context"]).groups()
        assert any(f" {v}?" in e["question"] for v in values) == (e["answer"] == "yes"), e
