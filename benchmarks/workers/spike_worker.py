"""torchrun worker for the gradient-spike scaler: tests/test_spike.py and benchmarks/spike.py.

    python -m torch.distributed.run --nproc_per_node=N benchmarks/workers/spike_worker.py \
        --out DIR --layouts ddp,distopt,...

Each layout re-initialises megatron's parallel state and builds a tiny Mix-LN GPT (4 layers,
hidden 64, P = 2, so the boundary layers are 2 and 3 and the targets are their four norm weights),
wrapped in megatron's DistributedDataParallel, with get_megatron_optimizer (Adam) and the schedule
from get_forward_backward_func. Every layout sees the same global batch per step (DP ranks take
their rows of it). Spikes are injected (x1000) into the reduced gradient of chosen target elements
by a finalize function that the scaler's hook wraps, so the scaler sees them exactly as it would
see a real spike. Results go to DIR/<layout>.rank<r>.pt; the tests compare them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

NUM_LAYERS = 4
POST_LN = 2  # boundary layers 2 (last Post-LN) and 3 (first Pre-LN)
GLOBAL_BATCH = 4
MICRO_BATCH = 2
STEPS = 8
SETTINGS = dict(threshold=50.0, beta=0.9, warmup_steps=3, log_interval=4)
# step -> [(target name, element, factor)]; the scaler is warm from step 4 on (3 committed steps).
INJECT = {
    5: [("layer2.norm2.weight", 5, 1000.0), ("layer3.norm1.weight", 7, 1000.0)],
    7: [("layer2.norm1.weight", 11, 1000.0), ("layer3.norm2.weight", 2, -1000.0)],
}
# fp16 layout: a non-finite target gradient at step 4 (its state must not move and the optimizer
# skips the step), a non-finite non-target gradient at step 6 (the optimizer skips: nothing commits).
INF_INJECT = {4: [("layer3.norm1.weight", 1, math.inf)], 6: [("nontarget", 0, math.inf)]}

LAYOUTS = {
    # name: tp, pp, sequence parallel, distributed optimizer, how the scaler is installed, inject
    # ddp_plain also saves the initial weights, which every later layout of the launch loads: a
    # pipeline stage initialises its layers from another random stream than a whole model does.
    "ddp_plain": dict(scaler=None, inject=False, save="ddp_plain", save_init=True),
    "ddp_quiet": dict(scaler="api", inject=False),
    "distopt_plain": dict(scaler=None, inject=False, distopt=True),
    "ddp": dict(scaler="api"),
    "distopt": dict(scaler="api", distopt=True, nosync=True),
    "tp2sp": dict(scaler="api", tp=2, sp=True),
    "pp2": dict(scaler="spec", pp=2, nosync=True),
    "pp2_resume": dict(scaler="spec", pp=2, resume_at=5),
    # the same, through a checkpoint whose spike state is in format 1 (earlier versions' objects)
    "pp2_resume_format1": dict(scaler="spec", pp=2, resume_at=5, format1=True),
    "fresh_load": dict(scaler="spec", load="ddp_plain", steps=2),
    "fp16": dict(scaler="spec", fp16=True, inf=True, nosync=True),
    "tp2pp2_distopt": dict(scaler="spec", tp=2, pp=2, sp=True, distopt=True),
    "dp2tp2_distopt": dict(scaler="api", tp=2, sp=True, distopt=True),
    # benchmarks/spike.py: default threshold / beta / warm-up, random x1000 spikes after warm-up.
    "bench": dict(scaler="api", distopt=True, bench="record"),
    "bench_timing": dict(scaler="api", distopt=True, bench="time"),
}


class NoHostSync:
    """Records every call that would make the host wait for the device (item, tolist, bool(t),
    nonzero, .cpu(), ...) while the hook runs: a CPU stand-in for torch.cuda.set_sync_debug_mode.
    Megatron's full-iteration CUDA graphs capture the hook, where such calls are not allowed."""

    BANNED = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu",
              "nonzero", "masked_select", "unique", "__array__", "__format__", "__repr__"}
    paused = False

    def __init__(self, sink):
        from torch.overrides import TorchFunctionMode

        banned, sink_ = self.BANNED, sink

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                if name in banned and not NoHostSync.paused:
                    sink_.append(name)
                return func(*args, **(kwargs or {}))

        self.mode = _Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _guard_host_syncs(scaler, run) -> None:
    """Watch every hook call after the (eager, once) set-up."""
    original = scaler.after_finalize

    def guarded(*args, **kwargs):
        if not scaler.is_set_up:
            return original(*args, **kwargs)
        run.hook_calls_checked += 1
        with NoHostSync(run.sync_violations):
            return original(*args, **kwargs)

    scaler.after_finalize = guarded


class Run:
    """Everything one layout records."""

    def __init__(self, name, bench=False):
        self.name = name
        self.bench = bench
        self.step = 0
        self.losses, self.digests, self.successes = [], [], []
        self.inputs, self.decisions, self.replacements = {}, {}, {}
        self.warnings = []
        self.step_times = []
        self.states = []  # scaler state after each step
        self.injected = []  # (step, target, element) of the injected spikes
        self.sync_violations, self.hook_calls_checked = [], 0
        self.inject_s = 0.0


def _settings_for(layout: dict):
    """Spec layouts get the scaler from the settings, installed by install_training_hooks."""
    from mixln_megatron.model.settings import MixLNSettings, SpikeSettings

    if layout.get("scaler") != "spec":
        return MixLNSettings(post_ln_layers=POST_LN)
    keys = ("threshold", "beta", "warmup_steps")
    return MixLNSettings(post_ln_layers=POST_LN, spike=SpikeSettings(enabled=True, **{k: SETTINGS[k] for k in keys}))


def _bench_plan(steps: int) -> dict:
    """Two random target elements every 4th step after the default warm-up."""
    import random

    from mixln_megatron.training.spike import DEFAULT_WARMUP_STEPS

    names = ["layer2.norm1.weight", "layer2.norm2.weight", "layer3.norm1.weight", "layer3.norm2.weight"]
    rng = random.Random(0)
    plan = {}
    for step in range(DEFAULT_WARMUP_STEPS + 2, steps + 1, 4):
        picks = set()
        while len(picks) < 2:
            picks.add((rng.choice(names), rng.randrange(64)))
        plan[step] = [(name, index, 1000.0) for name, index in sorted(picks)]
    return plan


def _named_targets(model):
    from mixln_megatron.model.layer import MixLNTransformerLayer

    out = {}
    for module in model.modules():
        if isinstance(module, MixLNTransformerLayer):
            for role, p in module.norm_parameters():
                out[f"layer{module.layer_number}.{role}"] = p
    return out


def _injector(run: Run, model, layout: dict):
    """A finalize_model_grads_func that runs megatron's, then injects spikes into reduced grads.

    Test layouts multiply fixed elements by 1000 (INJECT). Benchmark layouts set two random
    elements to 1000x their typical magnitude (the mean |g| of that element over the previous
    steps, kept here independently of the scaler): a literal x1000 of an element whose gradient is
    momentarily near zero would not be a spike at all. Under the distributed optimizer only the
    owner's value of an element counts, and the owner sees the reduced gradient, so no
    communication is needed. Time spent here is kept apart (run.inject_s).
    """
    from megatron.core.distributed import finalize_model_grads

    targets = _named_targets(model)
    nontarget = next(p for n, p in model.named_parameters() if "linear_fc2" in n)
    bench = bool(layout.get("bench"))
    if bench:
        plan = _bench_plan(layout["steps"])
    else:
        plan = dict(INJECT) if layout.get("inject", True) else {}
    if layout.get("inf"):
        for step, items in INF_INJECT.items():
            plan[step] = plan.get(step, []) + items
    run.injected = [(step, name, index) for step, items in sorted(plan.items())
                    for name, index, factor in items if name != "nontarget" and not math.isinf(factor)]
    sums = {name: torch.zeros(p.numel(), dtype=torch.float32) for name, p in targets.items()} if bench else {}
    seen = [0]

    def finalize(model_chunks, *args, **kwargs):
        result = finalize_model_grads(model_chunks, *args, **kwargs)
        started = time.perf_counter()
        for name, index, factor in plan.get(run.step, []):
            param = nontarget if name == "nontarget" else targets.get(name)
            if param is None:
                continue  # on another pipeline stage
            grad = param.main_grad.view(-1)
            if math.isinf(factor):
                grad[index] = factor
            elif bench:
                typical = float(sums[name][index]) / max(seen[0], 1)
                grad[index] = (1.0 if grad[index] >= 0 else -1.0) * factor * typical
            else:
                grad[index] *= factor
        if bench:
            for name, param in targets.items():
                sums[name].add_(param.main_grad.view(-1).abs().float())
            seen[0] += 1
        run.inject_s += time.perf_counter() - started
        return result

    return finalize


def _recorder(run: Run):
    def record(scaler, grads, spike, replacement, scale, owned):
        NoHostSync.paused = True  # the recorder is debug code, not the hook
        try:
            _record(scaler, grads, spike, replacement, scale, owned)
        finally:
            NoHostSync.paused = False

    def _record(scaler, grads, spike, replacement, scale, owned):
        g, r = grads.float(), replacement.float()
        if owned is not None:  # distributed optimizer: put the owners' pieces together (debug only)
            group = scaler.target_set.group
            g = torch.where(owned, g, 0.0)
            r = torch.where(spike, r, 0.0)
            flags = spike.to(torch.int32)
            for t in (g, r, flags):
                torch.distributed.all_reduce(t, group=group)
            spike = flags > 0
        if scale is not None:
            g, r = g / scale, r / scale
        for k, t in enumerate(scaler.targets):
            n = t.numel
            run.inputs.setdefault(run.step, {})[t.name] = g[k, :n].clone()
            run.decisions.setdefault(run.step, {})[t.name] = spike[k, :n].nonzero().flatten().tolist()
            run.replacements.setdefault(run.step, {})[t.name] = r[k, :n].clone()

    return record


def build(run: Run, layout: dict):
    """Model (DDP-wrapped), optimizer and scaler for `layout` on the current parallel state."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from harness.testing import build_gpt, tiny_config
    from mixln_megatron.training.spike import get_spike_scaler, install_spike_scaler
    from mixln_megatron.spec import get_mixln_decoder_block_spec
    from mixln_megatron.training.hooks import install_training_hooks

    settings = _settings_for(layout)
    fp16 = bool(layout.get("fp16"))
    dtype = torch.float16 if fp16 else torch.float32
    config = tiny_config(
        num_layers=NUM_LAYERS, hidden=_size(layout)["hidden"], tp=layout.get("tp", 1), pp=layout.get("pp", 1),
        sequence_parallel=bool(layout.get("sp")), fp16=fp16, params_dtype=dtype, pipeline_dtype=dtype,
    )
    spec = get_mixln_decoder_block_spec(config, backend="local", settings=settings)
    install_training_hooks(config, settings)
    model = build_gpt(config, spec)
    if fp16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=bool(layout.get("distopt")), grad_reduce_in_fp32=not fp16,
    )
    model = DistributedDataParallel(config, ddp_config, model)
    opt_config = OptimizerConfig(
        # No clipping: megatron's DDP and distributed optimizer then give bit-identical parameters
        # (their grad-norm reductions round differently), which the tests compare exactly.
        optimizer="adam", lr=1e-3, clip_grad=0.0, fp16=fp16, bf16=False, params_dtype=dtype,
        use_distributed_optimizer=bool(layout.get("distopt")),
        initial_loss_scale=2.0 ** 12 if fp16 else None,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    config.grad_scale_func = optimizer.scale_loss  # what Megatron-LM's train() does
    finalize = _injector(run, model, layout)
    scaler = None
    if layout.get("scaler") == "api":
        config.finalize_model_grads_func = finalize
        settings = {"log_interval": 50} if layout.get("bench") else SETTINGS
        scaler = install_spike_scaler([model], config, optimizer=optimizer, settings=settings)
    elif layout.get("scaler") == "spec":
        scaler = get_spike_scaler(config)  # installed by install_training_hooks; finds the optimizer itself
        assert scaler is not None, "install_training_hooks did not install the scaler"
        config.finalize_model_grads_func.original = finalize
        scaler._configure(dataclasses.replace(scaler.settings, log_interval=SETTINGS["log_interval"]),
                          scaler.placement)
    else:
        config.finalize_model_grads_func = finalize
    if scaler is not None:
        scaler.recorder = None if layout.get("bench") == "time" else _recorder(run)
        if layout.get("nosync"):
            _guard_host_syncs(scaler, run)
    return config, model, optimizer, scaler


def _size(layout: dict) -> dict:
    """Model / batch size; benchmarks/spike.py sets SPIKE_BENCH_* for its layouts."""
    size = {"hidden": 64, "seq": 16, "global_batch": GLOBAL_BATCH}
    if layout.get("bench"):
        for key in size:
            value = os.environ.get(f"SPIKE_BENCH_{key.upper()}")
            if value:
                size[key] = int(value)
    return size


def _digest(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def train_step(run: Run, config, model, optimizer, scaler=None, size=None) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from harness.testing import batch

    size = size or _size({})
    ids, labels, pos, mask = batch(seed=1000 + run.step, b=size["global_batch"], s=size["seq"])
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = size["global_batch"] // dp
    ids, labels = ids[dp_rank * rows:(dp_rank + 1) * rows], labels[dp_rank * rows:(dp_rank + 1) * rows]
    micro = [(ids[i:i + MICRO_BATCH], labels[i:i + MICRO_BATCH]) for i in range(0, rows, MICRO_BATCH)]
    position = pos[:MICRO_BATCH]

    def forward_step(data_iterator, model):
        mb_ids, mb_labels = next(data_iterator)
        output = model(mb_ids, position, mask, labels=mb_labels)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    started = time.perf_counter()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro), model=model,
        num_microbatches=len(micro), seq_length=size["seq"], micro_batch_size=MICRO_BATCH, forward_only=False,
    )
    ok, _, _ = optimizer.step()
    run.step_times.append(time.perf_counter() - started)
    run.successes.append(bool(ok))
    run.losses.append(float(sum(float(x["lm loss"]) for x in losses) / len(losses)) if losses else None)
    run.digests.append(_digest(model))
    if not run.bench:
        run.states.append(_scaler_state(scaler))


def _metadata(loading_from=None):
    """The sharded_state_dict metadata Megatron-LM passes (its keys, and content metadata at load)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    if loading_from is not None:
        md = dist_checkpointing.load_content_metadata(loading_from) or {}
    else:
        md = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    md["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    return md


def _unwrap(model):
    """The GPTModel inside DDP / Float16Module (Megatron-LM checkpoints the unwrapped model)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    while isinstance(model, (DistributedDataParallel, Float16Module)):
        model = model.module
    return model


def _as_format1(sharded: dict, md: dict, scaler) -> None:
    """Rewrite the spike state of a model's sharded state dict as mixln_megatron's format 1 saved
    it (one object per target layer, announced in the content metadata): an earlier version's
    checkpoint, for the load path that still reads it."""
    import re

    from megatron.core.dist_checkpointing.mapping import ShardedObject

    objects = {}
    for local in [k for k in sharded if ".mixln_spike_scaler." in k]:
        tensor = sharded.pop(local)
        key, number, role, name = re.fullmatch(r"(.*\.layer(\d+))\.(norm\d\.\w+)\.(momentum|step)", tensor.key).groups()
        prefix = local[: -len(f"{role}.{name}")]
        entry = objects.setdefault(prefix, (key, int(number), tensor.replica_id, {}))[3].setdefault(role, {})
        entry[name] = tensor.data.clone() if name == "momentum" else tensor.data.to(torch.int64)
    for prefix, (key, number, replica_id, targets) in objects.items():
        data = {"format": 1, "layer": number, "targets": targets, "settings": {}}
        sharded[f"{prefix}state"] = ShardedObject(key, data, (1,), (0,), replica_id=replica_id)
    md["mixln_spike_scaler"] = {"format": 1, "layers": list(scaler.layers)}


def save_checkpoint(path, model, optimizer=None, format1_scaler=None):
    from megatron.core import dist_checkpointing

    model = _unwrap(model)
    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    md = _metadata()
    state = {"model": model.sharded_state_dict(metadata=md)}
    if format1_scaler is not None:
        _as_format1(state["model"], md, format1_scaler)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=False, metadata=md)
    content = {k: v for k, v in md.items() if k != "dp_cp_group"}
    dist_checkpointing.save(state, path, content_metadata=content)
    torch.distributed.barrier()


def load_checkpoint(path, model, optimizer=None, strict="assume_ok_unexpected"):
    """strict: megatron's load strictness (its default refuses a checkpoint that lacks a requested
    key, such as the spike state of a checkpoint saved without the scaler)."""
    from megatron.core import dist_checkpointing

    model = _unwrap(model)
    md = _metadata(loading_from=path)
    request = {"model": model.sharded_state_dict(metadata=md)}
    if optimizer is not None:
        request["optimizer"] = optimizer.sharded_state_dict(request["model"], is_loading=True, metadata=md)
    state = dist_checkpointing.load(request, path, strict=strict)
    model.load_state_dict(state["model"], strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])


def _scaler_state(scaler) -> dict:
    """Full (synchronized) state of the local targets. Collective under the distributed optimizer."""
    if scaler is None:
        return {}
    scaler.synchronize()
    if scaler.state is None:
        return {}
    return {t.name: scaler.state.get_target(k) for k, t in enumerate(scaler.targets)}


def run_layout(name: str, layout: dict, out_dir: str, steps: int) -> None:
    from megatron.core import parallel_state as ps

    from harness.testing import init_distributed

    init_distributed(tp=layout.get("tp", 1), pp=layout.get("pp", 1), seed=1234)
    run = Run(name, bench=bool(layout.get("bench")))
    handler = _ListHandler(run.warnings)
    logging.getLogger("mixln_megatron.training.spike").addHandler(handler)
    steps = layout.get("steps", steps)
    layout = dict(layout, steps=steps)
    try:
        config, model, optimizer, scaler = build(run, layout)
        extra = {}
        init = os.path.join(out_dir, "ckpt_init")
        if layout.get("save_init"):
            save_checkpoint(init, model)
        elif os.path.isdir(init) and not layout.get("bench"):
            # The initial weights carry no scaler state (not what is tested): let megatron drop the keys.
            load_checkpoint(init, model, strict="log_unexpected")
            optimizer.reload_model_params()  # fp32 main copies (fp16, distributed optimizer)
            del run.warnings[:]
        if layout.get("load"):
            path = os.path.join(out_dir, "ckpt_" + layout["load"])
            try:  # megatron's default strictness: the checkpoint lacks the spike state
                load_checkpoint(path, model)
                extra["default_strictness"] = "loaded"
            except BaseException as exc:  # torch DCP's CheckpointException is a BaseException
                extra["default_strictness"] = f"{type(exc).__name__}: {exc}"
            load_checkpoint(path, model, strict="log_unexpected")
            optimizer.reload_model_params()
            extra["state_after_load"] = _holder_states(scaler)
        timing = scaler.enable_timing() if (scaler is not None and layout.get("bench") == "time") else None
        for step in range(1, steps + 1):
            run.step = step
            train_step(run, config, model, optimizer, scaler, _size(layout))
            if layout.get("resume_at") == step:
                path = os.path.join(out_dir, "ckpt_" + name)
                save_checkpoint(path, model, optimizer, format1_scaler=scaler if layout.get("format1") else None)
                extra["state_at_save"] = _scaler_state(scaler)
                del model, optimizer, scaler
                config, model, optimizer, scaler = build(run, layout)
                load_checkpoint(path, model, optimizer)
                extra["state_after_load"] = _holder_states(scaler)
        if layout.get("save"):
            save_checkpoint(os.path.join(out_dir, "ckpt_" + layout["save"]), model)
        result = dict(
            name=name, rank=torch.distributed.get_rank(),
            tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(), losses=run.losses, digests=run.digests,
            successes=run.successes, states=run.states, injected=run.injected, inputs=run.inputs, decisions=run.decisions,
            replacements=run.replacements, warnings=list(run.warnings), step_times=run.step_times,
            params={n: p.detach().float().clone() for n, p in model.named_parameters()},
            state=_scaler_state(scaler), totals=scaler.totals(reduce=True) if scaler is not None else None,
            report=scaler.last_report if scaler is not None else None,
            targets=scaler.target_names() if scaler is not None else [],
            timing=dict(timing) if timing is not None else None, inject_s=run.inject_s,
            sync_violations=run.sync_violations, hook_calls_checked=run.hook_calls_checked,
            loss_scale=float(optimizer.get_loss_scale()) if layout.get("fp16") else None,
            **extra,
        )
        torch.save(result, os.path.join(out_dir, f"{name}.rank{torch.distributed.get_rank()}.pt"))
    finally:
        logging.getLogger("mixln_megatron.training.spike").removeHandler(handler)
        torch.distributed.barrier()


def _holder_states(scaler) -> dict:
    """The state each local target holds right after a load, before any step (from the holders)."""
    return {name: {"momentum": momentum, "step": step.to(torch.int64)}
            for name, (momentum, step) in scaler.checkpoint.held_state().items()}


class _ListHandler(logging.Handler):
    def __init__(self, sink):
        super().__init__(level=logging.WARNING)
        self.sink = sink

    def emit(self, record):
        self.sink.append(record.getMessage())


# ===================================================================================== Megatron-LM
# `spike_worker.py --megatron-lm --out DIR --tag NAME -- <Megatron-LM args>`: stock
# megatron.training.pretrain with `--spec mixln_megatron.spec mixln_local_layer_spec` and
# MIXLN_SPIKE_SCALER=1 in the environment: the scaler must come from the spec alone.
MLM_INJECT = {5: [("layer2.norm2.weight", 5, 1000.0), ("layer3.norm1.weight", 7, 1000.0)]}
_MLM = {"model": None, "scaler": None, "decisions": {}, "warnings": []}


def _mlm_iteration() -> int:
    from megatron.training import get_args

    return int(get_args().curr_iteration) + 1


def _mlm_attach(model) -> None:
    """First forward step: find the scaler the spec installed, wrap its finalize with the injector."""
    if _MLM["model"] is not None:
        return
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    from mixln_megatron.training.spike import SpikeGradsHook

    _MLM["model"] = model
    hook = get_model_config(model).finalize_model_grads_func
    if os.environ.get("MIXLN_SPIKE_SCALER") != "1":
        assert not isinstance(hook, SpikeGradsHook), "the scaler was installed without MIXLN_SPIKE_SCALER=1"
        return
    assert isinstance(hook, SpikeGradsHook), f"Megatron-LM did not keep the spec's hook: {hook!r}"
    scaler = _MLM["scaler"] = hook.mixln_spike_scaler
    targets = _named_targets(model)

    def inject(model_chunks, *args, **kwargs):
        result = finalize_model_grads(model_chunks, *args, **kwargs)
        for name, index, factor in MLM_INJECT.get(_mlm_iteration(), []):
            if name in targets:
                targets[name].main_grad.view(-1)[index] *= factor
        return result

    hook.original = inject

    def record(scaler, grads, spike, replacement, scale, owned):
        for k, t in enumerate(scaler.targets):
            _MLM["decisions"].setdefault(_mlm_iteration(), {})[t.name] = spike[k, :t.numel].nonzero().flatten().tolist()

    scaler.recorder = record


def _mlm_forward_step(data_iterator, model, return_schedule_plan=False):
    from functools import partial

    from megatron.training.utils import is_first_or_last_pipeline_stage

    _mlm_attach(model)
    tokens = labels = loss_mask = position_ids = None
    if is_first_or_last_pipeline_stage(None):
        data = next(data_iterator)
        tokens, labels, loss_mask, position_ids = (data[k] for k in ("tokens", "labels", "loss_mask", "position_ids"))
    output = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask)

    def loss_func(mask, output_tensor):
        mask = mask.view(-1).float()
        loss = torch.sum(output_tensor.view(-1).float() * mask)
        count = mask.sum().to(torch.int)
        return loss, count, {"lm loss": torch.cat([loss.detach().view(1), count.view(1).float()])}

    return output, partial(loss_func, loss_mask)


def _mlm_datasets(num_samples, vp_stage=None):
    from functools import partial

    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, split=args.split,
                              tokenizer=get_tokenizer(), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False)

    def built_here(vp_stage=None):
        return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0

    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, partial(built_here, vp_stage=vp_stage),
                                         config).build()


_mlm_datasets.is_distributed = True


def run_megatron_lm(out_dir: str, tag: str, megatron_argv) -> None:
    from mixln_megatron import cpu

    cpu.enable_training()
    # The megatron-core wheel ships the prebuilt dataset helpers but no Makefile, and
    # initialize_megatron runs `make` (also on GPU machines); cpu.enable_training() does not cover it.
    from megatron.training import initialize as minit

    def _helpers_prebuilt():
        from megatron.core.datasets import helpers_cpp  # noqa: F401

        torch.distributed.barrier()

    minit._compile_dependencies = _helpers_prebuilt
    handler = _ListHandler(_MLM["warnings"])
    logging.getLogger("mixln_megatron.training.spike").addHandler(handler)
    sys.argv = [sys.argv[0]] + list(megatron_argv)
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args()
    cfg = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    try:
        pretrain(cfg, _mlm_datasets, ModelType.encoder_or_decoder, _mlm_forward_step)
    except SystemExit as exc:  # --exit-interval ends the program
        if exc.code not in (0, None):
            raise
    scaler, model = _MLM["scaler"], _MLM["model"]
    result = dict(rank=torch.distributed.get_rank(), digest=_digest(model), decisions=_MLM["decisions"],
                  warnings=_MLM["warnings"], scaler=scaler is not None)
    if scaler is not None:
        result.update(
            state={t.name: scaler.state.get_target(k) for k, t in enumerate(scaler.targets)},
            committed_steps=scaler.committed_steps, report=scaler.last_report,
            optimizer_found=scaler.optimizer is not None and not scaler.eager_commit,
        )
    torch.save(result, os.path.join(out_dir, f"mlm_{tag}.rank{torch.distributed.get_rank()}.pt"))


def main():
    if "--megatron-lm" in sys.argv:
        split = sys.argv.index("--")
        own, megatron_argv = sys.argv[1:split], sys.argv[split + 1:]
        parser = argparse.ArgumentParser()
        parser.add_argument("--megatron-lm", action="store_true")
        parser.add_argument("--out", required=True)
        parser.add_argument("--tag", required=True)
        args = parser.parse_args(own)
        torch.set_num_threads(1)
        logging.getLogger("megatron").setLevel(logging.WARNING)
        run_megatron_lm(args.out, args.tag, megatron_argv)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layouts", required=True)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    os.makedirs(args.out, exist_ok=True)
    from harness.testing import init_distributed

    init_distributed()
    for name in args.layouts.split(","):
        started = time.perf_counter()
        run_layout(name, LAYOUTS[name], args.out, args.steps)
        if torch.distributed.get_rank() == 0:
            print(f"[spike_worker] {name}: {time.perf_counter() - started:.1f}s", flush=True)
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
