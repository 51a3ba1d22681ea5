"""launch/device_check.sh's dry run on the CPU: every part runs at tiny sizes and the section has its shape."""

import re
import signal
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


@pytest.mark.parametrize(
    "flag,reason",
    [
        ("--bogus", "unrecognized arguments: --bogus"),  # argparse's usage line and its error: two lines
        ("--runs=0", "argument --runs: invalid positive value: '0'"),  # was the default (3) silently
    ],
)
def test_a_bad_flag_is_one_line(flag, reason, tmp_path):
    result = subprocess.run(
        [sys.executable, "launch/device_check.py", flag, f"--out={tmp_path}"],  # a folder: refused, were it reached
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"error: {reason}; run with --help for the flags.\n"


@pytest.mark.parametrize("signum,status,why", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")])
def test_a_check_stopped_midway_says_so_in_its_section(signum, status, why, tmp_path):
    """device_check.sh's time limit (SIGTERM) or Ctrl-C during the training part: the section kept the tests' part
    and ended there, reading as a whole check; the process died with a traceback or none."""
    out = tmp_path / "check.md"
    script = f"""
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("device_check", "launch/device_check.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)
check.device_line = lambda env: "1 x fake (cpu)"
def command(args, env, timeout):  # the parts' commands, faked: the tests pass, the training part is stopped
    if "pytest" in args:
        return 0, "3 passed in 1.00s", "", 1.0
    if "mot_jax.bench" in args:
        os.kill(os.getpid(), {int(signum)})
    return 0, "abc1234", "", 0.0
check.command = command
sys.exit(check.main(["--cpu", "--out={out}"]))
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == status, result.stderr[-2000:]
    assert result.stderr == f"error: stopped by {why}; {out} keeps the parts done (Tests).\n"
    text = out.read_text()
    assert text.startswith("## Device check: 1 x fake (cpu), ") and "### Tests\n" in text, text
    assert re.search(rf"\n\nStopped by {why} after \d+ s; the parts done: Tests.\n$", text), text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["check.md"]  # no temporary file left
