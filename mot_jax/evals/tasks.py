"""The tasks: every method on the same examples, scored. `evaluate_examples` for extractive and closed-set
questions (long_context is extractive at a context budget), `evaluate_agents` for agents sharing one document."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from mot_jax.evals import humaneval, metrics
from mot_jax.evals.kvcomm import KVComm
from mot_jax.evals.latency import timed
from mot_jax.evals.methods import (
    BASELINES,
    RECOMPUTING,
    SHUFFLED,
    SOURCE_ALONE,
    ShuffledSource,
    Stopwatch,
    TextRelay,
    Translated,
    held_bytes,
    wants_donors,
)
from mot_jax.evals.prompts import (
    SUFFIX_BUCKET,
    Settings,
    answer_and_logprob,
    batches,
    capacity_for,
    choice_logprob,
    decode_answers,
    is_closed,
    is_code,
    line_flags,
    padded,
    suffix_text,
    token_ids,
)
from mot_jax.models.cache import stack_rows
from mot_jax.models.generation import generate_from_cache


@dataclasses.dataclass
class Options:
    """A closed-set batch's likelihood inputs: the question without the options, and each option's tokens."""

    suffix: tuple  # (ids, mask) [B, Lp]
    choices: list  # per option index c: (ids [B, Lc], mask, has [B] bool: the row has an option c)

    @classmethod
    def of(cls, tokenizer, examples, chat=None):
        plain = [suffix_text(e, options=False, chat=chat) for e in examples]
        plain = padded(token_ids(tokenizer, plain, False), SUFFIX_BUCKET)
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


def evaluate_examples(models, methods, examples, settings: Settings, progress=None, record=None) -> dict:
    """Scores of every method on the examples (extractive or closed-set): {method: {metric: value}, ...} plus
    per-example predictions under "predictions". `progress(done, total)` counts answers (a method's on one example)
    after each batch of every method, so a slow batch of many methods still shows; `record(method name, first example
    index, predictions)` takes each batch's predictions (partial results). Methods that answer with another model
    (`SourceAlone`: the pair swapped; a translator that changes how the target reads: `KVTranslator.receiver`) answer in
    their own batches, batch by batch beside the others: a stopped run's partial results hold every row on the same
    examples."""
    passes = {}  # the methods that answer with one model (`Method.answerer`) answer in one batch
    for method in methods:
        passes.setdefault(method.answerer, []).append(method)
    rows, streams = {}, []
    for group in passes.values():
        reader, reader_settings = group[0].reader(models, settings)
        streams.append(answer_batches(reader, group, examples, reader_settings, rows, record))
    for _ in itertools.zip_longest(*streams):  # the passes batch the examples alike: one batch of each at a time
        if progress:
            progress(sum(len(r["predictions"]) for r in rows.values()), len(examples) * len(methods))
    closed = is_closed(examples)
    return {m.name: summarize(rows[m.name], examples, closed) for m in methods}


def answer_examples(models, methods, examples, settings: Settings) -> dict:
    """Every method's raw rows (predictions, timings, bytes handed over) on the examples, answered by
    `models.target` (`answer_batches` run to the end)."""
    rows = {}
    for _ in answer_batches(models, methods, examples, settings, rows):
        pass
    return rows


def answer_batches(models, methods, examples, settings: Settings, rows: dict, record=None):
    """Answer the examples batch by batch, yielding after each; every method's raw rows (predictions, timings, bytes
    handed over) go into `rows` (by method name) as they come. Open-answer predictions carry the gold answer's mean
    log-probability per token (`logprob`). Each batch's caches, one per method, read the question and decode as one
    batch (`stack_rows`): decoding a step costs about the same for many rows as for few, and each method is timed for
    its own cache and a share of that answer stage."""
    closed, code = is_closed(examples), is_code(examples[0])
    eos = tuple(models.target.config.eos_ids)
    # answers end at their first line's end; code runs on to its end token or max_new_tokens, cut afterwards
    lines = None if code else line_flags(models.target_tokenizer, models.target.config.vocab_size)
    rows |= {m.name: dict(predictions=[], timed=[], handed=[]) for m in methods}
    for contexts, suffix_ids, suffix_mask in batches(models, examples, settings, donors=wants_donors(methods)):
        tokenizer = models.target_tokenizer
        options = Options.of(tokenizer, contexts.examples, contexts.chat) if closed else None
        gold = None if closed else gold_tokens(tokenizer, contexts.examples, contexts.chat)
        scored = options.length if closed else suffix_ids.shape[1] + gold[0].shape[1]
        capacity = contexts.length + max(suffix_ids.shape[1] + settings.max_new_tokens, scored)
        start, size = len(rows[methods[0].name]["predictions"]), len(contexts.examples)
        built = []
        for method in methods:
            watch = Stopwatch()
            built.append((method, watch, *method.build(models, contexts, capacity, watch)))
        together = stack_rows([cache for _, _, cache, _ in built])
        answering = Stopwatch()
        questions = tiled(len(built), suffix_ids, suffix_mask)
        if closed:
            out = generate_from_cache(
                models.target, together, *questions, max_new_tokens=settings.max_new_tokens, eos_ids=eos, lines=lines
            )
        else:
            out, logprobs = answer_and_logprob(
                models.target,
                together,
                *questions,
                *tiled(len(built), *gold),
                max_new_tokens=settings.max_new_tokens,
                eos_ids=eos,
                lines=lines,
            )
            logprobs = np.asarray(logprobs)
        answering.lap("answer", out)
        for m, (method, watch, cache, handed) in enumerate(built):
            mine = slice(m * size, (m + 1) * size)
            texts = decode_answers(tokenizer, out[mine], eos)
            scores = options.scores(models.target, cache) if closed else None
            row = rows[method.name]
            row["timed"].append((size, sum(watch.stages.values()) + answering.stages["answer"] / len(built)))
            row["handed"] += handed.tolist()
            batch = []
            for b, (example, text) in enumerate(zip(contexts.examples, texts)):
                prediction = dict(
                    question=example["question"],
                    gold=gold_answers(example),
                    generation=text,
                    answer=metrics.first_line(text),
                )
                if closed:
                    chosen = metrics.match_choice(text, example["choices"])
                    prediction["choice"] = None if chosen is None else example["choices"][chosen]
                    prediction["likelihood_choice"] = example["choices"][int(np.argmax(scores[b]))]
                else:
                    prediction["logprob"] = float(logprobs[mine][b])
                    if code:  # the completion and its check, once
                        humaneval.score(prediction, example, settings.check_timeout)
                    else:
                        score(prediction, example)  # here too: the partial results carry it
                batch.append(prediction)
            row["predictions"] += batch
            if record:
                record(method.name, start, batch)
        yield


def tiled(copies: int, *arrays) -> list:
    """Each [B, ...] array repeated `copies` times along its rows (one copy per stacked cache)."""
    return [np.tile(a, (copies,) + (1,) * (a.ndim - 1)) for a in arrays]


def gold_tokens(tokenizer, examples, chat=None) -> tuple:
    """(ids, mask) [B, La] of each example's first gold answer as the target reads it after the suffix: after
    "Answer:" with a space, at the opening of the assistant's turn without one (code: right after the prompt)."""
    texts = [("" if chat or is_code(e) else " ") + e["answers"][0] for e in examples]
    return padded(token_ids(tokenizer, texts, False), 8)


def gold_answers(example: dict) -> list[str]:
    """The answers that score: every acceptable one (closed-set: MMLU-Redux may accept several choices)."""
    return example["answers"] if "answers" in example else [example["answer"]]


def standard_error(values) -> float | None:
    """Of the mean, over examples (None for one or none)."""
    return float(np.std(values, ddof=1) / np.sqrt(len(values))) if len(values) > 1 else None


def score(prediction: dict, example: dict) -> None:
    """An open answer's F1 and exact match against the example's gold answers, into the prediction."""
    prediction["f1"] = metrics.f1(prediction["answer"], example["answers"])
    prediction["exact_match"] = metrics.exact_match(prediction["answer"], example["answers"])


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
        out = {}
        for prediction, example in zip(predictions, examples):
            if not is_code(example):  # code was scored as it was answered (its check runs the program)
                score(prediction, example)
        for metric in OPEN_METRICS:  # those the predictions carry (code: pass@1 and log-prob; else the others)
            values = [p[metric] for p in predictions if metric in p]
            if values:
                out[metric], out[f"{metric}_se"] = float(np.mean(values)), standard_error(values)
    steady = row["timed"][1:] or row["timed"]  # the first batch compiles
    out["examples_per_s"] = sum(n for n, _ in steady) / max(sum(s for _, s in steady), 1e-9)
    out["handed_bytes"] = float(np.mean(row["handed"]))
    out["predictions"] = predictions
    return out


# per open-answer prediction; logprob: the gold answer's, per token; pass_at_1: a code completion's tests passed
OPEN_METRICS = ("f1", "exact_match", "logprob", "pass_at_1")
NATIVE_CORRECT = "f1_native_correct"  # F1 over the examples native answers exactly and no context does not
TWO_SE = 2  # a paired difference "exceeds" its noise beyond this many standard errors


def paired(values, controls) -> dict:
    """The mean of per-example differences `values - controls` (the same examples, in order), its standard error
    and, in words, whether it exceeds 2 s.e.: pairing takes out the noise of the examples both rows share."""
    diffs = np.subtract(values, controls, dtype=np.float64)
    mean, se = float(diffs.mean()), standard_error(diffs)
    if se is None:
        words = "one example"
    else:
        words = "level" if abs(mean) <= TWO_SE * se else ("above" if mean > 0 else "below")
    return dict(diff=mean, se=se, examples=len(diffs), verdict=words)


def controls_of(name: str, results: dict) -> list[str]:
    """The rows a translated method is paired against, those present: no context, native, the source alone, its
    shuffled source and its source-free variant (named as `method_name` names it); a recomputing row also against its
    translator without recomputation."""
    without = name.split(RECOMPUTING)[0]
    wanted = ("no_context", "native", SOURCE_ALONE, f"{name}{SHUFFLED}", f"source-free {name}", without)
    return [c for c in wanted if c in results and c != name]


def add_paired_controls(results: dict) -> dict:
    """Each translated method's paired differences against its controls (`controls_of`), per metric the
    predictions carry (F1, exact match, gold log-probability; F1 alone for multi-agent; pass@1 and gold
    log-probability for code), under
    scores["paired"][control][metric] (`paired`). Also every row's F1 on the native-correct subset (the
    examples native answers exactly and no context does not: where the context is needed and used), where both
    rows ran, with its paired differences. The source alone's log-probability counts the source's tokens, so it
    is not paired on that."""
    rows = {name: scores["predictions"] for name, scores in results.items()}
    subset = None
    if "native" in rows and "no_context" in rows and "exact_match" in rows["native"][0]:
        pairs = zip(rows["native"], rows["no_context"], strict=True)
        subset = [i for i, (n, z) in enumerate(pairs) if n.get("exact_match") and not z.get("exact_match")]
        for scores in results.values():
            f1 = [scores["predictions"][i]["f1"] for i in subset]
            scores[NATIVE_CORRECT] = float(np.mean(f1)) if f1 else None
            scores[f"{NATIVE_CORRECT}_examples"] = len(subset)
    for name, scores in results.items():
        if not is_translated(name):
            continue
        scores["paired"] = {}
        for control in controls_of(name, results):
            mine, theirs = rows[name], rows[control]
            out = {
                metric: paired([p[metric] for p in mine], [q[metric] for q in theirs])
                for metric in OPEN_METRICS
                if metric in mine[0] and metric in theirs[0] and not (metric == "logprob" and control == SOURCE_ALONE)
            }
            if subset:
                out[NATIVE_CORRECT] = paired([mine[i]["f1"] for i in subset], [theirs[i]["f1"] for i in subset])
            scores["paired"][control] = out
    return results


def is_translated(name: str) -> bool:
    """A row of a trained translator or a band diagnostic (not a baseline, the source alone or a shuffled-source
    control)."""
    return name not in (*BASELINES, SOURCE_ALONE) and not name.endswith(SHUFFLED)


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

    def longest(document):  # every agent reads the one context, cut to leave room for the longest question
        tokens = lambda q: token_ids(models.target_tokenizer, [suffix_text(document, q, chat=settings.chat)], False)
        return max(document["questions"][:agents], key=lambda q: len(tokens(q)[0]))

    examples = [dict(context=d["context"], question=longest(d)) for d in documents]
    eos = tuple(models.target.config.eos_ids)
    lines = line_flags(models.target_tokenizer, models.target.config.vocab_size)
    scores, predictions = {m.name: [] for m in methods}, {m.name: [] for m in methods}
    per_agent = [[d["questions"][k] for d in documents] for k in range(agents)]
    donors = wants_donors(methods)
    suffix_batches = [list(batches(models, examples, settings, questions)) for questions in per_agent]
    for index, (contexts, _, _) in enumerate(batches(models, examples, settings, donors=donors)):
        suffixes = [agent_batches[index][1:] for agent_batches in suffix_batches]
        capacity = contexts.length + max(s[0].shape[1] for s in suffixes) + settings.max_new_tokens
        # every agent reads its question after the same caches, one per method, decoded as one batch
        together = stack_rows([method.build(models, contexts, capacity, Stopwatch())[0] for method in methods])
        docs = documents[index * settings.batch_size :][: len(contexts.examples)]
        for k, (suffix_ids, suffix_mask) in enumerate(suffixes):
            out = generate_from_cache(
                models.target,
                together,
                *tiled(len(methods), suffix_ids, suffix_mask),
                max_new_tokens=settings.max_new_tokens,
                eos_ids=eos,
                lines=lines,
            )
            for m, method in enumerate(methods):
                texts = decode_answers(models.target_tokenizer, out[m * len(docs) : (m + 1) * len(docs)], eos)
                for b, (text, doc) in enumerate(zip(texts, docs)):
                    answer_text = metrics.first_line(text)
                    score = metrics.f1(answer_text, doc["answers"][k])
                    scores[method.name].append(score)
                    predictions[method.name].append(
                        dict(
                            index=index * settings.batch_size + b,
                            agent=k,
                            question=doc["questions"][k],
                            gold=doc["answers"][k],
                            generation=text,
                            answer=answer_text,
                            f1=score,
                        )
                    )
        if progress:
            progress(min((index + 1) * settings.batch_size, len(documents)), len(documents))
    results = {
        name: dict(f1=float(np.mean(values)), f1_se=standard_error(values), agents=agents)
        for name, values in scores.items()
    }
    first = next(iter(batches(models, examples, dataclasses.replace(settings, batch_size=1), donors=donors)))
    for method in methods:
        shared = isinstance(method, Translated | TextRelay | ShuffledSource | KVComm)  # one reader's work
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
    return add_paired_controls(add_retention(results, "f1"))
