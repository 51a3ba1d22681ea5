"""launch/colab.ipynb runs top to bottom with TINY = True: tiny random models, nothing downloaded."""

import json
import os

import nbformat
import pytest
from helpers import ROOT, one_device_command_env
from nbclient import NotebookClient


def kernel_environment(monkeypatch):
    """The kernel and the commands it starts use this checkout (set up by CI), so the install cell does nothing; they
    compile their one-device programs (the :tiny trainings, the evaluations) as the suite's other commands do."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("XLA_FLAGS", one_device_command_env()["XLA_FLAGS"])


@pytest.mark.slow
def test_colab_notebook_runs_top_to_bottom_on_tiny_models(tmp_path, monkeypatch):
    notebook = nbformat.read(ROOT / "launch" / "colab.ipynb", as_version=4)
    (parameters,) = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    assert "TINY = False" in parameters.source
    parameters.source = parameters.source.replace("TINY = False", "TINY = True")
    kernel_environment(monkeypatch)
    where = {"metadata": {"path": str(tmp_path)}}  # the kernel's working directory: WORKDIR is relative to it
    NotebookClient(notebook, timeout=900, kernel_name="python3", resources=where).execute()

    workdir = tmp_path / "runs" / "quickstart"
    assert json.loads((workdir / "summary.json").read_text())["steps"] == 3
    assert json.loads((workdir / "eval" / "results.json").read_text())["tasks"]
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2  # our figure and evaluate's plots


@pytest.mark.slow
def test_reproduce_paper_notebook_runs_top_to_bottom_on_tiny_models(tmp_path, monkeypatch):
    """The long-context pair (several top-k, HotpotQA-E budgets, TTFT, the paper's stored numbers): 3 tiny trainings,
    7 datasets from the adapters' fixture rows, the hub commands failing offline with one line, the table."""
    notebook = nbformat.read(ROOT / "launch" / "reproduce_paper.ipynb", as_version=4)
    (parameters,) = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    for default, tiny in [("TINY = False", "TINY = True"), ('PAIR = "gpt2_gpt2"', 'PAIR = "qwen2_5_0_5b"')]:
        assert default in parameters.source
        parameters.source = parameters.source.replace(default, tiny)
    kernel_environment(monkeypatch)
    where = {"metadata": {"path": str(tmp_path)}}
    NotebookClient(notebook, timeout=1800, kernel_name="python3", resources=where).execute()

    workdir = tmp_path / "runs" / "paper"
    for run in ("mot_k2", "mot_k4", "c2c_project"):
        assert json.loads((workdir / run / "summary.json").read_text())["steps"] == 3
    table = (workdir / "paper_table.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| dataset"))
    assert "paper (reference repository)" in header
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and line != header]
    datasets = {"squad", "newsqa", "boolq", "pubmedqa", "mmlu_redux", "hotpotqa", "hotpotqa_e"}
    assert {r[0].strip("| ") for r in rows} == datasets
    for dataset in datasets:
        methods = {r[3] for r in rows if r[0].strip("| ") == dataset}
        for control in ("No context", "Native", "MoT (top-k 4)", "MoT (top-k 4), shuffled source"):
            assert control in methods, (dataset, control, methods)
        assert {"C2C-Project", "C2C-Project, shuffled source", "MoT (top-k 2), shuffled source"} <= methods
    assert "| hotpotqa_e | f1 | 24576 | MoT (top-k 128) | not run here (TINY) |" in table  # the paper's rows
    assert "| 0.182 |" in table and "not reported in the reference repository" in table
    assert "51.0%" in table  # the abstract's claims, marked as such
    outputs = "".join(o.get("text", "") for cell in notebook.cells for o in cell.get("outputs", []))
    assert outputs.count("(exit status 2)") == 3  # the hub commands stopped with one line each
