"""The spike scaler and the telemetry on a Mix-LN HybridModel: targets keyed (block,
role), the four boundary norms of a `*-` model found also across pipeline stages, the spike state
in torch_dist checkpoints of hybrid models, and telemetry rows per block, all compared with the
GPTModel Mix-LN network of the same weights trained on the same batches.

Helpers, settings and the torchrun worker: tests/workers/hybrid_hooks_worker.py (L = 4 blocks,
P = 2: the boundary blocks are 2 and 3; spikes injected at steps 4 and 6).
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

from mixln_megatron import compat

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "hybrid_hooks_worker.py")
sys.path.insert(0, os.path.dirname(WORKER))
import hybrid_hooks_worker as W  # noqa: E402  (megatron is imported lazily there)

pytestmark = pytest.mark.skipif(not compat.HYBRID_MODEL, reason="Mix-LN on HybridModel needs megatron-core 0.19+")


@pytest.fixture(scope="module")
def reference(mcore_single, tmp_path_factory):
    """The GPT model and the HybridModel with the same weights, trained alike (TP1 PP1); the
    hybrid's initial weights saved to DIR/base for the pipeline worker."""
    from harness.testing import randomize

    workdir = str(tmp_path_factory.mktemp("hybrid_hooks"))
    gpt_config, gpt = W.build("gpt", os.path.join(workdir, "gpt.jsonl"))
    randomize([gpt], seed=5)
    hybrid_config, hybrid = W.build("hybrid", os.path.join(workdir, "hybrid.jsonl"))
    W.copy_gpt_weights(gpt, hybrid)
    W.save(os.path.join(workdir, "base"), hybrid)
    out = {"workdir": workdir, "hybrid_model": hybrid, "spike_keys": W.spike_keys(hybrid)}
    for kind, config, model in (("gpt", gpt_config, gpt), ("hybrid", hybrid_config, hybrid)):
        trainer = W.Trainer(config, model)
        trainer.train(W.STEPS)
        out[kind], out[f"{kind}_trainer"] = trainer.results(), trainer
    return out


def injected(step):
    return {name: [index] for name, index in W.INJECT.get(step, [])}


EXPECTED_DECISIONS = {str(s): {n: injected(s).get(n, []) for n in W.BOUNDARY_NAMES} for s in range(1, W.STEPS + 1)}


def merged(results, key):
    """{..} of all ranks' results[key]; what two ranks both hold must be the same."""
    out = {}
    for r in results:
        for name, value in r[key].items():
            if isinstance(value, dict):
                for inner, v in value.items():
                    assert out.setdefault(name, {}).setdefault(inner, v) == v, (key, name, inner)
            else:
                assert out.setdefault(name, value) == value, (key, name)
    return out


def assert_close(a, b, what, rel):
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), (what, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, f"{what}[{i}]", rel)
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b), (what, sorted(a), sorted(b))
        for k in a:
            assert_close(a[k], b[k], f"{what}.{k}", rel)
    elif isinstance(a, float) or isinstance(b, float):
        assert a is not None and b is not None and math.isfinite(a), (what, a, b)
        assert abs(a - b) <= rel * max(abs(a), abs(b)), f"{what}: {a} vs {b}"
    else:
        assert a == b, (what, a, b)


# ===================================================================================== one process
def test_boundary_targets_are_the_four_boundary_norms(reference):
    """Blocks 2 (Post-LN: N1 in hybrid layer 3, N2 in 4) and 3 (Pre-LN: input norm in 5, pre-MLP
    norm in 6); the layers holding them, and only they, carry the checkpoint holders."""
    from mixln_megatron.training.spike import HOLDER_NAME

    layers = reference["hybrid_model"].decoder.layers
    scaler = reference["hybrid_trainer"].scaler
    assert scaler.layers == (2, 3)
    want = [("layer2.norm1.weight", layers[2].post_attention_layernorm.weight),
            ("layer2.norm2.weight", layers[3].post_mlp_layernorm.weight),
            ("layer3.norm1.weight", layers[4].input_layernorm.weight),
            ("layer3.norm2.weight", layers[5].pre_mlp_layernorm.weight)]
    assert [(t.name, id(t.param)) for t in scaler.targets] == [(n, id(p)) for n, p in want]
    assert [(t.block_number, t.role) for t in scaler.targets] == [(2, "norm1.weight"), (2, "norm2.weight"),
                                                                   (3, "norm1.weight"), (3, "norm2.weight")]
    assert [HOLDER_NAME in layer._modules for layer in layers] == [False, False, True, True, True, True, False, False]
    holders = scaler.checkpoint.holders  # keyed by the holding layer's own number
    assert {n: (h.block_number, [r for r, _ in h.roles]) for n, h in holders.items()} == {
        3: (2, ["norm1.weight"]), 4: (2, ["norm2.weight"]), 5: (3, ["norm1.weight"]), 6: (3, ["norm2.weight"])}
    assert reference["gpt_trainer"].scaler.target_names() == scaler.target_names()


def test_spike_state_keys_are_per_hybrid_layer(reference):
    """HybridStack's per-layer prefix (global 0-based index), then the holder's block and role:
    unique, and independent of the pipeline split (the global index)."""
    assert reference["spike_keys"] == sorted(
        f"decoder.layers.{2 * (block - 1) + i - 1}.mixln_spike_scaler.layer{block}.norm{i}.weight.{what}"
        for block in (2, 3) for i in (1, 2) for what in ("momentum", "step"))


def test_gpt_and_hybrid_scale_the_same_elements(reference):
    gpt, hybrid = reference["gpt"], reference["hybrid"]
    assert gpt["decisions"] == hybrid["decisions"] == EXPECTED_DECISIONS
    assert_close(hybrid["replacements"], gpt["replacements"], "replacements", rel=0)
    assert_close(hybrid["state"], gpt["state"], "state", rel=0)
    assert all(step == [float(W.STEPS)] * 64 for _, step in hybrid["state"].values())
    assert gpt["totals"] == hybrid["totals"] and hybrid["totals"]["scaled"] == 4


def test_gpt_and_hybrid_telemetry_rows_are_per_block(reference):
    gpt, hybrid = reference["gpt"]["telemetry"], reference["hybrid"]["telemetry"]
    assert len(gpt) == len(hybrid) == W.STEPS
    for record in hybrid:
        assert len(record["layer_grad_norm"]) == len(record["norm1_grad_norm"]) == W.BLOCKS
    assert_close(hybrid, gpt, "telemetry", rel=1e-12)
    with open(os.path.join(reference["workdir"], "hybrid.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    assert [(r["num_layers"], r["post_ln_layers"]) for r in logged] == [(W.BLOCKS, W.POST_LN)] * W.STEPS
    assert [r["layer_grad_norm"] for r in logged] == [r["layer_grad_norm"] for r in hybrid]


def test_telemetry_rows_equal_norms_from_the_gradients(reference):
    """The last step's rows, straight from main_grad: a block's two hybrid layers summed, norm1
    from the `*` layer, norm2 from the `-` layer."""
    layers = reference["hybrid_model"].decoder.layers
    rows = []
    for block in range(1, W.BLOCKS + 1):
        attention, mlp = layers[2 * block - 2], layers[2 * block - 1]
        assert (attention.block_number, mlp.block_number) == (block, block)

        def sq(params):
            return sum(p.main_grad.double().pow(2).sum().item() for p in params)

        rows.append([math.sqrt(sq(list(attention.parameters()) + list(mlp.parameters()))),
                     math.sqrt(sq(p for _, p in attention.norm_parameters())),
                     math.sqrt(sq(p for _, p in mlp.norm_parameters()))])
    last = reference["hybrid"]["telemetry"][-1]
    logged = [list(r) for r in zip(last["layer_grad_norm"], last["norm1_grad_norm"], last["norm2_grad_norm"])]
    assert_close(logged, rows, "rows", rel=1e-6)


def test_explicit_and_all_targets_name_the_same_norms(mcore_single, tmp_path):
    from mixln_megatron.training.spike import target_layers
    from mixln_megatron.training.spike.state import find_targets

    _, hybrid = W.build("hybrid", str(tmp_path / "t.jsonl"))
    placement = hybrid.decoder.layers[0].placement
    names = W.norms_by_name(hybrid)
    for targets, blocks in (("all", (1, 2, 3, 4)), ((1, 4), (1, 4))):
        assert target_layers(targets, placement) == blocks
        found, _ = find_targets([hybrid], blocks)
        assert [(t.name, id(t.param)) for t in found] == [
            (n, id(names[n])) for n in sorted(names) if int(n[len("layer"):].split(".")[0]) in blocks]


def test_install_spike_scaler_on_a_built_hybrid_model(mcore_single, tmp_path):
    """The megatron-core path: no hooks before the build; the scaler attaches to the built layers."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from harness.testing import build_hybrid, tiny_config
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.model.specs import get_mixln_hybrid_stack_spec
    from mixln_megatron.training.spike import install_spike_scaler

    config = tiny_config(num_layers=2 * W.BLOCKS)
    spec = get_mixln_hybrid_stack_spec(config, backend="local", settings=MixLNSettings(post_ln_layers=1))
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), build_hybrid(config, spec, W.PATTERN))
    scaler = install_spike_scaler([model], config, settings={"warmup_steps": 1})
    assert scaler.layers == (1, 2) and sorted(scaler.checkpoint.holders) == [1, 2, 3, 4]
    scaler.after_finalize([model])  # set-up and a first step (no optimizer: committed at once)
    assert scaler.target_names() == ["layer1.norm1.weight", "layer1.norm2.weight",
                                     "layer2.norm1.weight", "layer2.norm2.weight"]
    assert scaler.state.step.eq(1).all()


def test_the_scaler_targets_every_norm_of_the_arms_layout_as_gpt_does(mcore_single, tmp_path):
    """A layout with every kind (deepnorm, sandwich, post, pre): with targets 'all' the scaler on
    the HybridModel takes the GPT model's (block, role) norms, sandwich's norm3 / norm4 included,
    and steps on them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from harness.testing import build_gpt, build_hybrid, tiny_config
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec, get_mixln_hybrid_stack_spec
    from mixln_megatron.training.spike import install_spike_scaler, remove_spike_scaler

    settings = MixLNSettings(layout="deepnorm:1,sandwich:2,post:3,pre:4")
    names = {}
    for kind in ("gpt", "hybrid"):
        if kind == "gpt":
            config = tiny_config(num_layers=W.BLOCKS)
            model = build_gpt(config, get_mixln_decoder_block_spec(config, backend="local", settings=settings))
        else:
            config = tiny_config(num_layers=2 * W.BLOCKS)
            model = build_hybrid(config, get_mixln_hybrid_stack_spec(config, backend="local", settings=settings),
                                 W.PATTERN)
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        scaler = install_spike_scaler([ddp], config, settings={"warmup_steps": 1, "targets": "all"})
        scaler.after_finalize([ddp])
        names[kind] = scaler.target_names()
        assert scaler.state.step.eq(1).all(), kind
        remove_spike_scaler(config)
    assert names["hybrid"] == names["gpt"]
    assert {"layer2.norm3.weight", "layer2.norm4.weight"} <= set(names["gpt"]), names["gpt"]
    assert len(names["gpt"]) == 2 * W.BLOCKS + 2  # two norms a layer, four in the sandwich one


def test_a_wrong_sized_state_names_block_and_hybrid_layer(reference, caplog):
    holder = reference["hybrid_model"].decoder.layers[4].mixln_spike_scaler
    errors = []
    holder._load_from_state_dict({"p.norm1.weight.momentum": torch.zeros(3), "p.norm1.weight.step": torch.zeros(3)},
                                 "p.", {}, True, [], [], errors)
    assert errors == ["mixln spike scaler: the checkpoint's state for block 3 (hybrid layer 5) norm1.weight "
                      "has 3 elements, the model's parameter 64"]
    with caplog.at_level("WARNING", logger="mixln_megatron.training.spike"):
        holder._load_from_state_dict({}, "p.", {}, True, [], [], errors)
    assert "no spike-scaler state for block 3 (hybrid layer 5) norm1.weight" in caplog.text


# ===================================================================================== two processes
@pytest.fixture(scope="module")
def pp2(reference):
    from harness.testing import torchrun

    workdir = reference["workdir"]
    torchrun(WORKER, 2, "--phase", "pp2", "--workdir", workdir, timeout=900)
    with open(os.path.join(workdir, "hybrid_pp2.json")) as f:
        return json.load(f)


STAGE_TARGETS = {
    "between_blocks": [["layer2.norm1.weight", "layer2.norm2.weight"], ["layer3.norm1.weight", "layer3.norm2.weight"]],
    "inside_block": [["layer2.norm1.weight", "layer2.norm2.weight", "layer3.norm1.weight"], ["layer3.norm2.weight"]],
}


@pytest.mark.mp
@pytest.mark.parametrize("split", sorted(W.SPLITS))
def test_pp2_finds_the_boundary_norms_on_both_stages(pp2, reference, split):
    ranks = sorted(pp2[split], key=lambda r: r["pp_rank"])
    assert [r["targets"] for r in ranks] == STAGE_TARGETS[split]
    if split == "inside_block":  # block 3's `*` layer on stage 0, its `-` layer on stage 1
        assert ranks[0]["layers"][-1] == [5, 3] and ranks[1]["layers"][0] == [6, 3]
    want = reference["hybrid"]
    assert merged(ranks, "decisions") == EXPECTED_DECISIONS
    assert_close(merged(ranks, "replacements"), want["replacements"], "replacements", rel=0)
    assert_close(merged(ranks, "state"), want["state"], "state", rel=0)
    for r in ranks:
        assert r["totals"] == want["totals"]  # reduced over the stages
        assert_close(r["telemetry"], want["telemetry"], f"telemetry rank {r['pp_rank']}", rel=1e-12)


@pytest.mark.mp
@pytest.mark.parametrize("split", sorted(W.SPLITS))
def test_pp2_spike_keys_are_the_pp1_keys(pp2, reference, split):
    keys = [r["spike_keys"] for r in pp2[split]]
    assert not set(keys[0]) & set(keys[1])
    assert sorted(keys[0] + keys[1]) == reference["spike_keys"]
    assert sorted(n for r in pp2[split] for n in r["holders"]) == [3, 4, 5, 6]


@pytest.mark.mp
def test_a_pp2_save_loads_at_pp1_and_training_continues(pp2, reference):
    """Saved at PP2 with block 3 split over the stages after step 3, loaded at PP1 (DP2): both
    ranks hold the whole state as saved, and steps 4-6 are those of the uninterrupted run."""
    at_save = merged(pp2["inside_block"], "at_save")
    resumed = pp2["inside_block_resumed_pp1"]
    for r in resumed:
        assert r["spike_keys"] == reference["spike_keys"]
        assert sorted(r["after_load"]) == W.BOUNDARY_NAMES
        assert_close(r["after_load"], at_save, "after load", rel=0)
        assert all(step == [float(W.SAVE_AT)] * 64 for _, step in r["after_load"].values())
    want = reference["hybrid"]
    assert merged(resumed, "decisions") == {s: d for s, d in EXPECTED_DECISIONS.items() if int(s) > W.SAVE_AT}
    assert_close(merged(resumed, "state"), want["state"], "state", rel=0)
    assert resumed[0]["telemetry"] == resumed[1]["telemetry"]
    without_totals = [[{k: v for k, v in r.items() if k != "spike"} for r in rows]  # totals count from the load
                      for rows in (resumed[0]["telemetry"], want["telemetry"][W.SAVE_AT:])]
    assert_close(*without_totals, "telemetry after resume", rel=1e-12)
    assert resumed[0]["totals"]["scaled"] == 4
