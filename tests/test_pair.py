"""`python -m mot_jax.evals.pair`: rows of two evaluations paired by example."""

import json

import numpy as np
import pytest

from mot_jax.errors import MotJaxError
from mot_jax.evals import pair


def report(folder, rows):
    folder.mkdir()
    lines = [json.dumps(dict(task="extractive_qa", budget=None, gold=["x"], **r)) + "\n" for r in rows]
    (folder / "predictions.jsonl").write_text("".join(lines))
    return str(folder)


def rows(method, f1, logprob, questions="abcd"):
    return [
        dict(method=method, index=i, question=q, f1=f, logprob=lp)
        for i, (q, f, lp) in enumerate(zip(questions, f1, logprob))
    ]


def test_paired_across_reports_equals_the_closed_form(tmp_path, capsys):
    f1_a, f1_b, lp_a, lp_b = (
        [1.0, 0.5, 0.0, 1.0],
        [0.0, 0.5, 0.0, 0.0],
        [-1.0, -2.0, -3.0, -0.5],
        [-2.0, -2.5, -3.0, -4.0],
    )
    a = report(tmp_path / "a", rows("row", f1_a, lp_a) + rows("other", f1_b, lp_b))
    b = report(tmp_path / "b", rows("control", f1_b, lp_b)[:3])  # fewer examples: the three both answered
    table = pair.compare(pair.predictions(a, "row"), pair.predictions(b, "control"))
    diffs = np.subtract(f1_a[:3], f1_b[:3])
    assert table["f1"][2]["diff"] == pytest.approx(diffs.mean())
    assert table["f1"][2]["se"] == pytest.approx(diffs.std(ddof=1) / np.sqrt(3))
    assert table["logprob"][:2] == pytest.approx((np.mean(lp_a[:3]), np.mean(lp_b[:3])))
    pair.main([a, "row", b, "control"])
    out = capsys.readouterr().out
    assert "f1: A 0.500, B 0.167, A - B +0.333 +- 0.333 (3 examples, level)" in out


def test_reports_of_different_examples_or_a_missing_row_are_refused(tmp_path):
    a = report(tmp_path / "a", rows("row", [1.0] * 4, [0.0] * 4))
    b = report(tmp_path / "b", rows("control", [0.0] * 4, [0.0] * 4, questions="abzd"))
    with pytest.raises(MotJaxError, match="Example 2 of extractive_qa is a different question"):
        pair.compare(pair.predictions(a, "row"), pair.predictions(b, "control"))
    with pytest.raises(MotJaxError, match="has no rows of 'rwo'; its methods: row"):
        pair.predictions(a, "rwo")
    with pytest.raises(MotJaxError, match="Four arguments are needed, 2 were given"):
        pair.main([a, "row"])
