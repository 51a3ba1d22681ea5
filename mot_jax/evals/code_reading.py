"""Offline code-reading examples: questions about a short generated Python module, deterministic from a seed.

The coder models' own ground, and a task where reading the context is not enough: the answer is rarely a span to
copy; it has to be worked out from the code (what a function returns for a given input, which function calls which,
what a constant holds). Every module defines two constants, a small table (a dict) and five functions with
invented names, in a random order:

- `arith(x)`: one arithmetic step on its argument (`x * 3 + 2`, `(x + 4) * 2`, `x * x - 1`, ...);
- `branch(x)`: one of two string literals, by a comparison of its argument with a threshold;
- `lookup(key)`: the table's value for a key;
- `chain(x)`: calls `arith` and changes its result (`arith(x) - 3`), so its value takes two steps;
- `offset(x)`: adds the second constant, itself defined from the first (`STEP = BASE + 3`), then calls `branch`.

Each example asks one question of one TYPE (drawn uniformly), always about the module's own names, with the
answer computed by the rule that wrote the code (and checked by executing the module, in the tests):

| type | question | answer |
|---|---|---|
| returns | What does `arith(5)` return? | an integer (one step) |
| chain | What does `chain(5)` return? | an integer (two steps through a call) |
| branch | What does `branch(5)` return? | a string literal of the module |
| lookup | What does `lookup("key")` return? | a value of the table |
| constant | What is the value of `STEP`? | an integer (one step from another constant) |
| offset | What does `offset(5)` return? | a string literal, through a constant and a call |
| caller | Which function calls `arith`? | a function name of the module |

Examples are in the extractive schema (`{"context", "question", "answers", "instruction", "id"}`, the id names the
type: `code-TYPE-INDEX`), for `python -m mot_jax.evaluate --task=extractive_qa --data=code_reading` (scored with
F1, exact match and the gold answer's log-probability like the synthetic extractive set).

Held-out split: as for the synthetic sets, examples 0 to HELD_OUT - 1 of every seed are the evaluation's (stored
whole by `datasets.generated_set`) and nothing else reads them; any other use starts at HELD_OUT (`start`). No
training module loads this generator (tested, with the held-out modules' absence from the training corpus).
"""

from __future__ import annotations

import numpy as np

from mot_jax.evals.synthetic import HELD_OUT

QUESTION_TYPES = ("returns", "chain", "branch", "lookup", "constant", "offset", "caller")  # order fixes the draws
INSTRUCTION = "The passage is Python code. Answer with the value or the name only."
TASK_SEED = 101  # the generator's stream beside the synthetic tasks' (0-3)
_VERBS = ["scale", "shift", "mix", "fold", "pick", "grade", "tally", "route", "tag", "probe", "weigh", "trim"]
_SYLLABLES = ["bra", "dol", "fen", "gri", "kav", "lum", "mor", "nex", "pol", "quin", "ros", "tav", "vel", "zor"]
_WORDS = ["amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kelp"]
_WORDS += ["lagoon", "marble", "nectar", "onyx", "pepper", "quartz", "saffron", "tundra", "umber", "willow"]
_CONSTANTS = ["BASE", "STEP", "LIMIT", "WIDTH", "DEPTH", "RATE", "SPAN", "GAIN"]
_ARITH = [  # (source with x and the constants a, b; its value)
    ("x * {a} + {b}", lambda x, a, b: x * a + b),
    ("(x + {a}) * {b}", lambda x, a, b: (x + a) * b),
    ("x * x - {b}", lambda x, a, b: x * x - b),
    ("{a} * x - {b}", lambda x, a, b: a * x - b),
    ("x + {a} * {b}", lambda x, a, b: x + a * b),
]


def _pick(rng, items):
    return items[int(rng.integers(len(items)))]


def _noun(rng) -> str:
    return "".join(_pick(rng, _SYLLABLES) for _ in range(2))


def _names(rng, count: int) -> list[str]:
    """`count` distinct function names, verb_noun with an invented noun."""
    names: list[str] = []
    while len(names) < count:
        name = f"{_pick(rng, _VERBS)}_{_noun(rng)}"
        if name not in names:
            names.append(name)
    return names


def _int(rng, low: int, high: int) -> int:
    return int(rng.integers(low, high + 1))


def module(rng) -> tuple[str, dict]:
    """A module's source and what the questions need: names, parameters and the functions' values."""
    arith, branch, lookup, chain, offset = _names(rng, 5)
    base_name, step_name = (str(n) for n in rng.choice(_CONSTANTS, size=2, replace=False))
    table_name = f"{_noun(rng).upper()}_TABLE"
    words = [str(w) for w in rng.choice(_WORDS, size=6, replace=False)]
    keys, values = words[:3], words[3:]
    high, low = (str(w) for w in rng.choice([w for w in _WORDS if w not in words], size=2, replace=False))
    base, step_add = _int(rng, 2, 9), _int(rng, 1, 6)
    a, b = _int(rng, 2, 5), _int(rng, 1, 9)
    form, value = _ARITH[int(rng.integers(len(_ARITH)))]
    step = base + step_add
    threshold = step + _int(rng, 2, 8)  # so that offset(x) = branch(x + step) takes either side for some x >= 0
    chain_op, chain_c = _pick(rng, ["+", "-"]), _int(rng, 1, 9)
    functions = {
        arith: f"def {arith}(x):\n    return {form.format(a=a, b=b)}\n",
        branch: f'def {branch}(x):\n    if x > {threshold}:\n        return "{high}"\n    return "{low}"\n',
        lookup: f"def {lookup}(key):\n    return {table_name}[key]\n",
        chain: f"def {chain}(x):\n    y = {arith}(x)\n    return y {chain_op} {chain_c}\n",
        offset: f"def {offset}(x):\n    return {branch}(x + {step_name})\n",
    }
    order = rng.permutation(len(functions))
    listed = list(functions.values())
    header = (
        f"{base_name} = {base}\n{step_name} = {base_name} + {step_add}\n"
        + f"{table_name} = {{"
        + ", ".join(f'"{k}": "{v}"' for k, v in zip(keys, values))
        + "}\n"
    )
    source = header + "\n\n" + "\n\n".join(listed[i] for i in order)
    branch_of = lambda x: high if x > threshold else low  # noqa: E731
    arith_of = lambda x: value(x, a, b)  # noqa: E731
    facts = dict(
        names=dict(arith=arith, branch=branch, lookup=lookup, chain=chain, offset=offset),
        step_name=step_name,
        step=step,
        table=dict(zip(keys, values)),
        arith=arith_of,
        chain=lambda x: arith_of(x) + chain_c if chain_op == "+" else arith_of(x) - chain_c,
        branch=branch_of,
        offset=lambda x: branch_of(x + step),
        threshold=threshold,
    )
    return source, facts


def _question(rng, question_type: str, facts: dict) -> tuple[str, str]:
    names = facts["names"]
    if question_type == "constant":
        return f"What is the value of `{facts['step_name']}`?", str(facts["step"])
    if question_type == "caller":
        return f"Which function calls `{names['arith']}`?", names["chain"]
    if question_type == "lookup":
        key = _pick(rng, sorted(facts["table"]))
        return f'What does `{names["lookup"]}("{key}")` return?', facts["table"][key]
    if question_type in ("branch", "offset"):  # an argument near the threshold, on either side, half the time each
        t = facts["threshold"] - (facts["step"] if question_type == "offset" else 0)
        x = max(0, t + _int(rng, 1, 4) if rng.random() < 0.5 else t - _int(rng, 0, 3))
    else:
        x = _int(rng, 1, 9)
    return f"What does `{names[question_type if question_type != 'returns' else 'arith']}({x})` return?", str(
        facts["arith" if question_type == "returns" else question_type](x)
    )


def examples(n: int, seed: int = 0, start: int = 0) -> list[dict]:
    """`n` code-reading examples from index `start` on (below HELD_OUT: the held-out split); example i is the same
    for every n."""
    out = []
    for index in range(start, start + n):
        rng = np.random.default_rng([seed, index, TASK_SEED])
        source, facts = module(rng)
        question_type = QUESTION_TYPES[int(rng.integers(len(QUESTION_TYPES)))]
        question, answer = _question(rng, question_type, facts)
        out.append(
            dict(
                context=source,
                question=question,
                answers=[answer],
                instruction=INSTRUCTION,
                id=f"code-{question_type}-{index}",
            )
        )
    return out


__all__ = ["HELD_OUT", "INSTRUCTION", "QUESTION_TYPES", "examples", "module"]
