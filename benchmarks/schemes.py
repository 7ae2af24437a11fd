"""The paper's comparison, every arm side by side: Pre-LN, Post-LN, DeepNorm (DeepNet's rule and the
Mix-LN authors' constants), Sandwich-LN, LayerNorm Scaling, Mix-LN, DeepNorm in Mix-LN's early layers,
and the authors' other placements of the Post-LN layers. One command, one table, one plot.

Every arm is a per-layer layout (mixln_megatron.model.layout) of the same megatron-core GPT (our
spec, local backend, CPU; RMSNorm, SwiGLU, RoPE, no biases, untied embeddings), trained with
fidelity.py's recipe and loop (AdamW, 10% warm-up, cosine to 10%, clipping 1.0) on the shipped
corpus. One seed policy: every arm of a seed starts from the same RNG seed and sees the same token
batches in the same order. What the paper plots at initialisation (its Figure 3e, per-layer
gradient norms of the first step) is measured for every arm, and the gradient norms after
`profile_step` steps too.

    python benchmarks/schemes.py --quick   # 12 layers, h 32, 160 steps, seed 1: ~5 min on 2 cores
    python benchmarks/schemes.py           # 12 and 24 layers, h 64, 200 steps, seeds 1 and 2: ~40 min
    python benchmarks/schemes.py --quick --moe   # + Pre-LN, Post-LN, DeepNorm, Mix-LN on an MoE model

`--moe` adds MoE arms to the same table and plot (labels end in "(MoE)"): the same model with a
dense first layer and megatron MoE layers after it (4 experts, top-2, each expert half the dense
FFN width so that the active FFN width per token equals the dense model's; the allgather
dispatcher, local experts), trained with the same recipe, seeds and batches.

Outputs (--out, default benchmarks/results): schemes[_quick].json (every run), schemes[_quick].md
(the table) and schemes[_quick].png (per-layer gradient norms at initialisation and training-loss
curves of every arm). The last line printed is `RESULT ...` with every arm's mean validation
perplexity. `--report FILE.json` prints a saved run's table again without training.

What this can show at CPU scale: that every arm builds and trains through the same Megatron code
path, and how the arms' gradient-norm profiles at initialisation differ (the paper's Figure 3e is a
property of the initialised network, so it is meaningful at any scale). What it cannot show: the
paper's perplexity ranking, which needs >= 71M-parameter models on >= 1B tokens; on ~0.1-1M
parameters and 1M tokens the differences between the stable arms are within seed noise (see the
table's sd) and the embedding-scale confound of fidelity.py applies (README, "Fidelity benchmark").
"""

from __future__ import annotations

import repo_paths  # noqa: F401  (tests/ and scripts/ on sys.path: the harness, the plots)
import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*absl.logging is not installed.*")

import fidelity  # noqa: E402  (the recipe, data, training loop and worker pool of the fidelity benchmark)

from mixln_megatron.analysis import diagnostics  # noqa: E402
from mixln_megatron.analysis.arms import ARM_BY_NAME, ARMS  # noqa: E402
from mixln_megatron.analysis.models import FreshShape  # noqa: E402
from mixln_megatron import cpu  # noqa: E402
from mixln_megatron.model.placement import resolve_placement  # noqa: E402

@dataclass(frozen=True)
class Setup:
    name: str
    depths: tuple
    seeds: tuple
    hidden: int
    heads: int
    recipe: fidelity.Recipe
    arms: tuple = tuple(arm.name for arm in ARMS)
    moe_arms: tuple = ()  # arms also trained on the MoE model (--moe)


# The MoE model of the MoE arms: a dense first layer (as DeepSeek-MoE / Qwen-MoE), then MoE layers.
MOE_ARMS = ("pre_ln", "post_ln", "deepnorm", "mix_ln")
MOE_EXPERTS, MOE_TOPK = 4, 2
MOE_TAG = "moe_"  # run keys L<depth>_moe_<arm>


def moe_overrides(shape: FreshShape) -> dict:
    """TransformerConfig fields of the MoE model: experts of half the dense FFN width, top-2."""
    from mixln_megatron.analysis.loading import fresh_moe_fields

    return fresh_moe_fields(MOE_EXPERTS, MOE_TOPK, ffn_hidden_size=shape.ffn // MOE_TOPK,
                            layer_freq=[0] + [1] * (shape.num_layers - 1))


FULL = Setup("full", depths=(12, 24), seeds=(1, 2), hidden=64, heads=4,
             recipe=fidelity.Recipe(steps=200, batch_size=16, seq_length=64, profile_step=40))
QUICK = Setup("quick", depths=(12,), seeds=(1,), hidden=32, heads=2,
              recipe=fidelity.Recipe(steps=160, batch_size=8, seq_length=64, profile_step=20, valid_windows=128))


def run_key(depth: int, arm: str, moe: bool = False) -> str:
    return f"L{depth}_{MOE_TAG if moe else ''}{arm}"


def parse_key(key: str):
    """(depth, arm, moe) of a run key."""
    depth, arm = key[1:].split("_", 1)
    moe = arm.startswith(MOE_TAG)
    return int(depth), arm[len(MOE_TAG):] if moe else arm, moe


def _run_task(setup: Setup, task):
    depth, arm, seed, moe = task
    r = setup.recipe
    shape = FreshShape(num_layers=depth, hidden_size=setup.hidden, num_attention_heads=setup.heads,
                       vocab_size=4096, seq_length=r.seq_length)
    res = fidelity.train_settings(shape, ARM_BY_NAME[arm].settings(depth), seed, r,
                                  fidelity._WORKER["train"], fidelity._WORKER["valid"],
                                  config_overrides=moe_overrides(shape) if moe else None)
    return task, res


def summarize(setup: Setup, runs: Dict[str, List[dict]]) -> dict:
    rows = {}
    for key, seed_runs in runs.items():
        depth, arm, moe = parse_key(key)
        placement = resolve_placement(depth, ARM_BY_NAME[arm].settings(depth))
        ppls = [r["valid_ppl"] for r in seed_runs]
        finite = [v for v in ppls if math.isfinite(v)]
        profiles = {}
        for step in sorted({s for r in seed_runs for s in r["grad_norm_profiles"]}, key=int):
            per_seed = [r["grad_norm_profiles"][step] for r in seed_runs if step in r["grad_norm_profiles"]]
            mean = [statistics.fmean(col) for col in zip(*per_seed)]
            profiles[step] = {"mean": mean, "summary": diagnostics.profile_summary(mean)}
        curves = [r["train_losses"] for r in seed_runs]
        rows[key] = {
            "depth": depth, "arm": arm, "moe": moe, "layout": placement.layout,
            "label": ARM_BY_NAME[arm].label + (" (MoE)" if moe else ""),
            "scheme": placement.scheme, "boundaries": [list(b) for b in placement.boundaries],
            "deepnorm_alpha": placement.deepnorm_alpha, "deepnorm_beta": placement.deepnorm_beta,
            "ppl_mean": statistics.fmean(finite) if finite else float("inf"),
            "ppl_sd": statistics.stdev(finite) if len(finite) > 1 else float("nan"),
            "ppl_per_seed": ppls, "diverged_runs": sum(r["diverged_at"] is not None for r in seed_runs),
            "grad_norm_profiles": profiles,
            "mean_train_loss_curve": [statistics.fmean(col) for col in zip(*curves)] if curves else [],
            "s_per_step": statistics.fmean(r["s_per_step"] for r in seed_runs),
        }
    return {"rows": rows}


def format_table(setup: Setup, summary: dict, unigram_ppl: Optional[float] = None) -> str:
    """The comparison as a Markdown table: one row per (depth, arm)."""
    step_k = str(setup.recipe.profile_step)
    lines = [
        f"| L | arm | layout | boundaries | val PPL | sd | init grad-norm last/first | init max/min | "
        f"@{step_k} last/first | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"].values():
        p0 = r["grad_norm_profiles"].get("0", {}).get("summary", {})
        pk = r["grad_norm_profiles"].get(step_k, {}).get("summary", {})
        ppl = r["ppl_mean"]
        flag = "*" if unigram_ppl and math.isfinite(ppl) and ppl > 0.95 * unigram_ppl else ""
        ppl_text = "diverged" if not math.isfinite(ppl) else f"{ppl:.1f}{flag}"
        layout = r["layout"] + (f" ({r['scheme']})" if r["scheme"] != "mixln" else "")
        bounds = ", ".join(f"{a}\\|{b}" for a, b in r["boundaries"]) or "none"

        def num(summary_, key):
            value = summary_.get(key, float("nan"))
            return f"{value:.3g}" if math.isfinite(value) else "n/a"

        lines.append(
            f"| {r['depth']} | {r['label']} | `{layout}` | {bounds} | {ppl_text} | "
            f"{r['ppl_sd']:.1f} | {num(p0, 'last_over_first')} | {num(p0, 'max_over_min')} | "
            f"{num(pk, 'last_over_first')} | {r['s_per_step']:.3f} |".replace("| nan |", "| n/a |"))
    if unigram_ppl:
        lines.append("")
        lines.append(f"Unigram perplexity of the held-out split: {unigram_ppl:.1f}; `*`: an arm above 95% of it "
                     "has learned little beyond token frequencies.")
    return "\n".join(lines)


def plot(setup: Setup, summary: dict, path: str) -> str:
    """Per depth: the per-layer gradient norm at initialisation (Figure 3e) and the training loss."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from plots import ema  # scripts/plots.py

    fig, axes = plt.subplots(len(setup.depths), 2, figsize=(15, 5.2 * len(setup.depths)), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    for i, depth in enumerate(setup.depths):
        grads, losses = axes[i]
        keys = [(run_key(depth, arm), j, False) for j, arm in enumerate(setup.arms)]
        keys += [(run_key(depth, arm, True), setup.arms.index(arm) if arm in setup.arms else len(setup.arms) + j, True)
                 for j, arm in enumerate(setup.moe_arms)]
        for key, j, moe in keys:
            r = summary["rows"].get(key)
            if r is None:
                continue
            # an MoE arm: its dense arm's colour, thicker, with square markers
            style = dict(color=colors[(2 * j) % 20 if j < 10 else (2 * j + 1) % 20],
                         linestyle=("-", "--", ":", "-.")[j % 4], linewidth=2.4 if moe else 1.4)
            prof = r["grad_norm_profiles"].get("0", {}).get("mean")
            if prof:
                grads.plot(range(1, len(prof) + 1), prof, marker="s" if moe else "o", markersize=3,
                           label=r["label"], **style)
            if r["mean_train_loss_curve"]:
                losses.plot(ema(r["mean_train_loss_curve"]), label=r["label"], **style)
        grads.set_yscale("log")
        grads.set_xlabel("layer (1-based)")
        grads.set_ylabel("gradient L2 norm of the layer's parameters")
        grads.set_title(f"L={depth}: per-layer gradient norm at initialisation (first step)")
        losses.set_xlabel("step")
        losses.set_ylabel("training loss (EMA 0.9)")
        losses.set_title(f"L={depth}: training loss, same batches and seeds for every arm")
        grads.legend(fontsize=7, ncol=2)
    return fidelity.save_figure(fig, path)


def result_line(summary: dict) -> str:
    return fidelity.result_line(summary, prefix="schemes_ppl_")


def setup_from_record(d: dict) -> Setup:
    recipe = fidelity.Recipe(**{k: tuple(v) if isinstance(v, list) else v for k, v in d["recipe"].items()})
    return Setup(**{**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}, "recipe": recipe})


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="12 layers, h 32, 160 steps, seed 1 (~5 min)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--cache-dir", default=None, help="tokenized corpus cache (default: $TMPDIR)")
    ap.add_argument("--arms", default=None, help=f"comma list of arms (default all: {', '.join(ARM_BY_NAME)})")
    ap.add_argument("--moe", nargs="?", const=",".join(MOE_ARMS), default=None, metavar="ARMS",
                    help=f"also train these arms on the MoE model (default {','.join(MOE_ARMS)}; "
                    f"{MOE_EXPERTS} experts, top-{MOE_TOPK}, a dense first layer)")
    ap.add_argument("--steps", type=int, default=None, help="override the number of training steps")
    ap.add_argument("--seeds", default=None, help="override the seeds, e.g. 1,2,3")
    ap.add_argument("--depths", default=None, help="override the depths, e.g. 12,24")
    ap.add_argument("--jobs", type=int, default=2, help="runs trained at once in worker processes (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per job (default 1)")
    ap.add_argument("--report", metavar="JSON", default=None, help="print a saved run's table instead of training")
    a = ap.parse_args(argv)
    if a.report:
        with open(a.report) as f:
            record = json.load(f)
        setup = setup_from_record(record["setup"])
        summary = summarize(setup, record["runs"])
        print(format_table(setup, summary, record.get("unigram_ppl")))
        print(result_line(summary))
        return 0

    setup = QUICK if a.quick else FULL
    if a.steps is not None:
        setup = replace(setup, recipe=replace(setup.recipe, steps=a.steps,
                                              profile_step=min(setup.recipe.profile_step, a.steps - 1)))
    if a.seeds:
        setup = replace(setup, seeds=tuple(int(s) for s in a.seeds.split(",")))
    if a.depths:
        setup = replace(setup, depths=tuple(int(s) for s in a.depths.split(",")))
    if a.arms:
        unknown = [n for n in a.arms.split(",") if n not in ARM_BY_NAME]
        if unknown:
            ap.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARM_BY_NAME)}")
        setup = replace(setup, arms=tuple(a.arms.split(",")))
    if a.moe:
        unknown = [n for n in a.moe.split(",") if n not in ARM_BY_NAME]
        if unknown:
            ap.error(f"unknown MoE arm(s) {', '.join(unknown)}; choose from {', '.join(ARM_BY_NAME)}")
        setup = replace(setup, moe_arms=tuple(a.moe.split(",")))
    for depth in setup.depths:  # every arm's layout is valid at every depth before anything trains
        for arm in setup.arms + setup.moe_arms:
            resolve_placement(depth, ARM_BY_NAME[arm].settings(depth))
    r = setup.recipe
    t_start = time.time()
    fidelity._worker_init(r, a.cache_dir, a.threads)  # builds the dataset cache once, before any worker
    _, _, info = fidelity.load_data(r, a.cache_dir)
    moe = f" + {len(setup.moe_arms)} MoE arms" if setup.moe_arms else ""
    print(f"[schemes:{setup.name}] {len(setup.arms)} arms{moe} x depths {setup.depths} x seeds {setup.seeds}; "
          f"{r.steps} steps x {r.batch_size} x {r.seq_length} tokens per run; hidden {setup.hidden}, heads "
          f"{setup.heads}; lr {r.lr}; unigram PPL {info['unigram_ppl']:.1f}", flush=True)

    tasks = [(depth, arm, seed, False) for depth in setup.depths for arm in setup.arms for seed in setup.seeds]
    tasks += [(depth, arm, seed, True) for depth in setup.depths for arm in setup.moe_arms for seed in setup.seeds]
    results = {}

    def report(task, res):
        results[task] = res
        div = f" DIVERGED at step {res['diverged_at']}" if res["diverged_at"] is not None else ""
        print(f"  {run_key(task[0], task[1], task[3]):<24} seed {task[2]}: valid PPL {res['valid_ppl']:.2f} "
              f"{res['seconds']:.0f}s{div}  [{len(results)}/{len(tasks)}, {time.time() - t_start:.0f}s]", flush=True)

    if a.jobs <= 1:
        with cpu.harness():
            for task in tasks:
                report(*_run_task(setup, task))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=a.jobs, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=fidelity._pool_worker_init, initargs=(r, a.cache_dir, a.threads)) as pool:
            futures = [pool.submit(_run_task, setup, task) for task in sorted(tasks, key=lambda t: -t[0])]
            for fut in as_completed(futures):
                report(*fut.result())

    runs: Dict[str, List[dict]] = {}
    for task in tasks:  # plan order, seeds in order: the record does not depend on --jobs
        runs.setdefault(run_key(task[0], task[1], task[3]), []).append(results[task])
    summary = summarize(setup, runs)
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, "schemes" + ("_quick" if a.quick else ""))
    table = format_table(setup, summary, info["unigram_ppl"])
    png = plot(setup, summary, stem + ".png")
    record = {"setup": {**asdict(setup), "recipe": asdict(r)}, **info, "seconds": round(time.time() - t_start, 1),
              "summary": summary, "runs": runs}
    for path, text in ((stem + ".json", json.dumps(record, indent=1, default=float)), (stem + ".md", table + "\n")):
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    print()
    print(table)
    print(f"\nwrote {stem}.json, {stem}.md and {png}; total {time.time() - t_start:.0f}s")
    print(result_line(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
