"""Output folders (mot_jax.outputs) and what export and evaluate write into them: all or nothing, never over a
workdir or foreign files, files that follow the umask; the report's plots."""

import json
import os
import re
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from flax import nnx

from mot_jax import outputs
from mot_jax.errors import MotJaxError
from mot_jax.evals import report, run
from mot_jax.evals.config import defaults
from mot_jax.export import weights
from mot_jax.export.__main__ import export_workdir
from mot_jax.models import tiny
from mot_jax.models.registry import FAMILIES
from mot_jax.translate import channels
from mot_jax.translate.spec import TranslationSpec
from mot_jax.translate.translator import KVTranslator, mixture_config

REFUSED = "choose another output folder"


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def tree(folder):
    """{relative path: bytes} of every file under `folder`."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def modes(folder):
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.rglob("*")]}


def write(out, text="new"):
    with outputs.written_folder(out, "test") as staging:
        (staging / "a.txt").write_text(text)
        fd = os.open(staging / "private.bin", os.O_WRONLY | os.O_CREAT, 0o600)  # as safetensors writes
        os.close(fd)


def test_an_output_folder_replaces_only_what_this_project_wrote(tmp_path, umask_027):
    out = tmp_path / "out"
    write(out, "first")
    write(out, "second")  # an earlier output is replaced
    assert (out / "a.txt").read_text() == "second"
    assert json.loads((out / outputs.MARKER).read_text()) == dict(tool="test", files=["a.txt", "private.bin"])
    assert set(modes(out).values()) <= {0o750, 0o640} and modes(out)["."] == 0o750
    assert modes(out)["private.bin"] == 0o640
    (tmp_path / "empty").mkdir()
    write(tmp_path / "empty")  # an empty folder is fine
    assert (tmp_path / "empty" / "a.txt").exists()

    (out / "notes.txt").write_text("mine")  # the user's file in an output folder
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "1").mkdir(parents=True)
    (workdir / "config.json").write_text("{}")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "file").write_text("data")
    for target, reason in [
        (out, "did not write there (notes.txt)"),
        (workdir, "is a training workdir"),
        (model, "is a training workdir"),
        (tmp_path / "file", "is a file"),
    ]:
        before = tree(tmp_path)
        with pytest.raises(MotJaxError, match=f"{re.escape(reason)}.*{REFUSED}"):
            write(target)
        assert tree(tmp_path) == before, target


def test_an_error_while_writing_leaves_the_earlier_output(tmp_path):
    out = tmp_path / "out"
    write(out, "first")
    with pytest.raises(RuntimeError), outputs.written_folder(out, "test") as staging:
        (staging / "a.txt").write_text("half")
        raise RuntimeError
    assert (out / "a.txt").read_text() == "first" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def tiny_config(name):
    config = tiny.hf_config(name)
    return FAMILIES[config["model_type"]][0].config_from_hf(config)


@pytest.fixture(scope="module")
def translator():
    """A tiny translator and the two models' configs (export needs no weights of theirs)."""
    source, target = tiny_config("random:llama"), tiny_config("random:gemma3")
    spec = TranslationSpec.build("replay", channels.terminal(4, 4, 0.5), 4, 4, k_attn=4, dense_bottom=1)
    cfg = mixture_config(
        spec,
        SimpleNamespace(config=source),
        SimpleNamespace(config=target),
        dim=8,
        heads=1,
        depth=1,
        num_experts=2,
        dispatch="dense",
    )
    return KVTranslator(spec, cfg, rngs=nnx.Rngs(0)), source, target


def test_export_never_deletes_a_workdir_or_foreign_files_and_follows_the_umask(translator, tmp_path, umask_027):
    """`export --workdir=W --out=W` deleted W's checkpoints; `--out=FILE` raised NotADirectoryError."""
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "2").mkdir(parents=True)
    for name in ("config.json", "summary.json"):
        (workdir / name).write_text("{}")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    (tmp_path / "file").write_text("data")
    for out in (workdir, foreign, tmp_path / "file"):
        before = tree(tmp_path)
        with pytest.raises(MotJaxError, match=REFUSED):
            weights.export(*translator, out)
        assert tree(tmp_path) == before, out
    out = weights.export(*translator, tmp_path / "exported")
    assert sorted(p.name for p in out.iterdir()) == [outputs.MARKER, weights.CONFIG_FILE, weights.WEIGHTS_FILE]
    assert modes(out) == {".": 0o750, outputs.MARKER: 0o640, weights.CONFIG_FILE: 0o640, weights.WEIGHTS_FILE: 0o640}
    weights.export(*translator, out)  # its own output: replaced


def results(lengths=(64,), f1=0.0):
    """A report's results as run.evaluate returns them (two methods, one TTFT length by default)."""
    names = ("native", "MoT replay")

    def scores():
        prediction = dict(question="Who?", gold=["Ada"], generation="Bo", answer="Bo")
        return dict(
            f1=f1, exact_match=0.0, retention=None, handed_bytes=10.0, examples_per_s=1.0, predictions=[prediction]
        )

    latency = [
        dict(
            method=m,
            context_tokens=n,
            ttft_s=0.01,
            ttft_with_source_s=0.01 + 0.01 * (m != "native"),
            stages={},
            handed_bytes=8,
            target_kv_bytes=64,
            planned_bytes=None,
        )
        for n in lengths
        for m in names
    ]
    meta = dict(
        methods={"MoT replay": dict(step=1, workdir="run")},
        source="s",
        target="t",
        dtype="float32",
        data="synthetic",
        config=dict(max_new_tokens=4),
        machine="cpu",
        seconds=1.0,
    )
    budgets = {b: {m: scores() for m in names} for b in ("48", "96")}
    tasks = dict(
        extractive_qa=dict(examples=1, methods={m: scores() for m in names}),
        long_context=dict(examples=1, budgets=budgets),
    )
    return dict(tasks=tasks, routing={}, latency=latency, meta=meta)


def test_the_report_never_replaces_foreign_files(tmp_path, umask_027):
    """`evaluate --out=DIR` deleted whatever DIR held."""
    out = tmp_path / "eval"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    with pytest.raises(MotJaxError, match=REFUSED):
        report.write(out, results())
    assert tree(tmp_path) == {"eval/notes.txt": b"keep"}
    report.write(tmp_path / "new", results())
    report.write(tmp_path / "new", results())  # its own output: replaced
    assert set(modes(tmp_path / "new").values()) == {0o750, 0o640}


def test_plots_show_a_single_length_and_keep_f1_at_or_above_zero(tmp_path, monkeypatch):
    figures, save = {}, report._save
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.setdefault(path.name, fig) and save(fig, path))
    report.write(tmp_path / "eval", results(lengths=(64,), f1=0.0))
    ttft = {line.get_label(): line for line in figures["ttft_vs_length.png"].axes[0].get_lines()}
    prefill = ttft["MoT replay + source prefill"]
    assert len(prefill.get_xdata()) == 1 and prefill.get_marker() not in (None, "None", "", " ")
    assert prefill.get_markersize() > 0
    bottom, top = figures["quality_vs_budget.png"].axes[0].get_ylim()
    assert bottom == 0 < top


def test_quality_against_ttft_puts_each_method_at_its_share_of_native_ttft(tmp_path, monkeypatch):
    """F1 +- its standard error against TTFT / native's at the longest length; the source's prefill as a hollow
    marker; a shuffled-source control at its method's TTFT; no plot for multi-agent or closed-set tasks."""
    figures, save = {}, report._save
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.setdefault(path.name, fig) and save(fig, path))
    data = results(lengths=(32, 64))
    methods = data["tasks"]["extractive_qa"]["methods"]
    methods["MoT replay"].update(f1=0.3, f1_se=0.05)
    methods["MoT replay, shuffled source"] = dict(methods["MoT replay"], f1=0.1, f1_se=0.02)
    for row in data["latency"]:
        if row["method"] == "MoT replay" and row["context_tokens"] == 64:
            row.update(ttft_s=0.005, ttft_with_source_s=0.015)  # native: 0.01
    report.write(tmp_path / "eval", data)
    assert [n for n in figures if n.startswith("quality_vs_ttft")] == ["quality_vs_ttft_extractive_qa.png"]
    ax = figures["quality_vs_ttft_extractive_qa.png"].axes[0]
    points = {c.get_label(): c for c in ax.containers}  # one errorbar per method
    shuffled = "MoT replay, shuffled source"
    for name, x, y, se in (("native", 1.0, 0.0, 0), ("MoT replay", 0.5, 0.3, 0.05), (shuffled, 0.5, 0.1, 0.02)):
        line, _, (bar,) = points[name]
        assert (line.get_xdata()[0], line.get_ydata()[0]) == pytest.approx((x, y))
        np.testing.assert_allclose(bar.get_segments()[0], [[x, y - se], [x, y + se]])
    hollow = [line for line in ax.get_lines() if line.get_markerfacecolor() == "none"]
    assert len(hollow) == 1 and (hollow[0].get_xdata()[0], hollow[0].get_ydata()[0]) == pytest.approx((1.5, 0.3))


def test_markdown_tables_put_names_left_and_numbers_right():
    table = outputs.markdown_table(("model", "dtype", "ms"), [("gpt2", "bf16", 1.5)], left=2)
    assert table == "| model | dtype | ms |\n| --- | --- | ---: |\n| gpt2 | bf16 | 1.5 |"
    extractive = [
        "| method | F1 | F1 s.e. | EM | native-correct F1 | gold log-prob | log-prob s.e. | retention "
        "| bytes handed over | examples/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        "| native | 0.000 | - | 0.000 | - | - | - | - | 10 | 1.00 |",
    ]
    assert "\n".join(extractive) in report.markdown(report.split_predictions(results())[0])


def test_paired_differences_are_a_table_with_their_standard_error_and_verdict():
    data = report.split_predictions(results())[0]
    methods = data["tasks"]["extractive_qa"]["methods"]
    methods["MoT replay"]["paired"] = {
        "native": dict(f1=dict(diff=-0.25, se=0.05, examples=4, verdict="below"), logprob=None),
        "no_context": dict(f1=dict(diff=0.05, se=None, examples=1, verdict="one example")),
    }
    table = report.paired_table(methods)
    assert "| method | minus | F1 | EM | native-correct F1 | gold log-prob |" in table
    assert "| MoT replay | native | -0.250 +- 0.050 below | - | - | - |" in table
    assert "| MoT replay | no_context | +0.050 one example | - | - | - |" in table
    assert table in report.markdown(data) and report.paired_table({"native": methods["native"]}) == ""


def test_export_and_evaluate_never_replace_each_others_output(translator, tmp_path):
    """`export --out=<a report>` deleted results.json and predictions.jsonl; `evaluate --out=<an export>` the export."""
    report_folder, exported = tmp_path / "eval", tmp_path / "exported"
    report.write(report_folder, results())
    weights.export(*translator, exported)
    before = tree(tmp_path)
    with pytest.raises(MotJaxError, match=f"output of mot_jax.evaluate.*{REFUSED}"):
        weights.export(*translator, report_folder)
    with pytest.raises(MotJaxError, match=f"output of mot_jax.export.*{REFUSED}"):
        report.write(exported, results())
    assert tree(tmp_path) == before


def test_an_unwritable_output_folder_is_refused_before_any_work(tmp_path):
    """An evaluation ran to its end before finding --out unwritable; export gave an OSError traceback. (The tests
    run as root, which any folder mode lets write: a folder under a file cannot be made, whoever asks.)"""
    (tmp_path / "file").write_text("data")
    out = tmp_path / "file" / "out"
    no_run = tmp_path / "no_run"  # never read: the output is checked first
    with pytest.raises(MotJaxError, match=f"Cannot write to {re.escape(str(out.parent))} .*writable output folder"):
        run.evaluate(no_run, defaults(), out=out)
    with pytest.raises(MotJaxError, match=f"Cannot write to {re.escape(str(out.parent))} .*writable output folder"):
        export_workdir(no_run, out)
    assert tree(tmp_path) == {"file": b"data"}


def test_a_report_that_cannot_be_written_keeps_the_results_elsewhere_with_the_real_cause(tmp_path):
    """When neither the report nor OUT.partial can be written (the folder became unwritable), the results went
    nowhere and the message blamed a full disk."""
    (tmp_path / "file").write_text("data")
    out = tmp_path / "file" / "eval"
    partial = run.Partial(out)
    assert partial.failed  # OUT.partial could not be written either
    data = results()
    with pytest.raises(MotJaxError, match=r"Could not write the report .*File exists.*choose another one") as e:
        run.write_report(out, data, partial)
    assert "free space" not in str(e.value)
    kept = Path(re.search(r"the results are in (\S+) ", str(e.value)).group(1))
    clean, rows = report.split_predictions(data)
    assert json.loads((kept / "results.json").read_text()) == clean
    assert [json.loads(line) for line in (kept / "predictions.jsonl").read_text().splitlines()] == rows
    shutil.rmtree(kept)
