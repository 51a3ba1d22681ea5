"""Issue 41's frontier: extractive F1 against time to first token at 2,048 tokens for every Qwen2.5-Coder 0.5B -> 1.5B
variant, with its shuffled source and its source-free twin. The numbers are copied from the dated logs named beside
each point (their evaluations and `bench ttft` runs); TTFT is a share of the 1.5B's native prefill, target side (the
0.5B's cache exists) and, where a square is drawn, with the 0.5B's prefill.

    python docs/results/2026-12-05-qwen-frontier.py   # writes docs/results/2026-12-05-qwen-frontier.png
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

NATIVE = dict(f1=0.970, se=0.006, ttft=1.0)  # 2026-12-05-qwen-512.md, 512 examples
ALONE = dict(f1=0.723, se=0.017, ttft=0.32)  # the 0.5B answering by itself: the bar
NO_CONTEXT = 0.047
COLORS = ("tab:blue", "tab:orange", "tab:purple", "tab:red", "tab:brown", "tab:cyan")
# name: F1 (s.e.), examples, TTFT target side / with the 0.5B's prefill, its shuffled source's and source-free twin's F1
# (None: not trained) and the twin's TTFT, the log
POINTS = {
    "KV Prediction, B=0": dict(
        f1=0.049, se=0.006, n=256, ttft=0.08, with_source=0.37, shuffled=0.048, free=None, log="qwen-kvp"
    ),
    "dial B=4": dict(
        f1=0.241,
        se=0.029,
        n=176,
        ttft=0.32,
        with_source=0.70,
        shuffled=0.101,
        free=0.037,
        free_ttft=0.31,
        log="qwen-dial-b4",
    ),
    "dial B=7": dict(
        f1=0.343,
        se=0.019,
        n=512,
        ttft=0.39,
        with_source=0.70,
        shuffled=0.143,
        free=0.162,
        free_ttft=0.36,
        log="qwen-512",
    ),
    "dial B=14": dict(
        f1=0.792, se=0.023, n=256, ttft=0.59, with_source=0.89, shuffled=0.485, free=None, log="qwen-dial-b14"
    ),
    "dial B=7, recomputing 10%": dict(
        f1=0.273,
        se=0.029,
        n=160,
        ttft=0.52,
        with_source=0.83,
        shuffled=None,
        free=0.159,
        free_ttft=0.50,
        log="qwen-512",
    ),
}


def plot(out):
    fig, ax = plt.subplots(figsize=(9, 5))
    ax.fill_between(
        [0.03, 0.35],
        ALONE["f1"] + 2 * ALONE["se"],
        1.05,
        color="tab:green",
        alpha=0.12,
        lw=0,
        label="goal: target side <= 0.35x, 2 s.e. above the 0.5B alone",
    )
    ax.axhline(NO_CONTEXT, color="grey", ls=":", lw=1, label="no context")
    ax.errorbar(
        [NATIVE["ttft"]],
        [NATIVE["f1"]],
        [NATIVE["se"]],
        marker="*",
        ms=10,
        color="black",
        ls="",
        label="the 1.5B native",
    )
    ax.errorbar(
        [ALONE["ttft"]],
        [ALONE["f1"]],
        [ALONE["se"]],
        marker="D",
        color="tab:green",
        ls="",
        label="the 0.5B alone (the bar)",
    )
    for i, (name, p) in enumerate(POINTS.items()):
        color = COLORS[i]
        ax.errorbar(
            [p["ttft"]], [p["f1"]], [p["se"]], marker="o", ls="", capsize=2, color=color, label=f"{name} ({p['n']} ex.)"
        )
        ax.plot([p["ttft"], p["with_source"]], [p["f1"]] * 2, ls=":", color=color)
        ax.plot([p["with_source"]], [p["f1"]], marker="s", mfc="none", color=color)
        if p["shuffled"] is not None:
            ax.plot([p["ttft"]], [p["shuffled"]], "x", color=color)
        if p["free"] is not None:
            ax.plot([p["free_ttft"]], [p["free"]], marker="o", mfc="none", ls="", color=color)
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
