"""Paired differences between two rows of evaluation reports, example by example, when the rows come from different
evaluations (a row added later beside an earlier evaluation's controls; the evaluation's examples depend only on the
task, the set, the seed and how many):

  python -m mot_jax.evals.pair OUT_A 'METHOD A' OUT_B 'METHOD B'

OUT: an evaluation's report folder (`--out`) or its predictions.jsonl. The examples both rows answered are matched by
task, budget and index; they must be the same questions with the same gold answers. The source alone's
log-probability counts its own tokens, so it is not paired on that. Prints, per metric, each row's mean, their
mean paired difference A - B with its standard error (`tasks.paired`, as the report's paired tables) and whether it
exceeds 2 s.e.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mot_jax.errors import MotJaxError
from mot_jax.evals.methods import SOURCE_ALONE
from mot_jax.evals.tasks import OPEN_METRICS, paired

USAGE = "usage: python -m mot_jax.evals.pair OUT_A 'METHOD A' OUT_B 'METHOD B'"


def predictions(out: str, method: str) -> dict:
    """{(task, budget, index): prediction} of `method` in the report `out` (a folder or its predictions.jsonl)."""
    path = Path(out) / "predictions.jsonl" if Path(out).is_dir() else Path(out)
    if not path.is_file():
        raise MotJaxError(f"{path} does not exist; pass an evaluation's report folder or its predictions.jsonl.")
    rows, names = {}, set()
    with path.open() as f:
        for line in f:
            row = json.loads(line)
            names.add(row["method"])
            if row["method"] == method:
                rows[row["task"], row.get("budget"), row["index"]] = row
    if not rows:
        raise MotJaxError(f"{path} has no rows of {method!r}; its methods: {', '.join(sorted(names))}.")
    return rows


def compare(a: dict, b: dict, skip=()) -> dict:
    """{metric: (mean of a, mean of b, `paired(a, b)`)} over the examples both answered, but the metrics `skip`."""
    shared = sorted(set(a) & set(b))
    if not shared:
        raise MotJaxError("The two rows share no example (task, budget and index); pass rows of the same task.")
    for key in shared:
        if (a[key]["question"], a[key]["gold"]) != (b[key]["question"], b[key]["gold"]):
            raise MotJaxError(
                f"Example {key[2]} of {key[0]} is a different question in the two reports; pair rows of evaluations "
                "with the same set, seed and examples."
            )
    out = {}
    for metric in (m for m in OPEN_METRICS if m not in skip):
        if all(metric in a[k] and metric in b[k] for k in shared):
            mine, theirs = [a[k][metric] for k in shared], [b[k][metric] for k in shared]
            out[metric] = (sum(mine) / len(mine), sum(theirs) / len(theirs), paired(mine, theirs))
    return out


def main(argv) -> None:
    if len(argv) != 4:
        raise MotJaxError(f"Four arguments are needed, {len(argv)} were given; {USAGE}.")
    skip = ("logprob",) if SOURCE_ALONE in (argv[1], argv[3]) else ()
    table = compare(predictions(argv[0], argv[1]), predictions(argv[2], argv[3]), skip)
    print(f"A: {argv[1]} ({argv[0]})\nB: {argv[3]} ({argv[2]})")
    for metric, (mine, theirs, p) in table.items():
        print(
            f"{metric}: A {mine:.3f}, B {theirs:.3f}, A - B {p['diff']:+.3f} +- {p['se']:.3f} "
            f"({p['examples']} examples, {p['verdict']})"
        )


if __name__ == "__main__":
    from mot_jax.cli import run_or_exit

    run_or_exit(main, sys.argv[1:])
