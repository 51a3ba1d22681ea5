"""User evaluation data in JSONL, one example per line, validated with the file and line named on any error.

extractive_qa: {"context": str, "question": str, "answers": [str, ...]}
closed_qa:     {"context": str, "question": str, "choices": [str, ...], "answer": str (one of the choices)}
"""

from __future__ import annotations

import json
from pathlib import Path

from mot_jax.errors import MotJaxError

SCHEMAS = {
    "extractive_qa": {"context": str, "question": str, "answers": list},
    "closed_qa": {"context": str, "question": str, "choices": list, "answer": str},
}


def _check(example, task: str) -> str | None:
    """What is wrong with one example, or None."""
    if not isinstance(example, dict):
        return "is not a JSON object"
    for key, kind in SCHEMAS[task].items():
        if key not in example:
            return f"has no {key!r}"
        if not isinstance(example[key], kind):
            return f"has {key!r} of type {type(example[key]).__name__}, not {kind.__name__}"
    if not example["context"].strip() or not example["question"].strip():
        return "has an empty context or question"
    listed = example.get("answers", example.get("choices"))
    if not listed or not all(isinstance(x, str) and x.strip() for x in listed):
        return f"needs a non-empty list of non-empty strings in {'answers' if 'answers' in example else 'choices'!r}"
    if task == "closed_qa" and example["answer"] not in example["choices"]:
        return f"has answer {example['answer']!r}, which is not one of its choices"
    return None


def read_jsonl(path, task: str) -> list[dict]:
    if task not in SCHEMAS:
        raise MotJaxError(f"Unknown task {task!r}; use one of {', '.join(SCHEMAS)}.")
    path = Path(path)
    if not path.is_file():
        raise MotJaxError(f"{path} does not exist; pass a JSONL file with one {task} example per line.")
    out = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                example = json.loads(line)
            except json.JSONDecodeError as e:
                raise MotJaxError(f"{path}:{number}: not valid JSON ({e.msg}); fix that line.") from None
            problem = _check(example, task)
            if problem:
                keys = ", ".join(SCHEMAS[task])
                raise MotJaxError(f"{path}:{number}: the example {problem}; a {task} line needs {keys}.")
            out.append(example)
    if not out:
        raise MotJaxError(f"{path} holds no example; write one JSON object per line.")
    return out
