"""MixLNTransformerLayer.norm_parameters(): the one answer to "which parameters are a layer's two
norms", used by the spike scaler, the telemetry and the grad-norm analysis."""

from types import SimpleNamespace

import torch


def _tiny_model(post_ln_layers=2):
    from harness.testing import build_gpt, tiny_config
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.spec import get_mixln_decoder_block_spec

    torch.manual_seed(0)
    config = tiny_config(num_layers=4)
    spec = get_mixln_decoder_block_spec(config, backend="local", settings=MixLNSettings(post_ln_layers=post_ln_layers))
    return build_gpt(config, spec)


def test_both_kinds_name_their_two_norms(mcore_single):
    model = _tiny_model()
    for layer in model.decoder.layers:
        got = dict(layer.norm_parameters())
        assert sorted(got) == ["norm1.weight", "norm2.weight"]
        first, second = (("post_attention_layernorm", "post_mlp_layernorm") if layer.is_post_ln
                         else ("input_layernorm", "pre_mlp_layernorm"))
        assert got["norm1.weight"] is getattr(layer, first).weight
        assert got["norm2.weight"] is getattr(layer, second).weight
        # nothing else in the layer is a norm, and every norm parameter is listed
        named = {id(p): n for n, p in layer.named_parameters()}
        assert sorted(named[id(p)] for p in got.values()) == sorted(
            n for n in named.values() if "layernorm" in n)
    assert [layer.is_post_ln for layer in model.decoder.layers] == [True, True, False, False]


def test_consumers_use_the_layer_s_answer(mcore_single):
    from mixln_megatron.analysis.diagnostics import layer_grad_norms
    from harness.testing import batch
    from mixln_megatron.training.telemetry import norm_columns

    model = _tiny_model()
    ids, labels, pos, mask = batch()
    model(ids, pos, mask, labels=labels).float().mean().backward()
    layers = list(model.decoder.layers)
    matrices_only = layer_grad_norms(SimpleNamespace(layers=layers), exclude_norms=True)
    for layer, got in zip(layers, matrices_only):
        norms = {id(p) for _, p in layer.norm_parameters()}
        want = sum(p.grad.double().pow(2).sum() for p in layer.parameters() if id(p) not in norms) ** 0.5
        assert abs(got - float(want)) <= 1e-9 * float(want)
        columns = norm_columns(layer)
        assert sorted(columns.values()) == [1, 2] and set(columns) == norms
