"""Question-shaped training rows (ours): a context that is a passage, a prompt that asks about a span of it
and then gives that span as the answer, with labels on the answer alone (Cartridges' finding: a cache trained on
plain continuation memorises a text but does not answer questions about it).

Two rules, both from training material alone and never from the evaluation's generators, templates or names:

- `span_row` (`data.question_fraction`): the passage is a corpus chunk's context; the question quotes a few of its
  tokens and asks which come next; the answer is the next tokens of the passage.
- `fact_row` (`data.fact_fraction`): records about invented ships (`FACTS`), several per passage; the question
  asks one field of one ship; the answer is that field's words as the passage states them. Every invented name
  holds a "w" or a "y", letters the evaluation's name syllables never use, and the sentence templates share no
  five-word run with the evaluation's (both tested).

A row is laid out as the target reads an instruction-following exchange: in its chat turns (`chat_turns`) when its
tokenizer has them, else as "Request: .. Reply: ..". Its context fills the chunk's context length exactly (no padding).
"""

from __future__ import annotations

import numpy as np

from mot_jax.errors import MotJaxError
from mot_jax.translate.align import adapter, chat_turns

INSTRUCTION = "Below is a text. Reply to the request that follows it with words copied from the text.\nText: "
SPAN_QUESTION = ('\nRequest: quote the words that come right after "', '" in the text.')
CUE_TOKENS, SPAN_TOKENS = 6, 6  # a span row quotes 6 tokens and answers with the next 6

_START = ["w", "y", "wh", "gw", "sk", "tr", "kl"]
_MIDDLE = ["y", "wy", "aw", "ow", "ey", "uy", "yo"]
_END = ["", "d", "ck", "ft", "ng", "p", "st"]
_VESSELS = ["schooner", "ketch", "barge", "sloop", "cutter", "lugger"]
_CARGO = ["salted cod", "copper wire", "tea chests", "wool bales", "roof slates", "lamp oil", "rye flour"]
_PENNANTS = ["striped", "chequered", "starred", "forked", "plain", "ringed"]
_MONTHS = ["January", "March", "April", "June", "August", "October", "December"]
# field -> the request about one ship (its name in {ship})
FACTS = {
    "harbour": "name the harbour the {ship} set out from.",
    "skipper": "give the name of the skipper of the {ship}.",
    "month": "say in which month the {ship} made its maiden voyage.",
    "cargo": "state what the {ship} had in its hold.",
    "pennant": "describe the pennant the {ship} flew.",
}


def invented_name(rng) -> str:
    """A capitalised invented word with a "w" or "y" in it (no evaluation name has either letter)."""
    parts = [_START, _MIDDLE, _END] * 2
    return "".join(p[int(rng.integers(len(p)))] for p in parts).capitalize()


def _ship(rng) -> dict:
    pick = lambda items: items[int(rng.integers(len(items)))]
    return dict(
        ship=invented_name(rng),
        vessel=pick(_VESSELS),
        harbour=f"{invented_name(rng)} harbour",
        skipper=invented_name(rng),
        month=pick(_MONTHS),
        cargo=pick(_CARGO),
        pennant=f"a {pick(_PENNANTS)} pennant",
    )


def record(s: dict) -> str:
    return (
        f"The {s['vessel']} {s['ship']} left {s['harbour']} in {s['month']} on its maiden voyage, skippered by "
        f"{s['skipper']}. Its hold was full of {s['cargo']}, and from its mast flew {s['pennant']}. "
    )


class QuestionRows:
    """Builds question-shaped rows [T] (ids) with their label masks [T - P] for one target tokenizer."""

    def __init__(self, tokenizer, prefix_tokens: int, total_tokens: int):
        self.backend = adapter(tokenizer).backend
        self.context_len, self.prompt_len = prefix_tokens - 1, total_tokens - prefix_tokens + 1
        turns = chat_turns(tokenizer)
        self.opening, self.close = turns if turns else ("", "\nReply: ")
        self.end = self.ids(self.close.split("\n")[0] if turns else "\n")  # the user turn's end closes the answer
        self.head = self.ids(self.opening + INSTRUCTION, specials=True)
        if len(self.head) + CUE_TOKENS + SPAN_TOKENS + 1 > self.context_len:
            raise MotJaxError(
                f"Question rows need a context of more than {len(self.head) + CUE_TOKENS + SPAN_TOKENS} tokens, not "
                f"{self.context_len}; raise data.prefix_tokens or set data.question_fraction and data.fact_fraction "
                "to 0."
            )
        self.fact_row(np.random.default_rng(0))  # refuses here, before training, a context too short for a record

    def ids(self, text: str, specials: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=specials).ids

    def _row(self, context: list[int], request: list[int], answer: list[int]):
        """Context (exactly the context length) + request + answer + end; the label mask is True on the answer
        and end tokens (labels = the row shifted by one, from the prompt's first position)."""
        answer = answer + self.end
        prompt = request + answer
        if len(prompt) > self.prompt_len:
            raise MotJaxError(
                f"A question row's request and answer take {len(prompt)} tokens, more than the {self.prompt_len} a "
                "chunk holds after its context; raise data.total_tokens - data.prefix_tokens."
            )
        pad = self.prompt_len - len(prompt)
        row = np.array(context + prompt + self.end * pad, np.int32)  # padding past the answer: never a label
        labels_mask = np.zeros(self.prompt_len - 1, bool)
        labels_mask[len(request) - 1 : len(prompt) - 1] = True  # label i is token i + 1 of the prompt
        return row, labels_mask

    def span_row(self, chunk: np.ndarray, rng):
        """A corpus chunk's context, cut after the instruction to the context length; the request quotes CUE_TOKENS
        of it and the answer is the SPAN_TOKENS after them."""
        passage = chunk[: self.context_len - len(self.head)].tolist()
        s = int(rng.integers(CUE_TOKENS, len(passage) - SPAN_TOKENS + 1))
        head, tail = SPAN_QUESTION
        request = self.ids(head) + passage[s - CUE_TOKENS : s] + self.ids(tail + self.close)
        return self._row(self.head + passage, request, passage[s : s + SPAN_TOKENS])

    def fact_row(self, rng):
        """Records of invented ships until they fill the context; the request asks one field of a ship whose record
        lies whole within it."""
        ships, text, whole = [], "", []
        while True:
            ships.append(_ship(rng))
            text += record(ships[-1])
            ids = self.ids(text)
            if len(self.head) + len(ids) > self.context_len:
                break
            whole.append(ships[-1])
        if not whole:
            raise MotJaxError(
                f"A {self.context_len}-token context holds no whole record for a fact row; raise data.prefix_tokens "
                "or set data.fact_fraction=0."
            )
        ship = whole[int(rng.integers(len(whole)))]
        field = sorted(FACTS)[int(rng.integers(len(FACTS)))]
        request = self.ids("\nRequest: " + FACTS[field].format(**ship) + self.close)
        context = self.head + ids[: self.context_len - len(self.head)]
        return self._row(context, request, self.ids(ship[field]))
