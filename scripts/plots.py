"""Loss-curve PNGs (matplotlib, headless) from the JSON records of `mixln-megatron pretrain --loss-log`.

A record is {"train": [{"iteration", "loss"}, ...], "eval": [{"split", "iteration", "loss"}, ...]}.
"""

from __future__ import annotations

import math
import os
from typing import Dict, Mapping, Optional, Sequence


_SPLIT_NAMES = {"valid": "validation", "test": "test"}


def ema(values: Sequence[float], beta: float = 0.9) -> list:
    """Bias-corrected exponential moving average (what the smoothed curves show)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = beta * avg + (1.0 - beta) * v
        out.append(avg / (1.0 - beta**i))
    return out


def plot_loss_curves(
    records: Mapping[str, Mapping],
    path: str,
    title: Optional[str] = None,
    smoothing: float = 0.9,
    split: str = "valid",
) -> str:
    """Write a PNG with two panels: training loss per iteration and `split` loss per evaluation.

    `records` maps a run name (legend label) to its loss record. Returns `path`.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors: Dict[str, str] = {}
    for i, (name, record) in enumerate(records.items()):
        color = f"C{i}"
        colors[name] = color
        train = record.get("train", [])
        if train:
            its = [t["iteration"] for t in train]
            losses = [t["loss"] for t in train]
            ax_train.plot(its, losses, color=color, alpha=0.25, linewidth=0.8)
            ax_train.plot(its, ema(losses, smoothing), color=color, linewidth=1.6, label=name)
        evals = [e for e in record.get("eval", []) if e.get("split") == split]
        if evals:
            its = [e["iteration"] for e in evals]
            ppl = [math.exp(min(e["loss"], 50.0)) for e in evals]
            ax_eval.plot(its, ppl, color=color, marker="o", markersize=3, linewidth=1.4,
                         label=f"{name} (final {ppl[-1]:.1f})")
    ax_train.set_xlabel("iteration")
    ax_train.set_ylabel("training loss (nats/token)")
    ax_train.set_title(f"training loss (EMA {smoothing:g}; raw faint)")
    ax_eval.set_xlabel("iteration")
    ax_eval.set_ylabel(f"{_SPLIT_NAMES.get(split, split)} perplexity")
    ax_eval.set_title(f"{_SPLIT_NAMES.get(split, split)} perplexity (per evaluation)")
    ax_eval.set_yscale("log")
    for ax in (ax_train, ax_eval):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"  # a reader never sees half a PNG
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return path
