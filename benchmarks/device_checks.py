"""What the device checks (gpu_check.py, te_check.py) share: shapes, configs, block builders,
the runtime, comparisons, the interleaved timing loop, machine facts and JSON output.

One job (the device checks' shared machinery), hence its length; the checks themselves (phases,
main) stay in their own files. Importing it imports only the standard library (preflight() must
be able to name every missing package before anything heavy loads); torch, megatron-core and
the project load inside the functions that use them.
"""

from __future__ import annotations

import repo_paths  # noqa: F401  (tests/ and scripts/ on sys.path: the harness, the plots)
import dataclasses
import datetime as _dt
import importlib
import importlib.util
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from typing import Callable, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_RESULTS = os.path.join(HERE, "results")
MCORE_SERIES = "0.19"

# ----------------------------------------------------------------------------- logging

_T0 = time.monotonic()


def elapsed() -> float:
    """Seconds since this process loaded the checks."""
    return time.monotonic() - _T0


def log(msg: str) -> None:
    """One progress line: wall-clock time and seconds since start (partial runs stay readable)."""
    now = _dt.datetime.now().strftime("%H:%M:%S")
    print(f"[{now} +{time.monotonic() - _T0:6.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------- preflight (stdlib only)

# (module, why it is needed). megatron-core 0.19.2 imports numpy, packaging and (for its MoE /
# SSM kernels) triton at import time; its wheel declares only numpy, packaging and torch.
BASE_MODULES = (
    ("torch", "PyTorch"),
    ("numpy", "imported by megatron-core at import time"),
    ("packaging", "imported by megatron-core at import time"),
)
GPU_MODULES = (("triton", "imported unconditionally by megatron-core 0.19 (MoE/SSM kernels)"),)


def spec_missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def preflight(need_gpu_modules: bool, extra: tuple = ()) -> None:
    """Fail early, naming every missing package, before anything heavy is imported."""
    wanted = list(BASE_MODULES) + (list(GPU_MODULES) if need_gpu_modules else []) + list(extra)
    missing = [(m, why) for m, why in wanted if spec_missing(m)]
    if spec_missing("megatron.core"):
        missing.append((
            "megatron.core",
            f"megatron-core {MCORE_SERIES}.x: run through benchmarks/gpu_check.sh (installs the wheel "
            "in benchmarks/wheels/ offline), or pip install megatron-core==0.19.2",
        ))
    if spec_missing("mixln_megatron"):
        missing.append(("mixln_megatron", f"this project: put {REPO} on PYTHONPATH or pip install -e ."))
    if not missing:
        try:  # what megatron.core itself imports at import time
            import megatron.core  # noqa: F401
        except ModuleNotFoundError as exc:
            missing.append((exc.name or str(exc), "imported by megatron.core at import time"))
    if missing:
        print("MISSING: " + ", ".join(m for m, _ in missing), file=sys.stderr, flush=True)
        for m, why in missing:
            print(f"  - {m}: {why}", file=sys.stderr)
        print(
            "Carry missing Python packages as wheels and install them offline, e.g. "
            "`python3 -m pip install --no-index --no-deps --target /tmp/site <wheels>` and "
            "`export PYTHONPATH=/tmp/site:$PYTHONPATH`.",
            file=sys.stderr, flush=True,
        )
        sys.exit(3)


# ----------------------------------------------------------------------------- shapes and configs


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    seq: int
    micro_batch: int = 1
    query_groups: Optional[int] = None  # None = multi-head attention (LLaMA-2 7B)

    def describe(self) -> str:
        g = f" groups {self.query_groups}" if self.query_groups else ""
        return (f"L {self.layers} h {self.hidden} ffn {self.ffn} heads {self.heads}{g} "
                f"seq {self.seq} mbs {self.micro_batch}")


SLICE_7B = Shape(layers=8, hidden=4096, ffn=11008, heads=32, seq=4096, micro_batch=1)
PAPER_7B_LAYERS, PAPER_7B_POST_LN = 32, 2
PARITY_SHAPE = Shape(layers=4, hidden=128, ffn=352, heads=4, seq=64, micro_batch=2, query_groups=2)
PARITY_POST_LN = 2
DRY_SLICE = Shape(layers=4, hidden=64, ffn=176, heads=4, seq=64, micro_batch=1)
DRY_PARITY_SHAPE = Shape(layers=4, hidden=64, ffn=176, heads=4, seq=32, micro_batch=2, query_groups=2)

# Tolerances (relative: max |a - b| / max |ref|, per tensor). fp32 runs with TF32 off; bf16 is
# compared with the fp32 CPU reference (the CPU's own bf16 error, 2-3e-2 on these shapes, is
# reported alongside). A misplaced or skipped norm gives O(1) errors, far above both bounds.
TOL_FP32 = 1e-3
TOL_BF16 = 1e-1


def add_run_options(ap, dry_run_help: str, seed: int) -> None:
    """The options every device check takes; each check adds its own after these."""
    ap.add_argument("--cpu-dry-run", action="store_true", help=dry_run_help)
    ap.add_argument("--out-dir", default=DEFAULT_RESULTS, help="where the JSON goes (default benchmarks/results)")
    ap.add_argument("--warmup", type=int, default=None, help="warmup rounds (default 3; dry run 1)")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (default 20; dry run 3)")
    ap.add_argument("--layers", type=int, default=None, help="layers of the timed slice (default 8)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length of the timed slice (default 4096)")
    ap.add_argument("--seed", type=int, default=seed)
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--dist-backend", default=None, help="torch.distributed backend (default nccl; dry run gloo)")


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What add_run_options' flags ask for: rounds and shapes (tiny ones in the dry run)."""

    warmup: int
    repeats: int
    shape: Shape
    parity_shape: Shape

    @classmethod
    def from_args(cls, args) -> "RunPlan":
        dry = args.cpu_dry_run
        base = DRY_SLICE if dry else SLICE_7B
        return cls(
            warmup=args.warmup if args.warmup is not None else (1 if dry else 3),
            repeats=args.repeats if args.repeats is not None else (3 if dry else 20),
            shape=dataclasses.replace(base, layers=args.layers or base.layers, seq=args.seq or base.seq),
            parity_shape=DRY_PARITY_SHAPE if dry else PARITY_SHAPE,
        )


def make_config(shape: Shape, dtype, on_cpu: bool, **overrides):
    """TransformerConfig of a LLaMA-style decoder; every fused kernel that needs apex/TE is off."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = dict(
        num_layers=shape.layers, hidden_size=shape.hidden, ffn_hidden_size=shape.ffn,
        num_attention_heads=shape.heads, num_query_groups=shape.query_groups,
        normalization="RMSNorm", layernorm_epsilon=1e-5, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=on_cpu,
        # no apex / TE fused kernels on the check machine; identical for every variant
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, masked_softmax_fusion=False, bias_activation_fusion=False,
    )
    cfg.update(overrides)
    return TransformerConfig(**cfg)


def block_spec(config, kind: str, post_ln_layers: Optional[int] = None, layout: Optional[str] = None):
    """kind: stock_local | stock_te (megatron's own GPT decoder spec) | mixln_local | mixln_te;
    `layout` (model.layout text) instead of P for the comparison arms."""
    if kind.startswith("stock_"):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=kind == "stock_te", normalization=config.normalization
        )
    from mixln_megatron.spec import get_mixln_decoder_block_spec

    backend = {"mixln_local": "local", "mixln_te": "te"}[kind]
    if layout is not None:
        return get_mixln_decoder_block_spec(config, backend=backend, layout=layout)
    return get_mixln_decoder_block_spec(config, backend=backend, post_ln_layers=post_ln_layers)


def build_block(config, kind: str, post_ln_layers: Optional[int], device, dtype, layout: Optional[str] = None):
    """The decoder (layers + final norm) as a TransformerBlock, on `device`, converted to `dtype`
    as megatron's Float16Module does for training (norm weights included)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    block = TransformerBlock(
        config, block_spec(config, kind, post_ln_layers, layout), post_layer_norm=True,
        pre_process=True, post_process=True,
    )
    return block.to(device=device, dtype=dtype)


def rotary(config, seq: int, device, on_cpu: bool):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                           use_cpu_initialization=on_cpu)
    return rope(seq).to(device)


def fwd_bwd(block, x, grad_out, rope):
    """One training step of the decoder without the optimizer: forward, then backward."""
    out = block(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)
    out.backward(grad_out)
    return out


# ----------------------------------------------------------------------------- runtime


class Runtime:
    """The device and its few device-specific operations (sync, memory statistics)."""

    def __init__(self, dry_run: bool):
        import torch

        self.torch = torch
        self.dry_run = dry_run
        self.device = torch.device("cpu") if dry_run else torch.device("cuda", torch.cuda.current_device())
        self.mode = "cpu-dry-run" if dry_run else "gpu"

    def sync(self) -> None:
        if not self.dry_run:
            self.torch.cuda.synchronize()

    def reset_peak(self) -> Optional[int]:
        """Start a peak window; returns the bytes allocated now (None on CPU)."""
        if self.dry_run:
            return None
        self.torch.cuda.synchronize()
        self.torch.cuda.reset_peak_memory_stats()
        return self.torch.cuda.memory_allocated()

    def peak(self) -> Optional[int]:
        if self.dry_run:
            return None
        self.torch.cuda.synchronize()
        return self.torch.cuda.max_memory_allocated()


def start_watchdog(seconds: float) -> None:
    """A hang (a collective that never returns, a stuck kernel) must not eat the machine's time:
    after `seconds` every thread's stack goes to stderr and the process exits (status 1). The JSON
    already written keeps the phases that finished."""
    if seconds and seconds > 0:
        import faulthandler

        faulthandler.dump_traceback_later(seconds, exit=True)
        log(f"watchdog: exit after {seconds:.0f}s")


def clear_mixln_env() -> None:
    """The checks measure the configurations they name: MIXLN_* settings (P, scheme, the spike
    scaler) inherited from the shell must not change what gets built. The reference process
    inherits the cleaned environment."""
    dropped = sorted(k for k in os.environ if k.startswith("MIXLN_") and k not in ("MIXLN_FORCE_WHEEL", "MIXLN_MCORE_WHEEL"))
    for k in dropped:
        del os.environ[k]
    if dropped:
        log(f"ignoring {', '.join(dropped)} from the environment (the check sets P itself)")


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device is visible; on a machine without a GPU run with --cpu-dry-run",
              file=sys.stderr, flush=True)
        sys.exit(2)


def init_runtime(dry_run: bool, seed: int = 1234, backend: Optional[str] = None) -> Runtime:
    """One-process torch.distributed group and megatron parallel state (TP = PP = 1)."""
    import torch

    if dry_run:
        from mixln_megatron import cpu

        cpu.enable()
    else:
        require_cuda()
        from mixln_megatron import cpu

        # The CPU shims would hide real device bugs: this process must never have them.
        assert not cpu.is_enabled(), "mixln_megatron.cpu is enabled in the GPU process"
        torch.cuda.set_device(0)
    from harness import testing

    os.environ.setdefault("LOCAL_RANK", "0")
    testing.init_process_group(backend or ("gloo" if dry_run else "nccl"))
    testing.init_model_parallel(1, 1, seed=seed)
    torch.manual_seed(seed)
    return Runtime(dry_run)


def shutdown() -> None:
    import torch

    try:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    except Exception:  # pragma: no cover - best effort at exit
        pass
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- comparisons


def compare(a, ref) -> dict:
    """max |a - ref| and the same relative to max |ref| (tensors of any dtype, compared in fp32)."""
    a32, r32 = a.detach().float().cpu(), ref.detach().float().cpu()
    diff = (a32 - r32).abs().max().item() if a32.numel() else 0.0
    scale = r32.abs().max().item() if r32.numel() else 0.0
    finite = bool(a32.isfinite().all().item())
    return {"max_abs": diff if finite else float("inf"), "rel": (diff / scale if scale > 0 else diff) if finite else float("inf"),
            "ref_max_abs": scale}


def compare_run(run: dict, ref: dict) -> dict:
    """Compare {'out', 'x_grad', 'grads': {name: t}} against the reference of the same form."""
    out = {"output": compare(run["out"], ref["out"]), "input_grad": compare(run["x_grad"], ref["x_grad"])}
    worst_name, worst = None, {"max_abs": 0.0, "rel": 0.0}
    max_abs = 0.0
    missing = sorted(set(ref["grads"]) ^ set(run["grads"]))
    for name, g_ref in ref["grads"].items():
        if name not in run["grads"]:
            continue
        c = compare(run["grads"][name], g_ref)
        max_abs = max(max_abs, c["max_abs"])
        if c["rel"] >= worst["rel"]:
            worst_name, worst = name, c
    out["param_grads"] = {"count": len(ref["grads"]), "max_abs": max_abs, "worst_rel": worst["rel"],
                          "worst_param": worst_name, "name_mismatch": missing}
    out["max_abs"] = max(out["output"]["max_abs"], out["input_grad"]["max_abs"], max_abs)
    out["max_rel"] = max(out["output"]["rel"], out["input_grad"]["rel"], worst["rel"])
    return out


def checked_phase(report: dict, path: str, name: str, run: Callable, *args) -> dict:
    """Run a pass/fail phase: `run(*args)` -> its dict with "ok". An exception fails the phase
    (recorded, not raised: the other phases still measure); timed, stored and written at once."""
    t = time.monotonic()
    try:
        phase = run(*args)
    except Exception as exc:
        log(f"{name}: ERROR {type(exc).__name__}: {exc}")
        phase = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    phase["seconds"] = time.monotonic() - t
    report["phases"][name] = phase
    write_json(path, report)
    return phase


def finite_or_none(v):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return None
    return v


# ----------------------------------------------------------------------------- phase 2: timing


@dataclasses.dataclass
class Variant:
    name: str
    kind: str  # stock_local | stock_te | mixln_local | mixln_te
    post_ln_layers: Optional[int]  # None for the stock spec and for a layout
    layout: Optional[str] = None  # a comparison arm's layout (model.layout text)
    block: object = None
    params: list = None
    times_ms: list = dataclasses.field(default_factory=list)
    step_peak: list = dataclasses.field(default_factory=list)
    abs_peak: list = dataclasses.field(default_factory=list)


def arm_layouts(shape: Shape) -> dict:
    """The comparison arms timed beside Mix-LN: DeepNorm in Mix-LN's place (its first P = 2 layers:
    Post-LN's cost plus a residual scale) and Sandwich-LN in every layer (two more norms a layer)."""
    p = min(PAPER_7B_POST_LN, shape.layers)
    deepnorm = f"deepnorm:1-{p},pre:*" if p < shape.layers else "deepnorm:*"
    return {"deepnorm_p2": deepnorm, "sandwich_all": "sandwich:*"}


def slice_variants(shape: Shape, backend: str = "local", arms: bool = False) -> List[Variant]:
    """Stock spec, Mix-LN P = 0, P = 2 (the paper's 7B count) and P = L (every layer Post-LN);
    with `arms`, the comparison arms of arm_layouts too."""
    out = [Variant(f"stock_{backend}", f"stock_{backend}", None)]
    for p in sorted({0, min(PAPER_7B_POST_LN, shape.layers), shape.layers}):
        out.append(Variant(f"mixln_{backend}_p{p}", f"mixln_{backend}", p))
    if arms:
        for name, layout in arm_layouts(shape).items():
            out.append(Variant(f"mixln_{backend}_{name}", f"mixln_{backend}", None, layout=layout))
    return out


def quartile_stats(values: List[float]) -> dict:
    if not values:
        return {}
    vs = sorted(values)
    q = statistics.quantiles(vs, n=4) if len(vs) >= 2 else [vs[0]] * 3
    return {"median": statistics.median(vs), "p25": q[0], "p75": q[2], "min": vs[0], "max": vs[-1], "n": len(vs)}


def time_variants(rt: Runtime, config_for: Callable, shape: Shape, variants: List[Variant], warmup: int,
                  repeats: int, seed: int, on_round: Optional[Callable] = None) -> dict:
    """Build every variant, then run warmup + repeats rounds; each round steps every variant once,
    in an order rotated by one per round. Times: wall clock around forward + backward with a device
    sync on both sides. Memory: peak allocated during the step minus allocated before it."""
    import torch

    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    x_host = torch.randn(shape.seq, shape.micro_batch, shape.hidden, generator=g)
    gout_host = torch.randn(shape.seq, shape.micro_batch, shape.hidden, generator=g)
    x = x_host.to(rt.device, dtype).requires_grad_(True)
    gout = gout_host.to(rt.device, dtype)
    rope = None
    for v in variants:
        t = time.monotonic()
        cfg = config_for(shape, dtype)
        v.block = build_block(cfg, v.kind, v.post_ln_layers, rt.device, dtype, layout=v.layout)
        v.params = [p for p in v.block.parameters() if p.requires_grad]
        if rope is None:
            rope = rotary(cfg, shape.seq, rt.device, on_cpu=rt.dry_run)
        rt.sync()
        log(f"timing: built {v.name} ({sum(p.numel() for p in v.params) / 1e6:.1f}M params) "
            f"in {time.monotonic() - t:.1f}s")
    for r in range(warmup + repeats):
        k = r % len(variants)
        order = variants[k:] + variants[:k]
        line = []
        for v in order:
            grads = [p.grad for p in v.params if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)  # gradients stay allocated, as in megatron's DDP buffers
            x.grad = None
            base = rt.reset_peak()
            rt.sync()
            t0 = time.perf_counter()
            fwd_bwd(v.block, x, gout, rope)
            rt.sync()
            dt = (time.perf_counter() - t0) * 1e3
            peak = rt.peak()
            if r >= warmup:
                v.times_ms.append(dt)
                if peak is not None:
                    v.step_peak.append(peak - base)
                    v.abs_peak.append(peak)
            line.append(f"{v.name} {dt:.1f}")
        tag = "warmup" if r < warmup else "timed"
        log(f"timing round {r + 1}/{warmup + repeats} ({tag}) ms: " + ", ".join(line))
        if on_round is not None and r >= warmup:
            on_round(variants)
    return summarize_variants(variants, shape)


def summarize_variants(variants: List[Variant], shape: Shape) -> dict:
    gib = 1024.0 ** 3
    out = {}
    for v in variants:
        entry = {"kind": v.kind, "post_ln_layers": v.post_ln_layers, "layout": v.layout,
                 "times_ms": [round(t, 4) for t in v.times_ms],
                 "step_ms": quartile_stats(v.times_ms)}
        if v.step_peak:
            entry["step_peak_gib"] = max(v.step_peak) / gib
            entry["abs_peak_gib"] = max(v.abs_peak) / gib
        else:
            entry["step_peak_gib"] = None
            entry["abs_peak_gib"] = None
        out[v.name] = entry
    return out


def _ratio(a, b):
    if a is None or b is None or not b:
        return None
    return a / b


def derive_figures(summary: dict, shape: Shape, backend: str) -> dict:
    """Ratios, the cost of one Post-LN layer, and its extrapolation to 32 layers with P = 2."""
    def med(name):
        e = summary.get(name)
        return e["step_ms"].get("median") if e and e["step_ms"] else None

    def mem(name):
        e = summary.get(name)
        return e.get("step_peak_gib") if e else None

    stock, p0 = f"stock_{backend}", f"mixln_{backend}_p0"
    p2 = f"mixln_{backend}_p{min(PAPER_7B_POST_LN, shape.layers)}"
    pall = f"mixln_{backend}_p{shape.layers}"
    fig = {
        "baselines": {"stock": stock, "p0": p0},
        "step_ratio_p2_vs_stock": _ratio(med(p2), med(stock)),
        "step_ratio_p2_vs_p0": _ratio(med(p2), med(p0)),
        "step_ratio_p0_vs_stock": _ratio(med(p0), med(stock)),
        "step_ratio_pall_vs_p0": _ratio(med(pall), med(p0)),
        "mem_ratio_p2_vs_stock": _ratio(mem(p2), mem(stock)),
        "mem_ratio_p2_vs_p0": _ratio(mem(p2), mem(p0)),
        "mem_ratio_p0_vs_stock": _ratio(mem(p0), mem(stock)),
        "mem_ratio_pall_vs_p0": _ratio(mem(pall), mem(p0)),
    }
    per_layer = {}
    if med(pall) is not None and med(p0) is not None:
        per_layer["ms"] = (med(pall) - med(p0)) / shape.layers
        per_layer["ms_from_p2"] = (med(p2) - med(p0)) / max(1, min(PAPER_7B_POST_LN, shape.layers))
        layer_ms = med(p0) / shape.layers  # includes 1/L of the final norm: negligible
        per_layer["pre_ln_layer_ms"] = layer_ms
        per_layer["pct_of_pre_ln_layer"] = 100.0 * per_layer["ms"] / layer_ms
    if mem(pall) is not None and mem(p0) is not None:
        per_layer["step_peak_gib"] = (mem(pall) - mem(p0)) / shape.layers
    fig["per_post_ln_layer"] = per_layer
    if "ms" in per_layer:
        pre_7b = PAPER_7B_LAYERS * per_layer["pre_ln_layer_ms"]
        extra = PAPER_7B_POST_LN * per_layer["ms"]
        fig["extrapolated_7b"] = {
            "layers": PAPER_7B_LAYERS, "post_ln_layers": PAPER_7B_POST_LN,
            "pre_ln_decoder_step_ms": pre_7b, "mixln_extra_ms": extra,
            "overhead_pct": 100.0 * extra / pre_7b,
            "method": "per-layer time of the P=0 slice x 32; plus 2 x (median(P=L) - median(P=0)) / L",
        }
    arms = {name: {"layout": layout, "step_ratio_vs_p0": _ratio(med(f"mixln_{backend}_{name}"), med(p0)),
                   "mem_ratio_vs_p0": _ratio(mem(f"mixln_{backend}_{name}"), mem(p0))}
            for name, layout in arm_layouts(shape).items() if f"mixln_{backend}_{name}" in summary}
    if arms:
        fig["arms"] = arms
    return fig


# ----------------------------------------------------------------------------- environment facts


def machine_facts(rt: Runtime) -> dict:
    import torch

    facts = {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
             "mode": rt.mode}
    if not rt.dry_run:
        props = torch.cuda.get_device_properties(rt.device)
        facts.update(
            device_name=props.name, capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count, total_memory_gib=props.total_memory / 1024 ** 3,
        )
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            facts["driver"] = out.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            facts["driver"] = None
    else:
        facts["device_name"] = "cpu"
    return facts


def versions() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "cudnn": None}
    try:
        out["cudnn"] = torch.backends.cudnn.version()
    except Exception:
        pass
    for key, mod, attrs in (("triton", "triton", ("__version__",)),
                            ("megatron_core", "megatron.core.package_info", ("__shortversion__", "__version__")),
                            ("mixln_megatron", "mixln_megatron", ("__version__",)),
                            ("transformer_engine", "transformer_engine", ("__version__",))):
        try:
            module = importlib.import_module(mod)
            out[key] = next(getattr(module, a) for a in attrs if hasattr(module, a))
        except Exception:
            out[key] = None
    try:
        import megatron.core

        out["megatron_core_path"] = os.path.dirname(megatron.core.__file__)
    except Exception:
        out["megatron_core_path"] = None
    try:
        out["git_commit"] = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                                           text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git_commit"] = None
    return out


def write_json(path: str, data: dict) -> None:
    """Atomic rewrite (the file is rewritten after each phase)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False, default=lambda o: str(o))
        f.write("\n")
    os.replace(tmp, path)


def result_path(out_dir: str, name: str, mode: str) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join(out_dir, f"{name}-{mode}-{stamp}.json")


def fmt(v, spec=".4f") -> str:
    return "nan" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)
