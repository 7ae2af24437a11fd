"""The gradient-spike scaler (training/spike/): the rule, and the scaler on Megatron's reduced grads.

Unit tests run in-process. The multi-process tests launch benchmarks/workers/spike_worker.py
(through tests/workers/fork_queue.py) once per world size (torchrun, gloo, CPU), covering several
layouts per launch; each layout trains a tiny Mix-LN GPT (4 layers, hidden 64, P = 2: targets are
the norms of layers 2 and 3) for 8 steps with x1000 spikes injected into reduced target gradients
at steps 5 and 7 (the scaler is warm from step 4 on: threshold 50, beta 0.9, warm-up 3).
"""

from __future__ import annotations

import glob
import math
import os
import sys

import pytest
import torch

from harness.testing import run_python
from mixln_megatron.model.placement import Placement
from mixln_megatron.training.spike import (
    ReferenceSpikeRule,
    SpikeConfigError,
    SpikeSettings,
    SpikeState,
    resolve_spike_settings,
    target_layers,
)


def spike_settings_from_env(env):
    from mixln_megatron.model.settings import MixLNSettings

    return MixLNSettings.from_environ(env).spike

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(ROOT, "benchmarks", "workers", "spike_worker.py")  # shared with benchmarks/spike.py
sys.path.insert(0, os.path.dirname(WORKER))
import spike_worker as W  # noqa: E402  (constants only; megatron is imported lazily there)

# What the launches run: spike_worker.main() with megatron's checkpoint write-results queue started
# by fork rather than by a spawned interpreter (tests/workers/fork_queue.py).
LAUNCH = [os.path.join(HERE, "workers", "fork_queue.py"), WORKER]

WORLD2_LAYOUTS = ["ddp_plain", "ddp_quiet", "ddp", "distopt", "tp2sp", "pp2", "pp2_resume", "pp2_resume_format1",
                  "fresh_load", "fp16"]
WORLD4_LAYOUTS = ["ddp_plain", "tp2pp2_distopt", "dp2tp2_distopt"]  # ddp_plain: the initial weights


# ===================================================================================== the rule
def _step(state, grad, scale=None, owned=None, stats=None):
    """One step the way the hook takes it: propose in place on an fp32 buffer, then commit.
    Returns (out, spike, replacement); the step's statistics go to `stats` (a [3] tensor)."""
    out = grad.float().clone()
    spike, replacement = state.propose_in_place(out, scale, owned)
    state.commit(stats)
    return out, spike, replacement


def _run_both(sizes, steps, threshold=50.0, beta=0.9, warmup=3, scale=None, seed=0, poke=None):
    """SpikeState and the per-element reference on the same random gradients; returns both."""
    gen = torch.Generator().manual_seed(seed)
    state = SpikeState(sizes, threshold, beta, warmup)
    refs = [ReferenceSpikeRule(n, threshold, beta, warmup) for n in sizes]
    history = []
    for step in range(steps):
        grads = [torch.randn(n, generator=gen) * (1 + step % 3) for n in sizes]
        if poke:
            poke(step, grads)
        scaled_in = [g * scale for g in grads] if scale is not None else grads
        rows = torch.zeros(len(sizes), max(sizes))  # the hook's [K, n] buffer, zero padding
        for row, g in zip(rows, scaled_in):
            row[: g.numel()] = g
        out, spike, _ = _step(state, rows, None if scale is None else torch.tensor([scale]))
        if scale is not None:
            out = out / scale
        ref = [r.step(g.tolist()) for r, g in zip(refs, grads)]
        history.append((grads, out, spike, ref))
    return state, refs, history


def _close(a, b):
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= 1e-5 * max(abs(a), abs(b))


@pytest.mark.parametrize("scale", [None, 4096.0])
def test_rule_matches_reference(scale):
    def poke(step, grads):
        if step in (6, 11):
            grads[0][3] *= 1000
            grads[2][1] *= -1000
        if step == 9:
            grads[1][2] = float("nan")
            grads[2][0] = float("inf")

    sizes = [8, 8, 5]  # unequal: exercises the padded rows
    state, refs, history = _run_both(sizes, 16, scale=scale, poke=poke)
    spikes = 0
    for step, (grads, out, spike, ref) in enumerate(history):
        for k, n in enumerate(sizes):
            ref_out, ref_flags = ref[k]
            assert spike[k, :n].tolist() == ref_flags, (step, k)
            assert not spike[k, n:].any()
            for i in range(n):
                assert _close(float(out[k, i]), ref_out[i]), (step, k, i, float(out[k, i]), ref_out[i])
            spikes += sum(ref_flags)
    assert spikes == 4  # the four injected ones, nothing natural
    for k, n in enumerate(sizes):
        assert torch.allclose(state.momentum[k, :n], torch.tensor(refs[k].momentum, dtype=torch.float32), rtol=1e-5)
        assert state.step[k, :n].tolist() == [float(t) for t in refs[k].steps]


def test_spike_comes_out_at_momentum_and_the_rest_is_untouched():
    state = SpikeState([16], threshold=50, beta=0.9, warmup_steps=3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        _step(state, torch.randn(1, 16, generator=gen))
    grad = torch.randn(1, 16, generator=gen)
    grad[0, 4] = -1000 * grad[0, 4].abs()
    mhat = state.momentum / (1 - 0.9 ** state.step)
    momentum_before = state.momentum.clone()
    stats = torch.zeros(3)
    out, _, _ = _step(state, grad, stats=stats)
    assert out[0, 4] == -mhat[0, 4]
    keep = torch.ones(16, dtype=torch.bool)
    keep[4] = False
    assert torch.equal(out[0, keep], grad[0, keep])  # bit-identical elsewhere
    assert stats[0] == 1 and stats[1] > 50
    # the momentum learned the scaled value, not the spike
    expected = 0.9 * momentum_before[0, 4] + 0.1 * mhat[0, 4]
    assert torch.allclose(state.momentum[0, 4], expected, rtol=1e-6)


def test_no_spike_is_bit_identical():
    state = SpikeState([32, 32], threshold=50, beta=0.99, warmup_steps=2)
    gen = torch.Generator().manual_seed(2)
    stats = torch.zeros(3)
    for _ in range(20):
        grad = torch.randn(2, 32, generator=gen) * 1e-3
        assert torch.equal(_step(state, grad, stats=stats)[0], grad)
    assert stats[0] == 0


def test_warmup_and_elements_without_history():
    state = SpikeState([4], threshold=50, beta=0.9, warmup_steps=3)
    for step in range(3):  # warm-up: even a 1e6 jump passes
        grad = torch.tensor([[1.0, 1.0, 0.0, 1.0]]) * (1e6 if step == 2 else 1.0)
        assert torch.equal(_step(state, grad)[0], grad)
    # element 2 never had a gradient: momentum 0, so it is never scaled (it would freeze at 0)
    grad = torch.tensor([[1.0, 1.0, 5.0, 1.0]])
    assert torch.equal(_step(state, grad)[0], grad)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_elements_leave_state_untouched(bad):
    state = SpikeState([8, 8], threshold=50, beta=0.9, warmup_steps=1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        _step(state, torch.randn(2, 8, generator=gen))
    momentum, step = state.momentum.clone(), state.step.clone()
    grad = torch.randn(2, 8, generator=gen)
    grad[1, 3] = bad
    stats = torch.zeros(3)
    out, _, _ = _step(state, grad, stats=stats)
    assert math.isnan(out[1, 3]) if math.isnan(bad) else out[1, 3] == bad
    assert state.momentum[1, 3] == momentum[1, 3] and state.step[1, 3] == step[1, 3]
    assert stats[2] == 1
    others = torch.ones(2, 8, dtype=torch.bool)
    others[1, 3] = False
    assert (state.step[others] == step[others] + 1).all()
    # a whole step of non-finite gradients changes nothing
    momentum, step = state.momentum.clone(), state.step.clone()
    _step(state, torch.full((2, 8), bad))
    assert torch.equal(state.momentum, momentum) and torch.equal(state.step, step)


def test_propose_commit_discard():
    state = SpikeState([8], threshold=50, beta=0.9, warmup_steps=1)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        _step(state, torch.randn(1, 8, generator=gen))
    grad = torch.randn(1, 8, generator=gen)
    grad[0, 0] *= 1000
    before = (state.momentum.clone(), state.step.clone())
    first_out = grad.clone()
    first = [t.clone() for t in state.propose_in_place(first_out)]
    pending = state.pending_momentum.clone()
    second_out = grad.clone()
    second = state.propose_in_place(second_out)  # a rerun of the same step: the same proposal
    assert all(torch.equal(a, b) for a, b in zip(first, second)) and torch.equal(first_out, second_out)
    assert torch.equal(state.pending_momentum, pending)
    state.discard()  # the optimizer skipped the step
    state.commit()  # nothing pending: no-op
    assert torch.equal(state.momentum, before[0]) and torch.equal(state.step, before[1])
    state.propose_in_place(grad.clone())
    state.commit()
    assert torch.equal(state.momentum, pending) and (state.step == before[1] + 1).all()


def test_owned_subset_gives_the_same_decisions():
    """A distributed-optimizer rank decides for its shard only; together the shards decide alike."""
    gen = torch.Generator().manual_seed(5)
    full = SpikeState([16, 16], threshold=50, beta=0.9, warmup_steps=2)
    parts = [SpikeState([16, 16], threshold=50, beta=0.9, warmup_steps=2) for _ in range(2)]
    owned = torch.zeros(2, 2, 16, dtype=torch.bool)
    owned[0, 0, :11] = True  # uneven shards crossing the target boundary
    owned[1, 0, 11:] = True
    owned[1, 1, :] = True
    for step in range(8):
        grad = torch.randn(2, 16, generator=gen)
        if step in (4, 6):
            grad[0, 10] *= 1000
            grad[0, 12] *= 1000
            grad[1, 3] *= -1000
        _, spike, repl = _step(full, grad)
        merged_spike = torch.zeros_like(spike)
        merged_out = torch.zeros_like(grad)
        for part, mine in zip(parts, owned):
            noisy = torch.where(mine, grad, torch.full_like(grad, float("nan")))  # others' data is garbage
            _, s, r = _step(part, noisy, owned=mine)
            assert not (s & ~mine).any()
            merged_spike |= s
            merged_out = torch.where(mine, torch.where(s, r, grad), merged_out)
        assert torch.equal(merged_spike, spike)
        assert torch.equal(merged_out, torch.where(spike, repl, grad))
    merged_m = torch.where(owned[0], parts[0].momentum, parts[1].momentum)
    assert torch.equal(merged_m, full.momentum)


# ===================================================================================== settings
def test_settings_precedence_and_env():
    env = {"MIXLN_SPIKE_SCALER": "1", "MIXLN_SPIKE_THRESHOLD": "30", "MIXLN_SPIKE_BETA": "0.95",
           "MIXLN_SPIKE_WARMUP_STEPS": "7", "MIXLN_SPIKE_TARGETS": "3, 5"}
    from mixln_megatron.model.settings import MixLNSettings, layered

    resolved = resolve_spike_settings(spike_settings_from_env(env))
    assert (resolved.enabled, resolved.threshold, resolved.beta, resolved.warmup_steps, resolved.targets) == (
        True, 30.0, 0.95, 7, (3, 5))
    explicit = layered(MixLNSettings(spike=SpikeSettings(threshold=80, targets="all")), MixLNSettings(spike=spike_settings_from_env(env)))
    explicit = resolve_spike_settings(explicit.spike)
    assert explicit.threshold == 80 and explicit.targets == "all" and explicit.beta == 0.95
    default = resolve_spike_settings(None)
    assert (default.enabled, default.threshold, default.targets) == (False, 50.0, "boundary")


@pytest.mark.parametrize("env", [
    {"MIXLN_SPIKE_SCALER": "maybe"}, {"MIXLN_SPIKE_THRESHOLD": "0.5"}, {"MIXLN_SPIKE_BETA": "1"},
    {"MIXLN_SPIKE_WARMUP_STEPS": "-1"}, {"MIXLN_SPIKE_TARGETS": "first"}, {"MIXLN_SPIKE_TARGETS": "0,2"},
    {"MIXLN_SPIKE_THRESHOLD": "abc"},
])
def test_bad_settings_are_refused(env):
    with pytest.raises(SpikeConfigError):
        spike_settings_from_env(env)


def test_flags_reach_the_settings():
    import argparse

    from mixln_megatron.megatron_args import add_mixln_args
    from mixln_megatron.model.settings import MixLNSettings

    args = add_mixln_args(argparse.ArgumentParser()).parse_args(
        ["--mixln-spike-scaler", "--mixln-spike-threshold", "40", "--mixln-spike-targets", "all"])
    resolved = resolve_spike_settings(MixLNSettings.from_args(args).spike)
    assert resolved.enabled and resolved.threshold == 40 and resolved.targets == "all"


def test_targets():
    placement = Placement(num_layers=12, post_ln_layers=3)
    assert target_layers("boundary", placement) == (3, 4)
    assert target_layers("all", placement) == tuple(range(1, 13))
    assert target_layers((1, 7), placement) == (1, 7)
    assert target_layers("boundary", Placement(num_layers=12, post_ln_layers=0)) == ()  # disabled
    assert target_layers("boundary", Placement(num_layers=12, post_ln_layers=12)) == ()
    with pytest.raises(SpikeConfigError):
        target_layers((13,), placement)


def test_the_spec_is_plain_data_and_install_training_hooks_installs(mcore_single):
    from harness.testing import tiny_config
    from harness.testing import build_gpt
    from mixln_megatron.model.layer import MixLNTransformerLayer
    from mixln_megatron.training.spike import HOLDER_NAME, SpikeGradsHook, get_spike_scaler
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.spec import get_mixln_decoder_block_spec
    from mixln_megatron.training.hooks import install_training_hooks

    on = MixLNSettings(post_ln_layers=2, spike=SpikeSettings(enabled=True))
    config = tiny_config(num_layers=4)
    spec = get_mixln_decoder_block_spec(config, backend="local", settings=on)
    assert spec.layer_specs[0].module is MixLNTransformerLayer  # the spec knows no training hooks
    assert config.finalize_model_grads_func is None
    install_training_hooks(config, on)
    hook = config.finalize_model_grads_func
    assert isinstance(hook, SpikeGradsHook) and hook.original is None  # Megatron-LM keeps a set hook
    assert get_spike_scaler(config).layers == (2, 3)
    install_training_hooks(config, on)  # another model chunk (VPP): the same hook
    assert config.finalize_model_grads_func is hook
    layers = build_gpt(config, spec).decoder.layers  # built after the install: targets hold the state
    assert [HOLDER_NAME in layer._modules for layer in layers] == [False, True, True, False]
    config0 = tiny_config(num_layers=4)
    install_training_hooks(config0, MixLNSettings(post_ln_layers=0, spike=SpikeSettings(enabled=True)))
    assert config0.finalize_model_grads_func is None  # no boundary: disabled
    config1 = tiny_config(num_layers=4)
    install_training_hooks(config1, MixLNSettings(post_ln_layers=2))
    assert config1.finalize_model_grads_func is None  # not asked for


def _bare_scaler(**settings):
    from mixln_megatron.training.spike import SpikeScaler

    return SpikeScaler(resolve_spike_settings(SpikeSettings(enabled=True, **settings)),
                       Placement(num_layers=4, post_ln_layers=2))


def _ops_per_step(targets):
    """Tensor ops (torch-function calls) of one step of the scaler's work, hook and commit, on a
    DDP-wrapped tiny Mix-LN GPT, after the one-off set-up."""
    from torch.overrides import TorchFunctionMode

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from harness.testing import build_gpt, tiny_config
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.spec import get_mixln_decoder_block_spec
    from mixln_megatron.training.spike import install_spike_scaler

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    config = tiny_config(num_layers=4)
    spec = get_mixln_decoder_block_spec(config, backend="local", settings=MixLNSettings(post_ln_layers=2))
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), build_gpt(config, spec))
    scaler = install_spike_scaler([model], config, settings={"targets": targets, "warmup_steps": 1})
    scaler.after_finalize([model])  # set-up (eager, once) and a first step
    with Count():
        scaler.after_finalize([model])  # no optimizer known: commits at once
    return len(scaler.targets), Count.calls


def test_ops_per_step_do_not_grow_with_the_targets(mcore_single):
    boundary, all_layers = _ops_per_step("boundary"), _ops_per_step("all")
    assert (boundary[0], all_layers[0]) == (4, 8)  # two norms of layers 2, 3 / of all four layers
    assert boundary[1] == all_layers[1] <= 33, (boundary, all_layers)  # 30 when written


def test_checkpoint_state_is_replicated_tensors_per_target_layer(mcore_single):
    """Save and load request the same replicated tensors (training/spike/state.py's doc); a
    format-1 checkpoint (its content metadata names the layers) is asked for its objects."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from harness.testing import build_gpt, tiny_config
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.spec import get_mixln_decoder_block_spec
    from mixln_megatron.training.hooks import install_training_hooks
    from mixln_megatron.training.spike import get_spike_scaler

    config = tiny_config(num_layers=4)
    settings = MixLNSettings(post_ln_layers=2, spike=SpikeSettings(enabled=True))
    spec = get_mixln_decoder_block_spec(config, backend="local", settings=settings)
    install_training_hooks(config, settings)
    model = build_gpt(config, spec)
    scaler = get_spike_scaler(config)

    def spike_entries(metadata):
        sharded = model.sharded_state_dict(metadata=metadata)
        return {k: v for k, v in sharded.items() if "mixln_spike_scaler" in k}

    for metadata in (None, {"singleton_local_shards": False}):  # megatron-core, Megatron-LM: alike
        entries = spike_entries(metadata)
        keys = sorted(v.key for v in entries.values())
        assert keys == sorted(f"decoder.layers.mixln_spike_scaler.layer{n}.norm{i}.weight.{what}"
                              for n in (2, 3) for i in (1, 2) for what in ("momentum", "step"))
        for v in entries.values():
            assert isinstance(v, ShardedTensor) and v.global_shape == (64,) and v.data.dtype == torch.float32
    format1 = spike_entries({"mixln_spike_scaler": {"format": 1, "layers": [3]}})
    assert [v.key for v in format1.values()] == ["decoder.layers.mixln_spike_scaler.layer3"]
    assert all(isinstance(v, ShardedObject) for v in format1.values())
    # what a format-1 load hands back: the layer's targets as a dict
    holder = model.decoder.layers[2].mixln_spike_scaler
    old = {"format": 1, "layer": 3, "targets": {
        "norm1.weight": {"momentum": torch.full((64,), 0.5), "step": torch.full((64,), 4, dtype=torch.int64)},
        "norm2.weight": {"momentum": torch.full((64,), 0.25), "step": torch.full((64,), 4, dtype=torch.int64)}}}
    errors = []
    holder._load_from_state_dict({"p.state": old}, "p.", {}, True, [], [], errors)
    assert not errors
    state = scaler.checkpoint.layer_state(3, holder.roles)
    assert state["norm1.weight"][0].eq(0.5).all() and state["norm2.weight"][1].eq(4).all()


def test_report_goes_to_megatron_tensorboard_writer():
    """One TensorBoard point per step. What W&B keeps is checked on a real offline run in
    test_wandb_offline.py (a fake writer cannot see W&B drop steps below its current one)."""
    from megatron.training import global_vars

    from mixln_megatron.training.spike import write_report

    class Writer:
        def __init__(self):
            self.calls = []

        def add_scalar(self, *args):
            self.calls.append(args)

    tb = Writer()
    saved = (global_vars._GLOBAL_TENSORBOARD_WRITER, global_vars._GLOBAL_WANDB_WRITER)
    global_vars._GLOBAL_TENSORBOARD_WRITER, global_vars._GLOBAL_WANDB_WRITER = tb, None
    try:
        write_report([{"iteration": 7, "scaled": 2, "max_ratio": 900.0, "nonfinite": 0},
                      {"iteration": 8, "scaled": 0, "max_ratio": 1.5, "nonfinite": 1}])
    finally:
        global_vars._GLOBAL_TENSORBOARD_WRITER, global_vars._GLOBAL_WANDB_WRITER = saved
    assert tb.calls == [("mixln-spike/scaled-elements", 2, 7), ("mixln-spike/max-ratio", 900.0, 7),
                        ("mixln-spike/nonfinite-elements", 0, 7), ("mixln-spike/scaled-elements", 0, 8),
                        ("mixln-spike/max-ratio", 1.5, 8), ("mixln-spike/nonfinite-elements", 1, 8)]


# ===================================================================================== multi-process
def _launch(nproc: int, layouts, out_dir: str) -> None:

    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--standalone", *LAUNCH, "--out", out_dir, "--layouts", ",".join(layouts)]
    proc = run_python(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        pytest.fail(f"spike worker failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def _load(out_dir: str, layout: str):
    files = sorted(glob.glob(os.path.join(out_dir, f"{layout}.rank*.pt")))
    assert files, f"no results for {layout}"
    return [torch.load(f, weights_only=False) for f in files]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("spike_world2"))
    _launch(2, WORLD2_LAYOUTS, out)
    return {name: _load(out, name) for name in WORLD2_LAYOUTS}


def _merged_decisions(results):
    """{(step, target): indices} over all ranks; replicas (TP, DP) must agree."""
    merged = {}
    for r in results:
        for step, per_target in r["decisions"].items():
            for name, idx in per_target.items():
                key = (step, name)
                assert merged.setdefault(key, idx) == idx, (r["name"], key)
    return merged


def _merged_states(results):
    merged = {}
    for r in results:
        for name, s in r["state"].items():
            if name in merged:
                assert torch.equal(merged[name]["momentum"], s["momentum"]), (r["name"], name)
                assert torch.equal(merged[name]["step"], s["step"])
            merged[name] = s
    return merged


def _injected(step):
    return {name: [index] for name, index, _ in W.INJECT.get(step, [])}


def _expected_decisions(steps=W.STEPS):
    names = ["layer2.norm1.weight", "layer2.norm2.weight", "layer3.norm1.weight", "layer3.norm2.weight"]
    return {(s, n): _injected(s).get(n, []) for s in range(1, steps + 1) for n in names}


@pytest.mark.mp
def test_injected_spikes_come_out_at_the_momentum(world2):
    """DDP: the hook's decisions and values equal the reference rule on the same reduced grads."""
    r = world2["ddp"][0]
    refs = {}
    for step in range(1, W.STEPS + 1):
        for name, grad in r["inputs"][step].items():
            ref = refs.setdefault(name, ReferenceSpikeRule(grad.numel(), **{k: W.SETTINGS[k] for k in ("threshold", "beta", "warmup_steps")}))
            ref_out, ref_flags = ref.step(grad.tolist())
            flagged = [i for i, f in enumerate(ref_flags) if f]
            assert r["decisions"][step][name] == flagged == _injected(step).get(name, []), (step, name)
            for i in flagged:
                value = float(r["replacements"][step][name][i])
                assert _close(value, ref_out[i]), (step, name, value, ref_out[i])
                assert abs(grad[i]) > 50 * abs(value)  # it was over the threshold
    for name, ref in refs.items():
        assert torch.allclose(r["state"][name]["momentum"], torch.tensor(ref.momentum, dtype=torch.float32), rtol=1e-5)
        assert r["state"][name]["step"].tolist() == ref.steps
    assert r["totals"]["scaled"] == 4


@pytest.mark.mp
def test_steps_without_spikes_are_bit_identical(world2):
    plain, quiet, injected = world2["ddp_plain"], world2["ddp_quiet"], world2["ddp"]
    for p, q, i in zip(plain, quiet, injected):
        assert q["digests"] == p["digests"]  # the scaler on, no spike: the very same training
        assert q["totals"]["scaled"] == 0
        assert i["digests"][:4] == p["digests"][:4]  # before the first injected spike
        assert all(torch.equal(q["params"][k], p["params"][k]) for k in p["params"])


@pytest.mark.mp
@pytest.mark.compat
def test_ddp_and_distributed_optimizer_agree_exactly(world2):
    for ddp, dist in zip(world2["ddp"], world2["distopt"]):
        assert dist["digests"] == ddp["digests"]
        assert all(torch.equal(dist["params"][k], ddp["params"][k]) for k in ddp["params"])
        assert dist["decisions"] == ddp["decisions"]
        for name, s in ddp["state"].items():
            assert torch.equal(dist["state"][name]["momentum"], s["momentum"])
            assert torch.equal(dist["state"][name]["step"], s["step"])
    assert world2["distopt"][0]["totals"]["scaled"] == 4  # summed over the two owners' shards


@pytest.mark.mp
def test_dp_replicas_stay_identical(world2):
    for layout in ("ddp", "distopt"):
        a, b = world2[layout]
        assert a["dp_rank"] != b["dp_rank"]
        assert a["digests"] == b["digests"]
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
        _merged_states([a, b])


@pytest.mark.mp
def test_tp_sp_and_pp_take_the_same_decisions(world2):
    expected = _expected_decisions()
    reference = _merged_states(world2["ddp"])
    for layout in ("ddp", "tp2sp", "pp2"):
        results = world2[layout]
        assert _merged_decisions(results) == expected, layout
        states = _merged_states(results)  # TP replicas hold bit-identical state
        assert sorted(states) == sorted(reference)
        for name, s in states.items():
            assert torch.allclose(s["momentum"], reference[name]["momentum"], rtol=1e-3, atol=0), (layout, name)
            assert torch.equal(s["step"], reference[name]["step"])
        for r in results:
            assert r["totals"]["scaled"] == 4, layout  # reduced over pipeline stages
    tp0, tp1 = world2["tp2sp"]
    assert (tp0["tp_rank"], tp1["tp_rank"]) == (0, 1) and tp0["decisions"] == tp1["decisions"]
    stages = {r["pp_rank"]: set(r["state"]) for r in world2["pp2"]}
    assert stages == {0: {"layer2.norm1.weight", "layer2.norm2.weight"},
                      1: {"layer3.norm1.weight", "layer3.norm2.weight"}}


@pytest.mark.mp
@pytest.mark.parametrize("layout", ["pp2_resume", "pp2_resume_format1"])
def test_resume_continues_exactly(world2, layout):
    """From a checkpoint with the state as tensors, and from one in format 1 (earlier versions)."""
    for full, resumed in zip(world2["pp2"], world2[layout]):
        assert resumed["digests"] == full["digests"]
        assert all(torch.equal(resumed["params"][k], full["params"][k]) for k in full["params"])
        assert resumed["decisions"] == full["decisions"]
        for name, s in full["state"].items():
            assert torch.equal(resumed["state"][name]["momentum"], s["momentum"])
            assert torch.equal(resumed["state"][name]["step"], s["step"])
        saved, loaded = resumed["state_at_save"], resumed["state_after_load"]
        assert sorted(saved) == sorted(loaded) and saved
        for name in saved:
            assert torch.equal(loaded[name]["momentum"], saved[name]["momentum"])
            assert loaded[name]["step"].tolist() == [5] * 64
        assert not resumed["warnings"]


@pytest.mark.mp
def test_checkpoint_without_state_starts_fresh_with_a_warning(world2):
    """megatron's load strictness decides: its default refuses the missing keys, log_unexpected
    drops them and the scaler starts fresh with a warning."""
    for r in world2["fresh_load"]:
        assert "mixln_spike_scaler.layer" in r["default_strictness"], r["default_strictness"]
        assert any("no spike-scaler state for layer 2" in w for w in r["warnings"])
        assert any("no spike-scaler state for layer 3" in w for w in r["warnings"])
        for name, s in r["state_after_load"].items():
            assert not s["momentum"].any() and not s["step"].any(), name
        assert all(s["step"].eq(2).all() for s in r["state"].values())
        assert r["successes"] == [True, True]


@pytest.mark.mp
def test_fp16_skipped_steps_never_commit(world2):
    """Loss-scaled grads: decisions in unscaled units; steps the optimizer skips leave no trace."""
    for r in world2["fp16"]:
        assert r["successes"] == [True, True, True, False, True, False, True, True]
        states = r["states"]
        for skipped in (4, 6):
            before, after = states[skipped - 2], states[skipped - 1]
            for name in before:
                assert torch.equal(after[name]["momentum"], before[name]["momentum"]), (skipped, name)
                assert torch.equal(after[name]["step"], before[name]["step"])
        assert all(s["step"].eq(6).all() for s in r["state"].values())
        assert {k: v for k, v in _merged_decisions([r]).items() if v} == {
            k: v for k, v in _expected_decisions().items() if v}
        assert r["loss_scale"] < 2.0 ** 12  # the scale backed off: later steps used the new one
        ddp = _merged_states(world2["ddp"])
        for name, s in r["state"].items():  # unscaled units: the same order as the fp32 run
            ratio = (s["momentum"].double().mean() / ddp[name]["momentum"].double().mean()).item()
            assert 0.2 < ratio < 5, (name, ratio)


@pytest.mark.mp
def test_hook_never_waits_for_the_device(world2):
    """No item()/tolist()/bool(tensor)/nonzero()/.cpu() in the hook (CUDA-graph capturable)."""
    for layout in ("distopt", "pp2", "fp16"):
        for r in world2[layout]:
            assert r["hook_calls_checked"] >= W.STEPS - 1, layout
            assert r["sync_violations"] == [], (layout, r["sync_violations"])


@pytest.mark.mp
def test_statistics_reach_the_report(world2):
    for layout in ("ddp", "distopt", "pp2"):
        for r in world2[layout]:
            rows = r["report"]  # the last logging interval: iterations 5-8
            assert [row["iteration"] for row in rows] == [5, 6, 7, 8]
            assert [row["scaled"] for row in rows] == [2, 0, 2, 0], layout
            assert rows[0]["max_ratio"] > 50 and rows[1]["max_ratio"] < 50


@pytest.mark.mp
@pytest.mark.slow
def test_world4_layouts_take_the_same_decisions(world2, tmp_path):
    _launch(4, WORLD4_LAYOUTS, str(tmp_path))
    expected = _expected_decisions()
    reference = _merged_states(world2["ddp"])
    for layout in WORLD4_LAYOUTS[1:]:
        results = _load(str(tmp_path), layout)
        assert _merged_decisions(results) == expected, layout
        for name, s in _merged_states(results).items():
            assert torch.allclose(s["momentum"], reference[name]["momentum"], rtol=1e-3), (layout, name)
        assert all(r["totals"]["scaled"] == 4 for r in results)


# ===================================================================================== Megatron-LM
MLM_ARGS = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --lr-decay-style constant --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128 --normalization RMSNorm --swiglu --disable-bias-linear "
    "--position-embedding-type rope --distributed-backend gloo --no-gradient-accumulation-fusion "
    "--transformer-impl local --no-masked-softmax-fusion --no-bias-swiglu-fusion --no-rope-fusion "
    "--no-persist-layer-norm --use-cpu-initialization --attention-dropout 0 --hidden-dropout 0 "
    "--eval-iters 0 --eval-interval 1000 --log-interval 1 --num-workers 0 --seed 1234 "
    "--spec mixln_megatron.spec mixln_local_layer_spec --pipeline-model-parallel-size 2 --train-iters 6"
).split()


def _megatron_lm(out: str, tag: str, extra, scaler: bool = True):

    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MIXLN_POST_LN_LAYERS="2",
               MIXLN_SPIKE_SCALER="1" if scaler else "0", MIXLN_SPIKE_WARMUP_STEPS="2", MIXLN_SPIKE_BETA="0.9")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           *LAUNCH, "--megatron-lm", "--out", out, "--tag", tag, "--", *MLM_ARGS, *extra]
    proc = run_python(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        pytest.fail(f"Megatron-LM run {tag} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return _load(out, f"mlm_{tag}")


@pytest.mark.mp
@pytest.mark.slow
def test_stock_megatron_lm_gets_the_scaler_from_the_spec(tmp_path):
    """megatron.training.pretrain, PP2, --spec mixln_megatron.spec mixln_local_layer_spec and
    MIXLN_SPIKE_SCALER=1: no patch. Spikes at iteration 5 are scaled; --exit-interval 3 + --load
    continues exactly (the state is in the torch_dist checkpoint); a checkpoint saved without the
    scaler loads, with --dist-ckpt-strictness log_unexpected, with a warning and a fresh state."""
    out = str(tmp_path)
    full = _megatron_lm(out, "full", [])
    _megatron_lm(out, "first", ["--exit-interval", "3", "--save", f"{out}/ckpt", "--save-interval", "3"])
    resumed = _megatron_lm(out, "resumed", ["--load", f"{out}/ckpt"])
    for a, c in zip(full, resumed):
        assert a["optimizer_found"] and c["optimizer_found"]  # through config.grad_scale_func
        assert c["digest"] == a["digest"]
        for name, s in a["state"].items():
            assert torch.equal(c["state"][name]["momentum"], s["momentum"])
            assert s["step"].eq(6).all() and c["state"][name]["step"].eq(6).all()
        assert c["decisions"][5] == a["decisions"][5] and sum(map(len, a["decisions"][5].values())) == 1
        assert not c["warnings"]
    _megatron_lm(out, "plain", ["--exit-interval", "3", "--save", f"{out}/plain", "--save-interval", "3"],
                 scaler=False)
    # megatron's load strictness decides: its default refuses the missing spike state
    fresh = _megatron_lm(out, "fresh", ["--load", f"{out}/plain", "--dist-ckpt-strictness", "log_unexpected"])
    for r in fresh:
        assert any("no spike-scaler state" in w for w in r["warnings"])
        assert all(s["step"].eq(3).all() for s in r["state"].values())  # counted from the load on
