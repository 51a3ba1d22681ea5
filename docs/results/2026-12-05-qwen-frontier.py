"""Issue 41's frontier: extractive F1 against time to first token at 2,048 tokens for every Qwen2.5-Coder 0.5B -> 1.5B
variant, with its shuffled source and its source-free twin. The numbers are copied from the dated logs named beside
each point (their evaluations and `bench ttft` runs); TTFT is a share of the 1.5B's native prefill, target side (the
0.5B's cache exists) and, where a square is drawn, with the 0.5B's prefill.

    python docs/results/2026-12-05-qwen-frontier.py   # writes docs/results/2026-12-05-qwen-frontier.png
"""

from pathlib import Path
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


class Point(NamedTuple):
    f1: float
    se: float
    n: int  # examples
    ttft: float  # target side
    with_source: float  # with the 0.5B's prefill
    shuffled: float | None  # its shuffled source's F1 (None: not evaluated)
    free: float | None  # its source-free twin's F1 (None: not trained)
    free_ttft: float | None  # (None: not measured; the twin is then not drawn)
    logs: str  # where the numbers come from: docs/results/{each}.md


# the references, from 2026-12-05-qwen-512.md (512 examples): the 1.5B native, the 0.5B answering by itself (the bar)
NATIVE, ALONE, NO_CONTEXT = (0.970, 0.006, 1.0), (0.723, 0.017, 0.32), 0.047
POINTS = {
    "KV Prediction, B=0": Point(
        0.049, 0.006, 256, 0.08, 0.37, 0.048, 0.043, None, "2026-12-05-qwen-kvp, 2026-12-06-qwen-code-reading"
    ),
    "dial B=4": Point(0.241, 0.029, 176, 0.32, 0.70, 0.101, 0.037, 0.31, "2026-12-05-qwen-dial-b4"),
    "dial B=7": Point(0.343, 0.019, 512, 0.39, 0.70, 0.143, 0.162, 0.36, "2026-12-05-qwen-512"),
    "dial B=14": Point(
        0.805, 0.016, 512, 0.58, 0.87, 0.485, 0.788, 0.57, "2026-12-05-qwen-dial-b14, 2026-12-06-qwen-b14-source-free"
    ),
    "dial B=7, recomputing 10%": Point(0.273, 0.029, 160, 0.52, 0.83, None, 0.159, 0.50, "2026-12-05-qwen-512"),
}
COLORS = ("tab:blue", "tab:orange", "tab:purple", "tab:red", "tab:brown")


def plot(out):
    fig, ax = plt.subplots(figsize=(9, 5))
    bar = ALONE[0] + 2 * ALONE[1]
    ax.fill_between(
        [0.03, 0.35],
        bar,
        1.05,
        color="tab:green",
        alpha=0.12,
        lw=0,
        label="goal: target side <= 0.35x, 2 s.e. above the 0.5B alone",
    )
    ax.axhline(NO_CONTEXT, color="grey", ls=":", lw=1, label="no context")
    for (f1, se, ttft), marker, size, color, label in (
        (NATIVE, "*", 10, "black", "the 1.5B native"),
        (ALONE, "D", None, "tab:green", "the 0.5B alone (the bar)"),
    ):
        ax.errorbar([ttft], [f1], [se], marker=marker, ms=size, color=color, ls="", label=label)
    for color, (name, p) in zip(COLORS, POINTS.items(), strict=True):
        ax.errorbar([p.ttft], [p.f1], [p.se], marker="o", ls="", capsize=2, color=color, label=f"{name} ({p.n} ex.)")
        ax.plot([p.ttft, p.with_source], [p.f1] * 2, ls=":", color=color)
        ax.plot([p.with_source], [p.f1], marker="s", mfc="none", color=color)
        if p.shuffled is not None:
            ax.plot([p.ttft], [p.shuffled], "x", color=color)
        if p.free is not None and p.free_ttft is not None:
            ax.plot([p.free_ttft], [p.free], marker="o", mfc="none", ls="", color=color)
    ax.set(
        xscale="log",
        xlim=(0.05, 1.3),
        ylim=(0, 1.05),
        xlabel="TTFT / the 1.5B's native prefill at 2,048 tokens (square: + the 0.5B's prefill)",
        ylabel="extractive F1",
        title="Qwen2.5-Coder 0.5B -> 1.5B\nx: shuffled source; hollow circle: source-free twin",
    )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    plot(Path(__file__).with_suffix(".png"))
