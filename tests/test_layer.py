"""The Mix-LN layer against independent references, on one process (TP1 PP1)."""

import math

import pytest
import torch
import torch.nn.functional as F

from harness import testing as mu

pytestmark = pytest.mark.usefixtures("mcore_single")

S, B = 8, 2


def build_layer(spec, config, layer_number):
    from megatron.core.transformer.spec_utils import build_module

    torch.manual_seed(layer_number)
    return build_module(spec, config=config, layer_number=layer_number)


def randomize_norms(layer, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_attention(x, layer, cfg):
    """Causal self-attention from the layer's raw weights (megatron's per-group QKV layout)."""
    att = layer.self_attention
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
    d = cfg.hidden_size // heads
    per = heads // groups
    qkv = x @ att.linear_qkv.weight.T  # [s, b, groups * (per + 2) * d]
    qkv = qkv.view(S, B, groups, (per + 2) * d)
    q = qkv[..., : per * d].reshape(S, B, heads, d)
    k = qkv[..., per * d : (per + 1) * d].repeat_interleave(per, dim=2)
    v = qkv[..., (per + 1) * d :].repeat_interleave(per, dim=2)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = out.permute(2, 0, 1, 3).reshape(S, B, cfg.hidden_size)
    return out @ att.linear_proj.weight.T


def reference_mlp(x, layer):
    gate, up = (x @ layer.mlp.linear_fc1.weight.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ layer.mlp.linear_fc2.weight.T


def causal_mask():
    return torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), 1)


@pytest.mark.parametrize("query_groups", [None, 2])
@pytest.mark.compat
def test_post_ln_layer_matches_functional_reference(query_groups):
    from mixln_megatron.spec import MixLNTransformerLayerSpec

    cfg = mu.tiny_config(num_layers=4, query_groups=query_groups)
    spec = MixLNTransformerLayerSpec(backend="local", post_ln_layers=2)
    layer = build_layer(spec, cfg, layer_number=2)
    assert layer.is_post_ln
    randomize_norms(layer, seed=5)
    n1 = layer.post_attention_layernorm.weight
    n2 = layer.post_mlp_layernorm.weight
    assert not torch.allclose(n1, n2)
    x = torch.randn(S, B, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    out, _ = layer(x, attention_mask=causal_mask())
    with torch.no_grad():
        eps = cfg.layernorm_epsilon
        h = rms(x + reference_attention(x, layer, cfg), n1, eps)  # h = N1(x + Attn(x))
        ref = rms(h + reference_mlp(h, layer), n2, eps)  # y = N2(h + MLP(h))
        swapped = rms(rms(x + reference_attention(x, layer, cfg), n2, eps) + 0, n1, eps)
    assert (out - ref).abs().max().item() <= 1e-6
    assert (out - swapped).abs().max().item() > 1e-3


@pytest.mark.compat
def test_pre_ln_layer_equals_megatron_transformer_layer():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mixln_megatron.spec import MixLNTransformerLayerSpec

    cfg = mu.tiny_config(num_layers=4)
    ours = build_layer(MixLNTransformerLayerSpec(backend="local", post_ln_layers=2), cfg, layer_number=3)
    stock = build_layer(get_gpt_layer_local_spec(normalization="RMSNorm"), cfg, layer_number=3)
    assert not ours.is_post_ln
    randomize_norms(ours, seed=9)
    missing, unexpected = stock.load_state_dict(ours.state_dict(), strict=False)
    assert not missing and not unexpected
    x = torch.randn(S, B, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    out, _ = ours(x, attention_mask=causal_mask())
    ref, _ = stock(x, attention_mask=causal_mask())
    assert (out - ref).abs().max().item() <= 1e-6


def test_lns_layer_scales_norm_outputs():
    from mixln_megatron.spec import MixLNTransformerLayerSpec

    cfg = mu.tiny_config(num_layers=4)
    layer = build_layer(MixLNTransformerLayerSpec(backend="local", scheme="lns"), cfg, layer_number=4)
    randomize_norms(layer, seed=3)
    x = torch.randn(S, B, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    out, _ = layer(x, attention_mask=causal_mask())
    eps, s = cfg.layernorm_epsilon, 1 / math.sqrt(4)
    with torch.no_grad():
        h = x + reference_attention(rms(x, layer.input_layernorm.weight, eps) * s, layer, cfg)
        ref = h + reference_mlp(rms(h, layer.pre_mlp_layernorm.weight, eps) * s, layer)
    assert (out - ref).abs().max().item() <= 1e-6
    # The stored weights are untouched by the scaling.
    assert layer.input_layernorm.output_scale == s


def test_post_ln_variant_does_not_mutate_the_shared_spec():
    from mixln_megatron.spec import MixLNTransformerLayerSpec

    cfg = mu.tiny_config(num_layers=4)
    spec = MixLNTransformerLayerSpec(backend="local", post_ln_layers=1)
    before = (spec.submodules.input_layernorm, spec.submodules.pre_mlp_layernorm,
              dict(spec.submodules.sharded_state_dict_keys_map))
    build_layer(spec, cfg, layer_number=1)
    after = (spec.submodules.input_layernorm, spec.submodules.pre_mlp_layernorm,
             dict(spec.submodules.sharded_state_dict_keys_map))
    assert before == after
    pre = build_layer(spec, cfg, layer_number=2)
    assert not pre.is_post_ln and pre.input_layernorm.__class__.__name__ == "MixLNNorm"


def test_whole_model_final_norm_and_post_ln_output_is_viewless():
    from mixln_megatron.model.backends import MixLNNorm
    from mixln_megatron.spec import get_mixln_decoder_block_spec

    cfg = mu.tiny_config(num_layers=4)
    model = mu.build_gpt(cfg, get_mixln_decoder_block_spec(cfg, backend="local", post_ln_layers=2))
    assert [l.is_post_ln for l in model.decoder.layers] == [True, True, False, False]
    assert isinstance(model.decoder.final_layernorm, MixLNNorm)
    layer = model.decoder.layers[0]
    x = torch.randn(S, B, cfg.hidden_size, requires_grad=True)
    out, _ = layer(x, attention_mask=causal_mask())
    assert out._base is None


# ------------------------------------------------------------------ unsupported configurations
@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(experimental_attention_variant="gated_delta_net"), "experimental attention"),
        (dict(inference_fuse_tp_communication=True), "inference_fuse_tp_communication"),
    ],
)
def test_unsupported_configurations_are_rejected(overrides, match):
    from mixln_megatron.model.support import MixLNUnsupportedError, check_supported

    cfg = mu.tiny_config(num_layers=4)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    with pytest.raises(MixLNUnsupportedError, match=match):
        check_supported(cfg)


def test_mla_is_rejected():
    from mixln_megatron.model.support import MixLNUnsupportedError, check_supported

    cfg = mu.tiny_config(num_layers=4)
    cfg.multi_latent_attention = True
    with pytest.raises(MixLNUnsupportedError, match="multi-latent"):
        check_supported(cfg)


def test_te_spec_without_te_names_the_local_spec():
    from mixln_megatron.model.backends import TransformerEngineMissingError, have_te
    from mixln_megatron.spec import MixLNTransformerLayerSpec, mixln_layer_spec

    if have_te():
        pytest.skip("TransformerEngine is installed here")
    cfg = mu.tiny_config(num_layers=4)
    with pytest.raises(TransformerEngineMissingError, match="mixln_local_layer_spec"):
        mixln_layer_spec(cfg)
    with pytest.raises(TransformerEngineMissingError):
        MixLNTransformerLayerSpec(backend="te", post_ln_layers=1)


def test_context_parallel_with_local_backend_is_rejected():
    from mixln_megatron.model.support import MixLNUnsupportedError
    from mixln_megatron.spec import get_mixln_decoder_block_spec

    cfg = mu.tiny_config(num_layers=4)
    cfg.context_parallel_size = 2
    with pytest.raises(MixLNUnsupportedError, match="context parallelism"):
        get_mixln_decoder_block_spec(cfg, backend="local", post_ln_layers=1)


def test_spec_names_resolve_through_megatron_import_module():
    from megatron.core.transformer.spec_utils import import_module

    import mixln_megatron.spec as spec_module

    for name in ("mixln_layer_spec", "mixln_local_layer_spec"):
        assert import_module(("mixln_megatron.spec", name)) is getattr(spec_module, name)


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_mixln_norm_matches_torch(normalization, zero_centered):
    from mixln_megatron.model.backends import MixLNNorm

    cfg = mu.tiny_config(num_layers=4, normalization=normalization, layernorm_zero_centered_gamma=zero_centered)
    norm = MixLNNorm(config=cfg, hidden_size=64, eps=1e-5)
    gamma = torch.randn(64)
    with torch.no_grad():
        norm.weight.copy_(gamma - 1 if zero_centered else gamma)
        if norm.bias is not None:
            norm.bias.normal_()
    x = torch.randn(8, 2, 64)
    if normalization == "RMSNorm":
        ref = torch.nn.functional.rms_norm(x, (64,), gamma, 1e-5)
    else:
        ref = torch.nn.functional.layer_norm(x, (64,), gamma, norm.bias.detach(), 1e-5)
    assert (norm(x) - ref).abs().max().item() <= 1e-5


def test_layernorm_model_builds_and_runs():
    from mixln_megatron.spec import get_mixln_decoder_block_spec

    cfg = mu.tiny_config(num_layers=4, normalization="LayerNorm")
    model = mu.build_gpt(cfg, get_mixln_decoder_block_spec(cfg, backend="local", post_ln_layers=1))
    ids, labels, pos, mask = mu.batch()
    loss = model(ids, pos, mask, labels=labels).mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert model.decoder.layers[0].post_attention_layernorm.bias is not None


def test_unknown_normalization_is_rejected():
    from mixln_megatron.model.backends import layer_submodules

    with pytest.raises(ValueError, match="RMSNorm or LayerNorm"):
        layer_submodules("local", normalization="L2Norm")
