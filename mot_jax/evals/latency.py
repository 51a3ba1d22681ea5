"""Time to first token (batch 1) and XLA's memory plan per method, and the TTFT set-up that `python -m
mot_jax.evaluate` and `python -m mot_jax.bench ttft` share: which context lengths fit and the example they time."""

from __future__ import annotations

import dataclasses
import statistics

from mot_jax.evals import synthetic
from mot_jax.evals.methods import Native, Stopwatch, Translated, held_bytes
from mot_jax.evals.prompts import Settings, batches, capacity_for
from mot_jax.models.generation import generate_from_cache_jit, prefill
from mot_jax.translate.pipeline import read_source, source_prefill, translate_jit

SUFFIX_ROOM = 64  # target positions a TTFT length leaves for the question suffix (besides the answer's)


@dataclasses.dataclass(frozen=True)
class TTFTSetup:
    lengths: list[int]  # the requested context lengths that fit the target, ascending
    limit: int  # the longest context that leaves room for the suffix and the answer
    example: dict  # a synthetic long-context example with more text than the longest length needs


def ttft_setup(models, lengths, max_new_tokens: int, seed: int) -> TTFTSetup:
    """The context lengths to time (those that fit the target model with a suffix and a `max_new_tokens` answer)
    and the example whose context is cut to each of them."""
    limit = models.target.config.max_positions - SUFFIX_ROOM - max_new_tokens
    fitting = sorted(n for n in lengths if n <= limit)
    passages = max(fitting, default=0) // 16 + 4
    # past the held-out split: the evaluation's examples are read by the evaluation only
    example = synthetic.examples("long_context", 1, seed, distractors=passages, start=synthetic.HELD_OUT)[0]
    return TTFTSetup(fitting, limit, example)


def timed(models, method, contexts, suffix_ids, suffix_mask, settings: Settings, runs: int) -> dict:
    """Median seconds per stage of building the cache and reading the suffix to the first token (batch 1), after
    one warm-up run that compiles."""
    capacity = capacity_for(contexts, suffix_ids, settings.max_new_tokens)
    samples = []
    for _ in range(runs + 1):
        watch = Stopwatch()
        contexts.forget()  # each run does all of its work (a shared result would carry the warm-up's compile time)
        cache, _ = method.build(models, contexts, capacity, watch)
        watch.lap("answer", generate_from_cache_jit(models.target, cache, suffix_ids, suffix_mask, max_new_tokens=1))
        samples.append(watch.stages)
    return {stage: statistics.median(s[stage] for s in samples[1:]) for stage in samples[0]}


def planned_bytes(models, method, contexts, suffix_ids, suffix_mask, settings: Settings) -> int | None:
    """XLA's memory plan (arguments + temporaries + outputs - aliased) of the largest program a method runs to its
    first token; arguments include the weights it reads, so this is its peak device memory."""
    capacity = capacity_for(contexts, suffix_ids, settings.max_new_tokens)
    programs = []
    if isinstance(method, Translated):
        spec = method.translator.spec
        tokenizers = (models.source_tokenizer, models.target_tokenizer)
        read = read_source(spec, models.source, *tokenizers, contexts.ids, contexts.mask)
        if read.cache is not None:
            flags = dict(topk=spec.attention_topk, **spec.source_hands)
            programs.append(source_prefill.lower(models.source, read.ids, read.mask, **flags))
        programs.append(translate_jit.lower(*method.translation_args(models, contexts, read), capacity=capacity))
    elif isinstance(method, Native):
        programs.append(prefill.lower(models.target, contexts.ids, contexts.mask, capacity=capacity))
    elif hasattr(method, "programs"):  # kvcomm
        programs += method.programs(models, contexts, capacity)
    else:
        return None
    cache, _ = method.build(models, contexts, capacity, Stopwatch())
    programs.append(generate_from_cache_jit.lower(models.target, cache, suffix_ids, suffix_mask, max_new_tokens=1))
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
        for method in methods:
            if method.name == "no_context" or method.needs_donors:  # a control: its TTFT is its method's
                continue
            # the source alone reads its own tokens: the same text cut to `length` of them
            reader, single = method.reader(models, dataclasses.replace(settings, batch_size=1, budget=length))
            contexts, suffix_ids, suffix_mask = next(batches(reader, [example], single))
            keep = int(contexts.mask.sum())
            contexts.ids, contexts.mask = contexts.ids[:, :keep], contexts.mask[:, :keep]  # exact length, no bucket
            stages = timed(reader, method, contexts, suffix_ids, suffix_mask, settings, runs)
            cache, handed = method.build(reader, contexts, capacity_for(contexts, suffix_ids, 1), Stopwatch())
            own = stages.get(method.source_stage, 0.0) if method.source_stage else 0.0
            last = i == len(lengths) - 1
            rows.append(
                dict(
                    method=method.name,
                    context_tokens=keep,
                    ttft_s=sum(stages.values()) - own,
                    ttft_with_source_s=sum(stages.values()),
                    stages=stages,
                    handed_bytes=int(handed[0]),
                    target_kv_bytes=held_bytes(reader.target, cache),
                    planned_bytes=planned_bytes(reader, method, contexts, suffix_ids, suffix_mask, settings)
                    if memory and last
                    else None,
                )
            )
    return rows
