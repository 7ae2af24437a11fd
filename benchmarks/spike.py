"""Gradient-spike scaler benchmark: a tiny Mix-LN training on CPU with injected spikes.

    .venv/bin/python benchmarks/spike.py [--nproc 2] [--steps 200] [--hidden 128] [--seq 64]

Launches benchmarks/workers/spike_worker.py under torchrun (gloo) with two layouts of the same run:
DP2 with the distributed optimizer, the scaler at its defaults (threshold 50, beta 0.99, warm-up
100 steps) on the boundary norms of a 4-layer model with P = 2. Every 4th step after the warm-up,
two random target elements of the reduced gradient are set to 1000x their typical magnitude (the
mean |g| of that element over the previous steps, tracked by the injector, not by the scaler).
Multiplying the current value by 1000 instead would sometimes hit an element whose gradient is
momentarily ~1% of its usual size, which is no spike at all (measured: 5 of 50 such "spikes" stayed
under 50x the momentum, and the reference rule agreed).

  bench         records, per step, the reduced target gradients the hook saw (the owners' shards put
                together) and its decisions; here they are checked against ReferenceSpikeRule, the
                rule written element by element in plain Python floats, run on the same gradients.
  bench_timing  the same run without the recorder, timing the hook (after megatron's own
                finalize_model_grads) and the commit in the optimizer-step wrapper, against the step
                time (forward-backward + optimizer step). The report (host sync and one all-gather,
                once per logging interval, 50 steps here) is timed apart and printed on its own.

Ends with  RESULT caught=<a>/<b> disagreements=<c> overhead=<fraction of step time>
  caught         injected spikes that were scaled / injected spikes
  disagreements  elements (all targets, all steps) where the hook's decision differs from the reference
  overhead       (hook + commit time) / step time, wall clock, mean over ranks (target <= 0.005,
                 measured at --hidden 256 --seq 256, overhead.py's shape: the hook's cost is fixed per
                 step, about 0.6 ms on CPU, so the default toy shape's 117 ms step gives ~0.0065)
Scaled elements that were not injected (natural spikes) are reported on their own line.
"""

from __future__ import annotations

import argparse
import glob
import os
import socket
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "workers", "spike_worker.py")
sys.path.insert(0, ROOT)

from mixln_megatron.training.spike import (
    DEFAULT_BETA,
    DEFAULT_THRESHOLD,
    DEFAULT_WARMUP_STEPS,
    ReferenceSpikeRule,
)  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(out: str, layout: str):
    files = sorted(glob.glob(os.path.join(out, f"{layout}.rank*.pt")))
    if not files:
        raise SystemExit(f"no results for {layout} in {out}")
    return [torch.load(f, weights_only=False) for f in files]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200, help="training steps (the warm-up is 100)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--out", default=None, help="keep the worker's results here")
    args = parser.parse_args()

    out = args.out or tempfile.mkdtemp(prefix="spike_bench_")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", SPIKE_BENCH_HIDDEN=str(args.hidden),
               SPIKE_BENCH_SEQ=str(args.seq), SPIKE_BENCH_GLOBAL_BATCH=str(args.global_batch))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
           f"--master_port={_free_port()}", WORKER, "--out", out, "--layouts", "bench,bench_timing",
           "--steps", str(args.steps)]
    print(f"[spike bench] {args.nproc} ranks (DP{args.nproc}, distributed optimizer), 4 layers, "
          f"hidden {args.hidden}, seq {args.seq}, global batch {args.global_batch}, {args.steps} steps; "
          f"threshold {DEFAULT_THRESHOLD:g}, beta {DEFAULT_BETA}, warm-up {DEFAULT_WARMUP_STEPS}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n")
        raise SystemExit(f"worker failed with exit code {proc.returncode}")

    # --- decisions against the reference rule, on rank 0's record (the owners' shards put together)
    record = _load(out, "bench")[0]
    steps = sorted(record["inputs"])
    refs, disagreements, flagged = {}, 0, set()
    for step in steps:
        for name, grad in record["inputs"][step].items():
            ref = refs.setdefault(name, ReferenceSpikeRule(grad.numel()))
            _, ref_flags = ref.step(grad.tolist())
            hook = set(record["decisions"][step][name])
            ref_set = {i for i, f in enumerate(ref_flags) if f}
            disagreements += len(hook ^ ref_set)
            flagged |= {(step, name, i) for i in hook}
    injected = {tuple(x) for x in record["injected"]}
    caught = len(injected & flagged)
    natural = sorted(flagged - injected)

    # --- overhead from the timing run (no recorder)
    timing_runs = _load(out, "bench_timing")
    fractions, hook_ms, commit_ms, step_ms, report_ms = [], [], [], [], []
    for r in timing_runs:
        t = r["timing"]
        step_wall = sum(r["step_times"]) - r["inject_s"]  # without the injector's own time
        fractions.append((t["hook_s"] + t["commit_s"]) / step_wall)
        hook_ms.append(1e3 * t["hook_s"] / max(t["hook_calls"], 1))
        commit_ms.append(1e3 * t["commit_s"] / max(t["commits"], 1))
        step_ms.append(1e3 * step_wall / len(r["step_times"]))
        report_ms.append(1e3 * t["report_s"] / max(t["reports"], 1))
    overhead = sum(fractions) / len(fractions)
    totals = timing_runs[0]["totals"]
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")

    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"[spike bench] per step: hook {mean(hook_ms):.3f} ms, commit {mean(commit_ms):.3f} ms, "
          f"step {mean(step_ms):.1f} ms; overhead per rank {', '.join(f'{f:.4f}' for f in fractions)} "
          f"(wall clock; load average {load:.1f} on {os.cpu_count()} cores); report {mean(report_ms):.2f} ms "
          f"per logging interval")
    print(f"[spike bench] scaled elements in total: {totals['scaled']} (timing run), largest |g|/momentum "
          f"{totals['max_ratio']:.1f}; natural (not injected) spikes scaled: {len(natural)}"
          + (f" {natural[:10]}" if natural else ""))
    print(f"RESULT caught={caught}/{len(injected)} disagreements={disagreements} overhead={overhead:.4f}")


if __name__ == "__main__":
    main()
