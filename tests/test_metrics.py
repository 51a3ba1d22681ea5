"""Answer metrics against hand-computed cases (the SQuAD v1.1 script's normalisation)."""

import pytest

from mot_jax.evals.metrics import exact_match, f1, first_line, match_choice, normalize_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  an   apple,  a day ", "apple day"),
        ("Theatre of the Absurd", "theatre of absurd"),  # "the" only as a whole word
        ("U.S.A.", "usa"),
        ("", ""),
        ("A", ""),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_exact_match_and_f1_take_the_best_gold():
    assert exact_match("the Paris", ["Lyon", "Paris"]) == 1.0
    assert exact_match("Paris, France", ["Paris"]) == 0.0
    # prediction "paris france" vs gold "paris": precision 1/2, recall 1 -> F1 2/3
    assert f1("Paris, France", ["Lyon", "Paris"]) == pytest.approx(2 / 3)
    # repeated tokens count once per occurrence: pred "blue blue sky" vs gold "blue sky": common 2 -> P 2/3, R 1
    assert f1("blue blue sky", ["blue sky"]) == pytest.approx(0.8)
    assert f1("nothing", ["something else"]) == 0.0
    assert f1("the", ["a"]) == 1.0  # both normalise to empty
    assert f1("the", ["Paris"]) == 0.0


def test_first_line_cuts_at_the_newline():
    assert first_line("  Paris\nQuestion: next") == "Paris"
    assert first_line("Paris Question: and Rome?") == "Paris" and first_line("Rome\r\nx") == "Rome"


@pytest.mark.parametrize(
    "generation, expected",
    [
        ("Yes", 0),
        ("no.", 1),
        ("The answer is no", 1),
        ("yes or no", None),  # names both: not credited to the first choice
        ("maybe", None),
        ("No\nyes", 1),  # only the first line counts
    ],
)
def test_match_choice_has_no_order_bias(generation, expected):
    assert match_choice(generation, ["yes", "no"]) == expected
    reversed_expected = None if expected is None else 1 - expected
    assert match_choice(generation, ["no", "yes"]) == reversed_expected


def test_match_choice_prefers_the_longer_named_choice():
    choices = ["New York", "New York City", "Boston"]
    assert match_choice("It is New York City.", choices) == 1
    assert match_choice("new york", choices) == 0


def test_a_task_summary_gives_f1_with_its_standard_error_over_examples():
    """Per-example F1 1, 2/3 (precision 1, recall 1/2), 0: mean 5/9, sample variance 7/27, standard error
    sqrt(7) / 9; one example has no standard error."""
    from mot_jax.evals.tasks import summarize

    examples = [dict(answers=["Ada Lovelace"]), dict(answers=["Ada Lovelace"]), dict(answers=["Ada"])]
    row = dict(predictions=[dict(answer=a) for a in ("Ada Lovelace", "Ada", "Bo")], timed=[(3, 1.0)], handed=[0])
    out = summarize(row, examples, closed=False)
    assert (out["f1"], out["f1_se"]) == pytest.approx((5 / 9, 7**0.5 / 9))
    assert summarize(dict(row, predictions=row["predictions"][:1]), examples[:1], closed=False)["f1_se"] is None


def test_paired_differences_against_every_control_are_the_mean_and_standard_error_of_per_example_differences():
    """Per-example F1 (1, 2/3, 0) against its shuffled control's (0, 2/3, 0): differences 1, 0, 0, mean 1/3, sample
    variance 1/3, standard error 1/3: within 2 s.e. ("level"). Against no context (0, 0, 0): differences 1, 2/3, 0,
    mean 5/9, s.e. sqrt(7)/9 ~ 0.29 (level). Every control present is paired (no context, native, the source alone,
    the shuffled source, the source-free variant), on F1, exact match and gold log-probability (not against the
    source alone: other tokens); baselines and controls get none."""
    from mot_jax.evals.tasks import add_paired_controls, summarize

    examples = [dict(answers=["Ada Lovelace"]), dict(answers=["Ada Lovelace"]), dict(answers=["Ada"])]

    def row(*answers, logprob=(0.0, 0.0, 0.0)):
        predictions = [dict(answer=a, logprob=lp) for a, lp in zip(answers, logprob)]
        return summarize(dict(predictions=predictions, timed=[(3, 1.0)], handed=[0]), examples, False)

    results = add_paired_controls(
        {
            "no_context": row("Bo", "", ""),
            "native": row("Ada Lovelace", "Ada Lovelace", "Ada"),
            "source alone": row("Ada Lovelace", "Bo", "Ada"),
            "MoT": row("Ada Lovelace", "Ada", "Bo", logprob=(-1.0, -2.0, -3.0)),
            "MoT, shuffled source": row("Bo", "Ada", "Bo", logprob=(-2.0, -3.0, -4.0)),
            "source-free MoT": row("Bo", "Bo", "Bo"),
        }
    )
    mot = results["MoT"]
    assert list(mot["paired"]) == ["no_context", "native", "source alone", "MoT, shuffled source", "source-free MoT"]
    shuffled = mot["paired"]["MoT, shuffled source"]
    assert (shuffled["f1"]["diff"], shuffled["f1"]["se"]) == pytest.approx((1 / 3, 1 / 3))
    assert shuffled["f1"]["verdict"] == "level" and shuffled["f1"]["examples"] == 3
    # log-probability one higher on every example: mean 1, standard error 0, beyond 2 s.e.
    assert (shuffled["logprob"]["diff"], shuffled["logprob"]["se"], shuffled["logprob"]["verdict"]) == (1, 0, "above")
    assert (mot["paired"]["no_context"]["f1"]["diff"], mot["paired"]["no_context"]["f1"]["se"]) == pytest.approx(
        (5 / 9, 7**0.5 / 9)
    )
    assert mot["paired"]["native"]["exact_match"]["diff"] == pytest.approx(-2 / 3)
    assert "logprob" not in mot["paired"]["source alone"] and "f1" in mot["paired"]["source alone"]
    # source-free MoT is a translated row too: its own controls, without itself
    assert list(results["source-free MoT"]["paired"]) == ["no_context", "native", "source alone"]
    for name in ("no_context", "native", "source alone", "MoT, shuffled source"):
        assert "paired" not in results[name]
    # native-correct subset: native exact and no context not, all three examples; MoT's F1 there (1 + 2/3 + 0) / 3
    assert mot["f1_native_correct_examples"] == 3 and mot["f1_native_correct"] == pytest.approx(5 / 9)


def test_paired_verdict_words_follow_two_standard_errors():
    from mot_jax.evals.tasks import paired

    assert paired([1, 1, 1, 0], [0, 0, 0, 0])["verdict"] == "above"  # mean 0.75, s.e. 0.25
    assert paired([0, 0, 0, 1], [1, 1, 1, 1])["verdict"] == "below"  # mean -0.75, s.e. 0.25
    assert paired([1, 0, 0, 0], [0, 0, 0, 0])["verdict"] == "level"  # mean 0.25, s.e. 0.25
    assert paired([1], [0]) == dict(diff=1.0, se=None, examples=1, verdict="one example")
    assert paired([2, 2], [2, 2])["verdict"] == "level"  # no difference at all
