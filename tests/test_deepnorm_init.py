"""DeepNorm's init against DeepNet's rule (arXiv 2203.00555), written here from the paper, not from
the project's modules: in a deepnorm layer of an L-layer model,

    V rows of linear_qkv, linear_proj, linear_fc1, linear_fc2:  std = base * beta,  beta = (8L)^(-1/4)
    Q and K rows of linear_qkv:                                  std = base
    base = megatron's depth-free init (init_method_std), NOT its output-layer init base / sqrt(2L)

Each std is compared with the formula's within 6 sigma of sampling error (the std of a sample std of
n normal draws is sigma / sqrt(2n)); through TP2 each rank's shard is compared on its own (its
value rows found in megatron's per-group [q..., k, v] layout). One process here for the local backend
(CPU init and GPU-style TP-sharded init) and TE (construction only, marker te); two ranks in
test_deepnorm_init_through_tp2.
"""

import json
import math
import os

import pytest
import torch

from harness import testing as mu

WORKER = os.path.join(os.path.dirname(__file__), "workers", "deepnorm_init_worker.py")
NUM_LAYERS, HIDDEN, HEADS, GROUPS = 16, 128, 4, 2  # sqrt(2L) = 5.7: the old init's error is far outside noise
STD = 0.02


def deepnet_expected_stds(num_layers: int, base: float) -> dict:
    """DeepNet's init for a decoder of `num_layers` layers: {weight: std}."""
    beta = (8 * num_layers) ** -0.25
    return {"q": base, "k": base, "v": base * beta, "proj": base * beta, "fc1": base * beta, "fc2": base * beta}


def split_qkv(weight, heads: int, groups: int, head_dim: int):
    """(q, k, v) rows of (a TP shard of) megatron's fused QKV weight: per query group, its heads'
    query rows, then one key head, then one value head."""
    per = heads // groups
    w = weight.reshape(groups, (per + 2) * head_dim, -1)
    return w[:, : per * head_dim], w[:, per * head_dim: (per + 1) * head_dim], w[:, (per + 1) * head_dim:]


def layer_weights(layer, heads_per_shard: int, groups_per_shard: int, head_dim: int) -> dict:
    attention, mlp = layer.self_attention, layer.mlp
    q, k, v = split_qkv(attention.linear_qkv.weight.detach(), heads_per_shard, groups_per_shard, head_dim)
    return {"q": q, "k": k, "v": v, "proj": attention.linear_proj.weight.detach(),
            "fc1": mlp.linear_fc1.weight.detach(), "fc2": mlp.linear_fc2.weight.detach()}


def assert_stds_follow_deepnet(stats, num_layers: int, where: str):
    """`stats`: [{name: (std, numel)}] per layer (or per shard); every std within 6 sigma of DeepNet's."""
    want = deepnet_expected_stds(num_layers, STD)
    for i, layer in enumerate(stats):
        for name, (std, numel) in layer.items():
            tolerance = 6 / math.sqrt(2 * numel)
            assert abs(std / want[name] - 1) <= tolerance, (
                f"{where} layer {i} {name}: std {std:.3g}, DeepNet's rule {want[name]:.3g} "
                f"(ratio {std / want[name]:.3f}, tolerance {tolerance:.3f})")


def build(cpu_init: bool, backend: str = "local", **cfg):
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec

    config = mu.tiny_config(num_layers=NUM_LAYERS, hidden=HIDDEN, heads=HEADS, query_groups=GROUPS,
                            use_cpu_initialization=cpu_init, init_method_std=STD, **cfg)
    torch.manual_seed(11)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(12)
    spec = get_mixln_decoder_block_spec(config, backend=backend, settings=MixLNSettings(layout="deepnorm:*"))
    return config, mu.build_gpt(config, spec)


def stats_of(model):
    head_dim = HIDDEN // HEADS
    return [{name: (w.std().item(), w.numel()) for name, w in layer_weights(layer, HEADS, GROUPS, head_dim).items()}
            for layer in model.decoder.layers]


@pytest.mark.usefixtures("mcore_single")
@pytest.mark.compat
@pytest.mark.parametrize("cpu_init", [True, False], ids=["cpu_init", "gpu_style_init"])
def test_deepnorm_init_is_deepnet_s_rule(cpu_init):
    config, model = build(cpu_init)
    assert model.decoder.layers[0].placement.deepnorm_beta == pytest.approx((8 * NUM_LAYERS) ** -0.25)
    assert_stds_follow_deepnet(stats_of(model), NUM_LAYERS, "local")
    # the build leaves megatron's config as it was: other layers and megatron keep the scaled init
    assert config.output_layer_init_method is not config.init_method
    assert config.output_layer_init_method.keywords["std"] == pytest.approx(STD / math.sqrt(2 * NUM_LAYERS))


@pytest.mark.usefixtures("mcore_single")
def test_only_deepnorm_layers_leave_megatron_s_output_layer_init():
    """In a mixed layout the post and pre layers keep megatron's init (proj / fc2 at base / sqrt(2L))."""
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec

    config = mu.tiny_config(num_layers=NUM_LAYERS, hidden=HIDDEN, heads=HEADS, query_groups=GROUPS,
                            init_method_std=STD)
    torch.manual_seed(3)
    spec = get_mixln_decoder_block_spec(config, backend="local",
                                        settings=MixLNSettings(layout="deepnorm:1-4,post:5-8,pre:*"))
    model = mu.build_gpt(config, spec)
    scaled = STD / math.sqrt(2 * NUM_LAYERS)
    for layer in model.decoder.layers[4:]:
        for name in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
            w = layer.get_parameter(name)
            assert abs(w.std().item() / scaled - 1) <= 6 / math.sqrt(2 * w.numel()), (layer.layer_number, name)
    assert_stds_follow_deepnet(stats_of(model)[:4], NUM_LAYERS, "mixed")


@pytest.mark.usefixtures("mcore_single")
def test_a_failed_build_restores_megatron_s_output_layer_init():
    from mixln_megatron.model.layer import output_layers_at_base_init

    config = mu.tiny_config(num_layers=4)
    saved = config.output_layer_init_method
    with pytest.raises(RuntimeError):
        with output_layers_at_base_init(config):
            assert config.output_layer_init_method is config.init_method
            raise RuntimeError("build failed")
    assert config.output_layer_init_method is saved


@pytest.mark.te
@pytest.mark.usefixtures("mcore_single")
def test_deepnorm_init_is_deepnet_s_rule_with_te_modules():
    """TE's linears take megatron's init methods too (construction only: no TE kernel runs)."""
    why = mu.te_missing()
    if why is not None:
        pytest.skip(str(why))
    from mixln_megatron import cpu

    with cpu.te_modules():  # TE modules built on the CPU (their forward needs a GPU)
        _, model = build(cpu_init=True, backend="te")
    assert_stds_follow_deepnet(stats_of(model), NUM_LAYERS, "te")


@pytest.mark.mp
@pytest.mark.compat
def test_deepnorm_init_through_tp2(tmp_path):
    """Two ranks, TP2, CPU init and TP-sharded (GPU-style) init: every rank's shard of every weight."""
    mu.torchrun(WORKER, 2, "--workdir", tmp_path)
    with open(tmp_path / "deepnorm_init.json") as f:
        result = json.load(f)
    for mode in ("cpu_init", "gpu_style_init"):
        shards = result[mode]
        assert len(shards) == 2 and all(len(s) == NUM_LAYERS for s in shards), mode
        for rank, layers in enumerate(shards):
            assert_stds_follow_deepnet([{k: tuple(v) for k, v in l.items()} for l in layers], NUM_LAYERS,
                                       f"{mode} rank {rank}")
