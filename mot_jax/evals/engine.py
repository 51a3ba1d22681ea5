"""The evaluation engine: each method turns the same examples' contexts into a target cache; the target answers.

Protocol (reference §6, with its quirks fixed): the prefix "instruction + Passage: context" is what a method hands
over (cached, translated or summarised); the suffix "Question: ... Answer:" is read by the target after it, tokenized
without special tokens (no BOS in the middle); greedy decoding, cut at the first line break or prompt marker.

Methods (all on the same examples, in one run):
- `no_context`: the target reads the instruction only;
- `native`: the target reads the passage as text (the upper bound);
- `text_relay`: the source writes a summary of the passage, the target reads the summary (a raw-text relay is the
  `native` row: the target re-prefills the same text);
- translated (one per training workdir): the source reads the passage and the translator builds the target cache;
- `<translated>, shuffled source` (a control beside each translated method, `ShuffledSource`): the same translator
  builds this example's cache from another example's source cache, so the translation carries none of this
  example's passage; a translated method carries the context only where it beats this row.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from mot_jax.errors import MotJaxError
from mot_jax.evals import metrics
from mot_jax.jit import jit
from mot_jax.models.base import generate, greedy_continue, last_valid_index, prefill
from mot_jax.translate import align as alignment_lib
from mot_jax.translate.translator import _translate_jit, source_prefill

BASELINES = ("no_context", "native", "text_relay")
INSTRUCTIONS = {
    "extractive": "Read the passage and answer the question briefly. Use a short phrase from the passage when "
    "possible.",
    "closed": "Read the passage and answer the question with one of the options only.",
}
SUMMARY_REQUEST = "Summarize this passage in a few sentences, keeping every name, place and number."
BUCKET, SUFFIX_BUCKET = 64, 16  # padded lengths: jitted code compiles once per bucket, not once per batch


# ---------------------------------------------------------------------------------------------------- prompts


def instruction(example: dict, closed: bool) -> str:
    extra = example.get("instruction")
    return INSTRUCTIONS["closed" if closed else "extractive"] + (f" {extra}" if extra else "")


def prefix_text(example: dict, closed: bool, passage: str | None = None) -> str:
    """What a method hands over: the instruction and the passage (`passage` replaces the context: a summary)."""
    return f"{instruction(example, closed)}\nPassage: {example['context'] if passage is None else passage}"


def suffix_text(example: dict, question: str | None = None, options: bool = True) -> str:
    """What the target reads after the handed-over prefix; closed-set questions list their options for a generated
    answer, not when each option's likelihood is scored (small models then mostly copy the first listed one)."""
    text = f"\nQuestion: {question or example['question']}"
    if "choices" in example and options:
        text += f"\nOptions: {' / '.join(example['choices'])}"
    return text + "\nAnswer:"


def summary_request(tokenizer, passage: str) -> tuple[str, bool]:
    """The text relay's request to the source: (text, add special tokens). Chat models that use ChatML
    (SmolLM2, Qwen) get their chat format, which makes a 135M model summarise far better than a plain prompt."""
    if alignment_lib.adapter(tokenizer).backend.token_to_id("<|im_start|>") is not None:
        turn = f"<|im_start|>user\n{SUMMARY_REQUEST}\n\n{passage}<|im_end|>\n<|im_start|>assistant\n"
        return turn, False
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


# ---------------------------------------------------------------------------------------------------- jitted


@jit(static_argnames=("max_new_tokens", "eos_ids"))
def answer(target, cache, suffix_ids, suffix_mask, *, max_new_tokens, eos_ids=None):
    """Greedy answers [B, max_new_tokens] of the target reading the suffix after a context cache."""
    hidden, cache = target.hidden_states(suffix_ids, suffix_mask, cache=cache)
    logits = target.unembed(hidden[jnp.arange(hidden.shape[0]), last_valid_index(suffix_mask)])
    return greedy_continue(target, logits, cache, max_new_tokens, eos_ids)


@jit
def choice_logprob(target, cache, suffix_ids, suffix_mask, choice_ids, choice_mask):
    """Mean log-probability per token [B] of each row's choice tokens read after the context cache and the suffix."""
    ids, mask = jnp.concatenate([suffix_ids, choice_ids], 1), jnp.concatenate([suffix_mask, choice_mask], 1)
    hidden, _ = target.hidden_states(ids, mask, cache=cache)
    first = hidden[jnp.arange(ids.shape[0]), last_valid_index(suffix_mask)]  # predicts the first choice token
    predictors = jnp.concatenate([first[:, None], hidden[:, suffix_ids.shape[1] : -1]], 1)
    logp = jax.nn.log_softmax(target.unembed(predictors).astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, choice_ids[..., None], axis=-1)[..., 0] * choice_mask
    return picked.sum(1) / jnp.maximum(choice_mask.sum(1), 1)


# ---------------------------------------------------------------------------------------------------- methods


@dataclasses.dataclass
class Contexts:
    """One batch of contexts as the methods need them."""

    examples: list[dict]
    closed: bool
    ids: np.ndarray  # [B, T] target ids of the prefix (BOS, instruction, passage), right-padded, within budget
    mask: np.ndarray
    passages: list[str]  # the passage text each row's prefix holds (after truncation to the budget)
    donors: Contexts | None = None  # row by row, another example's contexts (with another passage): ShuffledSource

    @property
    def length(self) -> int:
        return self.ids.shape[1]


class Stopwatch:
    """Seconds per stage; each stage ends when its device work is done."""

    def __init__(self):
        self.stages, self._start = {}, time.perf_counter()

    def lap(self, stage: str, result):
        jax.block_until_ready(result)
        now = time.perf_counter()
        self.stages[stage] = self.stages.get(stage, 0.0) + now - self._start
        self._start = now
        return result


def kv_bytes(model, tokens, layers=None) -> int:
    """Bytes of a model's K and V for `tokens` tokens over `layers` layers (default all), in its cache dtype."""
    c = model.config
    layers = c.num_layers if layers is None else layers
    return int(2 * layers * tokens * c.num_kv_heads * c.head_dim * jnp.dtype(model.param_dtype).itemsize)


def held_bytes(model, cache) -> int:
    """Bytes of the K/V a cache holds for its first row's valid tokens."""
    return kv_bytes(model, int(np.asarray(cache.valid[0]).sum()))


class Method:
    """A way for the target to get a context: `build(contexts, capacity, watch)` returns (target cache, the bytes
    handed over per row)."""

    name: str
    source_stage: str | None = None  # the stage that is the source's own prefill (excluded from TTFT)

    def build(self, models, contexts: Contexts, capacity: int, watch: Stopwatch):
        raise NotImplementedError


class NoContext(Method):
    name = "no_context"

    def build(self, models, contexts, capacity, watch):
        texts = [instruction(e, contexts.closed) for e in contexts.examples]
        ids, mask = padded(token_ids(models.target_tokenizer, texts, True), SUFFIX_BUCKET)
        cache = watch.lap("prefill", prefill(models.target, ids, mask, capacity=capacity)[1])
        return cache, np.zeros(len(texts), np.int64)


class Native(Method):
    name = "native"

    def build(self, models, contexts, capacity, watch):
        cache = watch.lap("prefill", prefill(models.target, contexts.ids, contexts.mask, capacity=capacity)[1])
        return cache, np.array([len(p.encode()) for p in contexts.passages])


class TextRelay(Method):
    name = "text_relay"

    def __init__(self, tokens: int):
        self.tokens = tokens

    def build(self, models, contexts, capacity, watch):
        requests = [summary_request(models.source_tokenizer, p) for p in contexts.passages]
        rows = [token_ids(models.source_tokenizer, [text], specials)[0] for text, specials in requests]
        ids, mask = padded(rows, BUCKET)
        eos = models.source.config.eos_ids
        out = watch.lap("source_summary", generate(models.source, ids, mask, max_new_tokens=self.tokens))
        summaries = [" ".join(s.split()) for s in decode_answers(models.source_tokenizer, out, eos)]
        texts = [prefix_text(e, contexts.closed, s) for e, s in zip(contexts.examples, summaries)]
        ids, mask = padded(token_ids(models.target_tokenizer, texts, True), BUCKET)
        room = capacity - contexts.length  # the slots the suffix and the answer need
        cache = watch.lap("prefill", prefill(models.target, ids, mask, capacity=ids.shape[1] + room)[1])
        return cache, np.array([len(s.encode()) for s in summaries])


class Translated(Method):
    """A trained translator from a training workdir: the source reads the passage, the target gets its cache."""

    source_stage = "source_prefill"

    def __init__(self, name: str, translator, workdir: str, step: int):
        self.name, self.translator, self.workdir, self.step = name, translator, workdir, step
        self.load = {}  # "key" / "value" -> tokens routed to each expert, summed over the evaluation

    def read_source(self, models, contexts, watch):
        """The source's side of a batch: (source cache, its attention top-k, alignment onto the contexts' target
        grid, source mask), the source having read the contexts' text."""
        source_ids, source_mask, alignment = alignment_lib.align_batch(
            models.target_tokenizer, models.source_tokenizer, contexts.ids, contexts.mask
        )
        longest = int(source_mask.sum(1).max())
        if longest > models.source.config.max_positions:
            raise MotJaxError(
                f"A context re-encodes to {longest} source tokens, more than the source model's "
                f"{models.source.config.max_positions}; lower the context budget (--config.budgets) or shorten it."
            )
        bucket = -(-source_ids.shape[1] // BUCKET) * BUCKET
        source_ids, source_mask, alignment = alignment_lib.pad_source(source_ids, source_mask, alignment, bucket)
        topk = self.translator.spec.attention_topk
        source_cache, source_topk = watch.lap(
            "source_prefill", source_prefill(models.source, source_ids, source_mask, topk=topk)
        )
        return source_cache, source_topk, alignment, source_mask

    def translate(self, models, contexts, read, capacity, watch):
        """(target cache, aux) of the translator writing the contexts' target grid from `read` (`read_source`)."""
        source_cache, source_topk, alignment, _ = read
        return watch.lap(
            "translation",
            _translate_jit(self.translator, models.source, models.target, source_cache, alignment, contexts.ids,
                           contexts.mask, source_topk, capacity=capacity),
        )  # fmt: skip

    def handed(self, models, source_mask) -> np.ndarray:
        layers = len(set(self.translator.spec.source_layers))  # the source layers the translator reads
        return np.array([kv_bytes(models.source, int(n), layers) for n in np.asarray(source_mask).sum(1)])

    def build(self, models, contexts, capacity, watch):
        read = self.read_source(models, contexts, watch)
        cache, aux = self.translate(models, contexts, read, capacity, watch)
        for part in ("key", "value"):
            if "stats" in aux.get(part, {}):
                self.load[part] = self.load.get(part, 0) + np.asarray(aux[part]["stats"]["load"], np.float64)
        return cache, self.handed(models, read[3])


class ShuffledSource(Method):
    """The control beside a translated method: each example's cache translated from another example's source cache.

    Row b's donor is the next example (cyclically, over all the task's examples, so a batch of one row has one too)
    whose context differs from row b's (datasets such as SQuAD ask several questions about one passage). The source
    reads the donor's prefix, and the donor's alignment is carried onto row b's own target grid by position:
    row b's i-th of n valid tokens takes the donor's floor(i * m / n)-th of m (the identity when n = m), and each
    donor source token goes to the first of row b's tokens that took its donor token or a later one. The translator
    then writes row b's grid (its positions, its mask) from the donor's source K/V. What it reads of row b is the
    number and positions of its tokens and its first token, whose K/V are the target's own (a BOS or the
    instruction's first token, the same for every example): never row b's passage. The target prompt (row b's
    question) is row b's. A replay translator's target still reads row b's text itself, as the method does, so
    there the row tells whether the translated window adds anything to that reading.
    """

    source_stage = "source_prefill"

    def __init__(self, method: Translated):
        self.method, self.name = method, f"{method.name}, shuffled source"

    def build(self, models, contexts, capacity, watch):
        if contexts.donors is None:
            raise MotJaxError(f"{self.name} needs another example's context per row; build batches with donors.")
        read = self.method.read_source(models, contexts.donors, watch)
        source_cache, source_topk, alignment, source_mask = read
        alignment = regrid(alignment, contexts.donors.mask, contexts.mask, source_mask)
        cache, _ = self.method.translate(models, contexts, (source_cache, source_topk, alignment, source_mask),
                                         capacity, watch)  # fmt: skip
        return cache, self.method.handed(models, source_mask)


def regrid(alignment, donor_mask, mask, source_mask) -> alignment_lib.Alignment:
    """An alignment of source rows onto a donor's target grid (`donor_mask` [B, Td]) carried onto another target
    grid (`mask` [B, T]) by position, as `ShuffledSource` describes: weights [B, T, S]."""
    batch, length = np.shape(mask)
    width = alignment.weights.shape[2]
    weights = np.zeros((batch, length, width), np.float32)
    to_source, to_target = np.zeros((batch, length), np.int32), np.zeros((batch, width), np.int32)
    for b in range(batch):
        mine, theirs = np.flatnonzero(mask[b]), np.flatnonzero(donor_mask[b])
        n, m = len(mine), len(theirs)
        pick = theirs[np.arange(n) * m // n]  # the donor token each of my tokens takes
        weights[b, mine] = alignment.weights[b, pick]
        to_source[b, mine] = alignment.target_to_source[b, pick]
        rank = np.searchsorted(theirs, alignment.source_to_target[b])  # each source token's donor token, 0..m-1
        first_taker = np.minimum(-(-rank * n // m), n - 1)
        to_target[b] = np.where(np.asarray(source_mask[b], bool), mine[first_taker], 0)
    return alignment_lib.Alignment(weights, to_source, to_target)


def method_name(config) -> str:
    """How a trained method is named in reports, from its training config."""
    t = config.translator
    if t.get("kind", "mot") == "projector":
        return f"C2C-Project ({t.mode})"
    return f"single translator ({t.mode})" if t.num_experts == 1 else f"MoT {t.mode}"


# ---------------------------------------------------------------------------------------------------- tasks


@dataclasses.dataclass
class Settings:
    batch_size: int = 4
    max_new_tokens: int = 32
    budget: int | None = None  # at most this many target tokens of prefix (None: what the model's limit leaves)


def is_closed(examples) -> bool:
    return "choices" in examples[0]


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


def donor_indices(examples) -> list[int]:
    """Per example, the next example (cyclically) whose context differs from its own: `ShuffledSource`'s donor."""
    count = len(examples)
    donors = []
    for i, example in enumerate(examples):
        others = [j % count for j in range(i + 1, i + count) if examples[j % count]["context"] != example["context"]]
        if not others:
            raise MotJaxError(
                f"The shuffled-source control needs examples with at least two different contexts; these {count} "
                "have one. Pass more examples (--config.examples) or turn it off (--config.shuffled_source=false)."
            )
        donors.append(others[0])
    return donors


def wants_donors(methods) -> bool:
    return any(isinstance(m, ShuffledSource) for m in methods)


def batches(models, examples, settings: Settings, questions=None, donors: bool = False):
    """(Contexts, suffix ids, suffix mask) per batch; `questions` replaces each example's question (multi-agent);
    `donors` attaches each row's donor contexts (`donor_indices`) for `ShuffledSource`."""
    donor = donor_indices(examples) if donors else None
    closed = is_closed(examples)
    prefixes = token_ids(models.target_tokenizer, [prefix_text(e, closed) for e in examples], True)
    suffixes = token_ids(
        models.target_tokenizer,
        [suffix_text(e, None if questions is None else questions[i]) for i, e in enumerate(examples)],
        False,
    )
    budgets = prefix_budgets(models, prefixes, suffixes, settings)
    prefixes = [p[:b] for p, b in zip(prefixes, budgets)]
    # the passage a truncated prefix still holds: its text minus the instruction header
    texts = alignment_lib.adapter(models.target_tokenizer).backend.decode_batch(prefixes, skip_special_tokens=True)
    passages = [t.split("\nPassage: ", 1)[1] if "\nPassage: " in t else "" for t in texts]
    for start in range(0, len(examples), settings.batch_size):
        rows = slice(start, start + settings.batch_size)
        ids, mask = padded(prefixes[rows], BUCKET)
        contexts = Contexts(examples[rows], closed, ids, mask, passages[rows])
        if donor:
            picked = donor[rows]
            contexts.donors = Contexts([examples[j] for j in picked], closed, *padded([prefixes[j] for j in picked],
                                       BUCKET), [passages[j] for j in picked])  # fmt: skip
        yield contexts, *padded(suffixes[rows], SUFFIX_BUCKET)


def capacity_for(contexts: Contexts, suffix_ids, extra: int) -> int:
    return contexts.length + suffix_ids.shape[1] + extra


@dataclasses.dataclass
class Options:
    """A closed-set batch's likelihood inputs: the question without the options, and each option's tokens."""

    suffix: tuple  # (ids, mask) [B, Lp]
    choices: list  # per option index c: (ids [B, Lc], mask, has [B] bool: the row has an option c)

    @classmethod
    def of(cls, tokenizer, examples):
        plain = padded(token_ids(tokenizer, [suffix_text(e, options=False) for e in examples], False), SUFFIX_BUCKET)
        choices = []
        for c in range(max(len(e["choices"]) for e in examples)):
            has = np.array([c < len(e["choices"]) for e in examples])
            texts = [" " + e["choices"][c] if ok else " " for e, ok in zip(examples, has)]
            choices.append((*padded(token_ids(tokenizer, texts, False), 8), has))
        return cls(plain, choices)

    @property
    def length(self) -> int:
        """Cache slots the scoring appends after the context."""
        return self.suffix[0].shape[1] + max(ids.shape[1] for ids, _, _ in self.choices)

    def scores(self, target, cache) -> np.ndarray:
        """[B, C] mean log-probability per token of each option (-inf where a row has fewer options)."""
        out = np.full((len(self.choices[0][2]), len(self.choices)), -np.inf)
        for c, (ids, mask, has) in enumerate(self.choices):
            out[has, c] = np.asarray(choice_logprob(target, cache, *self.suffix, ids, mask))[has]
        return out


def evaluate_examples(models, methods, examples, settings: Settings, progress=None) -> dict:
    """Scores of every method on the examples (extractive or closed-set): {method: {metric: value}, ...} plus
    per-example predictions under "predictions". `progress(done, total)` is called after each batch."""
    closed = is_closed(examples)
    eos = tuple(models.target.config.eos_ids)
    rows = {m.name: dict(predictions=[], timed=[], handed=[]) for m in methods}
    for contexts, suffix_ids, suffix_mask in batches(models, examples, settings, donors=wants_donors(methods)):
        options = Options.of(models.target_tokenizer, contexts.examples) if closed else None
        capacity = contexts.length + max(suffix_ids.shape[1] + settings.max_new_tokens, options.length if closed else 0)
        for method in methods:
            watch = Stopwatch()
            cache, handed = method.build(models, contexts, capacity, watch)
            out = watch.lap("answer", answer(models.target, cache, suffix_ids, suffix_mask,
                                             max_new_tokens=settings.max_new_tokens, eos_ids=eos))  # fmt: skip
            texts = decode_answers(models.target_tokenizer, out, eos)
            scores = options.scores(models.target, cache) if closed else None
            row = rows[method.name]
            row["timed"].append((len(texts), sum(watch.stages.values())))
            row["handed"] += handed.tolist()
            for b, (example, text) in enumerate(zip(contexts.examples, texts)):
                prediction = dict(question=example["question"], gold=gold_answers(example), generation=text,
                                  answer=metrics.first_line(text))  # fmt: skip
                if closed:
                    chosen = metrics.match_choice(text, example["choices"])
                    prediction["choice"] = None if chosen is None else example["choices"][chosen]
                    prediction["likelihood_choice"] = example["choices"][int(np.argmax(scores[b]))]
                row["predictions"].append(prediction)
        if progress:
            progress(len(rows[methods[0].name]["predictions"]), len(examples))
    return {name: summarize(row, examples, closed) for name, row in rows.items()}


def gold_answers(example: dict) -> list[str]:
    """The answers that score: every acceptable one (closed-set: MMLU-Redux may accept several choices)."""
    return example["answers"] if "answers" in example else [example["answer"]]


def summarize(row, examples, closed: bool) -> dict:
    predictions = row["predictions"]
    if closed:
        gold = [gold_answers(e) for e in examples]
        out = dict(
            accuracy=float(np.mean([p["choice"] in g for p, g in zip(predictions, gold)])),
            likelihood_accuracy=float(np.mean([p["likelihood_choice"] in g for p, g in zip(predictions, gold)])),
            unparsed=float(np.mean([p["choice"] is None for p in predictions])),
        )
    else:
        out = dict(
            f1=float(np.mean([metrics.f1(p["answer"], e["answers"]) for p, e in zip(predictions, examples)])),
            exact_match=float(
                np.mean([metrics.exact_match(p["answer"], e["answers"]) for p, e in zip(predictions, examples)])
            ),
        )
    steady = row["timed"][1:] or row["timed"]  # the first batch compiles
    out["examples_per_s"] = sum(n for n, _ in steady) / max(sum(s for _, s in steady), 1e-9)
    out["handed_bytes"] = float(np.mean(row["handed"]))
    out["predictions"] = predictions
    return out


def add_retention(results: dict, metric: str, key: str = "retention") -> dict:
    """Each method's `metric` as a percentage of the native method's, under `key` (None where native scores 0)."""
    native = results.get("native", {}).get(metric)
    for scores in results.values():
        scores[key] = 100 * scores[metric] / native if native else None
    return results


# ---------------------------------------------------------------------------------------------------- multi-agent


def evaluate_agents(models, methods, documents, settings: Settings, progress=None) -> dict:
    """Agents on the target model each ask their own question about a shared document.

    With `native` every agent reads the text itself (one prefill per agent); with a translated method one reader
    (the source model) reads it and its cache, translated once, is shared by every agent, each appending only its
    question. Reports answer F1 and per-document context cost: prefill/translation seconds (batch 1, median) and
    the target KV bytes the agents hold for the document.
    """
    agents = min(len(d["questions"]) for d in documents)
    examples = [dict(context=d["context"], question=d["questions"][0]) for d in documents]
    eos = tuple(models.target.config.eos_ids)
    scores, predictions = {m.name: [] for m in methods}, {m.name: [] for m in methods}
    per_agent = [[d["questions"][k] for d in documents] for k in range(agents)]
    donors = wants_donors(methods)
    suffix_batches = [list(batches(models, examples, settings, questions, donors)) for questions in per_agent]
    for index, (contexts, _, _) in enumerate(suffix_batches[0]):
        suffixes = [agent_batches[index][1:] for agent_batches in suffix_batches]
        capacity = contexts.length + max(s[0].shape[1] for s in suffixes) + settings.max_new_tokens
        for method in methods:
            cache, _ = method.build(models, contexts, capacity, Stopwatch())
            for k, (suffix_ids, suffix_mask) in enumerate(suffixes):  # every agent reuses the one cache
                out = answer(models.target, cache, suffix_ids, suffix_mask, max_new_tokens=settings.max_new_tokens,
                             eos_ids=eos)  # fmt: skip
                docs = documents[index * settings.batch_size :][: len(contexts.examples)]
                texts = decode_answers(models.target_tokenizer, out, eos)
                for b, (text, doc) in enumerate(zip(texts, docs)):
                    answer_text = metrics.first_line(text)
                    scores[method.name].append(metrics.f1(answer_text, doc["answers"][k]))
                    predictions[method.name].append(dict(
                        index=index * settings.batch_size + b, agent=k, question=doc["questions"][k],
                        gold=doc["answers"][k], generation=text, answer=answer_text,
                    ))  # fmt: skip
        if progress:
            progress(min((index + 1) * settings.batch_size, len(documents)), len(documents))
    results = {name: dict(f1=float(np.mean(values)), agents=agents) for name, values in scores.items()}
    first = next(iter(batches(models, examples, dataclasses.replace(settings, batch_size=1), donors=donors)))
    for method in methods:
        shared = isinstance(method, Translated | TextRelay | ShuffledSource)  # built once from the reader's work
        copies = 1 if shared else agents
        once = own = None  # a control's seconds are its method's
        if not isinstance(method, ShuffledSource):
            stages = timed(models, method, first[0], first[1], first[2], settings, runs=3)
            own = stages.pop(method.source_stage, 0.0) if method.source_stage else 0.0
            stages.pop("answer", None)
            once = copies * sum(stages.values())
        cache, _ = method.build(models, first[0], capacity_for(first[0], first[1], 1), Stopwatch())
        results[method.name] |= dict(
            context_seconds=once,
            reader_prefill_seconds=own,
            target_kv_bytes=copies * held_bytes(models.target, cache),
            shares_one_cache=shared,
            predictions=sorted(predictions[method.name], key=lambda p: (p["index"], p["agent"])),
        )
    return add_retention(results, "f1")


# ---------------------------------------------------------------------------------------------------- latency


def timed(models, method, contexts, suffix_ids, suffix_mask, settings: Settings, runs: int) -> dict:
    """Median seconds per stage of building the cache and reading the suffix to the first token (batch 1), after
    one warm-up run that compiles."""
    capacity = capacity_for(contexts, suffix_ids, settings.max_new_tokens)
    samples = []
    for _ in range(runs + 1):
        watch = Stopwatch()
        cache, _ = method.build(models, contexts, capacity, watch)
        watch.lap("answer", answer(models.target, cache, suffix_ids, suffix_mask, max_new_tokens=1))
        samples.append(watch.stages)
    return {stage: statistics.median(s[stage] for s in samples[1:]) for stage in samples[0]}


def planned_bytes(models, method, contexts, suffix_ids, suffix_mask, settings: Settings) -> int | None:
    """XLA's memory plan (arguments + temporaries + outputs - aliased) of the largest program a method runs to its
    first token; arguments include the weights it reads, so this is its peak device memory."""
    capacity = capacity_for(contexts, suffix_ids, settings.max_new_tokens)
    programs = []
    if isinstance(method, Translated):
        spec = method.translator.spec
        source_ids, source_mask, alignment = alignment_lib.align_batch(
            models.target_tokenizer, models.source_tokenizer, contexts.ids, contexts.mask
        )
        topk = spec.attention_topk
        source_cache, source_topk = source_prefill(models.source, source_ids, source_mask, topk=topk)
        programs.append(source_prefill.lower(models.source, source_ids, source_mask, topk=topk))
        programs.append(_translate_jit.lower(method.translator, models.source, models.target, source_cache, alignment,
                                             contexts.ids, contexts.mask, source_topk, capacity=capacity))  # fmt: skip
    elif isinstance(method, Native):
        programs.append(prefill.lower(models.target, contexts.ids, contexts.mask, capacity=capacity))
    else:
        return None
    cache, _ = method.build(models, contexts, capacity, Stopwatch())
    programs.append(answer.lower(models.target, cache, suffix_ids, suffix_mask, max_new_tokens=1))
    plans = [p.compile().memory_analysis() for p in programs]
    return max(
        m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes for m in plans
    )


def latency(models, methods, example: dict, lengths, settings: Settings, runs: int, memory: bool = True) -> list:
    """TTFT per method and context length (batch 1): building the cache + the suffix + the first token, without
    and with the source's own prefill, the bytes handed over, the target cache and (at the longest length) XLA's
    memory plan. The context is `example`'s, truncated to each length in target tokens."""
    rows = []
    for i, length in enumerate(sorted(lengths)):
        single = dataclasses.replace(settings, batch_size=1, budget=length)
        contexts, suffix_ids, suffix_mask = next(batches(models, [example], single))
        keep = int(contexts.mask.sum())
        contexts.ids, contexts.mask = contexts.ids[:, :keep], contexts.mask[:, :keep]  # exact length, no bucket
        for method in methods:
            if method.name == "no_context" or isinstance(method, ShuffledSource):  # its TTFT is its method's
                continue
            stages = timed(models, method, contexts, suffix_ids, suffix_mask, settings, runs)
            cache, handed = method.build(models, contexts, capacity_for(contexts, suffix_ids, 1), Stopwatch())
            own = stages.get(method.source_stage, 0.0) if method.source_stage else 0.0
            last = i == len(lengths) - 1
            rows.append(dict(
                method=method.name,
                context_tokens=keep,
                ttft_s=sum(stages.values()) - own,
                ttft_with_source_s=sum(stages.values()),
                stages=stages,
                handed_bytes=int(handed[0]),
                target_kv_bytes=held_bytes(models.target, cache),
                planned_bytes=planned_bytes(models, method, contexts, suffix_ids, suffix_mask, settings)
                if memory and last else None,
            ))  # fmt: skip
    return rows
