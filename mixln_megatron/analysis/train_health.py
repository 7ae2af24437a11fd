"""`mixln-megatron analyze train-health RUN_DIR`: plots of the telemetry a training run logged.

Reads the JSONL records written by mixln_megatron.training.telemetry (RUN_DIR/mixln_telemetry.jsonl, or
any *.jsonl of that name below RUN_DIR, or the file itself) and draws:
  train_health_heatmap.png   log10 gradient norm per layer (rows) and logged step (columns),
                             a line marking the Post/Pre-LN boundary;
  train_health_boundary.png  the norm-weight gradient norms of the last Post-LN and first
                             Pre-LN layers over steps, and the spike scaler's counts when logged.
A summary JSON (train_health.json) holds the series behind the plots.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from typing import List, Optional

from ..cli_parsing import CommandParser, add_flag, refused
from ..model.layout import boundaries, first_p_kinds
from ..training.telemetry import JSONL_NAME


def find_records(run_dir: str) -> str:
    if os.path.isfile(run_dir):
        return run_dir
    direct = os.path.join(run_dir, JSONL_NAME)
    if os.path.isfile(direct):
        return direct
    found = sorted(glob.glob(os.path.join(run_dir, "**", JSONL_NAME), recursive=True))
    if not found:
        raise FileNotFoundError(
            f"no {JSONL_NAME} under {run_dir!r}: train with --mixln-telemetry-interval N (or "
            "MIXLN_TELEMETRY_INTERVAL=N) to log per-layer gradient norms"
        )
    return found[0]


def read_records(path: str) -> List[dict]:
    records, bad = [], 0
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                bad += 1  # a run killed mid-write leaves a partial last line
    if not records:
        raise ValueError(f"{path!r} holds no telemetry records")
    by_step = {r["step"]: r for r in records}  # a resumed run may log a step twice: keep the last
    return [by_step[s] for s in sorted(by_step)]


def summarize(records: List[dict]) -> dict:
    first = records[0]
    P, L = first["post_ln_layers"], first["num_layers"]
    steps = [r["step"] for r in records]
    summary = {
        "num_layers": L,
        "post_ln_layers": P,
        "steps": steps,
        "layer_grad_norm": [r["layer_grad_norm"] for r in records],
        "post_ln_group_grad_norm": [r.get("post_ln_group_grad_norm") for r in records],
        "pre_ln_group_grad_norm": [r.get("pre_ln_group_grad_norm") for r in records],
    }
    # Every Post/Pre boundary of the run's layout (records before layouts existed carry no
    # layer_kinds: Mix-LN's first P layers are Post-LN).
    kinds = first.get("layer_kinds") or first_p_kinds(L, P)
    summary["layer_kinds"] = list(kinds)
    summary["boundaries"] = [list(pair) for pair in boundaries(kinds)]
    if summary["boundaries"]:
        layers = sorted({layer for pair in summary["boundaries"] for layer in pair})
        summary["boundary"] = {f"layer{layer}_{norm}": [r[f"{norm}_grad_norm"][layer - 1] for r in records]
                               for layer in layers for norm in ("norm1", "norm2")}
    spikes = [r.get("spike") for r in records]
    if any(spikes):
        keys = sorted({k for s in spikes if s for k in s})
        summary["spike"] = {k: [(s or {}).get(k) for s in spikes] for k in keys}
    return summary


def plot(summary: dict, out_dir: str) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, L = summary["steps"], summary["num_layers"]
    grid = [[math.log10(v) if v and v > 0 else float("nan") for v in row] for row in summary["layer_grad_norm"]]
    columns = list(map(list, zip(*grid)))  # [layer][step]
    fig, ax = plt.subplots(figsize=(max(6, min(16, len(steps) * 0.25 + 3)), max(3, L * 0.25 + 1.5)))
    image = ax.imshow(columns, aspect="auto", origin="lower", interpolation="nearest", cmap="viridis",
                      extent=(steps[0] - 0.5, steps[-1] + 0.5, 0.5, L + 0.5))
    for last_post, _ in summary.get("boundaries") or []:
        ax.axhline(last_post + 0.5, color="white", linestyle="--", linewidth=1)
        ax.text(steps[0], last_post + 0.6, f" Post-LN {last_post} below, Pre-LN {last_post + 1} above",
                color="white", fontsize=8, va="bottom")
    ax.set_xlabel("step")
    ax.set_ylabel("layer (global)")
    ax.set_title("log10 gradient norm per layer")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    heatmap = os.path.join(out_dir, "train_health_heatmap.png")
    fig.savefig(heatmap, dpi=120)
    plt.close(fig)

    has_spike = "spike" in summary
    fig, axes = plt.subplots(2 if has_spike else 1, 1, figsize=(8, 6 if has_spike else 3.5), squeeze=False)
    ax = axes[0][0]
    for name, series in (summary.get("boundary") or {}).items():
        ax.plot(steps, series, label=name)
    for key in ("post_ln_group_grad_norm", "pre_ln_group_grad_norm"):
        if any(v is not None for v in summary[key]):
            ax.plot(steps, summary[key], linestyle=":", label=key.replace("_grad_norm", ""))
    ax.set_yscale("log")
    ax.set_ylabel("gradient norm")
    ax.set_title("norm-weight gradients at the Post/Pre-LN boundary")
    ax.legend(fontsize=7)
    if has_spike:
        ax2 = axes[1][0]
        for name, series in summary["spike"].items():
            if all(isinstance(v, (int, float)) or v is None for v in series):
                ax2.plot(steps, [v if v is not None else float("nan") for v in series], label=name)
        ax2.set_xlabel("step")
        ax2.set_title("gradient-spike scaler")
        ax2.legend(fontsize=7)
    else:
        ax.set_xlabel("step")
    fig.tight_layout()
    boundary = os.path.join(out_dir, "train_health_boundary.png")
    fig.savefig(boundary, dpi=120)
    plt.close(fig)
    return [heatmap, boundary]


def build_parser(parser: Optional[argparse.ArgumentParser] = None, prog: Optional[str] = None):
    parser = parser or CommandParser(prog=prog or "mixln-megatron analyze train-health", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="run directory (or the JSONL file) with mixln_telemetry.jsonl")
    add_flag(parser, "--out-dir", "--out", default=None, help="output directory (default: RUN_DIR)")
    return parser


def run(args) -> dict:
    path = find_records(args.run_dir)
    summary = summarize(read_records(path))
    out_dir = args.out_dir or (args.run_dir if os.path.isdir(args.run_dir) else os.path.dirname(path))
    os.makedirs(out_dir, exist_ok=True)
    summary["figures"] = plot(summary, out_dir)
    summary["source"] = path
    target = os.path.join(out_dir, "train_health.json")
    tmp = target + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, target)
    print(f"train-health: {len(summary['steps'])} logged steps from {path}")
    for fig in summary["figures"]:
        print(f"  wrote {fig}")
    return summary


def main(argv=None, prog: Optional[str] = None) -> int:
    run(build_parser(prog=prog).parse_args(argv))
    return 0


if __name__ == "__main__":
    _prog = "python -m mixln_megatron.analysis.train_health"
    try:
        sys.exit(main(prog=_prog))
    except (ValueError, OSError) as error:  # no telemetry there, or an unreadable file: one line, exit 2
        sys.exit(refused(_prog, error))
