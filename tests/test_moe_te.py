"""Every layer kind on MoE layers with TransformerEngine's grouped-GEMM experts, built on the CPU
(construction, parameters, DeepNorm's init and torch_dist checkpoints; TE's forward needs a GPU).
Run by `make test-te`; skipped without TE.
"""

import math

import pytest
import torch

from mixln_megatron import cpu
from harness import testing as mu

WHY = mu.te_missing()
pytestmark = [pytest.mark.te, pytest.mark.skipif(WHY is not None, reason=str(WHY))]

L, EXPERTS = 4, 4
LAYOUT = "post:1,deepnorm:2,sandwich:3,pre:4"


def config(**overrides):
    kw = dict(query_groups=2, num_moe_experts=EXPERTS, moe_router_topk=2, moe_grouped_gemm=True,
              moe_token_dispatcher_type="allgather", moe_ffn_hidden_size=48,
              moe_shared_expert_intermediate_size=40)
    return mu.tiny_config(num_layers=L, **{**kw, **overrides})


def build(cfg, layout=LAYOUT, seed=3, **settings):
    from megatron.core import tensor_parallel

    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed + 1)
    with cpu.te_modules():
        spec = get_mixln_decoder_block_spec(cfg, backend="te", settings=MixLNSettings(layout=layout, **settings))
        return mu.build_gpt(cfg, spec)


@pytest.mark.usefixtures("te_single")
def test_every_kind_builds_grouped_gemm_experts_with_its_norms():
    from megatron.core.extensions.transformer_engine import TEColumnParallelGroupedLinear
    from megatron.core.transformer.identity_op import IdentityOp

    model = build(config(moe_layer_freq=[0, 1, 1, 1]))
    layers = model.decoder.layers
    assert [l.kind for l in layers] == ["post", "deepnorm", "sandwich", "pre"]
    assert [type(l.mlp).__name__ for l in layers] == ["MLP", "MoELayer", "MoELayer", "MoELayer"]
    for layer in layers[1:]:
        assert type(layer.mlp.experts).__name__ == "TEGroupedMLP"
        assert isinstance(layer.mlp.experts.linear_fc1, TEColumnParallelGroupedLinear)
        names = {n for n, _ in layer.mlp.experts.linear_fc1.named_parameters()}
        assert {f"weight{i}" for i in range(EXPERTS)} <= names
    deep, sandwich, pre = layers[1:]
    assert isinstance(deep.pre_mlp_layernorm, IdentityOp)  # Post-LN: the router reads h itself
    assert deep.post_mlp_layernorm is not None
    # the MoE layer's pre-MLP norm is a standalone TE norm (N_c before the router)
    assert not isinstance(sandwich.pre_mlp_layernorm, IdentityOp) and sandwich.mlp_output_layernorm is not None
    roles = [r for r, _ in sandwich.norm_parameters()]
    assert roles == ["norm1.weight", "norm2.weight", "norm3.weight", "norm4.weight"]
    assert [r for r, _ in pre.norm_parameters()] == ["norm1.weight", "norm2.weight"]


@pytest.mark.usefixtures("te_single")
def test_deepnorm_init_scales_each_grouped_expert_weight():
    deep, post = build(config(), layout="deepnorm:*", seed=5), build(config(), layout="post:*", seed=5)
    beta = deep.decoder.layers[0].placement.deepnorm_beta
    post_params = dict(post.named_parameters())
    checked = 0
    for name, p in deep.named_parameters():
        if "experts" in name and ("linear_fc1" in name or "linear_fc2" in name):
            factor = beta * (math.sqrt(2 * L) if "linear_fc2" in name else 1.0)
            torch.testing.assert_close(p, factor * post_params[name], rtol=1e-6, atol=0)
            checked += 1
        elif "router" in name:
            torch.testing.assert_close(p, post_params[name], rtol=0, atol=0)
    assert checked == L * (2 * EXPERTS + 2)


@pytest.mark.usefixtures("te_single")
def test_lns_hooks_the_standalone_te_norm_of_an_moe_layer():
    model = build(config(), layout="pre:*", scheme="lns")
    layer = model.decoder.layers[3]
    assert layer.norm_output_scale == pytest.approx(0.5)
    assert len(layer.pre_mlp_layernorm._forward_hooks) == 1  # the MoE path: no fused linear to scale


@pytest.mark.usefixtures("te_single")
def test_te_moe_checkpoint_round_trip(tmp_path):
    cfg = config()
    saved = build(cfg, seed=7)
    mu.save_chunks([saved], str(tmp_path / "ckpt"))
    loaded = build(cfg, seed=8)
    assert any((a != b).any() for a, b in zip(saved.state_dict().values(), loaded.state_dict().values())
               if torch.is_tensor(a) and a.is_floating_point())
    assert mu.load_chunks([loaded], str(tmp_path / "ckpt")) == []
    for (name, a), b in zip(saved.state_dict().items(), loaded.state_dict().values()):
        if torch.is_tensor(a) and a.is_floating_point():
            assert torch.equal(a, b), name
