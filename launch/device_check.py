"""The device check behind launch/device_check.sh: what a fresh GPU machine measures in one short run, written as one
Markdown section to paste into BENCHMARKS.md.

    python launch/device_check.py [--cpu] [--out=FILE]

In order, each part's result added to the section as it ends (a run cut short keeps the parts done): the device
and the versions; the GPU-relevant tests (`-m "not slow"`); `python -m mot_jax.bench train` in bfloat16 at a
GPU-sized step in the Qwen2.5-Coder pair's shapes and in a 7B pair's (Qwen2.5-7B -> Qwen2.5-7B, its layers cut so
the check fits its time), random weights (no network: the weights cannot travel there) with a small local
tokenizer; `python -m mot_jax.bench models` in bfloat16 at batch 8 and 2,048 tokens against transformers on the
same chip. `--cpu`: the same parts at tiny sizes on the CPU (a dry run: CI checks the section's shape).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QWEN = dict(model_type="qwen2", vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768)
# The shapes of the real checkpoints' config.json (the counts in tests/test_param_counts.py check them)
SHAPES = {
    "qwen2.5-coder-0.5b": dict(
        QWEN, num_hidden_layers=24, hidden_size=896, num_attention_heads=14, num_key_value_heads=2
    )
    | dict(intermediate_size=4864, tie_word_embeddings=True),
    "qwen2.5-coder-1.5b": dict(
        QWEN, num_hidden_layers=28, hidden_size=1536, num_attention_heads=12, num_key_value_heads=2
    )
    | dict(intermediate_size=8960, tie_word_embeddings=True),
    "qwen2.5-7b": dict(
        QWEN, vocab_size=152064, num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4
    )
    | dict(intermediate_size=18944, tie_word_embeddings=False),
}
SEVEN_B_LAYERS = 8  # of 28: the 7B pair's two frozen models and its step compile and run within the check's time
# (pair name, source shape, target shape, layers kept (None: all), batch, grad_accum, tokens)
GPU_TRAIN = (
    ("Qwen2.5-Coder 0.5B -> 1.5B", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", None, 8, 1, 2048),
    ("Qwen2.5-7B -> Qwen2.5-7B", "qwen2.5-7b", "qwen2.5-7b", SEVEN_B_LAYERS, 4, 1, 1024),
)
CPU_TRAIN = (("tiny Qwen2 -> Qwen2", "random:qwen2", "random:qwen2-large", None, 2, 1, 32),)
GPU_TESTS = ["tests/test_models.py", "tests/test_trainer.py", "tests/test_layers.py", "tests/test_attention_loss.py"]
CPU_TESTS = ["tests/test_train_run.py", "-k", "gpu_sized"]
CHEAP_CPU_COMPILES = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def shapes_dir(root: Path, name: str, layers: int | None) -> str:
    """`random:DIR` for `bench train`: DIR holds the shape's config.json (cut to `layers`) and the tiny qwen2
    tokenizer (its ids lie inside the real vocabulary)."""
    if name.startswith("random:"):
        return name
    from mot_jax.models import tiny

    folder = root / f"{name}-{layers or 'all'}"
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(SHAPES[name], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if layers:
        config["num_hidden_layers"] = layers
    (folder / "config.json").write_text(json.dumps(config))
    tiny.load_tokenizer("random:qwen2").save(str(folder / "tokenizer.json"))
    return f"random:{folder}"


def command(args: list, env: dict, timeout: float) -> tuple[int, str, str, float]:
    """(exit status, stdout, stderr, seconds) of a command in the repository; status 124 when it ran out of time."""
    began = time.perf_counter()
    try:
        done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        status, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        status, out, err = 124, (e.stdout or b"").decode(errors="replace"), (e.stderr or b"").decode(errors="replace")
    return status, out, err, time.perf_counter() - began


def versions() -> str:
    names = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "torch")
    found = []
    for name in names:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return ", ".join(found)


def device_line(env: dict) -> str:
    script = "import jax; d = jax.devices(); print(f'{len(d)} x {d[0].device_kind} ({jax.default_backend()})')"
    status, out, err, _ = command([sys.executable, "-c", script], env, 120)
    return out.strip() if status == 0 else f"no device ({err.strip().splitlines()[-1:] or status})"


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip("= ") if lines else "(no output)"


def markdown_part(out: str) -> str:
    """A bench part's section from its stdout, its headings two levels down (under the check's ### part heading)."""
    return "\n".join(f"##{line}" if line.startswith("#") else line for line in out.strip().splitlines())


def unwritable(path: Path) -> str | None:
    """Why the section cannot be written to `path` (tried with its temporary file), or None."""
    if not path.name or path.is_dir():
        return "names a folder, not a file"
    probe = path.with_name(path.name + ".tmp")
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return f"cannot be written ({e.strerror or e})"
    return None


class Section:
    """The check's Markdown section, rewritten to `path` after every part."""

    def __init__(self, path: Path, heading: str):
        self.path, self.parts, self.done = path, [heading], []

    def add(self, text: str):
        self.parts.append(text.strip())
        if text.startswith("### "):
            self.done.append(text[4:].split("\n")[0].split(":")[0])
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("\n\n".join(self.parts) + "\n")
        tmp.replace(self.path)
        print(text.strip(), flush=True)


# Seconds each part may take on a GPU: with start-up, 8 minutes in all (launch/device_check.sh stops the check there);
# the CPU's dry run compiles on a small machine, and has 15 minutes in all
LIMITS = dict(tests=120, train=130, models=90)
CPU_LIMITS = dict(tests=240, train=300, models=240)


class Stopped(KeyboardInterrupt):
    """SIGTERM (device_check.sh's time limit, a lent machine taken back), raised as Ctrl-C's KeyboardInterrupt."""


def _stop(signum, frame):
    raise Stopped


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError
    return value


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's usage and error lines, as one
        self.exit(2, f"error: {message}; run with --help for the flags.\n")


def main(argv=None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="a dry run at tiny sizes on the CPU")
    parser.add_argument("--out", default="device_check.md", help="the Markdown section's file")
    parser.add_argument("--runs", type=positive, default=None, help="timed runs per bench cell (default 3; --cpu 1)")
    args = parser.parse_args(argv)
    problem = unwritable(Path(args.out))
    if problem:  # before minutes of a lent device are spent
        print(f"error: --out={args.out} {problem}; pass --out=FILE in a folder this check can write.", file=sys.stderr)
        return 2
    section = Section(Path(args.out), f"## Device check, {datetime.date.today().isoformat()}")  # until the device
    previous = signal.signal(signal.SIGTERM, _stop)
    began = time.perf_counter()
    try:
        check(args, section, began)
    except KeyboardInterrupt as e:  # said in the section too: pasted, a cut-short check must not read as a whole one
        why = "SIGTERM" if isinstance(e, Stopped) else "Ctrl-C"
        done = ", ".join(section.done) or "none"
        section.add(f"Stopped by {why} after {time.perf_counter() - began:.0f} s; the parts done: {done}.")
        print(f"error: stopped by {why}; {args.out} keeps the parts done ({done}).", file=sys.stderr)
        return 143 if isinstance(e, Stopped) else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def check(args, section: Section, began: float) -> None:
    """The check's parts, each added to `section` as it ends."""
    runs = args.runs or (1 if args.cpu else 3)
    limits = CPU_LIMITS if args.cpu else LIMITS
    # the configs' default step (replay, sparse mixture) on the GPU; the CPU's dry run the cheapest to compile
    variants = "replay-dense" if args.cpu else "replay-sparse"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep))
    env |= dict(JAX_PLATFORMS="cpu" if args.cpu else env.get("JAX_PLATFORMS", "cuda"), HF_HUB_OFFLINE="1")
    if args.cpu:  # a dry run: one CPU device (as a single GPU), cheap compiles
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device")]
        flags += [f for f in CHEAP_CPU_COMPILES if f.split("=")[0] not in " ".join(flags)]
        env["XLA_FLAGS"] = " ".join(flags)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    device = device_line(env)
    commit = command(["git", "rev-parse", "--short", "HEAD"], env, 30)[1].strip() or "unknown"
    today = datetime.date.today().isoformat()
    section.parts = [f"## Device check: {device}, {today}"]
    section.add(
        f"From `bash launch/device_check.sh{' --cpu' if args.cpu else ''}`, code at {commit}: {versions()}; "
        f"Python {platform.python_version()}, {platform.machine()}. Random weights in the named shapes (no network)."
    )

    tests = CPU_TESTS if args.cpu else GPU_TESTS
    status, out, err, seconds = command(
        [sys.executable, "-m", "pytest", "-q", "-m", "not slow", *tests], env, limits["tests"]
    )
    result = last_line(out) if status != 124 else "stopped: out of time"
    section.add(f"### Tests\n\n`pytest -q -m 'not slow' {' '.join(tests)}`: {result} ({seconds:.0f} s).")

    with tempfile.TemporaryDirectory(prefix="mot_jax_device_check_") as tmp:
        for name, source, target, layers, batch, accum, tokens in CPU_TRAIN if args.cpu else GPU_TRAIN:
            pair = ",".join(shapes_dir(Path(tmp), m, layers) for m in (source, target))
            flags = [f"--runs={runs}", "--train_dtype=bfloat16", f"--train_pair={pair}"]
            flags += [f"--train_step={batch},{accum},{tokens}", f"--train_variants={variants}"]
            status, out, err, seconds = command(
                [sys.executable, "-m", "mot_jax.bench", "train", *flags], env, limits["train"]
            )
            cut = f", {layers} of {SHAPES[source]['num_hidden_layers']} layers each" if layers else ""
            heading = f"### Training step, {name} shapes{cut}: {batch} x {accum} x {tokens:,} tokens, bfloat16"
            body = markdown_part(out) if status == 0 else f"failed (exit {status}): {last_line(err)}"
            section.add(f"{heading}\n\n{body}\n\n({seconds:.0f} s)")

    models = ["tiny-qwen2"] if args.cpu else ["gpt2", "opt-125m", "qwen2-160m"]
    batch, length = (2, 64) if args.cpu else (8, 2048)
    flags = [f"--models={','.join(models)}", "--pair=", "--dtypes=bfloat16", f"--batches={batch}"]
    flags += [f"--tokens={length}", f"--runs={runs}"]
    status, out, err, seconds = command(
        [sys.executable, "-m", "mot_jax.bench", "models", *flags], env, limits["models"]
    )
    body = markdown_part(out) if status == 0 else f"failed (exit {status}): {last_line(err)}"
    heading = f"### Prefill against transformers: batch {batch}, {length:,} tokens, bfloat16"
    section.add(f"{heading}\n\n{body}\n\n({seconds:.0f} s)")
    section.add(f"The whole check took {time.perf_counter() - began:.0f} s.")


if __name__ == "__main__":
    sys.exit(main())
