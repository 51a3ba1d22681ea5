"""Answer metrics: SQuAD v1.1 exact match and token F1 (max over gold answers), and closed-set choice matching.

The normalisation is the official SQuAD v1.1 script's: lower-case, drop punctuation, drop the articles a / an /
the, collapse whitespace. Closed-set matching picks the choice the generated answer names without favouring any
position in the choice list (the reference's regex tried choices in order, so "yes" won over "no").
"""

from __future__ import annotations

import collections
import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, golds) -> float:
    return float(any(normalize_answer(prediction) == normalize_answer(g) for g in golds))


def _f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if not pred or not ref:
        return float(pred == ref)  # both empty: 1; one empty: 0 (as the official script)
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def f1(prediction: str, golds) -> float:
    """Token F1 against the best-matching gold answer."""
    return max(_f1(prediction, g) for g in golds)


_CUT = re.compile(r"[\r\n]|Question:|Context:|Answer:|Passage:")


def first_line(generation: str) -> str:
    """The answer part of a generation: up to the first line break or prompt marker (the protocol's cut)."""
    return _CUT.split(generation.strip(), 1)[0].strip()


def match_choice(generation: str, choices) -> int | None:
    """The index of the choice the answer names, or None.

    An answer equal to a choice (after normalisation) names it; otherwise the choices whose normalised text occurs
    as whole words in the answer are candidates, and exactly one candidate is required: an answer naming two
    choices ("yes or no") or none is not credited to whichever comes first.
    """
    answer = normalize_answer(first_line(generation))
    normalized = [normalize_answer(c) for c in choices]
    exact = [i for i, c in enumerate(normalized) if c and answer == c]
    if len(exact) == 1:
        return exact[0]
    padded = f" {answer} "
    named = [i for i, c in enumerate(normalized) if c and f" {c} " in padded]
    # a choice contained in a longer named choice ("new york" in "new york city") does not count on its own
    named = [i for i in named if not any(j != i and f" {normalized[i]} " in f" {normalized[j]} " for j in named)]
    return named[0] if len(named) == 1 else None
