#!/usr/bin/env python3
"""The GPU check: Mix-LN on a real GPU with megatron-core's local backend (no TransformerEngine).

Run it through `benchmarks/gpu_check.sh` (which makes megatron-core importable from the carried
wheel when the machine lacks it). Four phases, each printed with a timestamp as it finishes, and
the JSON in benchmarks/results/ rewritten after each phase so that a cut-off run keeps its figures:

1. parity    Mix-LN decoder (L = 4, P = 2, GQA) forward + backward on the GPU in fp32 and bf16,
             against a CPU reference computed from the same weights in a separate process (which
             uses mixln_megatron.cpu; this process never does when it runs on the GPU).
2. timing    forward + backward step time and peak step memory on a 7B-shaped slice of the
             decoder (h 4096, ffn 11008, 32 heads, 8 layers, seq 4096, micro-batch 1, bf16):
             megatron's stock local spec, the Mix-LN local spec with P = 0 (same network, the
             project's norm module), P = 2 and P = L (all Post-LN). Variants are interleaved in one
             process (order rotated each round); medians and ratios are reported, and the cost of
             one Post-LN layer is extrapolated to the paper's 7B setting (32 layers, P = 2).
             Scope: the decoder block only (layers + final norm); no embedding, output layer or
             loss, so the ratios are upper bounds of the whole-model ratios.
3. spike     the gradient-spike scaler's time per step on the same slice: the P = 2 slice is
             wrapped in megatron's DDP, mixln_megatron.training.spike.install_spike_scaler installs
             the hook, and the scaler's work after finalize_model_grads is timed between device
             syncs (skipped with a message when training/spike is not in the checkout).
4. result    one JSON (machine, versions, every figure) and the line
                 RESULT step_ratio=<r> mem_ratio=<m> gpu_vs_cpu_max_abs=<d>
             step_ratio / mem_ratio: Mix-LN P = 2 over megatron's stock local spec (median step
             time; peak memory of a step above what was allocated before it, i.e. activations
             and temporaries, weights and gradients excluded). gpu_vs_cpu_max_abs: the largest
             absolute difference over output, input gradient and parameter gradients in fp32.

`--cpu-dry-run` runs the same code on the CPU (mixln_megatron.cpu + gloo) with tiny shapes, so
that tests/test_gpu_check_dryrun.py keeps the script from rotting between GPU runs. One difference:
its CPU reference process is forked from the check right after the imports (ForkedReference; the
same arguments and environment, no second import of torch and megatron-core), where the GPU run
starts a fresh interpreter.

Exit status: 0 all checks passed; 1 a parity check failed (figures are still measured and
written); 2 wrong invocation or no GPU; 3 a needed package is missing (named in the message).

What it shares with te_check.py (shapes, configs, block builders, the timing loop, JSON) lives
in device_checks.py.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import datetime as _dt
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

from device_checks import (  # what gpu_check shares with te_check
    PAPER_7B_POST_LN, PARITY_POST_LN, TOL_BF16, TOL_FP32, add_run_options, build_block, checked_phase,
    clear_mixln_env, compare_run, derive_figures, elapsed, finite_or_none, fmt, fwd_bwd, init_runtime,
    log, machine_facts, make_config, preflight, quartile_stats, require_cuda, result_path, rotary,
    RunPlan, Runtime, Shape, shutdown, slice_variants, spec_missing, start_watchdog, summarize_variants,
    time_variants, Variant, versions, write_json,
)


# ----------------------------------------------------------------------------- phase 1: parity


def _parity_inputs(shape: Shape, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape.seq, shape.micro_batch, shape.hidden, generator=g)
    gout = torch.randn(shape.seq, shape.micro_batch, shape.hidden, generator=g)
    return x, gout


def run_parity_model(block, x, gout, rope) -> dict:
    """Forward + backward once; returns CPU fp32 copies of output, input grad and param grads."""
    x = x.detach().clone().requires_grad_(True)
    out = fwd_bwd(block, x, gout, rope)
    grads = {n: p.grad.detach().float().cpu() for n, p in block.named_parameters() if p.grad is not None}
    return {"out": out.detach().float().cpu(), "x_grad": x.grad.detach().float().cpu(), "grads": grads}


def reference_main(workdir: str) -> int:
    """The CPU reference, in its own process (--_reference DIR): builds the parity model with the
    CPU shims, saves its weights and inputs, and fp32 / bf16 results from those weights."""
    import torch

    with open(os.path.join(workdir, "parity.json")) as f:
        job = json.load(f)
    shape = Shape(**job["shape"])
    rt = init_runtime(dry_run=True, seed=job["seed"])
    results = {}
    state = None
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        cfg = make_config(shape, dtype, on_cpu=True)
        block = build_block(cfg, "mixln_local", job["post_ln_layers"], rt.device, dtype)
        if state is None:
            state = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in block.state_dict().items()}
            # Norm weights start at exactly 1: perturb them so a misplaced or skipped norm shows.
            g = torch.Generator().manual_seed(job["seed"] + 1)
            for k, v in state.items():
                if torch.is_tensor(v) and "layernorm" in k:
                    state[k] = v + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype)
        block.load_state_dict(state)
        x, gout = _parity_inputs(shape, job["seed"])
        rope = rotary(cfg, shape.seq, rt.device, on_cpu=True)
        results[name] = run_parity_model(block, x.to(dtype), gout.to(dtype), rope)
    torch.save({"state": state, "results": results}, os.path.join(workdir, "reference.pt"))
    shutdown()
    return 0


def _write_reference_job(workdir: str, shape: Shape, post_ln_layers: int, seed: int) -> None:
    with open(os.path.join(workdir, "parity.json"), "w") as f:
        json.dump({"shape": dataclasses.asdict(shape), "post_ln_layers": post_ln_layers, "seed": seed}, f)


def _reference_argv(workdir: str) -> list:
    """The reference process's arguments after the script (the GPU run: a fresh interpreter)."""
    return ["--_reference", workdir]


def _reference_env() -> dict:
    """CUDA hidden, so that the reference may use the CPU shims; no torchrun variables."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    for var in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        env.pop(var, None)
    return env


def _reference_failed(returncode: int, output: str) -> RuntimeError:
    return RuntimeError(f"the CPU reference process failed (exit {returncode}):\n{output[-4000:]}")


def run_cpu_reference(workdir: str, shape: Shape, post_ln_layers: int, seed: int, timeout: float = 600) -> dict:
    """Start the reference process (CUDA hidden, so that it may use the CPU shims) and load its file."""
    import torch

    _write_reference_job(workdir, shape, post_ln_layers, seed)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *_reference_argv(workdir)],
        env=_reference_env(), capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0:
        raise _reference_failed(proc.returncode, proc.stdout + proc.stderr)
    return torch.load(os.path.join(workdir, "reference.pt"), weights_only=False)


def _reference_child(log_path: str, env: dict, argv: list) -> None:
    """The forked reference process: its output to the log file, the fresh interpreter's
    environment, then main() as that interpreter would run it."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Python's streams onto those descriptors, whatever the parent had put in their place
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    sys.exit(main(argv))


class ForkedReference:
    """--cpu-dry-run only: the CPU reference process, forked from this one right after the imports
    (before the process group, the CPU shims or any computation exist here). The child runs
    main(_reference_argv(workdir)) in _reference_env(), the arguments and environment that the GPU
    run's fresh interpreter gets, so the reference code (its argument, preflight, reference_main)
    is the same; it saves the second import of torch and megatron-core (~8 CPU-seconds), and the
    reference computes while this process sets itself up. The GPU run keeps the fresh interpreter
    (run_cpu_reference): a process that uses CUDA must not fork, and its reference must not share
    this process's modules."""

    def __init__(self, shape: Shape, post_ln_layers: int, seed: int):
        import multiprocessing

        self._tmp = tempfile.TemporaryDirectory(prefix="mixln_parity_")
        self.workdir = self._tmp.name
        _write_reference_job(self.workdir, shape, post_ln_layers, seed)
        self.log_path = os.path.join(self.workdir, "reference.log")
        sys.stdout.flush()
        sys.stderr.flush()
        self.started = time.monotonic()
        self.process = multiprocessing.get_context("fork").Process(
            target=_reference_child, args=(self.log_path, _reference_env(), _reference_argv(self.workdir)),
            name="cpu-reference")
        self.process.start()
        atexit.register(self._kill)  # after multiprocessing's own exit handler, so it runs first

    def _kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()

    def result(self, timeout: float = 600) -> dict:
        """Wait for the child (as run_cpu_reference waits for its process) and load its file."""
        import torch

        try:
            self.process.join(timeout)
            if self.process.exitcode is None:
                raise subprocess.TimeoutExpired(f"forked reference ({self.workdir})", timeout)
            if self.process.exitcode != 0:
                with open(self.log_path, errors="replace") as f:
                    raise _reference_failed(self.process.exitcode, f.read())
            return torch.load(os.path.join(self.workdir, "reference.pt"), weights_only=False)
        finally:
            self._kill()
            self._tmp.cleanup()


def phase_parity(rt: Runtime, shape: Shape, post_ln_layers: int, seed: int,
                 forked: ForkedReference | None = None) -> dict:
    import torch

    if forked is None:
        with tempfile.TemporaryDirectory(prefix="mixln_parity_") as workdir:
            t = time.monotonic()
            ref = run_cpu_reference(workdir, shape, post_ln_layers, seed)
            log(f"parity: CPU reference done in {time.monotonic() - t:.1f}s (separate process, CPU shims)")
    else:
        t = time.monotonic()
        ref = forked.result()
        log(f"parity: CPU reference done {time.monotonic() - forked.started:.1f}s after its start, waited "
            f"{time.monotonic() - t:.1f}s (separate process forked after the imports: dry run; CPU shims)")
    x, gout = _parity_inputs(shape, seed)
    report = {"shape": dataclasses.asdict(shape), "post_ln_layers": post_ln_layers,
              "tolerance_rel": {"fp32": TOL_FP32, "bf16": TOL_BF16}}
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # fp32 GEMMs in fp32, not TF32
    try:
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            cfg = make_config(shape, dtype, on_cpu=rt.dry_run)
            block = build_block(cfg, "mixln_local", post_ln_layers, rt.device, dtype)
            block.load_state_dict(ref["state"])
            rope = rotary(cfg, shape.seq, rt.device, on_cpu=rt.dry_run)
            run = run_parity_model(block, x.to(rt.device, dtype), gout.to(rt.device, dtype), rope)
            rt.sync()
            vs_fp32 = compare_run(run, ref["results"]["fp32"])
            entry = {"vs_cpu_fp32": vs_fp32}
            if name == "bf16":
                entry["vs_cpu_bf16"] = compare_run(run, ref["results"]["bf16"])
            tol = TOL_FP32 if name == "fp32" else TOL_BF16
            entry["ok"] = bool(vs_fp32["max_rel"] <= tol and not vs_fp32["param_grads"]["name_mismatch"])
            report[name] = entry
            log(f"parity {name}: max_abs {vs_fp32['max_abs']:.3e} max_rel {vs_fp32['max_rel']:.3e} "
                f"(tol {tol:g}) -> {'ok' if entry['ok'] else 'FAIL'}")
            del block
    finally:
        torch.set_float32_matmul_precision(precision)
    report["cpu_bf16_vs_cpu_fp32"] = compare_run(ref["results"]["bf16"], ref["results"]["fp32"])
    report["gpu_vs_cpu_max_abs"] = report["fp32"]["vs_cpu_fp32"]["max_abs"]
    report["ok"] = report["fp32"]["ok"] and report["bf16"]["ok"]
    return report


# ----------------------------------------------------------------------------- phase 3: spike scaler


def phase_spike(rt: Runtime, variant: Variant, shape: Shape, warmup: int, repeats: int, seed: int) -> dict:
    """The gradient-spike scaler's cost per step, on the Mix-LN P = 2 slice of the timing phase.

    The slice is wrapped in megatron's DistributedDataParallel (fp32 grad buffers, as in training)
    and mixln_megatron.training.spike.install_spike_scaler puts the hook on its config. Each round runs
    forward + backward and megatron's finalize_model_grads, then times the scaler's own work
    (`after_finalize`: propose on the boundary norms' reduced grads, and the commit, which is eager
    without an optimizer) between device syncs. warmup_steps = 0 so the rule is live from step 1.
    """
    import torch

    try:
        spike = importlib.import_module("mixln_megatron.training.spike")
    except ModuleNotFoundError as exc:
        if exc.name == "mixln_megatron.training.spike":
            reason = f"{exc.name} is not in this checkout"
            log(f"spike: SKIP ({reason})")
            return {"status": "skipped", "reason": reason}
        raise
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads

    logging.getLogger("megatron.core.distributed").setLevel(logging.WARNING)  # DDP lists every param
    block = variant.block
    for p in variant.params:
        p.grad = None
    config = block.config
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                              use_distributed_optimizer=False), block,
    )
    scaler = spike.install_spike_scaler([ddp], config=config, settings={"warmup_steps": 0})
    if scaler is None:
        return {"status": "skipped", "reason": "install_spike_scaler found no Post/Pre-LN boundary"}
    host_timing = scaler.enable_timing()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape.seq, shape.micro_batch, shape.hidden, generator=g).to(rt.device, torch.bfloat16)
    gout = torch.randn(shape.seq, shape.micro_batch, shape.hidden, generator=g).to(rt.device, torch.bfloat16)
    x.requires_grad_(True)
    rope = rotary(config, shape.seq, rt.device, on_cpu=rt.dry_run)
    hook_ms, step_ms = [], []
    try:
        for i in range(warmup + repeats):
            ddp.zero_grad_buffer()
            x.grad = None
            rt.sync()
            t0 = time.perf_counter()
            fwd_bwd(ddp, x, gout, rope)
            finalize_model_grads([ddp], None)
            rt.sync()
            t1 = time.perf_counter()
            scaler.after_finalize([ddp], False, None)
            rt.sync()
            t2 = time.perf_counter()
            if i >= warmup:
                step_ms.append((t1 - t0) * 1e3)
                hook_ms.append((t2 - t1) * 1e3)
    finally:
        spike.remove_spike_scaler(config)
    stats = quartile_stats(hook_ms)
    step = quartile_stats(step_ms)
    targets = [t.name for t in scaler.targets]
    out = {
        "status": "measured", "on_variant": variant.name, "targets": targets,
        "target_elements": sum(t.numel for t in scaler.targets),
        "settings": scaler.settings.describe(),
        "hook_ms": stats, "hook_times_ms": hook_ms,
        "ddp_step_ms": step, "pct_of_step": 100.0 * stats["median"] / step["median"] if step.get("median") else None,
        "host_timing": dict(host_timing),
        "method": "DDP-wrapped slice; per round fwd+bwd+finalize_model_grads, then the scaler's "
                  "after_finalize timed between device syncs",
    }
    log(f"spike: scaler on {len(targets)} boundary norm tensors: median {stats['median']:.3f} ms per step "
        f"({fmt(out['pct_of_step'], '.3f')}% of a {step['median']:.1f} ms DDP step)")
    return out


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(ap, "same code on the CPU (mixln_megatron.cpu + gloo) with tiny shapes", seed=1234)
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="watchdog: dump every thread's stack and exit after this long (default 450 on "
                         "the GPU, keeping the whole run under 8 minutes; 0 = off; off in the dry run)")
    ap.add_argument("--_reference", metavar="DIR", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args._reference:
        clear_mixln_env()
    if args._reference:
        preflight(need_gpu_modules=False)
        return reference_main(args._reference)
    if not args.cpu_dry_run and not spec_missing("torch"):
        require_cuda()  # before the heavier imports: a CPU machine is told at once
    preflight(need_gpu_modules=not args.cpu_dry_run)
    import torch

    dry = args.cpu_dry_run
    plan = RunPlan.from_args(args)
    warmup, repeats, shape, parity_shape = plan.warmup, plan.repeats, plan.shape, plan.parity_shape
    # dry run: the CPU reference starts now, forked (see ForkedReference); the GPU run starts a
    # fresh interpreter for it in the parity phase
    forked = ForkedReference(parity_shape, PARITY_POST_LN, args.seed) if dry and not args.skip_parity else None
    start_watchdog(args.max_seconds if args.max_seconds is not None else (0 if dry else 450))

    rt = init_runtime(dry, seed=args.seed, backend=args.dist_backend)
    path = result_path(args.out_dir, "gpu_check", rt.mode)
    machine, vers = machine_facts(rt), versions()
    log(f"gpu_check ({rt.mode}) on {machine.get('device_name')}; torch {torch.__version__}; megatron-core "
        f"{vers.get('megatron_core')} from {vers.get('megatron_core_path')}; JSON -> {path}")
    report = {
        "check": "gpu_check", "schema": 1, "mode": rt.mode,
        "started": _dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine, "versions": vers,
        "notes": [
            "backend: megatron-core local modules (no TransformerEngine, no apex); fused kernels off",
            "timing scope: decoder block only (layers + final norm), no embedding / output layer / loss",
            "local attention is unfused (O(seq^2) memory and time), so per-layer baselines are larger "
            "than with TE's flash attention and overhead percentages are smaller than they would be with TE",
            "step_peak_gib: peak allocated during a step minus allocated before it (activations and "
            "temporaries; weights and persistent gradients excluded)",
        ],
        "phases": {},
    }
    write_json(path, report)
    ok = True

    # 1. parity
    if not args.skip_parity:
        parity = checked_phase(report, path, "parity", phase_parity, rt, parity_shape, PARITY_POST_LN, args.seed,
                               forked)
        ok = ok and parity.get("ok", False)

    # 2. timing
    spike_variant = None
    if not args.skip_timing:
        t = time.monotonic()
        variants = slice_variants(shape, "local", arms=True)  # the comparison arms' cost beside Mix-LN's
        timing = {"shape": dataclasses.asdict(shape), "dtype": "bf16", "warmup": warmup, "repeats": repeats,
                  "scope": "decoder block only (TransformerBlock: layers + final norm)"}
        report["phases"]["timing"] = timing

        def partial(vs):
            timing["variants"] = summarize_variants(vs, shape)
            write_json(path, report)

        summary = time_variants(
            rt, lambda s, d: make_config(s, d, on_cpu=dry), shape, variants, warmup, repeats, args.seed,
            on_round=partial,
        )
        timing["variants"] = summary
        timing["figures"] = derive_figures(summary, shape, "local")
        timing["seconds"] = time.monotonic() - t
        for v in variants:
            s = summary[v.name]
            log(f"timing {v.name}: median {fmt(s['step_ms'].get('median'), '.2f')} ms "
                f"(p25 {fmt(s['step_ms'].get('p25'), '.2f')}, p75 {fmt(s['step_ms'].get('p75'), '.2f')}), "
                f"step peak {fmt(s['step_peak_gib'], '.3f')} GiB")
        fig = timing["figures"]
        log(f"timing ratios: P2/stock step {fmt(fig['step_ratio_p2_vs_stock'])} mem "
            f"{fmt(fig['mem_ratio_p2_vs_stock'])}; P2/P0 step {fmt(fig['step_ratio_p2_vs_p0'])}; "
            f"P0/stock step {fmt(fig['step_ratio_p0_vs_stock'])}")
        for name, arm in fig.get("arms", {}).items():
            log(f"timing arm {name} ({arm['layout']}): step {fmt(arm['step_ratio_vs_p0'])} x P0, "
                f"mem {fmt(arm['mem_ratio_vs_p0'])} x P0")
        if "extrapolated_7b" in fig:
            e = fig["extrapolated_7b"]
            log(f"per Post-LN layer: {fmt(fig['per_post_ln_layer']['ms'], '.3f')} ms; 7B (32 layers, P=2) "
                f"decoder overhead {fmt(e['mixln_extra_ms'], '.3f')} ms = {fmt(e['overhead_pct'], '.3f')}%")
        write_json(path, report)
        spike_variant = next((v for v in variants if v.post_ln_layers == min(PAPER_7B_POST_LN, shape.layers)), None)

        # 3. spike scaler on the same slice
        try:
            report["phases"]["spike"] = phase_spike(rt, spike_variant, shape, warmup, repeats, args.seed)
        except Exception as exc:  # a figure missing, not a reason to lose the others
            log(f"spike: ERROR {type(exc).__name__}: {exc}")
            report["phases"]["spike"] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        write_json(path, report)
        for v in variants:
            v.block = v.params = None

    # 4. result
    fig = report["phases"].get("timing", {}).get("figures", {})
    parity = report["phases"].get("parity", {})
    result = {
        "step_ratio": finite_or_none(fig.get("step_ratio_p2_vs_stock")),
        "mem_ratio": finite_or_none(fig.get("mem_ratio_p2_vs_stock")),
        "gpu_vs_cpu_max_abs": finite_or_none(parity.get("gpu_vs_cpu_max_abs")),
        "parity_ok": parity.get("ok") if parity else None,
        "definition": "step/mem ratio: Mix-LN P=2 over megatron's stock local spec on the slice; "
                      "gpu_vs_cpu_max_abs: fp32 parity, max over output, input grad and param grads",
    }
    report["result"] = result
    report["elapsed_s"] = elapsed()
    write_json(path, report)
    shutdown()
    log(f"wrote {path}")
    if parity and not parity.get("ok", False):
        print("FAIL parity: GPU results differ from the CPU reference beyond tolerance (see JSON)", flush=True)
    print(f"RESULT step_ratio={fmt(result['step_ratio'])} mem_ratio={fmt(result['mem_ratio'])} "
          f"gpu_vs_cpu_max_abs={fmt(result['gpu_vs_cpu_max_abs'], '.3e')}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
