"""The offline code-reading set: deterministic, every answer what Python itself computes from the module, stored
as a held-out split that no training rule reads."""

import ast
import collections
import re
import subprocess
import sys

import pytest

from mot_jax.errors import MotJaxError
from mot_jax.evals import code_reading
from mot_jax.evals.code_reading import HELD_OUT, INSTRUCTION, QUESTION_TYPES, examples
from mot_jax.evals.datasets import load_examples
from mot_jax.evals.jsonl import check

CALL = re.compile(r"What does `(.+)` return\?")
CONSTANT = re.compile(r"What is the value of `(\w+)`\?")
CALLER = re.compile(r"Which function calls `(\w+)`\?")


def computed(example: dict) -> str:
    """The answer to an example's question, from running its module (and, for callers, from its syntax tree)."""
    namespace: dict = {}
    exec(example["context"], namespace)  # noqa: S102 (our own generated code)
    question = example["question"]
    if m := CALL.fullmatch(question):
        return str(eval(m[1], namespace))  # noqa: S307
    if m := CONSTANT.fullmatch(question):
        return str(namespace[m[1]])
    callee = CALLER.fullmatch(question)[1]
    tree = ast.parse(example["context"])
    callers = [
        f.name
        for f in tree.body
        if isinstance(f, ast.FunctionDef)
        and any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == callee for n in ast.walk(f))
    ]
    assert len(callers) == 1, callers  # one right answer
    return callers[0]


def test_examples_are_deterministic_seeded_and_independent_of_n():
    assert examples(20, seed=3) == examples(20, seed=3)
    assert examples(20, seed=3) != examples(20, seed=4)
    assert examples(5, seed=3) == examples(20, seed=3)[:5]
    assert examples(5, seed=3, start=7) == examples(12, seed=3)[7:]


def test_every_answer_is_what_python_computes():
    items = examples(700, seed=0)
    types = collections.Counter(e["id"].split("-")[1] for e in items)
    assert set(types) == set(QUESTION_TYPES) and min(types.values()) > 0.6 * len(items) / len(QUESTION_TYPES)
    for index, e in enumerate(items):
        assert check(e, "extractive_qa") is None and e["instruction"] == INSTRUCTION
        assert e["id"].startswith("code-") and e["id"].endswith(f"-{index}")
        assert e["answers"] == [computed(e)], e
        names = re.findall(r"^def (\w+)", e["context"], re.M)
        assert len(names) == len(set(names)) == 5  # a name means one function


def test_answers_are_worked_out_not_copied():
    """Most answers are not in the passage as they are asked for: the values of calls and constants are computed.
    The string answers (branch, offset, lookup) are literals of the module, so the model must pick the right one."""
    items = examples(400, seed=1)
    numeric = [e for e in items if e["id"].split("-")[1] in ("returns", "chain", "constant")]
    assert len(numeric) > 100
    assert sum(re.search(rf"\b{e['answers'][0]}\b", e["context"]) is None for e in numeric) > 0.6 * len(numeric)
    branches = [e for e in items if e["id"].split("-")[1] in ("branch", "offset")]
    labels = collections.Counter(
        e["answers"][0] == re.search(r'if x > \d+:\n\s+return "(\w+)"', e["context"])[1] for e in branches
    )
    assert min(labels.values()) > 0.25 * len(branches)  # both sides of the comparison are asked


def test_the_set_is_stored_as_its_held_out_split(tmp_path):
    assert HELD_OUT >= 1000
    stored = load_examples("extractive_qa", "code_reading", n=HELD_OUT, data_dir=str(tmp_path))
    assert stored == examples(HELD_OUT) and len({e["context"] for e in stored}) == HELD_OUT
    assert load_examples("extractive_qa", "code_reading", n=4, seed=2, data_dir=str(tmp_path)) == examples(4, seed=2)
    with pytest.raises(MotJaxError, match=f"holds {HELD_OUT} held-out examples, not {HELD_OUT + 1}; pass"):
        load_examples("extractive_qa", "code_reading", n=HELD_OUT + 1, data_dir=str(tmp_path))
    with pytest.raises(MotJaxError, match="code_reading is a extractive_qa set, not closed_qa; pass --task"):
        load_examples("closed_qa", "code_reading", n=4, data_dir=str(tmp_path))


def test_the_held_out_split_is_disjoint_from_training():
    """No training module (the trainer, its data, features, corpus and entry point) loads the generator, so no
    training rule can read the split; past the split (start=HELD_OUT) the generator writes other modules."""
    modules = "mot_jax.train, mot_jax.training.trainer, mot_jax.training.data, mot_jax.training.features"
    probe = f"import sys, {modules}; print(sorted(m for m in sys.modules if m.startswith('mot_jax.evals')))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "mot_jax.evals.code_reading" not in loaded and "mot_jax.evals.datasets" not in loaded, loaded
    held_out = {e["context"] for e in examples(HELD_OUT)}
    assert not held_out & {e["context"] for e in examples(256, start=HELD_OUT)}


@pytest.mark.slow
def test_held_out_modules_do_not_occur_in_the_training_corpus():
    """None of the held-out modules' invented function names is in the text training builds its rows from."""
    from mot_jax.training.corpus import documents

    names = {n for e in examples(HELD_OUT) for n in re.findall(r"^def (\w+)", e["context"], re.M)}
    assert len(names) > 1000
    words = re.compile(r"\b[a-z]+_[a-z]+\b")
    for split in documents("docs_prose").values():
        for text in split:
            assert not names & set(words.findall(text)), names & set(words.findall(text))


def test_module_parses_and_defines_what_it_names():
    import numpy as np

    source, facts = code_reading.module(np.random.default_rng(0))
    tree = ast.parse(source)
    defined = {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}
    assert defined == set(facts["names"].values())
