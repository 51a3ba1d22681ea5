"""Evaluation data: the synthetic long-context and multi-agent sets, their TFDS storage, the paper datasets
converted from local copies of their native rows, the dispatcher's errors, and the offline hub errors."""

import json
import re
import sys
import types
from pathlib import Path

import pytest

from mot_jax.errors import MotJaxError
from mot_jax.evals import datasets
from mot_jax.evals.datasets import ADAPTERS, TASKS, adapt, load_examples
from mot_jax.evals.jsonl import read_jsonl
from mot_jax.evals.synthetic import HELD_OUT, examples
from mot_jax.evals.synthetic import TASKS as SYNTHETIC_TASKS

FIXTURES = Path(__file__).parent / "fixtures" / "evals"
PASSAGE = re.compile(
    r"(\w+ \w+) was born in (\w+) in (\d+)\. \w+ works as an? [\w ]+ for (the \w+ Guild) and keeps an? (\w+) named "
    r"(\w+)\. The door of \w+'s house is painted (\w+)\."
)


def _facts(context: str) -> dict[str, dict]:
    """person -> the facts its passage states."""
    keys = ("town", "year", "guild", "pet", "pet_name", "colour")
    return {m[1]: dict(zip(keys, m.groups()[1:])) for m in PASSAGE.finditer(context)}


def _asked(question: str, facts: dict[str, dict]) -> tuple[str, str]:
    """(person, field) a synthetic question asks about."""
    person = next(p for p in facts if p in question)
    if question.startswith("Where"):
        return person, "town"
    if question.startswith("In which year"):
        return person, "year"
    if question.startswith("For which guild"):
        return person, "guild"
    return person, "colour" if question.startswith("What colour") else "pet_name"


# ------------------------------------------------------------------------------------------------ synthetic


@pytest.mark.parametrize("task", ["long_context", "multi_agent"])
def test_new_synthetic_tasks_are_deterministic_and_seeded(task):
    assert examples(task, 8, seed=3) == examples(task, 8, seed=3)
    assert examples(task, 8, seed=3) != examples(task, 8, seed=4)
    assert examples(task, 3, seed=3) == examples(task, 8, seed=3)[:3]


def test_long_context_hides_the_answer_among_many_paragraphs():
    positions = set()
    for e in examples("long_context", 40, seed=0):
        assert set(e) == {"context", "question", "answers"}
        paragraphs = e["context"].split("\n\n")
        assert len(paragraphs) == 25
        facts = _facts(e["context"])
        assert len(facts) == 25 and len({p.split()[0] for p in facts}) == 25  # unique (first) names
        person, field = _asked(e["question"], facts)
        assert e["answers"] == [facts[person][field]]
        positions.add(next(i for i, p in enumerate(paragraphs) if p.startswith(person)))
    assert len(positions) > 10  # the target passage moves around


def test_multi_agent_asks_distinct_answerable_questions_about_one_document():
    for e in examples("multi_agent", 60, seed=1, distractors=3, questions_per_example=4):
        assert set(e) == {"context", "questions", "answers"}
        facts = _facts(e["context"])
        assert len(facts) == 4 and len({p.split()[0] for p in facts}) == 4
        asked = [_asked(q, facts) for q in e["questions"]]
        assert len(set(asked)) == len(asked) == 4
        assert e["answers"] == [[facts[person][field]] for person, field in asked]
    with pytest.raises(ValueError, match="questions_per_example must be 1..5"):
        examples("multi_agent", 1, distractors=0, questions_per_example=6)


# ------------------------------------------------------------------------------------------------ JSONL


def test_jsonl_new_schemas_and_optional_fields(tmp_path):
    items = examples("multi_agent", 3)
    items[0] = dict(items[0], instruction="Answer briefly.", id="doc-0")
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in items))
    assert read_jsonl(path, "multi_agent") == items
    path.write_text("".join(json.dumps(e) + "\n" for e in examples("long_context", 2)))
    assert read_jsonl(path, "long_context") == examples("long_context", 2)


@pytest.mark.parametrize(
    "example, message",
    [
        (dict(context="c", questions=["a", "b"], answers=[["x"]]), "has 2 questions but 1 answer lists"),
        (
            dict(context="c", questions=["a", "b"], answers=[["x"], []]),
            "needs a non-empty list of non-empty strings in answers\\[1\\]",
        ),
        (dict(context="c", questions=[], answers=[]), "needs a non-empty list of non-empty strings in 'questions'"),
        (dict(context=" ", questions=["a"], answers=[["x"]]), "has an empty context"),
        (dict(context="c", questions=["a"], answers=[["x"]], id=3), "has 'id' of type int, not str"),
    ],
)
def test_malformed_multi_agent_lines(example, message, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(examples("multi_agent", 1)[0]) + "\n" + json.dumps(example) + "\n")
    with pytest.raises(MotJaxError, match=f"bad.jsonl:2: the example {message}"):
        read_jsonl(path, "multi_agent")


def test_closed_set_optional_answers_must_be_choices(tmp_path):
    good = dict(context="c", question="q", choices=["a", "b", "c"], answer="a", answers=["a", "c"])
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(good) + "\n")
    assert read_jsonl(path, "closed_qa") == [good]
    path.write_text(json.dumps(dict(good, answers=["b", "d"])) + "\n")
    with pytest.raises(MotJaxError, match="c.jsonl:1: .*'answers' that are not a list of its choices"):
        read_jsonl(path, "closed_qa")


# ------------------------------------------------------------------------------------------------ TFDS sets


def test_synthetic_sets_are_stored_with_tfds_and_read_back_exactly(tmp_path, capsys):
    for task in SYNTHETIC_TASKS:
        assert load_examples(task, n=12, seed=5, data_dir=str(tmp_path)) == examples(task, 12, seed=5)
    assert len(list(tmp_path.glob("mot_eval/*/1.0.0/*.array_record*"))) == len(SYNTHETIC_TASKS)
    options = dict(distractors=1, questions_per_example=2)
    assert load_examples("multi_agent", n=4, data_dir=str(tmp_path), **options) == examples("multi_agent", 4, **options)
    capsys.readouterr()
    assert load_examples("long_context", n=12, seed=5, data_dir=str(tmp_path)) == examples("long_context", 12, seed=5)
    assert "Preparing" not in capsys.readouterr().err  # reused, not rebuilt


# ------------------------------------------------------------------------------------------------ adapters

EXTRACTIVE_CONTEXT = "(CNN) -- A baker in Lyon sold 300 loaves on Sunday. The mayor praised the bakery."
SUPER_BOWL = "Super Bowl 50 was an American football game. The Denver Broncos defeated the Carolina Panthers 24-10."
BODY = ["a bone", "a muscle", "a nerve", "a gland"]
SKY = ["planet", "star", "moon", "comet"]
EXPECTED = {
    "squad": [  # the unanswerable row is skipped
        dict(
            id="56be4db0acb8001400a502ec",
            context=SUPER_BOWL,
            question="Which team won Super Bowl 50?",
            answers=["Denver Broncos", "Denver Broncos", "Broncos"],
        ),
        dict(
            id="56be4db0acb8001400a502ed", context=SUPER_BOWL, question="What was the final score?", answers=["24-10"]
        ),
    ],
    "newsqa": [  # each question its own example; a question without an answer is skipped
        dict(
            id="newsqa-0-0",
            context=EXTRACTIVE_CONTEXT,
            question="How many loaves were sold?",
            answers=["300", "300 loaves"],
        ),
        dict(id="newsqa-0-1", context=EXTRACTIVE_CONTEXT, question="Who praised the bakery?", answers=["The mayor"]),
        dict(id="newsqa-0-2", context=EXTRACTIVE_CONTEXT, question="When?", answers=["on Sunday"]),
        dict(
            id="newsqa-1-1",
            context="A storm closed the port of Genoa for two days.",
            question="Which city?",
            answers=["Genoa"],
        ),
    ],
    "boolq": [
        dict(
            id="boolq-0",
            context="On a clear day the sky looks blue because air scatters blue light.",
            question="is the sky blue on a clear day",
            choices=["yes", "no"],
            answer="yes",
            instruction="Answer yes or no.",
        ),
        dict(
            id="boolq-1",
            context="Penguins live almost only in the Southern Hemisphere.",
            question="do penguins live at the north pole",
            choices=["yes", "no"],
            answer="no",
            instruction="Answer yes or no.",
        ),
    ],
    "pubmedqa": [
        dict(
            id="21645374",
            context="Programmed cell death occurs in lace plants.\nMitochondria moved during PCD.",
            question="Do mitochondria play a role in remodelling lace plant leaves?",
            choices=["yes", "no", "maybe"],
            answer="yes",
            instruction="Answer yes, no, or maybe.",
        ),
        dict(
            id="16418930",
            context="We studied 40 patients.",
            question="Is the score useful?",
            choices=["yes", "no", "maybe"],
            answer="maybe",
            instruction="Answer yes, no, or maybe.",
        ),
    ],
    "mmlu_redux": [  # subjects interleaved; expert and unparseable corrections dropped
        dict(id="anatomy-0", context="Subject: anatomy", question="The femur is", choices=BODY, answer="a bone"),
        dict(id="astronomy-0", context="Subject: astronomy", question="The Sun is a", choices=SKY, answer="star"),
        dict(id="anatomy-2", context="Subject: anatomy", question="The biceps is", choices=BODY, answer="a muscle"),
        dict(id="astronomy-1", context="Subject: astronomy", question="Mars is a", choices=SKY, answer="planet"),
        dict(id="anatomy-3", context="Subject: anatomy", question="The vagus is", choices=BODY, answer="a nerve"),
        dict(
            id="anatomy-4",
            context="Subject: anatomy",
            question="Which are tissues?",
            choices=BODY,
            answer="a muscle",
            answers=["a muscle", "a bone", "a nerve"],
        ),
    ],
    "hotpotqa": [
        dict(
            id="5a8b57f25542995d1e6f1371",
            context="Title: Ed Wood\nEdward Davis Wood Jr. was an American filmmaker. He made cult films.\n\n"
            "Title: Scott Derrickson\nScott Derrickson is an American director.",
            question="Were Scott Derrickson and Ed Wood of the same nationality?",
            answers=["yes"],
        ),
    ],
    "hotpotqa_e": [
        dict(
            id="0f3a",
            context="Passage 1:\nThe Louvre\nThe Louvre is in Paris.",
            question="Which city hosts the museum?",
            answers=["Paris"],
        ),
        dict(
            id="77b1",
            context="Passage 1:\nHamlet\nHamlet was written by Shakespeare.",
            question="Who wrote it?",
            answers=["William Shakespeare", "Shakespeare"],
        ),
    ],
}
FILES = {"newsqa": "newsqa.json", "mmlu_redux": "mmlu_redux"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_adapters_convert_native_rows(name):
    path = FIXTURES / FILES.get(name, f"{name}.jsonl")
    assert load_examples(ADAPTERS[name], f"{name}:{path}", n=100) == EXPECTED[name]
    assert load_examples(ADAPTERS[name], f"{name}:{path}", n=1) == EXPECTED[name][:1]


def test_parquet_copies_and_one_file_holding_every_subject(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (FIXTURES / "boolq.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "validation.parquet")
    assert adapt("boolq", str(tmp_path / "validation.parquet")) == EXPECTED["boolq"]
    merged = [
        dict(json.loads(line), subject=file.stem)
        for file in sorted((FIXTURES / "mmlu_redux").glob("*.jsonl"))
        for line in file.read_text().splitlines()
    ]
    (tmp_path / "all.jsonl").write_text("".join(json.dumps(row) + "\n" for row in merged))
    assert adapt("mmlu_redux", str(tmp_path / "all.jsonl")) == EXPECTED["mmlu_redux"]


def test_mmlu_redux_correct_answer_parsing():
    parse = datasets._choice_indices
    assert parse("C", BODY) == [2] and parse("(D)", BODY) == [3] and parse("B or D", BODY) == [1, 3]
    assert parse("a Gland", BODY) == [3] and parse("a bone and a nerve", BODY) == [0, 2]
    assert parse(None, BODY) == [] and parse("none of the above", BODY) == []


# ------------------------------------------------------------------------------------------------ dispatcher


def test_dispatcher_errors_and_jsonl(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in examples("closed_qa", 5)))
    assert load_examples("closed_qa", str(path), n=3) == examples("closed_qa", 3)
    assert load_examples("closed_qa", str(path), n=50) == examples("closed_qa", 5)  # what there is
    with pytest.raises(MotJaxError, match="boolq is a closed_qa dataset, not extractive_qa; pass --task closed_qa"):
        load_examples("extractive_qa", f"boolq:{FIXTURES / 'boolq.jsonl'}")
    with pytest.raises(MotJaxError, match="Unknown evaluation data 'trivia'.* squad, newsqa, boolq, pubmedqa"):
        load_examples("extractive_qa", "trivia")
    with pytest.raises(MotJaxError, match="Unknown task 'summaries'"):
        load_examples("summaries")
    with pytest.raises(MotJaxError, match="distractors only apply to the synthetic sets"):
        load_examples("closed_qa", str(path), distractors=4)
    with pytest.raises(MotJaxError, match="Unknown synthetic option 'topics'"):
        load_examples("closed_qa", topics=3)
    with pytest.raises(MotJaxError, match="distractors must be 0 or more"):
        load_examples("closed_qa", data_dir=str(tmp_path), distractors=-1)
    with pytest.raises(MotJaxError, match="does not exist; pass squad:PATH"):
        load_examples("extractive_qa", f"squad:{tmp_path / 'missing.parquet'}")
    (tmp_path / "bad.jsonl").write_text('{"id": "1", "question": "q"}\n')
    with pytest.raises(MotJaxError, match="Could not convert the squad rows .*KeyError.*rajpurkar/squad validation"):
        load_examples("extractive_qa", f"squad:{tmp_path / 'bad.jsonl'}")
    assert set(ADAPTERS.values()) <= set(TASKS)


def test_hub_errors_are_one_clear_sentence_offline(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(MotJaxError, match="needs the `datasets` package; `pip install datasets`, or pass squad:PATH"):
        load_examples("extractive_qa", "squad")

    def unreachable(**kwargs):
        raise ConnectionError(f"Couldn't reach '{kwargs['path']}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=unreachable))
    with pytest.raises(MotJaxError, match=r"Could not load qiaojin/PubMedQA .*Couldn't reach .*pubmedqa:PATH"):
        load_examples("closed_qa", "pubmedqa")


def test_hub_rows_are_converted_like_local_ones(monkeypatch):
    """A stand-in `datasets` returning the fixture rows: MMLU-Redux parts get their subject from the config name."""
    rows = {p.stem: [json.loads(line) for line in p.read_text().splitlines()] for p in FIXTURES.glob("*/*.jsonl")}
    calls = []

    def load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return rows.get(name, [])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert load_examples("closed_qa", "mmlu_redux", n=100) == EXPECTED["mmlu_redux"]
    assert len(calls) == 57 and calls[0] == ("edinburgh-dawg/mmlu-redux-2.0", "abstract_algebra", "test")


# ------------------------------------------------------------------------------------------------ disjointness


def held_out_names(seed: int = 0) -> set[str]:
    """Every invented person of the held-out split of every task (what the evaluation reads)."""
    return {
        name for task in SYNTHETIC_TASKS for e in examples(task, HELD_OUT, seed=seed) for name in _facts(e["context"])
    }


@pytest.mark.slow
def test_synthetic_names_do_not_occur_in_the_training_corpus():
    """The invented people of the whole held-out split are unknown to a model trained on our corpus: none of their
    names is in the text training builds its rows from."""
    from mot_jax.training.corpus import documents

    names = held_out_names()
    assert len(names) > 10_000
    pairs = re.compile(r"(?=\b([A-Z][a-z]+ [A-Z][a-z]+)\b)")  # every pair of capitalised words, overlaps included
    for split in documents("docs_prose").values():
        for text in split:
            assert not names & set(pairs.findall(text)), names & set(pairs.findall(text))


def test_the_held_out_split_is_read_by_the_evaluation_alone():
    """No training module (the trainer, its data, features, corpus and entry point) loads the synthetic generator,
    so no training rule can read the split; the one other generated text, the TTFT passage, lies past the split and
    names none of its people."""
    import subprocess

    modules = "mot_jax.train, mot_jax.training.trainer, mot_jax.training.data, mot_jax.training.features"
    check = f"import sys, {modules}; print(sorted(m for m in sys.modules if m.startswith('mot_jax.evals')))"
    loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout
    assert "mot_jax.evals.synthetic" not in loaded and "mot_jax.evals.datasets" not in loaded, loaded
    from mot_jax.evals import latency

    models = types.SimpleNamespace(target=types.SimpleNamespace(config=types.SimpleNamespace(max_positions=4096)))
    passage = latency.ttft_setup(models, [2048], 32, seed=0).example
    assert passage == examples("long_context", 1, seed=0, distractors=2048 // 16 + 4, start=HELD_OUT)[0]
    assert not set(_facts(passage["context"])) & held_out_names()


def test_synthetic_sets_hold_the_held_out_split_and_refuse_more(tmp_path):
    assert HELD_OUT >= 1000
    stored = load_examples("extractive_qa", n=HELD_OUT, data_dir=str(tmp_path))
    assert stored == examples("extractive_qa", HELD_OUT) and len({e["context"] for e in stored}) == HELD_OUT
    assert load_examples("extractive_qa", n=5, data_dir=str(tmp_path)) == stored[:5]  # the same stored set
    with pytest.raises(MotJaxError, match=f"holds {HELD_OUT} held-out examples, not {HELD_OUT + 1}; pass"):
        load_examples("extractive_qa", n=HELD_OUT + 1, data_dir=str(tmp_path))
