"""HybridModel `E` layers: megatron's MoE MLP symbol takes the kind of its block like a `-` layer.

A `*E*-` HybridModel (local backend, 4 experts, top-2, allgather dispatcher) with the weights of
the GPTModel of the same layout whose first layer is MoE (moe_layer_freq [1, 0]) gives the same
logits and the same gradient of every parameter, bit for bit, with a Post-LN and a Sandwich block.
The pattern rule accepts `E` only where a `-` belongs; HF conversion still refuses it, one line.
"""

import pytest

from mixln_megatron import compat
from harness import testing as mu

from test_hybrid_model import assert_same_network

pytestmark = pytest.mark.skipif(not compat.HYBRID_MODEL, reason="HybridModel Mix-LN needs megatron-core 0.19+")

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="allgather",
           moe_grouped_gemm=False, moe_ffn_hidden_size=48)
PATTERN = "*E*-"


def spread_routers(model, seed):
    """Router logits far apart, so that no top-k choice is a near tie in float rounding."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.router.weight"):
                p.copy_(torch.randn(p.shape, generator=g))


def moe_twins(layout):
    from mixln_megatron.spec import get_mixln_decoder_block_spec, get_mixln_hybrid_stack_spec

    gpt_cfg = mu.tiny_config(num_layers=2, **MOE, moe_layer_freq=[1, 0])
    gpt = mu.build_gpt(gpt_cfg, get_mixln_decoder_block_spec(gpt_cfg, backend="local", layout=layout))
    mu.randomize([gpt])
    spread_routers(gpt, seed=6)
    hyb_cfg = mu.tiny_config(num_layers=len(PATTERN), **MOE)
    hyb = mu.build_hybrid(hyb_cfg, get_mixln_hybrid_stack_spec(
        hyb_cfg, backend="local", layout=layout, hybrid_layer_pattern=PATTERN), PATTERN)
    mu.randomize([hyb], seed=11)  # other values, so that a tensor not loaded shows
    hyb.load_state_dict(mu.hybrid_state_dict(gpt), strict=True)
    return gpt, hyb


@pytest.mark.parametrize("layout", ["post:1,sandwich:2", "sandwich:1,post:2"])
def test_an_e_layer_is_the_gpt_models_moe_layer(mcore_single, layout):
    from mixln_megatron.model.layout import parse_layout

    gpt, hyb = moe_twins(layout)
    kinds = parse_layout(layout, 2, "the test")
    layers = list(hyb.decoder.layers)
    assert [layer.kind for layer in layers] == [k for k in kinds for _ in "*-"]
    assert [type(layer.mlp).__name__ for layer in layers[1::2]] == ["MoELayer", "MLP"]
    assert [type(layer.mlp).__name__ for layer in gpt.decoder.layers] == ["MoELayer", "MLP"]
    assert_same_network(gpt, hyb)


@pytest.mark.parametrize("pattern,where", [("E*-*", "layer 1"), ("*-E-", "layer 3"), ("*-*E*", "5 layers")])
def test_e_only_where_an_mlp_layer_belongs(pattern, where):
    from mixln_megatron.model import hybrid_pattern

    assert hybrid_pattern.pattern_problem("*E*-") is None and hybrid_pattern.check_pattern("*E|*-") == 2
    problem = hybrid_pattern.pattern_problem(pattern)
    assert problem is not None and where in problem, problem


def test_hf_conversion_still_refuses_e_in_one_line():
    from mixln_megatron.convert.megatron_reader import pattern_problem

    for problem in (pattern_problem("*E*-", "*E*-"), pattern_problem(None, "*E*-")):
        assert problem is not None and "'E' (MoE)" in problem and "\n" not in problem, problem
    assert pattern_problem("*-*-", "*-*-") is None


def test_e_layers_need_a_stack_spec_with_the_moe_layer(mcore_single):
    """A stack spec built without a config of experts has no MoE layer: megatron would build an
    identity for each `E`, so the stack refuses it."""
    from mixln_megatron.model.support import MixLNUnsupportedError
    from mixln_megatron.spec import get_mixln_hybrid_stack_spec

    cfg = mu.tiny_config(num_layers=len(PATTERN), **MOE)
    with pytest.raises(MixLNUnsupportedError, match="'E' \\(MoE\\) layers, but the Mix-LN stack spec has no MoE"):
        mu.build_hybrid(cfg, get_mixln_hybrid_stack_spec(backend="local", hybrid_layer_pattern=PATTERN), PATTERN)
