"""The evaluation report: results.json, results.md (the tables printed at the end), predictions.jsonl and plots
(quality against context budget, TTFT against context length, quality against TTFT per task, routing load per
expert), written all or nothing."""

from __future__ import annotations

import copy

from etils import epath

from mot_jax import outputs
from mot_jax.evals.methods import SHUFFLED
from mot_jax.files import strict_json

MIB = 2**20
TOOL = "mot_jax.evaluate"  # the writer its report folders name (mot_jax.outputs)


def _pct(value) -> str:
    return "-" if value is None else f"{value:.1f}%"


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _value(scores: dict, key: str) -> str:
    """A score to 3 decimals, "-" where it is None or absent (results.json written before it)."""
    return "-" if scores.get(key) is None else f"{scores[key]:.3f}"


PAIRED_COLUMNS = dict(
    f1="F1", exact_match="EM", f1_native_correct="native-correct F1", logprob="gold log-prob", pass_at_1="pass@1"
)


def _paired(stat: dict | None) -> str:
    if stat is None:
        return "-"
    se = "" if stat["se"] is None else f" +- {stat['se']:.3f}"
    return f"{stat['diff']:+.3f}{se} {stat['verdict']}"


def paired_table(methods: dict) -> str:
    """Each translated method against each of its controls: the mean paired difference (method minus control, over
    the same examples) +- its standard error per metric, and whether it exceeds 2 s.e. ("" when none was paired)."""
    pairs = [(name, control, stats) for name, m in methods.items() for control, stats in m.get("paired", {}).items()]
    if not pairs:
        return ""
    code = any("pass_at_1" in stats for _, _, stats in pairs)  # paired on pass@1 and log-prob, not on answers'
    metrics = ["pass_at_1", "logprob"] if code else [m for m in PAIRED_COLUMNS if m != "pass_at_1"]
    rows = [[name, control, *(_paired(stats.get(metric)) for metric in metrics)] for name, control, stats in pairs]
    table = outputs.markdown_table(["method", "minus", *(PAIRED_COLUMNS[m] for m in metrics)], rows, left=2)
    return (
        "\nPaired differences, method minus control over the same examples, +- their standard error: above / below "
        "where the difference exceeds 2 s.e., level where it does not.\n\n" + table
    )


def task_table(task: str, entry: dict) -> str:
    methods = entry["methods"]
    if task == "multi_agent":
        header = [
            "method",
            "F1",
            "F1 s.e.",
            "retention",
            "context seconds / document",
            "target KV held (MiB)",
            "one shared cache",
        ]
        rows = [
            [
                name,
                f"{m['f1']:.3f}",
                _value(m, "f1_se"),
                _pct(m["retention"]),
                _seconds(m["context_seconds"]),
                f"{m['target_kv_bytes'] / MIB:.2f}",
                "yes" if m["shares_one_cache"] else "no",
            ]
            for name, m in methods.items()
        ]
        return outputs.markdown_table(header, rows)
    if "accuracy" in next(iter(methods.values())):
        header = [
            "method",
            "accuracy (generation)",
            "retention",
            "unparsed",
            "accuracy (option likelihood)",
            "retention",
            "examples/s",
        ]
        rows = [
            [
                name,
                f"{m['accuracy']:.3f}",
                _pct(m["retention"]),
                f"{m['unparsed']:.0%}",
                f"{m['likelihood_accuracy']:.3f}",
                _pct(m["likelihood_retention"]),
                f"{m['examples_per_s']:.2f}",
            ]
            for name, m in methods.items()
        ]
        return outputs.markdown_table(header, rows)
    if "pass_at_1" in next(iter(methods.values())):
        return code_table(methods)
    return open_table(methods)


def code_table(methods: dict) -> str:
    """Code completion: pass@1 (the share of problems whose tests pass on the greedy completion) and the canonical
    solution's log-probability."""
    header = ["method", "pass@1", "pass@1 s.e.", "gold log-prob", "log-prob s.e.", "retention", "examples/s"]
    rows = [
        [
            name,
            f"{m['pass_at_1']:.3f}",
            _value(m, "pass_at_1_se"),
            _value(m, "logprob"),
            _value(m, "logprob_se"),
            _pct(m["retention"]),
            f"{m['examples_per_s']:.2f}",
        ]
        for name, m in methods.items()
    ]
    return outputs.markdown_table(header, rows)


def open_table(methods: dict) -> str:
    """Extractive answers: F1, exact match, F1 on the native-correct subset, the gold answer's log-probability."""
    native_correct = next(iter(methods.values())).get("f1_native_correct_examples")
    header = [
        "method",
        "F1",
        "F1 s.e.",
        "EM",
        "native-correct F1" + ("" if native_correct is None else f" ({native_correct})"),
        "gold log-prob",
        "log-prob s.e.",
        "retention",
        "bytes handed over",
        "examples/s",
    ]
    rows = [
        [
            name,
            f"{m['f1']:.3f}",
            _value(m, "f1_se"),
            f"{m['exact_match']:.3f}",
            _value(m, "f1_native_correct"),
            _value(m, "logprob"),
            _value(m, "logprob_se"),
            _pct(m["retention"]),
            f"{m['handed_bytes']:,.0f}",
            f"{m['examples_per_s']:.2f}",
        ]
        for name, m in methods.items()
    ]
    return outputs.markdown_table(header, rows)


def budget_table(entry: dict) -> str:
    budgets = list(entry["budgets"])
    names = list(entry["budgets"][budgets[0]])
    rows = []
    for name in names:
        cells = [
            f"{entry['budgets'][b][name]['f1']:.3f} ({_pct(entry['budgets'][b][name]['retention'])})" for b in budgets
        ]
        rows.append([name, *cells])
    return outputs.markdown_table(["method", *(f"F1 at {b} tokens (retention)" for b in budgets)], rows)


def latency_table(rows: list[dict]) -> str:
    header = [
        "method",
        "context tokens",
        "TTFT (ms)",
        "TTFT incl. source prefill (ms)",
        "handed over (KiB)",
        "target KV (MiB)",
        "memory plan (MiB)",
    ]
    cells = [
        [
            r["method"],
            r["context_tokens"],
            f"{r['ttft_s'] * 1e3:.1f}",
            f"{r['ttft_with_source_s'] * 1e3:.1f}",
            f"{r['handed_bytes'] / 1024:,.1f}",
            f"{r['target_kv_bytes'] / MIB:.2f}",
            "-" if r["planned_bytes"] is None else f"{r['planned_bytes'] / MIB:,.0f}",
        ]
        for r in rows
    ]
    return outputs.markdown_table(header, cells)


def cut_note(cut: dict) -> str:
    """The line saying how many examples' contexts were cut to fit the target (`prompts.context_cuts`)."""
    return (
        f"{cut['examples']} of {cut['of']} examples' contexts were cut to fit the target's positions (with the "
        f"question and the answer), by up to {cut['most_tokens']} tokens ({cut['mean_tokens']} on average); every "
        "method read the same cut context."
    )


def new_tokens(config: dict, tasks) -> str:
    """The answers' length limit, as the tasks generated: `max_new_tokens`, but humaneval's completions
    `humaneval_max_new_tokens`."""
    code = f"{config['humaneval_max_new_tokens']}" if "humaneval" in tasks else None
    if tasks and all(task == "humaneval" for task in tasks):
        return f"{code} new tokens"
    return f"{config['max_new_tokens']} new tokens" + (f" ({code} for humaneval)" if code else "")


def markdown(results: dict) -> str:
    meta = results["meta"]
    translators = ", ".join(f"{n} (step {m['step']}, {m['workdir']})" for n, m in meta["methods"].items()) or "none"
    lines = [
        f"# Evaluation: {meta['source']} -> {meta['target']} ({meta['dtype']})",
        "",
        f"Translators: {translators}. "
        f"Data: {meta['data']}; {'chat-template' if meta.get('chat_template') else 'plain'} prompts; greedy, "
        f"{new_tokens(meta['config'], results['tasks'])}; {meta['machine']}; "
        f"{meta['seconds']:.0f} s. Retention = the method's score as a percentage of native context's. "
        "Gold log-prob: the mean log-probability per token of the first gold answer read after the question "
        "(teacher-forced). Native-correct F1: over the examples native context answers exactly and no context "
        "does not (their number in its header).",
    ]
    if meta["config"].get("shuffled_source"):
        lines[-1] += (
            ' Rows named "..., shuffled source": the same translator writing each example\'s cache from '
            "another example's source cache (a control; a translated method carries the context only where "
            "it beats it; no TTFT of its own)."
        )
    if meta["config"].get("source_alone") and meta.get("methods"):
        lines[-1] += (
            ' "source alone": the source model reads the passage and answers itself (its own prompts and TTFT; its '
            "log-probability counts its own tokens, so it is not paired on that)."
        )
    for name, calibration in meta.get("kvcomm", {}).items():
        lines[-1] += (
            f" {name}: the source's raw K/V of the whole context at target layers "
            f"{', '.join(map(str, calibration['sent']))}, of its first token at the others."
        )
    for task, entry in results["tasks"].items():
        lines += ["", f"## {task} ({entry['examples']} examples)", ""]
        if task == "long_context":
            lines.append(budget_table(entry))
            for budget, methods in entry["budgets"].items():
                lines += ["", f"### at {budget} tokens", "", open_table(methods), paired_table(methods)]
        else:
            if entry.get("cut"):
                lines += [cut_note(entry["cut"]), ""]
            if task == "humaneval":
                config = meta["config"]
                lines += [
                    f"Greedy completions of up to {config['humaneval_max_new_tokens']} tokens after the prompt (plain, "
                    "no chat turns), cut at the standard stop sequences; pass@1: the share of problems whose own "
                    f"tests pass on prompt + completion, run in a child process limited to "
                    f"{config['humaneval_timeout']:g} s. Gold log-prob: the canonical solution's.",
                    "",
                ]
            lines += [task_table(task, entry), paired_table(entry["methods"])]
    if results.get("latency"):
        lines += ["", "## Time to first token (batch 1)", ""]
        lines += [
            "Building the cache (source prefill excluded / included), reading the question and the first token; "
            "median of the timed runs. Handed over: the text for native context and relay, the source K/V the "
            "translator reads for translated methods, the K/V sent for KVComm. Memory plan: XLA's plan of the "
            "largest program, weights included (longest length only).",
            "",
        ]
        lines.append(latency_table(results["latency"]))
    if results.get("routing"):
        lines += ["", "## Routing (tokens per expert over the evaluation contexts)", ""]
        for name, parts in results["routing"].items():
            for part, load in parts.items():
                total = sum(load) or 1
                lines.append(f"- {name}, {part}: " + ", ".join(f"{x / total:.1%}" for x in load))
    return "\n".join(lines) + "\n"


def split_predictions(results: dict):
    """(results without per-example predictions, prediction rows: the example's index unless the prediction names
    its own, e.g. a multi-agent document's)."""
    results, rows = copy.deepcopy(results), []
    for task, entry in results["tasks"].items():
        groups = [(None, entry["methods"])] if "methods" in entry else list(entry["budgets"].items())
        for budget, methods in groups:
            for name, scores in methods.items():
                for index, prediction in enumerate(scores.pop("predictions", [])):
                    rows.append(dict(task=task, budget=budget, method=name, index=index) | prediction)
    return results, rows


def plots(results: dict, folder: epath.Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    entry = results["tasks"].get("long_context")
    if entry:
        fig, ax = plt.subplots(figsize=(6, 4))
        budgets = [int(b) for b in entry["budgets"]]
        for name in entry["budgets"][str(budgets[0])]:
            ax.plot(budgets, [entry["budgets"][str(b)][name]["f1"] for b in budgets], marker="o", label=name)
        ax.set(xscale="log", xlabel="context budget (target tokens)", ylabel="F1", title="Quality against budget")
        ax.set_ylim(bottom=0)  # F1 is never negative (matplotlib pads an all-zero axis below 0)
        ax.legend(fontsize=8)
        written.append(_save(fig, folder / "quality_vs_budget.png"))
    if results.get("latency"):
        fig, ax = plt.subplots(figsize=(6, 4))
        # markers on both series: with one length evaluated each is one point, which a line alone does not draw
        for name in dict.fromkeys(r["method"] for r in results["latency"]):
            rows = [r for r in results["latency"] if r["method"] == name]
            line = ax.plot(
                [r["context_tokens"] for r in rows], [r["ttft_s"] * 1e3 for r in rows], marker="o", label=name
            )
            if any(r["ttft_with_source_s"] != r["ttft_s"] for r in rows):
                ax.plot(
                    [r["context_tokens"] for r in rows],
                    [r["ttft_with_source_s"] * 1e3 for r in rows],
                    ls="--",
                    marker="x",
                    color=line[0].get_color(),
                    label=f"{name} + source prefill",
                )
        ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="TTFT (ms)", title="Time to first token")
        ax.legend(fontsize=8)
        written.append(_save(fig, folder / "ttft_vs_length.png"))
        written += quality_vs_ttft(results, folder, plt)
    if results.get("routing"):
        bars = [(f"{name}\n{part}", load) for name, parts in results["routing"].items() for part, load in parts.items()]
        fig, ax = plt.subplots(figsize=(6, 4))
        width = 0.8 / max(len(load) for _, load in bars)
        for expert in range(max(len(load) for _, load in bars)):
            shares = [load[expert] / (sum(load) or 1) if expert < len(load) else 0 for _, load in bars]
            ax.bar([i + expert * width for i in range(len(bars))], shares, width, label=f"expert {expert}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(bars))], [label for label, _ in bars], fontsize=7)
        ax.set(ylabel="share of tokens", title="Routing load per expert")
        ax.legend(fontsize=8)
        written.append(_save(fig, folder / "routing_load.png"))
    return written


def quality_vs_ttft(results: dict, folder: epath.Path, plt) -> list[str]:
    """Per open-answer task (extractive QA, the user's JSONL): each method's F1 (+- its standard error) against its
    TTFT at the longest timed length, as a fraction of native context's where native was timed; a hollow marker at
    the TTFT with the source's prefill added where that differs, and each shuffled-source control at its method's."""
    longest = max(r["context_tokens"] for r in results["latency"])
    timed = {r["method"]: r for r in results["latency"] if r["context_tokens"] == longest}
    scale = timed["native"]["ttft_s"] if "native" in timed else 1e-3
    unit = "TTFT / native context's" if "native" in timed else "TTFT (ms)"
    written = []
    for task, entry in results["tasks"].items():
        methods = entry.get("methods", {})
        if task == "multi_agent" or not methods or "exact_match" not in next(iter(methods.values())):
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, m in methods.items():
            base, shuffled = name.removesuffix(SHUFFLED), name.endswith(SHUFFLED)
            if base not in timed:
                continue
            x, y = timed[base]["ttft_s"] / scale, m["f1"]
            marker = "x" if shuffled else "o"
            line = ax.errorbar([x], [y], yerr=[m.get("f1_se") or 0], marker=marker, capsize=3, ls="", label=name)
            with_source = timed[base]["ttft_with_source_s"] / scale
            if not shuffled and with_source != x:
                color = line[0].get_color()
                ax.plot([x, with_source], [y, y], ls=":", color=color)
                ax.plot([with_source], [y], marker="o", mfc="none", color=color)
        title = f"{task}: quality against TTFT at {longest} tokens (hollow: + source prefill)"
        ax.set(xscale="log", xlabel=unit, ylabel="F1", title=title)
        ax.title.set_fontsize(9)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=6)
        written.append(_save(fig, folder / f"quality_vs_ttft_{task}.png"))
    return written


def _save(fig, path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(str(path), dpi=120)
    plt.close(fig)
    return path.name


def write(out, results: dict) -> None:
    """Write the report into `out` (a folder), all or nothing, replacing only an earlier output (`mot_jax.outputs`)."""
    clean, rows = split_predictions(results)
    with outputs.written_folder(out, TOOL) as partial:
        clean["plots"] = plots(clean, partial)
        (partial / "results.json").write_text(strict_json(clean, indent=2))
        (partial / "results.md").write_text(markdown(clean))
        (partial / "predictions.jsonl").write_text("".join(strict_json(r) + "\n" for r in rows))
