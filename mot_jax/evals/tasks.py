"""The tasks: every method on the same examples, scored. `evaluate_examples` for extractive and closed-set
questions (long_context is extractive at a context budget), `evaluate_agents` for agents sharing one document."""

from __future__ import annotations

import dataclasses

import numpy as np

from mot_jax.evals import metrics
from mot_jax.evals.kvcomm import KVComm
from mot_jax.evals.latency import timed
from mot_jax.evals.methods import SHUFFLED, ShuffledSource, Stopwatch, TextRelay, Translated, held_bytes, wants_donors
from mot_jax.evals.prompts import (
    SUFFIX_BUCKET,
    Settings,
    batches,
    capacity_for,
    choice_logprob,
    decode_answers,
    is_closed,
    padded,
    suffix_text,
    token_ids,
)
from mot_jax.models.base import generate_from_cache


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


def evaluate_examples(models, methods, examples, settings: Settings, progress=None) -> dict:
    """Scores of every method on the examples (extractive or closed-set): {method: {metric: value}, ...} plus
    per-example predictions under "predictions". `progress(done, total)` is called after each batch."""
    closed = is_closed(examples)
    eos = tuple(models.target.config.eos_ids)
    rows = {m.name: dict(predictions=[], timed=[], handed=[]) for m in methods}
    for contexts, suffix_ids, suffix_mask in batches(models, examples, settings, donors=wants_donors(methods)):
        options = Options.of(models.target_tokenizer, contexts.examples, contexts.chat) if closed else None
        capacity = contexts.length + max(suffix_ids.shape[1] + settings.max_new_tokens, options.length if closed else 0)
        for method in methods:
            watch = Stopwatch()
            cache, handed = method.build(models, contexts, capacity, watch)
            out = watch.lap(
                "answer",
                generate_from_cache(
                    models.target, cache, suffix_ids, suffix_mask, max_new_tokens=settings.max_new_tokens, eos_ids=eos
                ),
            )
            texts = decode_answers(models.target_tokenizer, out, eos)
            scores = options.scores(models.target, cache) if closed else None
            row = rows[method.name]
            row["timed"].append((len(texts), sum(watch.stages.values())))
            row["handed"] += handed.tolist()
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
                row["predictions"].append(prediction)
        if progress:
            progress(len(rows[methods[0].name]["predictions"]), len(examples))
    return {name: summarize(row, examples, closed) for name, row in rows.items()}


def gold_answers(example: dict) -> list[str]:
    """The answers that score: every acceptable one (closed-set: MMLU-Redux may accept several choices)."""
    return example["answers"] if "answers" in example else [example["answer"]]


def standard_error(values) -> float | None:
    """Of the mean, over examples (None for one)."""
    return float(np.std(values, ddof=1) / np.sqrt(len(values))) if len(values) > 1 else None


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
        f1 = [metrics.f1(p["answer"], e["answers"]) for p, e in zip(predictions, examples)]
        for prediction, score in zip(predictions, f1):
            prediction["f1"] = score
        out = dict(
            f1=float(np.mean(f1)),
            f1_se=standard_error(f1),
            exact_match=float(
                np.mean([metrics.exact_match(p["answer"], e["answers"]) for p, e in zip(predictions, examples)])
            ),
        )
    steady = row["timed"][1:] or row["timed"]  # the first batch compiles
    out["examples_per_s"] = sum(n for n, _ in steady) / max(sum(s for _, s in steady), 1e-9)
    out["handed_bytes"] = float(np.mean(row["handed"]))
    out["predictions"] = predictions
    return out


def add_paired_controls(results: dict) -> dict:
    """Each translated method's F1 minus its shuffled-source control's over the same examples (`vs_shuffled`) and
    that difference's standard error (`vs_shuffled_se`): what the cache carries of *this* example's context beyond
    what any source cache gives, with the noise the two rows share taken out."""
    for name, scores in results.items():
        control = results.get(f"{name}{SHUFFLED}")
        if control:
            diffs = [p["f1"] - q["f1"] for p, q in zip(scores["predictions"], control["predictions"], strict=True)]
            scores["vs_shuffled"], scores["vs_shuffled_se"] = float(np.mean(diffs)), standard_error(diffs)
    return results


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
                out = generate_from_cache(
                    models.target, cache, suffix_ids, suffix_mask, max_new_tokens=settings.max_new_tokens, eos_ids=eos
                )
                docs = documents[index * settings.batch_size :][: len(contexts.examples)]
                texts = decode_answers(models.target_tokenizer, out, eos)
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
