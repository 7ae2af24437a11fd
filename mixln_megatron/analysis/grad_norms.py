"""Per-layer gradient norms (the paper's Figures 3e and 6a), on megatron-core GPTs built from our spec.

For each variant a fresh GPTModel (CPU, one process) is built from the Mix-LN spec:
  pre_ln     P = 0                   post_ln    P = L
  mix_ln     P = floor(alpha * L)    lns        P = 0, LayerNorm Scaling 1/sqrt(l)
  mix_ln+lns P = floor(alpha * L) with LNS on its Pre-LN layers
The gradient of the mean next-token loss over a few real-text batches is taken at initialization,
and layer l's norm is the L2 norm over every parameter of decoder layer l (attention, MLP and its
two norms). Several seeds give several profiles; the summary uses their mean.

Summary figures of a profile g_1..g_L:
  last_over_first = g_L / g_1   (< 1: norms fall with depth, the Pre-LN picture; > 1: they rise,
                                  the Post-LN picture)
  max_over_min    = max_l g_l / min_l g_l   (how uneven the profile is)
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .models import LanguageModel, FreshShape, build_megatron_gpt

VARIANTS = ("pre_ln", "post_ln", "mix_ln", "lns", "mix_ln+lns")
DEFAULT_VARIANTS = ("pre_ln", "post_ln", "mix_ln")
LABELS = {
    "pre_ln": "Pre-LN", "post_ln": "Post-LN", "mix_ln": "Mix-LN", "lns": "LNS",
    "mix_ln+lns": "Mix-LN+LNS",
}


def variant_placement(name: str, num_layers: int, alpha: float = 0.25) -> Tuple[int, str]:
    """(P, scheme) of a variant for an L-layer model."""
    from ..model.placement import post_ln_count

    if name == "pre_ln":
        return 0, "mixln"
    if name == "post_ln":
        return num_layers, "mixln"
    if name == "mix_ln":
        return post_ln_count(str(alpha), num_layers), "mixln"
    if name == "lns":
        return 0, "lns"
    if name == "mix_ln+lns":
        return post_ln_count(str(alpha), num_layers), "mixln+lns"
    raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")


def layer_grad_norms(lm: LanguageModel, exclude_norms: bool = False) -> List[float]:
    """L2 norm of the current .grad over all parameters of each decoder layer (optionally over the
    weight matrices only, leaving out the two norms: MixLNTransformerLayer.norm_parameters())."""
    out = []
    for layer in lm.layers:
        if exclude_norms and not hasattr(layer, "norm_parameters"):
            raise ValueError(f"exclude_norms needs Mix-LN layers (norm_parameters()), got {type(layer).__name__}")
        norms = {id(p) for _, p in layer.norm_parameters()} if exclude_norms else set()
        sq = 0.0
        for p in layer.parameters():
            if p.grad is None or id(p) in norms:
                continue
            sq += float(p.grad.detach().double().pow(2).sum())
        out.append(math.sqrt(sq))
    return out


def accumulate_gradient(lm: LanguageModel, batch_list: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Zero the grads, then backprop the mean token loss over all batches. Returns that loss."""
    lm.module.zero_grad(set_to_none=True)
    lm.module.train()
    total = 0.0
    for ids, labels in batch_list:
        loss = lm.token_losses(ids, labels).mean() / len(batch_list)
        loss.backward()
        total += float(loss.detach())
    return total


def grad_norm_profile(lm: LanguageModel, batch_list, exclude_norms: bool = False) -> Tuple[List[float], float]:
    loss = accumulate_gradient(lm, batch_list)
    norms = layer_grad_norms(lm, exclude_norms)
    lm.module.zero_grad(set_to_none=True)
    return norms, loss


def profile_summary(norms: Sequence[float]) -> Dict[str, float]:
    lo = min(norms)
    return {
        "first": norms[0],
        "last": norms[-1],
        "last_over_first": norms[-1] / norms[0] if norms[0] > 0 else float("inf"),
        "max_over_min": max(norms) / lo if lo > 0 else float("inf"),
        "argmax_layer": int(max(range(len(norms)), key=lambda i: norms[i])) + 1,
        "argmin_layer": int(min(range(len(norms)), key=lambda i: norms[i])) + 1,
    }


def measure_at_init(
    shape: FreshShape,
    batch_list,
    variants: Iterable[str] = DEFAULT_VARIANTS,
    alpha: float = 0.25,
    seeds: Sequence[int] = (1234,),
    exclude_norms: bool = False,
    config_overrides: Optional[dict] = None,
) -> dict:
    """Per-layer gradient norms at initialization of each variant, for each seed, and their mean.
    `config_overrides`: TransformerConfig fields on top of the shape's (e.g. MoE layers, whose
    norm then covers the router and every expert)."""
    result = {"shape": shape.describe(), "alpha": alpha, "seeds": list(seeds), "variants": {},
              "parameters": "weight matrices only" if exclude_norms else "all parameters of the layer"}
    for name in variants:
        p, scheme = variant_placement(name, shape.num_layers, alpha)
        per_seed, losses = [], []
        for seed in seeds:
            lm = build_megatron_gpt(shape, post_ln_layers=p, scheme=scheme, seed=seed,
                                    config_overrides=config_overrides)
            norms, loss = grad_norm_profile(lm, batch_list, exclude_norms)
            per_seed.append(norms)
            losses.append(loss)
            del lm
        mean = [sum(col) / len(col) for col in zip(*per_seed)]
        result["variants"][name] = {
            "label": LABELS.get(name, name), "post_ln_layers": p, "scheme": scheme,
            "per_seed": per_seed, "mean": mean, "loss_at_init": losses,
            "summary": profile_summary(mean),
            "summary_per_seed": [profile_summary(n) for n in per_seed],
        }
    return result


def qualitative_checks(result: dict, margin: float = 0.1) -> Dict[str, Optional[bool]]:
    """The paper's claims about the profiles, evaluated on `result["variants"]` means.

    "falls" / "rises" need the last/first ratio below 1 - margin / above 1 + margin (default 10%),
    so that a flat profile is not reported as a trend.
    """
    v = result["variants"]
    out: Dict[str, Optional[bool]] = {}
    if "pre_ln" in v:
        out["pre_ln_falls_with_depth"] = v["pre_ln"]["summary"]["last_over_first"] < 1.0 - margin
    if "post_ln" in v:
        out["post_ln_rises_with_depth"] = v["post_ln"]["summary"]["last_over_first"] > 1.0 + margin
    if {"pre_ln", "post_ln", "mix_ln"} <= set(v):
        m = v["mix_ln"]["summary"]["max_over_min"]
        out["mix_ln_flatter_than_both"] = (
            m < v["pre_ln"]["summary"]["max_over_min"] and m < v["post_ln"]["summary"]["max_over_min"]
        )
    return out


def format_table(result: dict) -> str:
    lines = [f"{'variant':<12} {'P':>3} {'first':>10} {'last':>10} {'last/first':>11} {'max/min':>9}"]
    for name, v in result["variants"].items():
        s = v["summary"]
        lines.append(f"{v['label']:<12} {v['post_ln_layers']:>3} {s['first']:>10.4g} {s['last']:>10.4g} "
                     f"{s['last_over_first']:>11.3f} {s['max_over_min']:>9.3f}")
    return "\n".join(lines)


def draw_profiles(ax, result: dict, title: Optional[str] = None) -> None:
    """Per-layer gradient norm against layer index, one line per variant (log scale), seeds faint."""
    for i, (name, v) in enumerate(result["variants"].items()):
        xs = list(range(1, len(v["mean"]) + 1))
        color = f"C{i}"
        if len(v["per_seed"]) > 1:
            for norms in v["per_seed"]:
                ax.plot(xs, norms, color=color, alpha=0.2, linewidth=0.8)
        s = v["summary"]
        ax.plot(xs, v["mean"], color=color, marker="o", markersize=3, linewidth=1.6,
                label=f"{v['label']} (P={v['post_ln_layers']}; last/first {s['last_over_first']:.2f}, "
                      f"max/min {s['max_over_min']:.2f})")
        if 0 < v["post_ln_layers"] < len(xs):
            ax.axvline(v["post_ln_layers"] + 0.5, color=color, linestyle=":", linewidth=0.8)
    ax.set_yscale("log")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel("gradient norm (L2 over the layer's parameters)")
    ax.set_title(title or f"per-layer gradient norm ({result.get('when', 'at initialization')})", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)


def plot_profiles(result: dict, path: str, title: Optional[str] = None) -> str:
    """One panel of draw_profiles, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    draw_profiles(ax, result, title)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def _save(fig, path: str) -> None:
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
