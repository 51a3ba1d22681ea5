"""What every part shares: the plan (the flags' sizes, or tiny ones for --quick), the section and table a part
returns, and the timing and formatting helpers."""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from mot_jax.outputs import markdown_table

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
EXPERIMENT = "smollm2_gemma3.py"  # the config whose translators the ttft and train parts time


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the parts measure: the flags' values, or tiny ones for --quick."""

    runs: int
    models: tuple  # random-init shapes (RANDOM) or model names: prefill at `tokens`, every batch and dtype
    tokens: int
    batches: tuple
    dtypes: tuple
    pair: tuple  # real models: prefill at every length (batch 1, every dtype) and greedy decode
    lengths: tuple  # the pair's prefill lengths and the ttft context lengths
    decode_tokens: int
    decode_prompt: int
    mixture: dict  # tokens, widths, window and translator size of the mixture part
    align: dict  # target and source tokenizers, text length, batches
    config_arg: str  # prefix of the EXPERIMENT config argument ("tiny," for tiny random models)
    workdirs: tuple = ()
    only: tuple = ()  # ttft: the methods whose names hold one of these (and native); empty: every method
    recompute: tuple = (0.0,)  # ttft with workdirs: shares of context tokens recomputed (`--config.recompute`)
    quick: bool = False
    train_pair: tuple = ()  # train: (source, target) model names instead of the EXPERIMENT's own
    train_dtype: str = ""  # train: the LLMs' dtype instead of the EXPERIMENT's ("")
    train_step: tuple = ()  # train: (batch_size, grad_accum, total_tokens) instead of the EXPERIMENT's
    train_variants: tuple = ()  # train: the steps to time (bench.train.VARIANTS' names); empty: all
    eval_examples: int = 32  # eval: examples of the evaluation's answer loop, in batches of eval_batch
    eval_batch: int = 16
    matmul_size: int = 2048  # models, eval: the square matmul that measures the machine's rate


DEFAULT_MIXTURE = dict(
    tokens=512,
    source_width=192,
    target_width=256,
    window=5,
    dim=256,
    heads=4,
    depth=1,
    mlp_ratio=4,
    experts=(2, 4, 8),
    top_k=(1, 2),
)
QUICK = Plan(
    runs=1,
    models=("tiny-gpt2", "tiny-qwen2"),
    tokens=64,
    batches=(1, 2),
    dtypes=("float32", "bfloat16"),
    pair=("tiny-llama", "tiny-gemma3"),
    lengths=(32, 64),
    decode_tokens=8,
    decode_prompt=16,
    mixture=dict(
        tokens=64,
        source_width=32,
        target_width=32,
        window=2,
        dim=32,
        heads=2,
        depth=1,
        mlp_ratio=2,
        experts=(2, 8),
        top_k=(1,),
    ),
    align=dict(target="random:gemma3", source="random:llama", length=128, batches=(1, 2)),
    config_arg="tiny,",
    quick=True,
    eval_examples=4,
    eval_batch=2,
    matmul_size=256,
)


@dataclasses.dataclass
class Table:
    header: tuple
    rows: list  # rows of cells (str() is applied)
    left: int = 1  # the first `left` columns are names (left-aligned); the others are numbers

    def markdown(self) -> str:
        return markdown_table(self.header, self.rows, self.left)


@dataclasses.dataclass
class Section:
    """One part's result: what it measures, its tables (and paragraphs between them), notes computed from the
    numbers, and optionally a plot that the page writer draws into a file (`plot(path)`)."""

    title: str
    intro: str
    body: list  # Tables and paragraphs (str), in order
    notes: list = dataclasses.field(default_factory=list)
    plot: Callable | None = None
    part: str = ""  # set by run_parts, with the seconds the part took
    seconds: float = 0.0

    def markdown(self, image: str | None = None) -> str:
        blocks = [f"## {self.title}", self.intro]
        blocks += [b.markdown() if isinstance(b, Table) else b for b in self.body]
        if image:
            blocks.append(f"![{self.title}]({image})")
        blocks += self.notes
        return "\n\n".join(blocks) + "\n"


def goal_note(goal: str, value: float, threshold: float, higher_is_better: bool, fmt: str = "{:.2f}") -> str:
    """The note 'Goal (GOAL): **met, VALUE**.' (or 'not met'): `value` against `threshold`."""
    met = value >= threshold if higher_is_better else value <= threshold
    return f"Goal ({goal}): **{'met' if met else 'not met'}, {fmt.format(value)}**."


def ms(seconds: float) -> str:
    """Milliseconds with the digits that matter (tiny models run in well under a millisecond)."""
    value = seconds * 1e3
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 1 else f"{value:.3f}"


def span(values, fmt="{:.2f}x") -> str:
    low, high = min(values), max(values)
    return fmt.format(low) if fmt.format(low) == fmt.format(high) else f"{fmt.format(low)}-{fmt.format(high)}"


def log(message: str):
    print(message, file=sys.stderr, flush=True)


def median_time(fn, runs):
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def load_experiment(arg: str):
    """The EXPERIMENT training config (configs/ is not a package: loaded from its file)."""
    spec = importlib.util.spec_from_file_location(EXPERIMENT.removesuffix(".py"), CONFIGS / EXPERIMENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)
