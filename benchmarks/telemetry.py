"""Overhead of the per-layer gradient-norm telemetry (mixln_megatron.training.telemetry), CPU, one process.

Trains the same model twice from the same weights, interleaving steps with and without the
telemetry hook (interval N, default 10), and reports the hook's own time over the step time.
    python benchmarks/telemetry.py [--quick] [--interval 10]
Last line: RESULT telemetry_overhead=<fraction of step time> interval=<N> steps=<n>
"""

import repo_paths  # noqa: F401  (tests/ and scripts/ on sys.path: the harness, the plots)
import os
import statistics
import time


def main(argv=None):
    from harness import testing

    parser = testing.benchmark_parser(
        __doc__, quick=dict(steps=20, layers=4, hidden=128), interval=10, steps=60, layers=8, hidden=256,
    )
    a = testing.parse_benchmark_args(parser, argv)
    import torch

    from mixln_megatron.training.telemetry import install_telemetry

    run = testing.MixLNRun(num_layers=a.layers, hidden=a.hidden, heads=max(1, a.hidden // 32), post_ln_layers=a.layers // 4)
    telemetry = install_telemetry(run.cfg, interval=a.interval, path=os.path.join("runs", "bench_telemetry.jsonl"))
    step_times = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        run.train(steps=1, seed=1000 + step)
        step_times.append(time.perf_counter() - t0)
    total = sum(step_times)
    per_log = telemetry.seconds / max(1, len(telemetry.records))
    print(f"shape: L={a.layers} h={a.hidden}; {a.steps} steps, median step {statistics.median(step_times) * 1e3:.1f} ms")
    print(f"telemetry: {len(telemetry.records)} logged steps, {per_log * 1e3:.2f} ms each, "
          f"{telemetry.seconds * 1e3:.1f} ms in all")
    print(f"RESULT telemetry_overhead={telemetry.seconds / total:.5f} interval={a.interval} steps={a.steps}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
