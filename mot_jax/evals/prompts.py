"""The evaluation protocol: what a method hands over, what the target reads after it, and how it answers.

Protocol (reference §6, with its quirks fixed): the prefix "instruction + Passage: context" is what a method hands
over (cached, translated or summarised); the suffix "Question: ... Answer:" is read by the target after it, tokenized
without special tokens (no BOS in the middle); greedy decoding, cut at the first line break or prompt marker.

Here: the prompt text, its tokens, the padded batches of contexts and suffixes (`batches`) and the jitted scoring
of options after a context cache (`choice_logprob`), and the open answers with their gold answer's log-probability
(`answer_and_logprob`; greedy decoding: `mot_jax.models.generation.greedy_continue`). The methods that build the cache:
`methods`.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from mot_jax.errors import MotJaxError
from mot_jax.jit import jit
from mot_jax.models.base import last_valid_index
from mot_jax.models.generation import LINE_BREAK, LINE_TEXT, TEXT_BEFORE_BREAK, check_room, greedy_continue
from mot_jax.translate import align as alignment_lib
from mot_jax.translate.align import CHAT_TURNS, chat_turns
from mot_jax.translate.donors import donor_indices

INSTRUCTIONS = {
    "extractive": "Read the passage and answer the question briefly. Use a short phrase from the passage when "
    "possible.",
    "closed": "Read the passage and answer the question with one of the options only.",
}
SUMMARY_REQUEST = "Summarize this passage in a few sentences, keeping every name, place and number."
INSTRUCT_NAMES = ("instruct", "-it", "chat")  # a model name with one of these is chat-tuned
CHAT_SETTINGS = ("auto", "on", "off")
BUCKET, SUFFIX_BUCKET = 16, 8  # padded lengths: jitted code compiles once per bucket, not once per batch


def instruction(example: dict, closed: bool) -> str:
    """The task's instruction ("" for code completion: the prompt is the code)."""
    if is_code(example):
        return ""
    extra = example.get("instruction")
    return INSTRUCTIONS["closed" if closed else "extractive"] + (f" {extra}" if extra else "")


def target_chat(setting: str, target_name: str, tokenizer) -> tuple[str, str] | None:
    """The chat turns the evaluation wraps the target's prompts in (None: plain prompts): `setting` on, off, or auto
    (on for a chat-tuned target, by its name or its embedded file's, whose tokenizer has a known chat format)."""
    from mot_jax.models import gguf

    turns = chat_turns(tokenizer) if setting != "off" else None
    if setting == "on" and turns is None:
        raise MotJaxError(
            f"chat_template=on, but the tokenizer of {target_name!r} has no known chat format (ChatML or Gemma "
            "turns); pass chat_template=off."
        )
    names = f"{target_name} {gguf.EMBEDDED.get(target_name, {}).get('file', '')}".lower()
    return turns if setting == "on" or any(n in names for n in INSTRUCT_NAMES) else None


def prefix_text(example: dict, closed: bool, passage: str | None = None, chat=None) -> str:
    """What a method hands over: the instruction and the passage (`passage` replaces the context: a summary), in
    the user turn's opening of the `chat` format (`target_chat`) when one is given. Code completion (HumanEval):
    the code itself (or `passage`), in no chat turns."""
    if is_code(example):
        return example["context"] if passage is None else passage
    text = f"{instruction(example, closed)}\nPassage: {example['context'] if passage is None else passage}"
    return (chat[0] if chat else "") + text


def suffix_text(example: dict, question: str | None = None, options: bool = True, chat=None) -> str:
    """What the target reads after the handed-over prefix; closed-set questions list their options for a generated
    answer, not when each option's likelihood is scored (small models then mostly copy the first listed one). With
    a `chat` format the user turn closes and the assistant's opens instead of "Answer:". Code completion: the
    prompt's last line (`humaneval.example`'s cue)."""
    if is_code(example):
        return example["cue"]
    text = f"\nQuestion: {question or example['question']}"
    if "choices" in example and options:
        text += f"\nOptions: {' / '.join(example['choices'])}"
    return text + (chat[1] if chat else "\nAnswer:")


def summary_request(tokenizer, passage: str) -> tuple[str, bool]:
    """The text relay's request to the source: (text, add special tokens). Chat models that use ChatML
    (SmolLM2, Qwen) get their chat format, which makes a 135M model summarise far better than a plain prompt."""
    if chat_turns(tokenizer) == CHAT_TURNS["<|im_start|>"]:
        opening, close = CHAT_TURNS["<|im_start|>"]
        return f"{opening}{SUMMARY_REQUEST}\n\n{passage}{close}", False
    return f"{passage}\n\n{SUMMARY_REQUEST}\nSummary:", True


def token_ids(tokenizer, texts, specials: bool) -> list[list[int]]:
    """Token ids of each text, with (prefixes: the tokenizer's BOS) or without (suffixes, answers) special tokens."""
    backend = alignment_lib.adapter(tokenizer).backend
    return [e.ids for e in backend.encode_batch(list(texts), add_special_tokens=specials)]


def padded(rows, multiple: int, length: int | None = None):
    """Right-padded [B, L] int32 ids and bool mask, L the longest row rounded up to `multiple` (or `length`)."""
    width = length or -(-max(map(len, rows)) // multiple) * multiple
    ids, mask = np.zeros((len(rows), width), np.int32), np.zeros((len(rows), width), bool)
    for b, row in enumerate(rows):
        ids[b, : len(row)], mask[b, : len(row)] = row, True
    return ids, mask


def decode_answers(tokenizer, tokens, eos_ids) -> list[str]:
    """The text of each row of generated ids, up to its first end-of-sequence token."""
    backend = alignment_lib.adapter(tokenizer).backend
    rows = []
    for row in np.asarray(tokens).tolist():
        stop = [i for i, t in enumerate(row) if t in eos_ids]
        rows.append(row[: stop[0]] if stop else row)
    return backend.decode_batch(rows, skip_special_tokens=True)


@functools.cache
def line_flags(tokenizer, vocab_size: int) -> jax.Array:
    """[vocab_size] int32 bit flags per token id, as `greedy_continue`'s `lines` reads them (`LINE_TEXT`,
    `LINE_BREAK`, `TEXT_BEFORE_BREAK`), from each token's text alone; 0 for special tokens and ids past the
    tokenizer's. Decoding then stops at a line break only after non-blank text, where `metrics.first_line` cuts or
    later, so the scored answers are unchanged. Once per tokenizer (every task and budget of a run asks)."""
    backend = alignment_lib.adapter(tokenizer).backend
    known = min(vocab_size, backend.get_vocab_size(with_added_tokens=True))
    flags = np.zeros(vocab_size, np.int32)
    for i, text in enumerate(backend.decode_batch([[i] for i in range(known)], skip_special_tokens=True)):
        text = text.replace("\ufffd", "")  # part of a character's bytes: not known to be text, so stop later
        head, *rest = re.split(r"[\r\n]", text, maxsplit=1)
        flags[i] = (
            LINE_TEXT * bool(text.strip()) + LINE_BREAK * bool(rest) + TEXT_BEFORE_BREAK * bool(rest and head.strip())
        )
    return jnp.asarray(flags)


def read_and_score(target, cache, suffix_ids, suffix_mask, choice_ids, choice_mask, layers=None):
    """The target reads each row's suffix then its choice tokens after the context cache: (the final hidden state of
    its last suffix token [B, D], the choice's mean log-probability per token [B], the cache holding both). `layers`:
    see `CausalLM.run_layers`."""
    ids, mask = jnp.concatenate([suffix_ids, choice_ids], 1), jnp.concatenate([suffix_mask, choice_mask], 1)
    hidden, cache = target.hidden_states(ids, mask, cache=cache, layers=layers)
    first = hidden[jnp.arange(ids.shape[0]), last_valid_index(suffix_mask)]  # predicts the first choice token
    predictors = jnp.concatenate([first[:, None], hidden[:, suffix_ids.shape[1] : -1]], 1)
    logp = jax.nn.log_softmax(target.unembed(predictors).astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, choice_ids[..., None], axis=-1)[..., 0] * choice_mask
    return first, picked.sum(1) / jnp.maximum(choice_mask.sum(1), 1), cache


@jit
def choice_logprob(target, cache, suffix_ids, suffix_mask, choice_ids, choice_mask):
    """Mean log-probability per token [B] of each row's choice tokens read after the context cache and the suffix."""
    return read_and_score(target, cache, suffix_ids, suffix_mask, choice_ids, choice_mask)[1]


def answer_and_logprob(target, cache, suffix_ids, suffix_mask, gold_ids, gold_mask, *, max_new_tokens, eos_ids, lines):
    """(greedy answers [B, max_new_tokens] after the context cache and the suffix, as `generate_from_cache` gives
    them; the gold answer's mean log-probability per token [B], as `choice_logprob`) from one read of the suffix and
    the gold answer: the gold's slots are freed before decoding, so the answer never sees them."""
    check_room(cache, suffix_ids.shape[1] + max(max_new_tokens, gold_ids.shape[1]))
    args = (target, cache, suffix_ids, suffix_mask, gold_ids, gold_mask)
    return answer_and_logprob_jit(*args, max_new_tokens=max_new_tokens, eos_ids=eos_ids, lines=lines)


@jit(static_argnames=("max_new_tokens", "eos_ids"))
def answer_and_logprob_jit(
    target, cache, suffix_ids, suffix_mask, gold_ids, gold_mask, *, max_new_tokens, eos_ids, lines
):
    after_suffix = cache.index + suffix_ids.shape[1]
    layers = target.layer_params()  # one copy of the weights for the read and every decoding step
    last, logprob, cache = read_and_score(target, cache, suffix_ids, suffix_mask, gold_ids, gold_mask, layers)
    freed = jax.lax.dynamic_update_slice(cache.valid, jnp.zeros(gold_mask.shape, bool), (0, after_suffix))
    cache = cache.replace(valid=freed, index=after_suffix)
    answers = greedy_continue(target, target.unembed(last), cache, max_new_tokens, eos_ids, lines, layers)
    return answers, logprob


@dataclasses.dataclass
class Contexts:
    """One batch of contexts as the methods need them."""

    examples: list[dict]
    closed: bool
    ids: np.ndarray  # [B, T] target ids of the prefix (BOS, instruction, passage), right-padded, within budget
    mask: np.ndarray
    passages: list[str]  # the passage text each row's prefix holds (after truncation to the budget)
    donors: Contexts | None = None  # row by row, another example's contexts (with another passage): ShuffledSource
    chat: tuple | None = None  # the chat turns the prompts are in (`Settings.chat`)
    shared: dict = dataclasses.field(default_factory=dict)  # results several rows reuse (`methods.native_cache`)
    # with donors, the batch's contexts and its donors' are rows of one batch (`some`), which a source reads once
    whole: Contexts | None = None
    rows: np.ndarray | None = None  # which of `whole`'s rows these are

    @property
    def length(self) -> int:
        return self.ids.shape[1]

    def forget(self) -> None:
        """Drop the results its rows share (`shared`, its whole batch's too), so that a timed build runs them anew."""
        self.shared.clear()
        if self.whole is not None:
            self.whole.shared.clear()

    def some(self, rows) -> Contexts:
        """These contexts' rows `rows`, as a batch of their own that knows it is part of this one."""
        rows = np.asarray(rows)
        pick = lambda items: [items[i] for i in rows]
        return Contexts(
            pick(self.examples),
            self.closed,
            self.ids[rows],
            self.mask[rows],
            pick(self.passages),
            chat=self.chat,
            whole=self,
            rows=rows,
        )


@dataclasses.dataclass
class Settings:
    batch_size: int = 4
    max_new_tokens: int = 32
    budget: int | None = None  # at most this many target tokens of prefix (None: what the model's limit leaves)
    chat: tuple | None = None  # the target's chat turns around the prompts (`target_chat`), None for plain prompts
    check_timeout: float = 5.0  # code completion: seconds a problem's tests may run (`humaneval.score`)


def is_closed(examples) -> bool:
    return "choices" in examples[0]


def is_code(example: dict) -> bool:
    """A code-completion example (`mot_jax.evals.humaneval`)."""
    return "entry_point" in example


def prefix_budgets(models, prefixes, suffixes, settings: Settings) -> list[int]:
    """Per example, the prefix tokens that fit: the model's limit minus suffix and answer, capped by the budget."""
    limit = models.target.config.max_positions
    budgets = []
    for index, (prefix, suffix) in enumerate(zip(prefixes, suffixes)):
        budget = int(min(limit - len(suffix) - settings.max_new_tokens, settings.budget or np.inf))
        if budget < min(len(prefix), 2):
            raise MotJaxError(
                f"Example {index} cannot fit: its question and a {settings.max_new_tokens}-token answer leave "
                f"{budget} of the target's {limit} tokens for the context; shorten the question, lower "
                "max_new_tokens or raise the budget."
            )
        budgets.append(budget)
    return budgets


def fitted(models, examples, settings: Settings, questions=None):
    """(prefix ids cut to their budgets, suffix ids, tokens cut from each prefix) of the examples' prompts;
    `questions` replaces each example's question (multi-agent)."""
    closed = is_closed(examples)
    prefixes = token_ids(models.target_tokenizer, [prefix_text(e, closed, chat=settings.chat) for e in examples], True)
    questions = questions or [None] * len(examples)
    suffixes = [suffix_text(e, q, chat=settings.chat) for e, q in zip(examples, questions)]
    suffixes = token_ids(models.target_tokenizer, suffixes, False)
    budgets = prefix_budgets(models, prefixes, suffixes, settings)
    cut = [max(0, len(p) - b) for p, b in zip(prefixes, budgets)]
    return [p[:b] for p, b in zip(prefixes, budgets)], suffixes, cut


def context_cuts(models, examples, settings: Settings) -> dict | None:
    """How many examples' contexts `batches` cuts to fit (the target's positions less the question and the answer,
    or the budget) and by how many tokens: {"examples", "of", "most_tokens", "mean_tokens"} (over those cut), or None
    when none is."""
    cut = [n for n in fitted(models, examples, settings)[2] if n]
    if not cut:
        return None
    return dict(examples=len(cut), of=len(examples), most_tokens=max(cut), mean_tokens=round(float(np.mean(cut)), 1))


def batches(models, examples, settings: Settings, questions=None, donors: bool = False):
    """(Contexts, suffix ids, suffix mask) per batch; `questions` replaces each example's question (multi-agent);
    `donors` attaches each row's donor contexts (`donor_indices`) for `ShuffledSource`."""
    donor = np.asarray(donor_indices(examples)) if donors else None
    closed = is_closed(examples)
    prefixes, suffixes, _ = fitted(models, examples, settings, questions)
    # the passage a truncated prefix still holds: its text minus the instruction header (code: all of it)
    texts = alignment_lib.adapter(models.target_tokenizer).backend.decode_batch(prefixes, skip_special_tokens=True)
    passages = [held_passage(e, t) for e, t in zip(examples, texts)]
    for start in range(0, len(examples), settings.batch_size):
        rows = list(range(start, min(start + settings.batch_size, len(examples))))
        # with donors: the batch's rows, then those of its donors not among them (mostly one: the next batch's first)
        whole = rows if donor is None else rows + [j for j in dict.fromkeys(donor[rows].tolist()) if j not in rows]
        contexts = Contexts(
            [examples[j] for j in whole],
            closed,
            *padded([prefixes[j] for j in whole], BUCKET),
            [passages[j] for j in whole],
            chat=settings.chat,
        )
        if donor is not None:
            at = {j: i for i, j in enumerate(whole)}
            contexts, contexts.donors = (
                contexts.some(range(len(rows))),
                contexts.some([at[j] for j in donor[rows].tolist()]),
            )
        yield contexts, *padded([suffixes[j] for j in rows], SUFFIX_BUCKET)


def held_passage(example: dict, prefix: str) -> str:
    """The passage a prefix's text holds (all of it for code; after the header, or nothing where a budget cut it)."""
    if is_code(example):
        return prefix
    return prefix.split("\nPassage: ", 1)[1] if "\nPassage: " in prefix else ""


def capacity_for(contexts: Contexts, suffix_ids, extra: int) -> int:
    return contexts.length + suffix_ids.shape[1] + extra
