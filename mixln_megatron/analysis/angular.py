"""Angular distance between the inputs of layers l and l + n (the paper's Eq. 8 and Figure 5).

    d(x_l, x_{l+n}) = arccos( cos(x_l, x_{l+n}) ) / pi        in [0, 1]

x_l is the hidden state entering decoder layer l (1-based), per token; x_{L+1} is the last layer's
output before the final norm. The cosine is taken over the hidden dimension of each token and
the distance averaged over tokens. Matrix entry [l-1, n-1] holds the mean distance from layer l
to l + n for n = 1 .. L + 1 - l; entries with l + n > L + 1 are NaN.

A layer that returns its input unchanged (bypassed) has distance 0 to the next layer.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

from .models import LanguageModel


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


def most_redundant_blocks(result: dict, n: int) -> List[dict]:
    """For block size n, the starting layers ordered by distance (smallest = most prunable)."""
    rows = []
    for l, row in enumerate(result["matrix"], start=1):
        if n - 1 < len(row) and row[n - 1] is not None:
            rows.append({"layer": l, "n": n, "distance": row[n - 1]})
    return sorted(rows, key=lambda r: r["distance"])


def plot_heatmap(result: dict, path: str, title: Optional[str] = None) -> str:
    """Figure 5 style: rows l (layer), columns n (block size), colour = mean angular distance."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np

    m = np.array([[np.nan if x is None else x for x in row] for row in result["matrix"]], dtype=float)
    L = m.shape[0]
    fig, ax = plt.subplots(figsize=(5.8 + 0.1 * L, 4.6 + 0.1 * L))
    im = ax.imshow(m, cmap="viridis_r", vmin=0.0, vmax=max(0.05, float(np.nanmax(m))), origin="upper",
                   aspect="auto", extent=(0.5, L + 0.5, L + 0.5, 0.5))
    ax.set_xlabel("n (layers apart)")
    ax.set_ylabel("l (layer)")
    step = max(1, L // 12)
    ax.set_xticks(range(1, L + 1, step))
    ax.set_yticks(range(1, L + 1, step))
    fig.colorbar(im, ax=ax, label="angular distance d(x_l, x_{l+n})")
    ax.set_title(title or f"angular distance ({result['tokens']} tokens)", fontsize=9)
    fig.tight_layout()
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
