"""The paper's diagnostics (Mix-LN, arXiv 2412.13795), on any model behind analysis.models'
LanguageModel (what each measures: docs/commands.md, `analyze`).

Gradient norms: layer l's norm is the L2 norm over every parameter of decoder layer l of the
gradient, at initialization, of the mean next-token loss over a few real-text batches; several
seeds give several profiles and the summary uses their mean.

Angular distance: x_l is the hidden state entering decoder layer l (1-based), per token; x_{L+1}
the last layer's output before the final norm. The cosine is over each token's hidden dimension,
the distance averaged over tokens. Matrix entry [l-1, n-1] holds the distance from layer l to
l + n; entries with l + n > L + 1 are NaN.

Layer drop: "without layer l" means the layer returns its input unchanged (the residual stream
passes through). Perplexity on held-out text stands in for the paper's task accuracy, so a larger
Delta means a more important layer (the sign is flipped relative to an accuracy drop).
"""

from __future__ import annotations

import math
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..model.placement import post_ln_count
from .models import FreshShape, LanguageModel, build_megatron_gpt


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (the figures are written, never shown)."""
    import matplotlib  # optional

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt  # optional

    return plt


def _save(fig, path: str) -> str:
    """Write `fig` to `path` (its folder made), close it, and return the path."""
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


# ------------------------------------------------------------------------------------------ gradient norms
VARIANTS = ("pre_ln", "post_ln", "mix_ln", "lns", "mix_ln+lns")
DEFAULT_VARIANTS = ("pre_ln", "post_ln", "mix_ln")
LABELS = {
    "pre_ln": "Pre-LN", "post_ln": "Post-LN", "mix_ln": "Mix-LN", "lns": "LNS",
    "mix_ln+lns": "Mix-LN+LNS",
}


def variant_placement(name: str, num_layers: int, alpha: float = 0.25) -> Tuple[int, str]:
    """(P, scheme) of a variant for an L-layer model."""
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
    from matplotlib.ticker import MaxNLocator  # optional

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel("gradient norm (L2 over the layer's parameters)")
    ax.set_title(title or f"per-layer gradient norm ({result.get('when', 'at initialization')})", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)


def plot_profiles(result: dict, path: str, title: Optional[str] = None) -> str:
    """One panel of draw_profiles, saved as a PNG."""
    fig, ax = _pyplot().subplots(figsize=(6.8, 4.4))
    draw_profiles(ax, result, title)
    return _save(fig, path)


# ------------------------------------------------------------------------------------------ angular distance
def angular_distance(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Per-vector arccos(cos(a, b)) / pi over the last dimension, in [0, 1] (float64)."""
    a = a.double()
    b = b.double()
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(eps)
    return torch.arccos(cos.clamp(-1.0, 1.0)) / math.pi


class AngularAccumulator:
    """Running sums of per-token distances between every pair of layer inputs (l, l + n)."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.sums = torch.zeros(num_layers, num_layers, dtype=torch.float64)
        self.tokens = 0

    def add(self, states: Sequence[torch.Tensor], token_mask: Optional[torch.Tensor] = None) -> None:
        """`states`: L + 1 tensors [b, s, h] (layer inputs, then the last output)."""
        L = self.num_layers
        if len(states) != L + 1:
            raise ValueError(f"expected {L + 1} states, got {len(states)}")
        flat = [s.reshape(-1, s.shape[-1]) for s in states]
        if token_mask is not None:
            keep = token_mask.reshape(-1)
            flat = [f[keep] for f in flat]
        for l in range(L):
            for n in range(1, L + 1 - l):
                self.sums[l, n - 1] += angular_distance(flat[l], flat[l + n]).sum()
        self.tokens += flat[0].shape[0]

    def matrix(self) -> torch.Tensor:
        out = self.sums / max(self.tokens, 1)
        L = self.num_layers
        for l in range(L):
            out[l, L - l:] = float("nan")
        return out


def angular_distance_matrix(lm: LanguageModel, batch_list) -> dict:
    """Mean angular distances over all tokens of `batch_list` ((ids, labels) pairs)."""
    acc = AngularAccumulator(lm.num_layers)
    lm.module.eval()
    for ids, _labels in batch_list:
        acc.add(lm.layer_states(ids))
    m = acc.matrix()
    return {
        "num_layers": lm.num_layers,
        "tokens": acc.tokens,
        "matrix": [[None if math.isnan(x) else float(x) for x in row] for row in m.tolist()],
        "adjacent": [float(m[l, 0]) for l in range(lm.num_layers)],  # d(x_l, x_{l+1}), l = 1..L
        "rows": "l = 1..L (input of layer l)",
        "columns": "n = 1..L (distance to the input of layer l + n; l + n = L + 1 is the last output)",
    }


def plot_heatmap(result: dict, path: str, title: Optional[str] = None) -> str:
    """Figure 5 style: rows l (layer), columns n (block size), colour = mean angular distance."""
    m = np.array([[np.nan if x is None else x for x in row] for row in result["matrix"]], dtype=float)
    L = m.shape[0]
    fig, ax = _pyplot().subplots(figsize=(5.8 + 0.1 * L, 4.6 + 0.1 * L))
    im = ax.imshow(m, cmap="viridis_r", vmin=0.0, vmax=max(0.05, float(np.nanmax(m))), origin="upper",
                   aspect="auto", extent=(0.5, L + 0.5, L + 0.5, 0.5))
    ax.set_xlabel("n (layers apart)")
    ax.set_ylabel("l (layer)")
    step = max(1, L // 12)
    ax.set_xticks(range(1, L + 1, step))
    ax.set_yticks(range(1, L + 1, step))
    fig.colorbar(im, ax=ax, label="angular distance d(x_l, x_{l+n})")
    ax.set_title(title or f"angular distance ({result['tokens']} tokens)", fontsize=9)
    return _save(fig, path)


# ------------------------------------------------------------------------------------------ layer drop
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
    xs = [r["layer"] for r in result["layers"]]
    ys = [r["delta_ppl"] for r in result["layers"]]
    fig, ax = _pyplot().subplots(figsize=(max(5.0, 0.35 * len(xs) + 2.5), 4.0))
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
    return _save(fig, path)
