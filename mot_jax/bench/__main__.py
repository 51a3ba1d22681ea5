"""Benchmarks: every part in one run writes the benchmark page; one part prints its section.

  python -m mot_jax.bench                       # every part -> BENCHMARKS.md + benchmarks_ttft.png (here, or --out)
  python -m mot_jax.bench models                # prefill (and decode) against transformers: random-init shapes at
                                                # 512 tokens, and the offline pair at 128 / 512 / 2,048 tokens, in
                                                # float32 and bfloat16, each side's GFLOP/s against the machine's
                                                # matmul rate measured in the run
  python -m mot_jax.bench mixture               # sparse against dense mixture, N = 2, 4, 8 and k = 1, 2
  python -m mot_jax.bench align                 # alignment of 2,048-token texts against the per-token reference
  python -m mot_jax.bench ttft                  # every method's time to first token, side by side (evals.latency):
                                                # native, text relay, each translator kind, KVComm (homogeneous)
  python -m mot_jax.bench ttft --workdirs=DIR   # ... of trained translators (training workdirs) instead of untrained
  python -m mot_jax.bench ttft --only=linear    # ... of native and the methods whose names hold "linear" (the dial)
  python -m mot_jax.bench ttft --workdirs=DIR --recompute=0,0.1   # ... each dial as translated and recomputing 10%
  python -m mot_jax.bench train                 # the training step of configs/smollm2_gemma3.py (replay and direct)
  python -m mot_jax.bench train --train_dtype=bfloat16 --train_pair=random:DIR_S,random:DIR_T
                                                # ... in bf16, on random weights of two checkpoints' shapes
  python -m mot_jax.bench train --train_step=8,1,2048   # ... at a step of 8 sequences x 1 micro-batch x 2,048 tokens
  python -m mot_jax.bench features              # K/V-space training steps: frozen forwards live vs the feature cache
  python -m mot_jax.bench eval                  # the evaluation's examples per second against the compute bound of
                                                # its prefills (their FLOPs / the machine's measured matmul rate)
  python -m mot_jax.bench --quick --out=/tmp/bench/BENCHMARKS.md   # every part on tiny random models

Time: the whole page takes about 20 minutes on a 2-core CPU with the default `--runs=3` (models ~7, train ~2, align ~1,
mixture ~0.5, features ~6 with its cache built, measured on a loaded machine), after the offline models are converted
and the corpus prepared, and the ttft part far longer since it times every method (its 128 and 512 tokens alone took ~20
minutes at `--runs=1` on a loaded machine, 2,048 several times that). `--quick` runs every part on tiny random models
with tiny sizes and one run per cell (it ignores the size flags) in ~2 minutes, most of it compiling: it checks that
the page builds, its numbers mean nothing; without --out it writes no page. Parts named on the command line are printed
(each section's Markdown on stdout, progress on stderr); with --out they also make a page of their own. The page is
written (atomically, with its plot) only after every part has succeeded.

Both sides of a comparison do the same work in one process, interleaved: same weights, dtype, batch and tokens;
prefill fills the cache and computes logits for the last position only (transformers: `logits_to_keep=1`); torch
uses as many threads as XLA has cores; compile time is reported apart; each cell is the median of `--runs` runs.
"""

from __future__ import annotations

import dataclasses
import os
import time

from mot_jax.bench.align import bench_align
from mot_jax.bench.common import DEFAULT_MIXTURE, QUICK, Plan, log
from mot_jax.bench.evalrate import bench_eval
from mot_jax.bench.features import bench_features
from mot_jax.bench.mixture import bench_mixture
from mot_jax.bench.models import bench_models
from mot_jax.bench.page import PAGE, PLOT, machine, write_page
from mot_jax.bench.train import bench_train
from mot_jax.bench.ttft import bench_ttft

# --quick compiles with XLA's cheap CPU pipeline (it halves the compile time; the numbers mean nothing anyway)
QUICK_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

PARTS = {
    "models": bench_models,
    "mixture": bench_mixture,
    "align": bench_align,
    "ttft": bench_ttft,
    "train": bench_train,
    "features": bench_features,
    "eval": bench_eval,
}


def run_parts(parts: list[str], plan: Plan, out: str | None):
    import gc

    import jax

    sections, began = [], time.perf_counter()
    for part in parts:
        log(f"bench: {part} ...")
        start = time.perf_counter()
        section = PARTS[part](plan)
        section.part, section.seconds = part, time.perf_counter() - start
        log(f"bench: {part} done in {section.seconds:.0f} s ({time.perf_counter() - began:.0f} s in all)")
        print(section.markdown(), flush=True)
        sections.append(section)
        jax.clear_caches()  # each part's compiled programs and their memory go
        gc.collect()
    if out:
        write_page(out, sections, plan)
        log(f"bench: wrote {out}" + (f" and {PLOT}" if any(s.plot for s in sections) else ""))


# ---------------------------------------------------------------------------------------------------- main


def define_flags():
    from absl import flags

    flags.DEFINE_integer("runs", 3, "Timed runs per cell (the median is reported).")
    models = "models: random-init shapes (RANDOM) or model names, prefill at --tokens ('' skips)."
    flags.DEFINE_list("models", ["gpt2", "opt-125m", "qwen2-160m"], models)
    flags.DEFINE_integer("tokens", 512, "models: prompt length of --models.")
    flags.DEFINE_list("batches", ["1", "8"], "models: batch sizes of --models.")
    flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "models: dtypes of --models and --pair.")
    pair = "models: real models, prefill at every --lengths (batch 1, every --dtypes) and greedy decode ('' skips)."
    flags.DEFINE_list("pair", ["smollm2-135m", "gemma3-270m"], pair)
    flags.DEFINE_list("lengths", ["128", "512", "2048"], "Prompt lengths of --pair and context lengths of ttft.")
    flags.DEFINE_integer("decode_tokens", 32, "models: greedy tokens decoded by --pair (0: skip).")
    flags.DEFINE_list("workdirs", [], "ttft: training workdirs (one model pair) to time instead of untrained ones.")
    recompute = "ttft with --workdirs: each dial translator once per share of its tokens recomputed (0: as translated)."
    flags.DEFINE_list("recompute", ["0"], recompute)
    only = "ttft: time only native and the methods whose names hold one of these strings (repeatable)."
    flags.DEFINE_multi_string("only", [], only)
    flags.DEFINE_list("train_pair", [], "train: SOURCE,TARGET model names instead of the experiment's own.")
    step = "train: BATCH,ACCUM,TOKENS: the step's sequences, micro-batches and tokens instead of the experiment's."
    flags.DEFINE_list("train_step", [], step)
    variants = "train: the steps to time, some of replay-sparse, replay-dense, direct-sparse (default: all)."
    flags.DEFINE_list("train_variants", [], variants)
    flags.DEFINE_enum("train_dtype", "", ["", "float32", "bfloat16"], "train: the LLMs' dtype ('': the experiment's).")
    flags.DEFINE_integer("eval_examples", 32, "eval: examples of the evaluation's answer loop (no context, native).")
    flags.DEFINE_integer("eval_batch", 16, "eval: its batch size (the evaluation's default).")
    flags.DEFINE_string("out", None, f"Page to write (default {PAGE} when every part runs; the plot goes beside it).")
    flags.DEFINE_bool(
        "quick", False, "Every size tiny (random models, one run): checks the page builds (about 2 minutes on 2 cores)."
    )


def make_plan(fail) -> Plan:
    from absl import flags

    f = flags.FLAGS
    if f.train_pair and len(f.train_pair) != 2:
        fail(f"--train_pair takes two model names, SOURCE,TARGET, not {','.join(f.train_pair)!r}.")
    try:
        train_step = tuple(int(v) for v in f.train_step)
    except ValueError:
        train_step = ()
    if f.train_step and (len(train_step) != 3 or min(train_step) < 1):
        fail(
            f"--train_step takes three whole numbers of at least 1, BATCH,ACCUM,TOKENS, not {','.join(f.train_step)!r}."
        )
    from mot_jax.bench.train import VARIANTS

    if set(f.train_variants) - set(VARIANTS):
        fail(f"--train_variants takes some of {', '.join(VARIANTS)}, not {','.join(f.train_variants)!r}.")
    from mot_jax.errors import MotJaxError
    from mot_jax.evals.run import recompute_fractions

    try:
        recompute = tuple(recompute_fractions(f.recompute))
    except (MotJaxError, ValueError) as e:
        fail(f"--recompute: {e}" if isinstance(e, MotJaxError) else "--recompute takes a comma list of shares.")
    if any(recompute) and not f.workdirs:
        fail("--recompute applies to trained translators; pass --workdirs with it.")
    chosen = dict(
        workdirs=tuple(f.workdirs),
        only=tuple(f.only),
        train_pair=tuple(f.train_pair),
        train_step=train_step,
        train_variants=tuple(f.train_variants),
        recompute=recompute,
    )
    if f.quick:
        return dataclasses.replace(QUICK, train_dtype=f.train_dtype, **chosen)
    try:
        ints = lambda values: tuple(int(v) for v in values)
        batches, lengths = ints(f.batches), ints(f.lengths)
    except ValueError:
        fail("--batches and --lengths take comma lists of integers.")
    if f.runs < 1:
        fail("--runs must be at least 1.")
    if f.eval_examples < 1 or f.eval_batch < 1:
        fail("--eval_examples and --eval_batch must be at least 1.")
    if set(f.dtypes) - {"float32", "bfloat16"}:
        fail(f"--dtypes takes float32 and/or bfloat16, not {','.join(f.dtypes)}.")
    return Plan(
        runs=f.runs,
        models=tuple(f.models),
        tokens=f.tokens,
        batches=batches,
        dtypes=tuple(f.dtypes),
        pair=tuple(f.pair),
        lengths=lengths,
        decode_tokens=f.decode_tokens,
        decode_prompt=128,
        mixture=DEFAULT_MIXTURE,
        align=dict(target="gemma3-270m", source="smollm2-135m", length=2048, batches=(1, 8)),
        config_arg="",
        train_dtype=f.train_dtype,
        eval_examples=f.eval_examples,
        eval_batch=f.eval_batch,
        **chosen,
    )


def main(argv):
    from absl import flags

    from mot_jax.cli import fail, run_or_exit

    parts = argv[1:] or list(PARTS)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        fail(f"unknown part {unknown[0]!r}; name some of {', '.join(PARTS)}, or none for all of them and the page.")
    quick = flags.FLAGS.quick
    if quick:  # before jax starts its backend, which reads the flags
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {QUICK_XLA_FLAGS}".strip()
    out = flags.FLAGS.out or (PAGE if not argv[1:] and not quick else None)
    plan = make_plan(fail)
    log(f"bench: {', '.join(parts)}{' (quick)' if quick else ''}; {machine()['machine']}")
    run_or_exit(run_parts, parts, plan, out)


if __name__ == "__main__":
    from absl import app

    define_flags()
    app.run(main)
