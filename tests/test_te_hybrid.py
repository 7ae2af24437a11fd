"""HybridModel Mix-LN built from real TransformerEngine 2.20.2 modules (on the CPU: construction and
parameters only; TE's forward needs a GPU). Run by `make test-te`; skipped without TE.

- get_mixln_hybrid_stack_spec(backend="te") and the `--spec` object mixln_hybrid_stack_spec:
  Pre-LN `*` layers keep TE's fused TELayerNormColumnParallelLinear as linear_qkv, Pre-LN `-`
  layers as linear_fc1; Post-LN layers a plain TE column-parallel linear and a TE norm, N1 in the
  `*` layer, N2 in the `-` layer; the final norm is TENorm.
- At P = 0 the model is megatron's own hybrid_stack_spec model: the same module classes and
  flags, parameter names and shapes, and state-dict keys, layer by layer.
"""

import pytest

from mixln_megatron import compat
from mixln_megatron import cpu
from harness import testing as mu

WHY = mu.te_missing() or (None if compat.HYBRID_MODEL else "HybridModel Mix-LN needs megatron-core 0.19+")
pytestmark = [pytest.mark.te, pytest.mark.skipif(WHY is not None, reason=str(WHY))]

L = 4
PATTERN = "*-" * L
TP_ATTRS = ("sequence_parallel", "tensor_model_parallel", "partition_dim", "partition_stride")


def config(normalization="RMSNorm"):
    return mu.tiny_config(num_layers=2 * L, query_groups=2, normalization=normalization, layernorm_epsilon=1e-6)


def factory_model(cfg, p):
    from mixln_megatron.spec import get_mixln_hybrid_stack_spec

    spec = get_mixln_hybrid_stack_spec(cfg, backend="te", post_ln_layers=p, hybrid_layer_pattern=PATTERN)
    with cpu.te_modules():
        return mu.build_hybrid(cfg, spec, PATTERN)


def spec_object_model(cfg):
    from mixln_megatron.spec import mixln_hybrid_stack_spec

    with cpu.te_modules():
        return mu.build_hybrid(cfg, mixln_hybrid_stack_spec, PATTERN)


def stock_model(cfg):
    """megatron's own TE hybrid stack spec (the oracle for P = 0 and for Pre-LN layers)."""
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    with cpu.te_modules():
        return mu.build_hybrid(cfg, hybrid_stack_spec, PATTERN)


@pytest.fixture
def edge_settings(monkeypatch):
    """The --spec object reads MIXLN_* (no Megatron-LM args); its build line is printed once per placement."""
    import sys

    from mixln_megatron.model import support

    global_vars = sys.modules.get("megatron.training.global_vars")
    if global_vars is not None:
        monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", None)
    monkeypatch.setattr(support, "_announced", set())
    return lambda p: monkeypatch.setenv("MIXLN_POST_LN_LAYERS", str(p))


def check_te_layers(model, p, normalization="RMSNorm"):
    import transformer_engine.pytorch as te
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TELayerNormColumnParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp

    from mixln_megatron.model.hybrid import MixLNHybridStack

    norm_cls = te.RMSNorm if normalization == "RMSNorm" else te.LayerNorm  # what TENorm builds
    assert type(model.decoder) is MixLNHybridStack
    assert type(model.decoder.final_norm) is norm_cls and model.decoder.final_norm.eps == 1e-6
    layers = model.decoder.layers
    assert [(l.block_number, l.hybrid_part, l.is_post_ln) for l in layers] == [
        ((n + 1) // 2, "attention" if n % 2 else "mlp", (n + 1) // 2 <= p) for n in range(1, 2 * L + 1)]
    for layer in layers:
        attention = layer.hybrid_part == "attention"
        linear = layer.self_attention.linear_qkv if attention else layer.mlp.linear_fc1
        assert isinstance(layer.input_layernorm, IdentityOp) and isinstance(layer.pre_mlp_layernorm, IdentityOp)
        if layer.is_post_ln:
            assert isinstance(linear, TEColumnParallelLinear)
            assert not isinstance(linear, TELayerNormColumnParallelLinear)
            assert not any(n.startswith("layer_norm") for n, _ in linear.named_parameters())
            own, absent = ("post_attention_layernorm", "post_mlp_layernorm")[::1 if attention else -1]
            norm = getattr(layer, own)  # N1 in `*`, N2 in `-`
            assert type(norm) is norm_cls and norm.eps == 1e-6 and getattr(layer, absent) is None
            weight = norm.weight
        else:  # the stock fused norm + linear
            assert isinstance(linear, TELayerNormColumnParallelLinear) and linear.normalization == normalization
            assert getattr(layer, "post_attention_layernorm", None) is None
            assert getattr(layer, "post_mlp_layernorm", None) is None
            weight = linear.layer_norm_weight
        role = "norm1.weight" if attention else "norm2.weight"
        got = [(r, id(q)) for r, q in layer.norm_parameters() if r.endswith("weight")]
        assert got == [(role, id(weight))], layer.layer_number


def same_as_stock_hybrid_layer(ours, theirs):
    """A Mix-LN hybrid layer is megatron's stock hybrid layer (TransformerLayer / MLPLayer): the same
    submodule classes and flags, parameter names, shapes and tensor-parallel attributes."""
    mine, ref = dict(ours.named_modules()), dict(theirs.named_modules())
    assert list(mine) == list(ref), (list(mine), list(ref))
    for name, module in ref.items():
        if name:
            assert type(mine[name]) is type(module), name
            assert mu.module_flags(mine[name]) == mu.module_flags(module), name
    stock_flags = mu.module_flags(theirs)
    assert {k: mu.module_flags(ours).get(k) for k in stock_flags} == stock_flags
    assert mu.param_shapes(ours) == mu.param_shapes(theirs)
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        for attr in TP_ATTRS:
            assert getattr(a, attr, None) == getattr(b, attr, None), (name, attr)


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("p", [0, 2, L])
def test_factory_builds_te_modules_in_their_places(mcore_single, normalization, p):
    cfg = config(normalization)
    check_te_layers(factory_model(cfg, p), p, normalization)


@pytest.mark.parametrize("p", [0, 2])
def test_spec_object_builds_te_modules_in_their_places(mcore_single, edge_settings, p):
    edge_settings(p)
    cfg = config()
    model = spec_object_model(cfg)
    check_te_layers(model, p)
    assert mu.param_shapes(model) == mu.param_shapes(factory_model(config(), p))


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("p", [0, 2])
def test_pre_ln_layers_are_megatrons_stock_hybrid_layers(mcore_single, normalization, p):
    stock, mixln = stock_model(config(normalization)), factory_model(config(normalization), p)
    for ours, theirs in zip(mixln.decoder.layers, stock.decoder.layers, strict=True):
        if not ours.is_post_ln:
            same_as_stock_hybrid_layer(ours, theirs)
    assert type(mixln.decoder.final_norm) is type(stock.decoder.final_norm)
    assert mu.module_flags(mixln.decoder.final_norm) == mu.module_flags(stock.decoder.final_norm)


@pytest.mark.parametrize("build", ["factory", "spec object"])
def test_p0_is_megatrons_hybrid_stack_spec_model(mcore_single, edge_settings, build):
    if build == "spec object":
        edge_settings(0)
        mixln = spec_object_model(config())
    else:
        mixln = factory_model(config(), 0)
    stock = stock_model(config())
    for ours, theirs in zip(mixln.decoder.layers, stock.decoder.layers, strict=True):
        same_as_stock_hybrid_layer(ours, theirs)
    assert mu.param_shapes(mixln) == mu.param_shapes(stock)
    assert list(mixln.state_dict()) == list(stock.state_dict())  # checkpoint-compatible both ways


def test_every_layer_kind_builds_te_modules_and_saves_the_gpt_layout_keys(mcore_single):
    """The comparison arms on TE: a deepnorm block is built as a Post-LN one, a sandwich block as a
    Pre-LN one (TE's fused norm + linear) plus a TE norm after its sublayer (N_b in the `*` layer,
    N_d in the `-` layer); the sharded keys are the GPT model's per hybrid layer, with sandwich's
    output norms under mixln_norm_c / mixln_norm_d."""
    import transformer_engine.pytorch as te
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear

    from mixln_megatron.model.layer import ResidualStep
    from mixln_megatron.spec import get_mixln_hybrid_stack_spec

    cfg = config()
    spec = get_mixln_hybrid_stack_spec(cfg, backend="te", layout="deepnorm:1,sandwich:2,post:3,pre:4",
                                       hybrid_layer_pattern=PATTERN)
    with cpu.te_modules():
        model = mu.build_hybrid(cfg, spec, PATTERN)
    layers = model.decoder.layers
    assert [l.kind for l in layers] == [k for k in ("deepnorm", "sandwich", "post", "pre") for _ in "*-"]
    sandwich_attention, sandwich_mlp = layers[2], layers[3]
    assert isinstance(sandwich_attention.self_attention.linear_qkv, TELayerNormColumnParallelLinear)
    assert type(sandwich_attention.attn_output_layernorm) is te.RMSNorm
    assert sandwich_attention.mlp_output_layernorm is None
    assert type(sandwich_mlp.mlp_output_layernorm) is te.RMSNorm and sandwich_mlp.attn_output_layernorm is None
    assert isinstance(sandwich_attention.self_attn_bda, ResidualStep) and isinstance(sandwich_mlp.mlp_bda, ResidualStep)
    deepnorm_attention, deepnorm_mlp = layers[0], layers[1]
    assert deepnorm_attention.self_attn_bda.residual_scale == deepnorm_mlp.mlp_bda.residual_scale == (2 * L) ** 0.25
    assert not isinstance(deepnorm_attention.mlp_bda, ResidualStep)  # the identity half stays megatron's
    keys = {v.key for v in model.sharded_state_dict().values() if "mixln_norm" in getattr(v, "key", "")}
    assert keys == {f"decoder.layers.{j}.mixln_norm_{n}.weight" for j, n in (
        (0, "b"), (1, "a"), (2, "a"), (3, "b"), (2, "c"), (3, "d"), (4, "b"), (5, "a"), (6, "a"), (7, "b"))}
