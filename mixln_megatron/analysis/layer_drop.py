"""Layer-drop: the change in perplexity when one decoder layer is bypassed (the paper's Eq. 9).

    Delta(l) = PPL(model without layer l) - PPL(full model)

"Without layer l" means the layer returns its input unchanged (its attention, MLP and both norms
are skipped; the residual stream passes through), all other layers untouched. The paper measures
the drop in task accuracy; perplexity on held-out text stands in for it here, so a larger Delta
means a more important layer (the sign is flipped relative to an accuracy drop).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .models import LanguageModel


def evaluate(lm: LanguageModel, batch_list) -> dict:
    """Mean next-token loss (nats) over all tokens of `batch_list`, and its perplexity.
    The module's training mode is restored afterwards."""
    was_training = lm.module.training
    lm.module.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels in batch_list:
            losses = lm.token_losses(ids, labels)
            total += float(losses.double().sum())
            count += losses.numel()
    lm.module.train(was_training)
    nll = total / max(count, 1)
    return {"loss": nll, "ppl": math.exp(min(nll, 50.0)), "tokens": count}


def layer_drop(lm: LanguageModel, batch_list, layers: Optional[list] = None) -> dict:
    """Baseline perplexity and, for each layer (1-based; default all), the perplexity without it."""
    base = evaluate(lm, batch_list)
    rows = []
    for number in layers or range(1, lm.num_layers + 1):
        with lm.bypass(number - 1):
            r = evaluate(lm, batch_list)
        rows.append({
            "layer": number, "loss": r["loss"], "ppl": r["ppl"],
            "delta_ppl": r["ppl"] - base["ppl"],
            "relative": (r["ppl"] - base["ppl"]) / base["ppl"],
        })
    return {"baseline": base, "layers": rows, "num_layers": lm.num_layers}


def plot_layer_drop(result: dict, path: str, title: Optional[str] = None) -> str:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    xs = [r["layer"] for r in result["layers"]]
    ys = [r["delta_ppl"] for r in result["layers"]]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.35 * len(xs) + 2.5), 4.0))
    colors = ["C3" if y < 0 else "C0" for y in ys]
    ax.bar(xs, ys, color=colors)
    positive = [y for y in ys if y > 0]
    if positive and min(ys) > 0 and max(positive) / min(positive) > 50:
        ax.set_yscale("log")
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xlabel("bypassed layer")
    ax.set_ylabel("perplexity increase (PPL without layer - PPL)")
    base = result["baseline"]
    ax.set_title(title or f"layer drop (baseline PPL {base['ppl']:.2f} over {base['tokens']} tokens)", fontsize=9)
    ax.set_xticks(xs)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
