"""The spike scaler's state through `mixln-megatron convert gpt-to-hybrid` and back.

One process (gloo, TP1 PP1): a tiny GPTModel Mix-LN (local backend, L = 4, P = 2, the scaler on
the boundary blocks 2 and 3) trains SAVE_AT steps with the scaler and a spike injected at step 4,
and is saved as Megatron-LM saves (torch_dist, its parsed args in the common state, the tracker
file). The converter makes a HybridModel checkpoint of it, loaded into a HybridModel Mix-LN with
the scaler installed (hybrid=True): every target's momentum and step must be the GPT model's, and
the next step (spikes injected at step 6) must scale the very elements, to the very values, that
the GPT model's uninterrupted next step scales. A scaler that started fresh would still be warming
up (warmup_steps = 3) and scale nothing; a norm's state moved to the wrong (block, role) would
carry another norm's momentum and misjudge the elements. Then `hybrid-to-gpt` back: the GPT
checkpoint's tensors again, and a GPTModel loaded from it holds the saved state.

Training helpers (Trainer, injection, norm names): tests/workers/hybrid_hooks_worker.py; the
Megatron-LM-shaped save / load: tests/workers/hybrid_ckpt_worker.py.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from mixln_megatron import compat

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "workers"))
import hybrid_ckpt_worker as C  # noqa: E402  (megatron is imported lazily there)
import hybrid_hooks_worker as W  # noqa: E402

pytestmark = pytest.mark.skipif(not compat.HYBRID_MODEL, reason="Mix-LN on HybridModel needs megatron-core 0.19+")

SAVE_AT = C.ITERATION  # 5: after the step-4 spike, before the step-6 spikes
NEXT = SAVE_AT + 1
assert NEXT in W.INJECT and any(s <= SAVE_AT for s in W.INJECT)
BOUNDARY_NAMES = W.BOUNDARY_NAMES  # layer2.norm1.weight ... layer3.norm2.weight


def build(kind, telemetry_path):
    """(config, model): W.build's model with the targets named explicitly ("boundary")."""
    from harness.testing import build_gpt, build_hybrid, tiny_config
    from mixln_megatron.model.settings import MixLNSettings, SpikeSettings, TelemetrySettings
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec, get_mixln_hybrid_stack_spec
    from mixln_megatron.training.hooks import install_training_hooks

    s = MixLNSettings(post_ln_layers=W.POST_LN, spike=SpikeSettings(enabled=True, targets="boundary", **W.SPIKE),
                      telemetry=TelemetrySettings(interval=1, path=telemetry_path))
    hybrid = kind == "hybrid"
    config = tiny_config(num_layers=2 * W.BLOCKS if hybrid else W.BLOCKS)
    install_training_hooks(config, s, hybrid=hybrid)
    if hybrid:
        spec = get_mixln_hybrid_stack_spec(config, backend="local", settings=s)
        return config, build_hybrid(config, spec, W.PATTERN, untie=True)
    return config, build_gpt(config, get_mixln_decoder_block_spec(config, backend="local", settings=s), untie=True)


def megatron_lm_args(kind):
    """Megatron-LM's parsed args of the model (what its save_checkpoint writes), sys.argv restored."""
    argv = list(sys.argv)
    try:
        args = C.megatron_lm_args(kind, W.POST_LN, 1)
    finally:
        sys.argv[:] = argv
    args.untie_embeddings_and_output_weights = True  # as built (untie=True)
    return args


def tensors(state: dict) -> dict:
    """The weights of a state dict, cloned (no `_extra_state`, no Mix-LN settings record)."""
    return {k: v.clone() for k, v in state.items() if torch.is_tensor(v) and "_extra_state" not in k}


def held(scaler) -> dict:
    """{target: (momentum, step)} as a save would write them, cloned."""
    return {name: tuple(t.clone() for t in pair) for name, pair in scaler.checkpoint.held_state().items()}


def convert(direction, load, save):
    from mixln_megatron.convert.cli import main

    assert main([direction, "--load", load, "--save", save, "--no-progress"]) == 0


def checkpoint_tensors(path) -> dict:
    """{key: full tensor} of every tensor of a torch_dist checkpoint directory (an iter_* dir)."""
    from mixln_megatron.convert.torch_dist_reader import TorchDistCheckpoint

    reader = TorchDistCheckpoint(path)
    return {k: reader.read(k, (0,) * len(reader.global_shape(k)), reader.global_shape(k))
            for k in reader.files.tensors}


def next_step(config, model, path) -> dict:
    """Load the Megatron-LM checkpoint `path` into `model` (fresh Adam: the converter carries no
    optimizer state), the scaler's state right after the load, then step NEXT's results."""
    trainer = W.Trainer(config, model, first_step=NEXT)
    C.load(model, path)
    after_load = held(trainer.scaler)
    weights = tensors(model.state_dict())
    trainer.train(NEXT)
    return {"after_load": after_load, "weights": weights, "trainer": trainer, **trainer.results()}


@pytest.fixture(scope="module")
def run(mcore_single, tmp_path_factory):
    from harness.testing import hybrid_state_dict, randomize

    d = str(tmp_path_factory.mktemp("hybrid_conv_state"))
    config, gpt = build("gpt", os.path.join(d, "gpt.jsonl"))
    randomize([gpt], seed=5)
    trainer = W.Trainer(config, gpt)
    trainer.train(SAVE_AT)
    C.save(gpt, f"{d}/gpt", megatron_lm_args("gpt"))
    out = {"dir": d, "saved": held(trainer.scaler), "saved_weights": tensors(hybrid_state_dict(gpt))}
    trainer.train(NEXT)  # the uninterrupted run's next step
    out["gpt"] = trainer.results()

    convert("gpt-to-hybrid", f"{d}/gpt", f"{d}/hybrid")
    hybrid_config, hybrid = build("hybrid", os.path.join(d, "hybrid.jsonl"))
    out["hybrid_weights_before"] = tensors(hybrid.state_dict())
    out["hybrid"] = next_step(hybrid_config, hybrid, f"{d}/hybrid")

    convert("hybrid-to-gpt", f"{d}/hybrid", f"{d}/back")
    back_config, back = build("gpt", os.path.join(d, "back.jsonl"))
    out["back"] = next_step(back_config, back, f"{d}/back")
    return out


def as_lists(state: dict) -> dict:
    return {name: [t.tolist() for t in pair] for name, pair in state.items()}


# --------------------------------------------------------------------------------------------- tests
def test_the_saved_state_is_warm_and_nontrivial(run):
    """What the checkpoint must carry: SAVE_AT committed steps and a momentum of its own per norm."""
    saved = run["saved"]
    assert sorted(saved) == BOUNDARY_NAMES
    for name, (momentum, step) in saved.items():
        assert momentum.shape == step.shape == (64,), name
        assert torch.equal(step, torch.full((64,), float(SAVE_AT))), name
        assert momentum.abs().min() > 0, name
    momenta = [saved[n][0] for n in BOUNDARY_NAMES]
    assert all(not torch.equal(a, b) for i, a in enumerate(momenta) for b in momenta[i + 1:])  # a swap shows


def test_hybrid_checkpoint_holds_each_norms_state_in_its_hybrid_layer(run):
    """Block b's norm1 state in its `*` layer 2b-1, norm2 in its `-` layer 2b (0-based 2b-2, 2b-1),
    the GPT checkpoint's per-block tensors, bit for bit."""
    d = run["dir"]
    gpt, hybrid = (checkpoint_tensors(f"{d}/{k}/iter_{SAVE_AT:07d}") for k in ("gpt", "hybrid"))
    spike = lambda keys: sorted(k for k in keys if ".mixln_spike_scaler." in k)  # noqa: E731
    want = {}
    for block in (2, 3):
        for i in (1, 2):
            for what in ("momentum", "step"):
                name = f"mixln_spike_scaler.layer{block}.norm{i}.weight.{what}"
                want[f"decoder.layers.{2 * block - 3 + i}.{name}"] = f"decoder.layers.{name}"
    assert spike(hybrid) == sorted(want) and spike(gpt) == sorted(want.values())
    for hkey, gkey in want.items():
        assert hybrid[hkey].dtype == gpt[gkey].dtype == torch.float32 and torch.equal(hybrid[hkey], gpt[gkey]), hkey
    for name, (momentum, _) in run["saved"].items():  # and they are the trained scaler's state
        block, i = int(name[len("layer")]), int(name[len("layer2.norm")])
        key = f"decoder.layers.{2 * block - 3 + i}.mixln_spike_scaler.{name}.momentum"
        assert torch.equal(hybrid[key], momentum), key


def test_hybrid_model_loads_the_gpt_models_weights_and_scaler_state(run):
    hybrid = run["hybrid"]
    assert hybrid["trainer"].scaler.target_names() == BOUNDARY_NAMES
    assert [(t.block_number, t.role) for t in hybrid["trainer"].scaler.targets] == [
        (2, "norm1.weight"), (2, "norm2.weight"), (3, "norm1.weight"), (3, "norm2.weight")]
    after_load = hybrid["after_load"]
    assert sorted(after_load) == sorted(run["saved"])
    for name, (momentum, step) in run["saved"].items():
        assert torch.equal(after_load[name][0], momentum) and torch.equal(after_load[name][1], step), name
    weights, saved = hybrid["weights"], run["saved_weights"]  # GPT names mapped to the hybrid's
    assert sorted(weights) == sorted(saved)
    for k in saved:
        assert torch.equal(weights[k], saved[k]), k
    before = run["hybrid_weights_before"]
    assert any(not torch.equal(before[k], saved[k]) for k in saved)  # the load did something


def test_hybrid_models_next_step_scales_the_gpt_models_elements(run):
    gpt, hybrid = run["gpt"], run["hybrid"]
    step = str(NEXT)
    want = {name: [] for name in BOUNDARY_NAMES}
    for name, index in W.INJECT[NEXT]:
        want[name] = [index]
    assert gpt["decisions"][step] == want  # the uninterrupted GPT run scales the injected spikes
    assert hybrid["decisions"] == {step: want}
    assert hybrid["replacements"] == {step: gpt["replacements"][step]}
    assert hybrid["state"] == gpt["state"]  # momentum and step after step NEXT, bit for bit
    assert all(s == [float(NEXT)] * 64 for _, s in hybrid["state"].values())


def test_hybrid_to_gpt_gives_back_the_gpt_checkpoint_and_state(run):
    d = run["dir"]
    original, back = (checkpoint_tensors(f"{d}/{k}/iter_{SAVE_AT:07d}") for k in ("gpt", "back"))
    model_keys = sorted(k for k in original if k.startswith(("embedding.", "decoder.", "output_layer.")))
    assert model_keys and sorted(back) == model_keys  # optimizer state is not converted (documented)
    for k in model_keys:
        assert back[k].dtype == original[k].dtype and torch.equal(back[k], original[k]), k
    assert as_lists(run["back"]["after_load"]) == as_lists(run["saved"])
    gpt, again = run["gpt"], run["back"]
    step = str(NEXT)
    assert again["decisions"] == {step: gpt["decisions"][step]}
    assert again["replacements"] == {step: gpt["replacements"][step]}
    assert again["state"] == gpt["state"]
