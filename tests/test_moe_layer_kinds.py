"""Every layer kind on MoE layers (local backend: sequential experts, allgather dispatcher), one process.

A layer kind is defined on the block, so an MoE MLP takes the dense MLP's norms:

    pre       h = x + Attn(Na(x))               y = h + MoE(Nc(h))
    post      h = N1(x + Attn(x))               y = N2(h + MoE(h))
    deepnorm  h = N1(a * x + Attn(x))           y = N2(a * h + MoE(h))
    sandwich  h = x + Nb(Attn(Na(x)))           y = h + Nd(MoE(Nc(h)))      (Nc before the router)

MoE(h) is written here from its formula, not from megatron's MoE classes: router logits h R^T,
top-k of the logits, softmax over the k chosen (megatron's default: score function softmax, no
pre-softmax), each token's output the probability-weighted sum of its k experts' SwiGLU MLPs,
plus the shared expert's MLP when there is one. With the model's own weights the routing
decisions are the same, so outputs and every parameter's gradient must agree (fp32, ~1e-5).
Also: mixed dense/MoE stacks (--moe-layer-freq), DeepNorm's init on every expert, the support
table. Multi-process (TP, EP, checkpoints): tests/test_moe_parallel.py.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from harness import testing as mu

from test_layer_kinds import assert_grads_equal, leaf_copy, randomize, ref_attention, rms

pytestmark = pytest.mark.usefixtures("mcore_single")

S, B = 8, 2
EXPERTS, TOPK = 4, 2
MOE = dict(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_token_dispatcher_type="allgather",
           moe_grouped_gemm=False, moe_ffn_hidden_size=48)


def moe_config(num_layers=4, **overrides):
    return mu.tiny_config(num_layers=num_layers, query_groups=2, **{**MOE, **overrides})


# ------------------------------------------------------------------ the reference (plain PyTorch)
def swiglu(x, fc1, fc2):
    gate, up = (x @ fc1.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ fc2.T


def ref_moe(h, w, p, cfg):
    """The MoE MLP on h [s, b, hidden]: top-k of the router logits, softmax over the k, experts."""
    tokens = h.reshape(-1, h.shape[-1])
    logits = tokens @ w[p + "mlp.router.weight"].T
    top_logits, top = torch.topk(logits, cfg.moe_router_topk, dim=-1)
    probs = torch.softmax(top_logits, dim=-1)
    out = torch.zeros_like(tokens)
    for e in range(cfg.num_moe_experts):
        pe = f"{p}mlp.experts.local_experts.{e}."
        chosen = (top == e)  # [tokens, k]: at most one True per row
        rows = chosen.any(-1)
        if rows.any():
            weight = (probs * chosen).sum(-1)[rows, None]
            out = out.index_add(0, rows.nonzero()[:, 0],
                                weight * swiglu(tokens[rows], w[pe + "linear_fc1.weight"], w[pe + "linear_fc2.weight"]))
    if p + "mlp.shared_experts.linear_fc1.weight" in w:
        out = out + swiglu(tokens, w[p + "mlp.shared_experts.linear_fc1.weight"],
                           w[p + "mlp.shared_experts.linear_fc2.weight"])
    return out.view_as(h), top


def ref_moe_layer(x, w, p, kind, cfg, alpha=1.0, lns=1.0):
    """One MoE layer of `kind` from its formula; also the routing (top-k expert ids)."""
    eps = cfg.layernorm_epsilon

    def n(name, t):
        return rms(t, w[p + name + ".weight"], eps)

    if kind in ("pre", "sandwich"):
        attn = ref_attention(lns * n("input_layernorm", x), w, p, cfg, False)
        h = x + (n("attn_output_layernorm", attn) if kind == "sandwich" else attn)
        moe, top = ref_moe(lns * n("pre_mlp_layernorm", h), w, p, cfg)
        return h + (n("mlp_output_layernorm", moe) if kind == "sandwich" else moe), top
    a = alpha if kind == "deepnorm" else 1.0
    h = n("post_attention_layernorm", a * x + ref_attention(x, w, p, cfg, False))
    moe, top = ref_moe(h, w, p, cfg)
    return n("post_mlp_layernorm", a * h + moe), top


def build_layer(cfg, layout, layer_number, seed=None, **settings):
    from megatron.core import tensor_parallel
    from megatron.core.transformer.spec_utils import build_module

    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.spec import MixLNTransformerLayerSpec

    seed = layer_number if seed is None else seed
    spec = MixLNTransformerLayerSpec(backend="local", settings=MixLNSettings(layout=layout, **settings), config=cfg)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed + 100)  # the experts draw from the tracker
    return build_module(spec, config=cfg, layer_number=layer_number)


def spread_router(layer, seed):
    """A router with logits far apart, so that no top-k choice is a near tie in float rounding."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.mlp.router.weight.copy_(torch.randn(layer.mlp.router.weight.shape, generator=g))


def run_layer(layer, x):
    out, _ = layer(x, attention_mask=torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), 1))
    return out


# ------------------------------------------------------------------ each kind = its formula
@pytest.mark.compat
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
@pytest.mark.parametrize("kind", ["pre", "post", "deepnorm", "sandwich"])
def test_each_kind_on_an_moe_layer_equals_its_formula(kind, shared):
    extra = dict(moe_shared_expert_intermediate_size=40) if shared else {}
    cfg = moe_config(**extra)
    layer = build_layer(cfg, f"{kind}:2,pre:*", layer_number=2)
    assert layer.kind == kind and type(layer.mlp).__name__ == "MoELayer"
    assert (layer.mlp.shared_experts is not None) == shared
    randomize(layer, seed=5)
    spread_router(layer, seed=6)
    ref = leaf_copy(layer)
    x = torch.randn(S, B, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    x_ref = x.clone().requires_grad_(True)
    x = x.clone().requires_grad_(True)
    out = run_layer(layer, x)
    alpha = layer.placement.deepnorm_alpha or 1.0
    want, top = ref_moe_layer(x_ref, ref, "", kind, cfg, alpha=alpha)
    assert len(set(top.flatten().tolist())) == EXPERTS, "the batch should reach every expert"
    err = (out - want).abs().max().item()
    assert err <= 1e-5 * max(want.abs().max().item(), 1.0)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * g).sum().backward()
    (want * g).sum().backward()
    assert_grads_equal(layer, ref, rel=1e-4)
    assert (x.grad - x_ref.grad).abs().max().item() <= 1e-4 * x_ref.grad.abs().max().item()
    with torch.no_grad():  # the kind and the routing are what make the output, not a coincidence
        if kind in ("sandwich", "deepnorm"):  # N_b / N_d, and DeepNet's alpha, matter
            other = {"sandwich": "pre", "deepnorm": "post"}[kind]
            assert (out - ref_moe_layer(x_ref, ref, "", other, cfg)[0]).abs().max().item() > 20 * max(err, 1e-6)
        top1 = copy.copy(cfg)
        top1.moe_router_topk = 1
        assert (out - ref_moe_layer(x_ref, ref, "", kind, top1, alpha=alpha)[0]).abs().max().item() > 20 * max(err, 1e-6)


@pytest.mark.compat
def test_lns_scales_the_router_input_of_a_pre_ln_moe_layer():
    cfg = moe_config()
    layer = build_layer(cfg, "pre:*", layer_number=4, scheme="lns")
    assert layer.norm_output_scale == pytest.approx(4 ** -0.5)
    randomize(layer, seed=7)
    spread_router(layer, seed=8)
    ref = leaf_copy(layer)
    x = torch.randn(S, B, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, _ = ref_moe_layer(x, ref, "", "pre", cfg, lns=4 ** -0.5)
        assert (run_layer(layer, x) - want).abs().max().item() <= 1e-5 * max(want.abs().max().item(), 1.0)


# ------------------------------------------------------------------ mixed dense / MoE stacks
@pytest.mark.compat
def test_moe_layer_freq_gives_dense_first_layers_every_kind():
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec

    cfg = moe_config(moe_layer_freq=[0, 1, 1, 0])
    spec = get_mixln_decoder_block_spec(cfg, backend="local", settings=MixLNSettings(
        layout="post:1,deepnorm:2,sandwich:3,pre:4"))
    model = mu.build_gpt(cfg, spec)
    layers = model.decoder.layers
    assert [type(l.mlp).__name__ for l in layers] == ["MLP", "MoELayer", "MoELayer", "MLP"]
    assert [l.kind for l in layers] == ["post", "deepnorm", "sandwich", "pre"]
    ids, labels, pos, mask = mu.batch(seed=3)
    loss = model(ids, pos, mask, labels=labels).mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for n, p in model.named_parameters() if "router" in n)


def test_stage_layer_ids_follow_the_pipeline_offset():
    from mixln_megatron.model import specs

    cfg = moe_config(num_layers=6, moe_layer_freq=2)
    assert specs.moe_layer_pattern(cfg) == [True, False, True, False, True, False]
    cfg.pipeline_model_parallel_size = 2  # pp_rank given: no parallel state needed
    cfg.num_layers_in_first_pipeline_stage = 2
    cfg.num_layers_in_last_pipeline_stage = 4
    assert specs.stage_layer_ids(cfg, 2, None, 0) == [0, 1]
    assert specs.stage_layer_ids(cfg, 4, None, 1) == [2, 3, 4, 5]


def test_one_layer_spec_refuses_a_mixed_stack_and_a_bad_pattern():
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.model.specs import checked_layer_spec
    from mixln_megatron.model.support import MixLNUnsupportedError

    with pytest.raises(MixLNUnsupportedError, match="mixed dense/MoE stack .*get_mixln_decoder_block_spec"):
        checked_layer_spec(moe_config(moe_layer_freq=2), "local", MixLNSettings(post_ln_layers=1))
    cfg = moe_config()
    cfg.moe_layer_freq = [1, 1]
    with pytest.raises(MixLNUnsupportedError, match="moe_layer_freq must be"):
        checked_layer_spec(cfg, "local", MixLNSettings(post_ln_layers=1))


# ------------------------------------------------------------------ DeepNorm's init on experts
@pytest.mark.compat
def test_deepnorm_init_scales_every_expert_like_the_dense_mlp_and_leaves_the_router():
    import math

    cfg = moe_config(moe_shared_expert_intermediate_size=40)
    deep = build_layer(cfg, "deepnorm:*", layer_number=2, seed=9)
    post = build_layer(cfg, "post:*", layer_number=2, seed=9)
    beta = deep.placement.deepnorm_beta
    assert beta == pytest.approx((8 * 4) ** -0.25)
    post_params = dict(post.named_parameters())
    checked = 0
    for name, p in deep.named_parameters():
        want = post_params[name]
        if "experts" in name and ("linear_fc1" in name or "linear_fc2" in name):
            # the same draws; fc2 from the base init rather than megatron's base / sqrt(2L)
            factor = beta * (math.sqrt(2 * cfg.num_layers) if "linear_fc2" in name else 1.0)
            torch.testing.assert_close(p, factor * want, rtol=1e-6, atol=0)
            checked += 1
        elif "router" in name:
            torch.testing.assert_close(p, want, rtol=0, atol=0)
    assert checked == 2 * EXPERTS + 2  # every routed expert's fc1 / fc2, and the shared expert's


def test_the_support_table_lets_moe_build_convert_and_analyse():
    from mixln_megatron.model import support

    cfg = moe_config()
    support.check_supported(cfg, backend="local")
    support.check_supported(cfg, backend="te", post_ln=True)
    support.check(cfg, support.CONVERT)  # the HF export carries experts (convert.shape.moe_shape_of_args refuses routing)
    support.check(cfg, support.ANALYSIS)
    cfg.multi_latent_attention = True
    with pytest.raises(support.MixLNUnsupportedError, match="multi-latent"):
        support.check_supported(cfg)
