"""Offline evaluation examples about invented entities, generated deterministically from a seed.

No model knows the answers without the context: people, places, organisations and pets get invented names, and
each passage states a few facts about its entity among sentences about other invented entities (distractors).
Every example is a dict in the documented JSONL schemas:

- extractive: {"context", "question", "answers": [..]} (the answer is a span of the context);
- closed-set: {"context", "question", "choices": [..], "answer"} (yes/no or four options, the answer's position
  drawn at random so no position is favoured);
- long_context: the extractive schema, the target passage at a random position among many distractor paragraphs
  (blank-line separated), to measure how translation holds up over a long prefix;
- multi_agent: {"context", "questions": [..], "answers": [[..], ..]}, several questions about distinct
  (entity, fact) pairs of one document, one per agent sharing that document's cache.

`examples(task, n, seed, distractors)` gives the same list for the same arguments on every machine (numpy's
PCG64 with the seed, the example index and the task). First names are unique within a context (the passages
refer to people by first name), so no question has two right answers.

Held-out split: examples 0 to HELD_OUT - 1 of every task and seed are the evaluation's (`datasets.synthetic_set`
stores them whole) and nothing else reads them; any other use of the generator (the TTFT passage of
`evals.latency`, a future training rule) starts at HELD_OUT (`start`). No training rule reads this module at all
(tested, with the held-out names' absence from the training corpus).
"""

from __future__ import annotations

import numpy as np

TASKS = ("extractive_qa", "closed_qa", "long_context", "multi_agent")  # order fixes the seeds
HELD_OUT = 1024  # examples per task and seed in the evaluation's held-out split: indices 0..HELD_OUT-1
DISTRACTORS = {"extractive_qa": 2, "closed_qa": 2, "long_context": 24, "multi_agent": 4}  # defaults per task
_ONSETS = ["b", "br", "d", "f", "g", "k", "l", "m", "n", "p", "qu", "r", "s", "t", "th", "v", "z", "c", "h", "j"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ia", "ou"]
_CODAS = ["", "n", "r", "l", "s", "th", "m", "x", "nd", "rk"]
_JOBS = ["glassblower", "cartographer", "beekeeper", "clockmaker", "ferry pilot", "archivist", "lens grinder"]
_PETS = ["heron", "tortoise", "lynx", "parrot", "goat", "otter", "raven"]
_COLOURS = ["amber", "teal", "crimson", "ivory", "olive", "violet", "slate"]


def _pick(rng, items: list):
    """rng.choice(items), the same draw, without converting the list to an array on every call (5x faster)."""
    return items[int(rng.integers(len(items)))]


def _word(rng, syllables: int) -> str:
    parts = [_pick(rng, _ONSETS) + _pick(rng, _VOWELS) + _pick(rng, _CODAS) for _ in range(syllables)]
    return "".join(parts).capitalize()


def _entity(rng) -> dict:
    return dict(
        person=f"{_word(rng, 2)} {_word(rng, 2)}",
        town=_word(rng, 3),
        year=int(rng.integers(1720, 1990)),
        job=_pick(rng, _JOBS),
        guild=f"the {_word(rng, 2)} Guild",
        pet=_pick(rng, _PETS),
        pet_name=_word(rng, 2),
        colour=_pick(rng, _COLOURS),
    )


def _entities(rng, count: int) -> list[dict]:
    """`count` entities with distinct first names (a clash redraws, so without one the draws are unchanged)."""
    out, firsts = [], set()
    while len(out) < count:
        e = _entity(rng)
        first = e["person"].split()[0]
        if first not in firsts:
            firsts.add(first)
            out.append(e)
    return out


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _passage(e: dict) -> str:
    first = e["person"].split()[0]
    return (
        f"{e['person']} was born in {e['town']} in {e['year']}. {first} works as {_a(e['job'])} for {e['guild']} "
        f"and keeps {_a(e['pet'])} named {e['pet_name']}. The door of {first}'s house is painted {e['colour']}."
    )


# answer field -> (question, yes/no question about a claimed value {value})
_QUESTIONS = {
    "town": ("Where was {person} born?", "Was {person} born in {value}?"),
    "year": ("In which year was {person} born?", "Was {person} born in {value}?"),
    "pet_name": ("What is the name of {person}'s {pet}?", "Is {person}'s {pet} named {value}?"),
    "guild": ("For which guild does {person} work?", "Does {person} work for {value}?"),
    "colour": ("What colour is the door of {person}'s house?", "Is the door of {person}'s house painted {value}?"),
}


def examples(
    task: str, n: int, seed: int = 0, distractors: int | None = None, questions_per_example: int = 3, start: int = 0
) -> list[dict]:
    """`n` examples of `task` (one of TASKS) from index `start` on (below HELD_OUT: the held-out split); each context
    holds the target entity's passage among `distractors` passages about other invented entities (default
    DISTRACTORS[task]), in a random order. multi_agent asks `questions_per_example` questions about distinct
    (entity, field) pairs of its `distractors + 1` entities."""
    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}; use one of {', '.join(TASKS)}.")
    distractors = DISTRACTORS[task] if distractors is None else distractors
    fields = sorted(_QUESTIONS)
    if distractors < 0:
        raise ValueError(f"distractors must be 0 or more, not {distractors}.")
    if task == "multi_agent" and not 0 < questions_per_example <= (distractors + 1) * len(fields):
        raise ValueError(
            f"questions_per_example must be 1..{(distractors + 1) * len(fields)}, not {questions_per_example}."
        )
    out = []
    for index in range(start, start + n):
        rng = np.random.default_rng([seed, index, TASKS.index(task)])
        entities = _entities(rng, distractors + 1)
        target = entities[0]
        order = rng.permutation(len(entities))
        context = ("\n\n" if task == "long_context" else " ").join(_passage(entities[i]) for i in order)
        if task == "multi_agent":
            pairs = rng.choice(len(entities) * len(fields), size=questions_per_example, replace=False)
            asked = [(entities[p // len(fields)], fields[p % len(fields)]) for p in pairs.tolist()]
            questions = [_QUESTIONS[field][0].format(**e) for e, field in asked]
            out.append(dict(context=context, questions=questions, answers=[[str(e[field])] for e, field in asked]))
            continue
        field = fields[int(rng.integers(len(_QUESTIONS)))]
        question, yes_no = _QUESTIONS[field]
        answer = str(target[field])
        if task in ("extractive_qa", "long_context"):
            out.append(dict(context=context, question=question.format(**target), answers=[answer]))
        elif rng.random() < 0.5:  # yes / no about the true value or another invented one
            truth, claimed = bool(rng.random() < 0.5), answer
            while not truth and claimed == answer:
                claimed = str(_entity(rng)[field])
            statement = yes_no.format(**target, value=claimed)
            out.append(
                dict(context=context, question=statement, choices=["yes", "no"], answer="yes" if truth else "no")
            )
        else:  # four options: the answer and three other invented values of the same field, in a random order
            others = dict.fromkeys(str(_entity(rng)[field]) for _ in range(40))
            options = [answer] + [o for o in others if o != answer][:3]
            options = [options[i] for i in rng.permutation(len(options))]
            out.append(dict(context=context, question=question.format(**target), choices=options, answer=answer))
    return out
