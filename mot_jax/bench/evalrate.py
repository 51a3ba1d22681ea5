"""The eval part: examples per second of the evaluation's own work against the compute bound of that work.

The work: `mot_jax.evaluate`'s answer loop (`evals.tasks.answer_examples`, padded batches, greedy answers, the gold
answer's log-probability) with its two baselines that need no translator, no context and native context, on the
target of `--pair`, over synthetic extractive examples drawn past the held-out split (so the evaluation's own split
stays unread). The bound: the FLOPs of the prefills it runs (every forward over many tokens at once: the context's
prefill, the question and gold answer teacher-forced after the cache) over the machine's matmul
rate, measured here on a square matmul in the model's dtype. The FLOPs are counted in closed form
(`flops.forward_flops`, shared with the models part) on the real tokens, causally, as a perfect kernel would do them:
no padding, no masked keys; the decode steps are counted apart (memory-bound, one token a step) and added in a second
bound.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import types

from mot_jax.bench.common import Plan, Section, Table, log
from mot_jax.bench.flops import forward_flops, matmul_rate, rate_size


@dataclasses.dataclass
class Work:
    """FLOPs of one method's rows: its prefills (parallel forwards) and its decode steps, and the rows counted."""

    prefill: int = 0
    decode: int = 0
    rows: int = 0


def batch_flops(cfg, prefix: list[int], suffix: list[int], gold: list[int], new_tokens: int) -> Work:
    """One method's work on a batch, row by row from its real token counts: the context (`prefix` tokens) filled
    with its last token's logits, then the question (`suffix`) and the gold answer (`gold` tokens) read after it as
    one, teacher-forced, with one logit per answer token (the first also the greedy answer's: `answer_and_logprob`),
    and `new_tokens - 1` greedy steps."""
    work = Work(rows=len(prefix))
    for p, s, g in zip(prefix, suffix, gold):
        work.prefill += forward_flops(cfg, p) + forward_flops(cfg, s + g, past=p, logits=g)
        work.decode += sum(forward_flops(cfg, 1, past=p + s + j) for j in range(new_tokens - 1))
    return work


def work_of(models, methods, examples, settings) -> dict[str, Work]:
    """Each method's Work over the examples, from the batches the evaluation forms (`prompts.batches`)."""
    from mot_jax.evals.methods import NoContext
    from mot_jax.evals.prompts import batches, instruction, token_ids
    from mot_jax.evals.tasks import gold_tokens

    cfg, tokenizer = models.target.config, models.target_tokenizer
    out = {m.name: Work() for m in methods}
    for contexts, _, suffix_mask in batches(models, examples, settings):
        suffix = suffix_mask.sum(1).tolist()
        gold = gold_tokens(tokenizer, contexts.examples, contexts.chat)[1].sum(1).tolist()
        native = contexts.mask.sum(1).tolist()
        bare = [len(t) for t in token_ids(tokenizer, [instruction(e, False) for e in contexts.examples], True)]
        for method in methods:
            prefix = bare if isinstance(method, NoContext) else native
            work, total = batch_flops(cfg, prefix, suffix, gold, settings.max_new_tokens), out[method.name]
            total.prefill, total.decode, total.rows = (
                total.prefill + work.prefill,
                total.decode + work.decode,
                total.rows + work.rows,
            )
    return out


def bench_eval(plan: Plan) -> Section:
    """The evaluation's no-context and native rows on `plan.eval_examples` examples of the pair's target."""
    from mot_jax.evals import synthetic
    from mot_jax.evals.methods import Native, NoContext
    from mot_jax.evals.prompts import Settings, target_chat
    from mot_jax.evals.tasks import answer_examples
    from mot_jax.models import tiny
    from mot_jax.models.loading import load_model, load_tokenizer

    name = plan.pair[1]
    if name.startswith("tiny-"):  # --quick's pair: the tiny random family
        name = tiny.PREFIX + name.removeprefix("tiny-")
    target, tokenizer = load_model(name, "float32")[0], load_tokenizer(name)
    models = types.SimpleNamespace(source=None, target=target, source_tokenizer=None, target_tokenizer=tokenizer)
    settings = Settings(plan.eval_batch, plan.decode_tokens, chat=target_chat("auto", name, tokenizer))
    examples = synthetic.examples("extractive_qa", plan.eval_examples, seed=0, start=synthetic.HELD_OUT)
    methods = [NoContext(), Native()]
    for method in methods:
        method.prepare(models)
    log(f"  eval: {len(examples)} examples of {name}, batch {plan.eval_batch}: a warm-up pass (compiles)")
    answer_examples(models, methods, examples, settings)
    walls, per_method = [], {m.name: [] for m in methods}
    for _ in range(plan.runs):
        start = time.perf_counter()
        rows = answer_examples(models, methods, examples, settings)
        walls.append(time.perf_counter() - start)
        for m in methods:
            per_method[m.name].append(sum(seconds for _, seconds in rows[m.name]["timed"]))
    size = rate_size(plan)
    rate = matmul_rate(size, "float32", max(plan.runs, 3))
    work = work_of(models, methods, examples, settings)
    n = len(examples)
    total = Work(sum(w.prefill for w in work.values()), sum(w.decode for w in work.values()))
    table_rows = []
    for label, seconds, w in [
        *((m.name, statistics.median(per_method[m.name]), work[m.name]) for m in methods),
        ("both rows (wall)", statistics.median(walls), total),
    ]:
        prefill, decode = w.prefill / n, w.decode / n
        measured, bound, bound_all = n / seconds, rate / prefill, rate / (prefill + decode)
        table_rows.append(
            (
                label,
                f"{measured:.2f}",
                f"{prefill / 1e9:.2f}",
                f"{decode / 1e9:.2f}",
                f"{bound:.1f}",
                f"{100 * measured / bound:.1f}%",
                f"{bound_all:.1f}",
                f"{100 * measured / bound_all:.1f}%",
            )
        )
    header = (
        "rows",
        "examples/s",
        "prefill GFLOP / example",
        "decode GFLOP / example",
        "bound, prefills (examples/s)",
        "share",
        "bound, prefills + decode",
        "share",
    )
    intro = (
        f"`python -m mot_jax.evaluate`'s answer loop (padded batches of {plan.eval_batch}, {plan.decode_tokens} greedy "
        f"tokens, the gold answer's log-probability) on {n} synthetic extractive examples (past the held-out split) "
        f"of `{name}` (float32), no context and native context, the median of {plan.runs} timed passes after a "
        f"warm-up pass; against the compute bound of the same work: its FLOPs (real tokens, causal attention, closed "
        f"form: `mot_jax/bench/flops.py`) at the machine's matmul rate, **{rate / 1e9:.1f} GFLOP/s** (float32 "
        f"[{size}]^2 @ [{size}]^2, median). 'share' is examples/s over the bound: the "
        "fraction of the machine's matmul rate the run turns into useful work."
    )
    return Section("Evaluation rate against its compute bound", intro, [Table(header, table_rows)])
