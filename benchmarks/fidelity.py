"""Fidelity benchmark: does our Megatron Mix-LN reproduce the paper's direction at tiny scale?

Pretrains tiny LLaMA-shaped megatron-core GPTs (our spec, local backend, CPU; RMSNorm, SwiGLU, RoPE,
no biases, untied embeddings; a plain loop with torch AdamW, not Megatron-LM's training loop) on
the shipped Austen corpus with the shipped BPE, for
  pre_ln (P = 0), mix_ln (alpha 0.25), post_ln (P = L), lns (LayerNorm Scaling), mix_ln+lns
at 12 and 24 layers, several init seeds each. Every run sees the same token batches in the same
order and uses the same hyper-parameters (the paper's recipe scaled down: Adam (0.9, 0.999),
peak lr 2e-3, 10% linear warm-up, cosine decay to 10% of the peak, gradient clipping 1.0, no
weight decay, no dropout). Full: hidden 64, 200 steps of 16 x 64 tokens, seeds 1 and 2; quick:
hidden 32, 160 steps of 8 x 64 tokens, seed 1.

Embedding-scale control: megatron initialises the embeddings with std init_method_std (0.02);
the Mix-LN reference code uses sqrt(2/5). With tiny embeddings a Pre-LN model's residual stream
starts tiny, and a first Post-LN layer rescales it, which can look like a Mix-LN gain. Pre-LN and
Mix-LN are therefore also trained with embeddings of std sqrt(2/5) ("emb=ref" rows), and the
report says how much of the Pre-LN - Mix-LN gap remains under that init.

Gradient-norm profiles (per-layer L2 norm of the training gradient, before clipping) are recorded
at step 0 (initialization) and at a step a few dozen into training.

  python benchmarks/fidelity.py --quick      # < 5 min on 2 cores: smaller model, fewer steps, 1 seed
  python benchmarks/fidelity.py              # the full grid, < 60 min on 2 cores
Runs are independent: --jobs (default 2) trains that many at once in worker processes of one
torch thread each; results do not depend on --jobs (fixed seeds and batches, one thread per run).

Outputs (--out, default benchmarks/results): fidelity[_quick].json and fidelity[_quick]_grad_norms.png.
The last line printed is `RESULT ...` with every run's mean validation perplexity.
`--report FILE.json` prints the table and RESULT line of a saved run again without training.

Not the paper's setup: ~0.1-1M-parameter models, a 1M-token corpus, a few hundred steps; megatron
initialises the output projections of attention and MLP with std 0.02 / sqrt(2L) (HF LLaMA's
init uses 0.02 for every linear layer); and at alpha = 1 (Post-LN) the decoder's final norm follows the last
layer's own Post-LN norm (two norms in a row; the reference Post-LN applies the final norm too).
"""

from __future__ import annotations

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

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*absl.logging is not installed.*")

import torch  # noqa: E402

from mixln_megatron.analysis import diagnostics, models  # noqa: E402
from mixln_megatron.analysis.diagnostics import evaluate  # noqa: E402
from mixln_megatron.analysis.models import REFERENCE_EMBEDDING_STD, FreshShape, build_megatron_gpt  # noqa: E402
from mixln_megatron import cpu  # noqa: E402

EMB_MEGATRON = "megatron"
EMB_REFERENCE = "ref"


@dataclass(frozen=True)
class Recipe:
    steps: int
    batch_size: int
    seq_length: int
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_fraction: float = 0.1
    betas: tuple = (0.9, 0.999)  # torch Adam's defaults
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    profile_step: int = 40  # the "after a few dozen steps" grad-norm profile
    valid_windows: Optional[int] = None  # None: the whole held-out split


@dataclass(frozen=True)
class Setup:
    name: str
    depths: tuple
    seeds: tuple
    hidden: int
    heads: int
    recipe: Recipe
    variants: tuple = ("pre_ln", "mix_ln", "post_ln", "lns", "mix_ln+lns")
    control_variants: tuple = ("pre_ln", "mix_ln")
    alpha: float = 0.25


FULL = Setup("full", depths=(12, 24), seeds=(1, 2), hidden=64, heads=4,
             recipe=Recipe(steps=200, batch_size=16, seq_length=64, profile_step=40))
QUICK = Setup("quick", depths=(12, 24), seeds=(1,), hidden=32, heads=2,
              recipe=Recipe(steps=160, batch_size=8, seq_length=64, profile_step=20, valid_windows=128))


def lr_at(step: int, r: Recipe) -> float:
    """10% linear warm-up, cosine from lr to min_lr_ratio * lr over the remaining steps."""
    warm = max(1, int(round(r.warmup_fraction * r.steps)))
    if step < warm:
        return r.lr * (step + 1) / warm
    progress = (step - warm) / max(1, r.steps - warm)
    lo = r.lr * r.min_lr_ratio
    return lo + 0.5 * (r.lr - lo) * (1.0 + math.cos(math.pi * min(1.0, progress)))


def train_one(shape: FreshShape, variant: str, seed: int, alpha: float, recipe: Recipe,
              train_batches, valid_batches) -> dict:
    from mixln_megatron.model.settings import MixLNSettings

    p, scheme = diagnostics.variant_placement(variant, shape.num_layers, alpha)
    res = train_settings(shape, MixLNSettings(post_ln_layers=p, scheme=scheme), seed, recipe,
                         train_batches, valid_batches)
    return {"variant": variant, "post_ln_layers": p, "scheme": scheme, **res}


def train_settings(shape: FreshShape, settings, seed: int, recipe: Recipe, train_batches, valid_batches,
                   config_overrides: Optional[dict] = None) -> dict:
    """Train one model of `settings` (a MixLNSettings) with `recipe` on the given batches; the
    per-layer gradient-norm profiles at step 0 and recipe.profile_step, losses and timings.
    `config_overrides`: TransformerConfig fields on top of the shape's (e.g. MoE layers)."""
    lm = build_megatron_gpt(shape, seed=seed, settings=settings, config_overrides=config_overrides)
    model = lm.module
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, betas=recipe.betas, eps=1e-8,
                            weight_decay=recipe.weight_decay)
    profiles: Dict[str, List[float]] = {}  # every parameter of the layer
    matrix_profiles: Dict[str, List[float]] = {}  # weight matrices only (norm scales left out)
    losses: List[float] = []
    diverged_at = None
    t0, c0 = time.time(), time.process_time()
    for step in range(recipe.steps):
        ids, labels = train_batches[step]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe)
        opt.zero_grad(set_to_none=True)
        loss = lm.token_losses(ids, labels).mean()
        loss.backward()
        value = float(loss.detach())
        losses.append(value)
        if not math.isfinite(value):
            diverged_at = step
            break
        if step in (0, recipe.profile_step):
            profiles[str(step)] = diagnostics.layer_grad_norms(lm)
            matrix_profiles[str(step)] = diagnostics.layer_grad_norms(lm, exclude_norms=True)
        if recipe.clip_grad:
            torch.nn.utils.clip_grad_norm_(params, recipe.clip_grad)
        opt.step()
    train_seconds = time.time() - t0
    cpu_seconds = time.process_time() - c0
    valid_loss = float("nan") if diverged_at is not None else evaluate(lm, valid_batches)["loss"]
    ppl = math.exp(valid_loss) if math.isfinite(valid_loss) and valid_loss < 50 else float("inf")
    return {
        "seed": seed, "valid_loss": valid_loss, "valid_ppl": ppl, "diverged_at": diverged_at,
        "final_train_loss": statistics.fmean(losses[-10:]) if losses else float("nan"),
        "train_losses": losses, "grad_norm_profiles": profiles,
        "profile_summaries": {k: diagnostics.profile_summary(v) for k, v in profiles.items()},
        "grad_norm_profiles_matrices_only": matrix_profiles,
        "seconds": round(train_seconds, 1), "s_per_step": round(train_seconds / max(1, len(losses)), 3),
        "cpu_seconds": round(cpu_seconds, 1),
    }


def run_key(depth: int, variant: str, emb: str) -> str:
    return f"L{depth}_{variant}" + ("" if emb == EMB_MEGATRON else "_embref")


def plan(setup: Setup):
    for depth in setup.depths:
        for variant in setup.variants:
            yield depth, variant, EMB_MEGATRON
        for variant in setup.control_variants:
            yield depth, variant, EMB_REFERENCE


def _mean_sd(values: Sequence[float]):
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return float("inf"), float("nan"), len(values) - len(vals)
    sd = statistics.stdev(vals) if len(vals) > 1 else float("nan")
    return statistics.fmean(vals), sd, len(values) - len(vals)


def summarize(setup: Setup, runs: Dict[str, List[dict]]) -> dict:
    rows = {}
    for key, seed_runs in runs.items():
        ppls = [r["valid_ppl"] for r in seed_runs]
        mean, sd, diverged = _mean_sd(ppls)
        prof = {}
        for step in sorted({s for r in seed_runs for s in r["grad_norm_profiles"]}, key=int):
            profs = [r["grad_norm_profiles"][step] for r in seed_runs if step in r["grad_norm_profiles"]]
            meanprof = [statistics.fmean(col) for col in zip(*profs)]
            prof[step] = {"mean": meanprof, "summary": diagnostics.profile_summary(meanprof)}
        rows[key] = {
            "ppl_mean": mean, "ppl_sd": sd, "ppl_per_seed": ppls, "diverged_runs": diverged,
            "spread": (max(ppls) - min(ppls)) if len(ppls) > 1 and all(map(math.isfinite, ppls)) else float("nan"),
            "grad_norm_profiles": prof, "s_per_step": statistics.fmean(r["s_per_step"] for r in seed_runs),
        }
    comparisons = {}
    for depth in setup.depths:
        def ppl(v, emb=EMB_MEGATRON):
            r = rows.get(run_key(depth, v, emb))
            return None if r is None else r["ppl_mean"]
        c = {}
        pre, mix, post = ppl("pre_ln"), ppl("mix_ln"), ppl("post_ln")
        if pre and mix:
            c["mix_minus_pre"] = mix - pre
            c["mix_over_pre"] = mix / pre
        if post and pre:
            c["post_minus_pre"] = post - pre
        pre_r, mix_r = ppl("pre_ln", EMB_REFERENCE), ppl("mix_ln", EMB_REFERENCE)
        if pre and mix and pre_r and mix_r:
            gap_m, gap_r = pre - mix, pre_r - mix_r
            c["gap_pre_minus_mix_megatron_emb"] = gap_m
            c["gap_pre_minus_mix_reference_emb"] = gap_r
            # a fraction of a gap that is itself within 2% of the perplexity says nothing
            c["gap_remaining_fraction"] = gap_r / gap_m if abs(gap_m) > 0.02 * pre else float("nan")
        # seed-to-seed spread of the Pre-LN / Mix-LN rows, the noise floor of the comparison
        spreads = [rows[run_key(depth, v, EMB_MEGATRON)]["spread"] for v in ("pre_ln", "mix_ln")
                   if run_key(depth, v, EMB_MEGATRON) in rows]
        c["seed_spread_pre_mix"] = max(spreads) if spreads else float("nan")
        comparisons[f"L{depth}"] = c
    return {"rows": rows, "comparisons": comparisons}


def format_report(setup: Setup, summary: dict, unigram_ppl: Optional[float] = None) -> str:
    rows = summary["rows"]
    lines = []
    if unigram_ppl:
        lines.append(f"(unigram perplexity of the held-out split: {unigram_ppl:.1f}; '*' marks a seed above 95% "
                     "of it: it has learned little beyond token frequencies)")
    step_k = str(setup.recipe.profile_step)
    hdr = (f"{'run':<22} {'P':>3} {'val PPL':>9} {'sd':>7} {'seeds':<22} "
           f"{'init last/first':>15} {'init max/min':>12} {f'@{step_k} last/first':>15} {f'@{step_k} max/min':>13}")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for key, r in rows.items():
        p0 = r["grad_norm_profiles"].get("0", {}).get("summary", {})
        pk = r["grad_norm_profiles"].get(step_k, {}).get("summary", {})
        def show(x):
            if not math.isfinite(x):
                return "div"
            return f"{x:.2f}" + ("*" if unigram_ppl and x > 0.95 * unigram_ppl else "")

        seeds = ", ".join(show(x) for x in r["ppl_per_seed"])
        depth = int(key[1:].split("_")[0])
        variant = key.split("_", 1)[1].replace("_embref", "")
        p, _ = diagnostics.variant_placement(variant, depth, setup.alpha)
        lines.append(
            f"{key:<22} {p:>3} {r['ppl_mean']:>9.2f} {r['ppl_sd']:>7.2f} {seeds:<22} "
            f"{p0.get('last_over_first', float('nan')):>15.3f} {p0.get('max_over_min', float('nan')):>12.3f} "
            f"{pk.get('last_over_first', float('nan')):>15.3f} {pk.get('max_over_min', float('nan')):>13.3f}"
        )
    lines.append("")
    for depth_key, c in summary["comparisons"].items():
        parts = [f"{depth_key}:"]
        if "mix_over_pre" in c:
            parts.append(f"Mix-LN/Pre-LN PPL = {c['mix_over_pre']:.4f} (Mix - Pre = {c['mix_minus_pre']:+.2f})")
        if "post_minus_pre" in c:
            parts.append(f"Post - Pre = {c['post_minus_pre']:+.2f}")
        if "gap_remaining_fraction" in c:
            frac = c["gap_remaining_fraction"]
            frac_text = f"{frac:.2f}" if math.isfinite(frac) else "n/a: the gap under 0.02 is within 2%"
            parts.append(f"Pre-Mix gap: emb std 0.02 {c['gap_pre_minus_mix_megatron_emb']:+.2f}, "
                         f"emb std sqrt(2/5) {c['gap_pre_minus_mix_reference_emb']:+.2f} "
                         f"(remaining fraction {frac_text})")
        if math.isfinite(c.get("seed_spread_pre_mix", float("nan"))):
            parts.append(f"seed spread (max-min) of Pre/Mix rows {c['seed_spread_pre_mix']:.2f}")
        lines.append("  ".join(parts))
    return "\n".join(lines)


def plot_profiles(setup: Setup, summary: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    steps = ["0", str(setup.recipe.profile_step)]
    fig, axes = plt.subplots(len(setup.depths), 2, figsize=(13, 4.4 * len(setup.depths)), squeeze=False)
    for i, depth in enumerate(setup.depths):
        for j, step in enumerate(steps):
            result = {"variants": {}}
            for key, r in summary["rows"].items():
                if not key.startswith(f"L{depth}_") or step not in r["grad_norm_profiles"]:
                    continue
                variant = key.split("_", 1)[1]
                base = variant.replace("_embref", "")
                p, _ = diagnostics.variant_placement(base, depth, setup.alpha)
                prof = r["grad_norm_profiles"][step]
                label = diagnostics.LABELS.get(base, base) + (" emb=ref" if variant.endswith("_embref") else "")
                result["variants"][key] = {"label": label, "post_ln_layers": p, "per_seed": [prof["mean"]],
                                           "mean": prof["mean"], "summary": prof["summary"]}
            when = "at initialization" if step == "0" else f"after {step} steps"
            diagnostics.draw_profiles(axes[i][j], result, title=f"L={depth}: per-layer gradient norm {when}")
    return save_figure(fig, path)


def save_figure(fig, path: str) -> str:
    """Write a matplotlib figure as a PNG at `path` (its folder made) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def result_line(summary: dict, prefix: str = "fidelity_ppl_") -> str:
    """`RESULT <prefix><row>=<mean validation perplexity> ...` for every row of a summary."""
    parts = []
    for key, r in summary["rows"].items():
        v = r["ppl_mean"]
        parts.append(f"{prefix}{key}={'inf' if not math.isfinite(v) else f'{v:.3f}'}")
    return "RESULT " + " ".join(parts)


def load_data(recipe: Recipe, cache_dir: Optional[str]):
    """The fixed training batches (same for every run) and the held-out batches."""
    tokens = models.corpus_tokens(cache_dir=cache_dir)
    train_tokens, valid_tokens = models.split_train_valid(tokens)
    train_batches = models.batches(train_tokens, recipe.seq_length, recipe.batch_size, recipe.steps, seed=0)
    n_valid = len(valid_tokens) // (recipe.seq_length + 1)
    n_valid = min(n_valid, recipe.valid_windows or n_valid)
    valid_batches = models.eval_batches(valid_tokens, n_valid * recipe.seq_length, recipe.seq_length, batch_size=32)
    info = {"corpus_tokens": int(len(tokens)), "train_split_tokens": int(len(train_tokens)),
            "valid_split_tokens": int(len(valid_tokens)), "valid_tokens": n_valid * recipe.seq_length,
            "unigram_ppl": unigram_perplexity(train_tokens, valid_batches)}
    return train_batches, valid_batches, info


def unigram_perplexity(train_tokens, valid_batches, vocab: int = 4096) -> float:
    """Perplexity of the held-out labels under the training split's token frequencies (add-one):
    the plateau a model sits on while it predicts frequencies only."""
    import numpy as np

    counts = np.bincount(train_tokens, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    labels = np.concatenate([lab.reshape(-1).numpy() for _, lab in valid_batches])
    return float(math.exp(-logp[labels].mean()))


_WORKER: dict = {}


def _worker_init(recipe: Recipe, cache_dir: Optional[str], threads: int) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    train_batches, valid_batches, _ = load_data(recipe, cache_dir)
    _WORKER.update(train=train_batches, valid=valid_batches)


def _pool_worker_init(recipe: Recipe, cache_dir: Optional[str], threads: int) -> None:
    cpu.enable()  # the worker process is ours: the CPU harness for its whole life
    _worker_init(recipe, cache_dir, threads)


def _run_task(setup: Setup, task):
    depth, variant, emb, seed = task
    r = setup.recipe
    shape = FreshShape(num_layers=depth, hidden_size=setup.hidden, num_attention_heads=setup.heads,
                       vocab_size=4096, seq_length=r.seq_length,
                       embedding_init_std=REFERENCE_EMBEDDING_STD if emb == EMB_REFERENCE else None)
    res = train_one(shape, variant, seed, setup.alpha, r, _WORKER["train"], _WORKER["valid"])
    res["embedding_init"] = emb
    return task, res


def setup_from_record(d: dict) -> Setup:
    tup = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    recipe = Recipe(**{k: tuple(v) if isinstance(v, list) else v for k, v in d["recipe"].items()})
    return Setup(**{**tup, "recipe": recipe})


def print_saved_report(path: str, cache_dir: Optional[str] = None) -> int:
    with open(path) as f:
        record = json.load(f)
    setup = setup_from_record(record["setup"])
    summary = summarize(setup, record["runs"])
    unigram = record.get("unigram_ppl")
    if unigram is None:
        _, valid_batches, info = load_data(setup.recipe, cache_dir)
        unigram = info["unigram_ppl"]
    print(format_report(setup, summary, unigram))
    print(result_line(summary))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, fewer steps, 1 seed (< 5 min)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--cache-dir", default=None, help="tokenized corpus cache (default: $TMPDIR)")
    ap.add_argument("--steps", type=int, default=None, help="override the number of training steps")
    ap.add_argument("--seeds", default=None, help="override the seeds, e.g. 1,2,3")
    ap.add_argument("--depths", default=None, help="override the depths, e.g. 12,24")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--jobs", type=int, default=2,
                    help="runs trained at once, in separate processes (default 2: one per core; these "
                    "models are too small for two threads to help one run)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per job (default 1)")
    ap.add_argument("--report", metavar="JSON", default=None,
                    help="print the table and RESULT line of a saved fidelity JSON instead of training")
    a = ap.parse_args(argv)
    if a.report:
        return print_saved_report(a.report, a.cache_dir)

    setup = QUICK if a.quick else FULL
    if a.steps is not None:
        setup = replace(setup, recipe=replace(setup.recipe, steps=a.steps,
                                              profile_step=min(setup.recipe.profile_step, a.steps - 1)))
    if a.lr is not None:
        setup = replace(setup, recipe=replace(setup.recipe, lr=a.lr))
    if a.seeds:
        setup = replace(setup, seeds=tuple(int(s) for s in a.seeds.split(",")))
    if a.depths:
        setup = replace(setup, depths=tuple(int(s) for s in a.depths.split(",")))
    r = setup.recipe
    t_start = time.time()

    _worker_init(r, a.cache_dir, a.threads)  # also builds the dataset cache once, before any worker
    _, _, info = load_data(r, a.cache_dir)
    print(f"[fidelity:{setup.name}] corpus {info['corpus_tokens']} tokens (train {info['train_split_tokens']}, "
          f"held out {info['valid_split_tokens']}); {r.steps} steps x {r.batch_size} x {r.seq_length} = "
          f"{r.steps * r.batch_size * r.seq_length} training tokens per run, validation on "
          f"{info['valid_tokens']} tokens; hidden {setup.hidden}, heads {setup.heads}, depths {setup.depths}, "
          f"seeds {setup.seeds}; lr {r.lr}; {a.jobs} job(s) x {a.threads} thread(s); unigram PPL "
          f"{info['unigram_ppl']:.1f}", flush=True)

    tasks = [(depth, variant, emb, seed) for depth, variant, emb in plan(setup) for seed in setup.seeds]
    results = {}

    def report(task, res):
        results[task] = res
        key = run_key(task[0], task[1], task[2])
        div = f" DIVERGED at step {res['diverged_at']}" if res["diverged_at"] is not None else ""
        print(f"  {key:<22} seed {task[3]}: valid PPL {res['valid_ppl']:.3f} (train loss "
              f"{res['final_train_loss']:.3f}) {res['seconds']:.0f}s (cpu {res['cpu_seconds']:.0f}s){div}  "
              f"[{len(results)}/{len(tasks)}, elapsed {time.time() - t_start:.0f}s]", flush=True)

    if a.jobs <= 1:
        with cpu.harness():
            for task in tasks:
                report(*_run_task(setup, task))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # Deepest first, so the longest runs do not end up alone at the tail.
        order = sorted(tasks, key=lambda t: -t[0])
        with ProcessPoolExecutor(max_workers=a.jobs, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_pool_worker_init, initargs=(r, a.cache_dir, a.threads)) as pool:
            futures = [pool.submit(_run_task, setup, task) for task in order]
            for fut in as_completed(futures):
                report(*fut.result())

    runs: Dict[str, List[dict]] = {}
    for task in tasks:  # plan order, seeds in order: the record does not depend on --jobs
        runs.setdefault(run_key(task[0], task[1], task[2]), []).append(results[task])
    summary = summarize(setup, runs)
    os.makedirs(a.out, exist_ok=True)
    stem = "fidelity" + ("_quick" if a.quick else "")
    fig = plot_profiles(setup, summary, os.path.join(a.out, f"{stem}_grad_norms.png"))
    record = {
        "setup": {**asdict(setup), "recipe": asdict(r)}, **info,
        "train_tokens_per_run": r.steps * r.batch_size * r.seq_length,
        "jobs": a.jobs, "torch_threads_per_job": a.threads,
        "seconds": round(time.time() - t_start, 1), "summary": summary, "runs": runs,
    }
    with open(os.path.join(a.out, f"{stem}.json"), "w") as f:
        json.dump(record, f, indent=1, default=float)
    print()
    print(format_report(setup, summary, info["unigram_ppl"]))
    print(f"\nwrote {os.path.join(a.out, stem + '.json')} and {fig}; total {time.time() - t_start:.0f}s")
    print(result_line(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
