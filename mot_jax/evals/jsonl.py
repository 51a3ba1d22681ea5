"""User evaluation data in JSONL, one example per line, validated with the file and line named on any error.

extractive_qa: {"context": str, "question": str, "answers": [str, ...]}
closed_qa:     {"context": str, "question": str, "choices": [str, ...], "answer": str (one of the choices)}
               optional "answers": [str, ...], every acceptable choice (the answer among them), for questions
               with several right choices (MMLU-Redux "multiple_correct_answers")
long_context:  the extractive_qa schema (long contexts: many passages, most of them distractors)
multi_agent:   {"context": str, "questions": [str, ...], "answers": [[str, ...], ...]}, several questions about
               one document (one per agent); answers[i] holds the gold answers of questions[i]

Any example may also carry "instruction" (a task instruction such as "Answer yes, no, or maybe.") and "id" strings.
"""

from __future__ import annotations

from pathlib import Path

from mot_jax.errors import MotJaxError
from mot_jax.files import json_lines

SCHEMAS = {
    "extractive_qa": {"context": str, "question": str, "answers": list},
    "closed_qa": {"context": str, "question": str, "choices": list, "answer": str},
    "long_context": {"context": str, "question": str, "answers": list},
    "multi_agent": {"context": str, "questions": list, "answers": list},
}
OPTIONAL = {"instruction": str, "id": str}


def _strings(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(x, str) and x.strip() for x in value)


def check(example, task: str) -> str | None:
    """What is wrong with one example of `task`, or None."""
    if not isinstance(example, dict):
        return "is not a JSON object"
    for key, kind in SCHEMAS[task].items():
        if key not in example:
            return f"has no {key!r}"
        if not isinstance(example[key], kind):
            return f"has {key!r} of type {type(example[key]).__name__}, not {kind.__name__}"
    for key, kind in OPTIONAL.items():
        if key in example and not isinstance(example[key], kind):
            return f"has {key!r} of type {type(example[key]).__name__}, not {kind.__name__}"
    if task == "multi_agent":
        if not example["context"].strip():
            return "has an empty context"
        if not _strings(example["questions"]):
            return "needs a non-empty list of non-empty strings in 'questions'"
        if len(example["answers"]) != len(example["questions"]):
            return f"has {len(example['questions'])} questions but {len(example['answers'])} answer lists"
        bad = [i for i, answers in enumerate(example["answers"]) if not _strings(answers)]
        return f"needs a non-empty list of non-empty strings in answers[{bad[0]}]" if bad else None
    if not example["context"].strip() or not example["question"].strip():
        return "has an empty context or question"
    listed = "choices" if task == "closed_qa" else "answers"
    if not _strings(example[listed]):
        return f"needs a non-empty list of non-empty strings in {listed!r}"
    if task == "closed_qa" and example["answer"] not in example["choices"]:
        return f"has answer {example['answer']!r}, which is not one of its choices"
    if task == "closed_qa" and "answers" in example:
        answers = example["answers"]
        if not _strings(answers) or example["answer"] not in answers or not set(answers) <= set(example["choices"]):
            return "has 'answers' that are not a list of its choices including its 'answer'"
    return None


def read_jsonl(path, task: str) -> list[dict]:
    if task not in SCHEMAS:
        raise MotJaxError(f"Unknown task {task!r}; use one of {', '.join(SCHEMAS)}.")
    path = Path(path)
    if not path.is_file():
        raise MotJaxError(f"{path} does not exist; pass a JSONL file with one {task} example per line.")
    out = []
    for number, example in json_lines(path):
        problem = check(example, task)
        if problem:
            keys = ", ".join(SCHEMAS[task])
            raise MotJaxError(f"{path}:{number}: the example {problem}; a {task} line needs {keys}.")
        out.append(example)
    if not out:
        raise MotJaxError(f"{path} holds no example; write one JSON object per line.")
    return out
