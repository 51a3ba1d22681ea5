"""launch/device_check.sh's dry run on the CPU: every part runs at tiny sizes and the section has its shape."""

import re
import subprocess
import sys

import pytest
from helpers import ROOT, one_device_command_env


@pytest.mark.slow
def test_the_device_checks_dry_run_writes_one_section_with_every_part(tmp_path):
    out = tmp_path / "check.md"
    result = subprocess.run(
        ["bash", "launch/device_check.sh", "--cpu", f"--out={out}"],
        cwd=ROOT,
        env=one_device_command_env(),  # the dry run's parts run on one CPU device: compiled as the suite's commands
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = out.read_text()
    headings = re.findall(r"^(#+) (.*)$", text, re.MULTILINE)
    assert [h for h, _ in headings if h == "##"] == ["##"], headings  # one section to paste
    assert headings[0][1].startswith("Device check: ") and "(cpu)" in headings[0][1], headings
    titles = [title for level, title in headings if level == "###"]
    assert titles[0] == "Tests" and re.search(r"`pytest .*`: \d+ passed", text), text
    assert any(t.startswith("Training step, tiny Qwen2 -> Qwen2 shapes: 2 x 1 x 32 tokens") for t in titles), titles
    assert any(t.startswith("Prefill against transformers: batch 2") for t in titles), titles
    assert "failed (exit" not in text and "out of time" not in text, text
    # each bench part brought its table (header row, alignment row, data rows)
    assert len(re.findall(r"^\| --- \|", text, re.MULTILINE)) >= 2, text
    assert re.search(r"jax \d+\.\d+", text) and "The whole check took" in text, text


@pytest.mark.parametrize("out", ["/nonexistent/folder/check.md", "", "/proc/check.md"])
def test_an_output_file_that_cannot_be_written_is_refused_before_any_part_runs(out, tmp_path):
    result = subprocess.run(
        [sys.executable, "launch/device_check.py", "--cpu", f"--out={out or tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert re.fullmatch(
        r"error: --out=\S* (names a folder, not a file|cannot be written \(.+\)); "
        r"pass --out=FILE in a folder this check can write.\n",
        result.stderr,
    )
