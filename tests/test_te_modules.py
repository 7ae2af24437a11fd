"""The Mix-LN TE spec built from real TransformerEngine 2.20.2 modules (on the CPU: construction,
parameters and state only; TE's forward needs a GPU). Run by `make test-te`; skipped without TE.

- Pre-LN layers are megatron's stock TE layer: the same module classes, parameter names, shapes
  and module flags as megatron's own TE decoder spec built from the same config, at P = 0, 2, L.
- Post-LN layers: plain TE column-parallel linears (no fused norm) for qkv / fc1, and N1 / N2 TE
  norms configured like megatron's own TE norm of the same config (epsilon, zero-centred gamma,
  sequence_parallel), for RMSNorm and LayerNorm.
- norm_parameters(), the spike scaler's targets and telemetry's norm columns find the TE norms,
  fused (Pre-LN) and not (Post-LN); scoped CUDA-graph lists include N1 / N2; Post-LN norms'
  `_extra_state` is left out of sharded checkpoints and refilled on load.
- The support table's TE refusals fire on real TE configs, and TE-only features build.
"""

import pytest
import torch

from mixln_megatron import cpu
from harness import testing as mu

WHY = mu.te_missing()
pytestmark = [pytest.mark.te, pytest.mark.skipif(WHY is not None, reason=str(WHY))]

L = 4
flags, params = mu.module_flags, mu.param_shapes


def config(normalization="RMSNorm", **overrides):
    kw = dict(query_groups=2, normalization=normalization, layernorm_epsilon=1e-6,
              layernorm_zero_centered_gamma=True, qk_layernorm=True)
    return mu.tiny_config(num_layers=L, **{**kw, **overrides})


def stock_model(cfg):
    """megatron's own TE GPT decoder spec for `cfg` (the oracle)."""
    with cpu.te_modules():
        return mu.build_gpt(cfg, mu.stock_te_spec(cfg))


def mixln_model(cfg, p):
    (model,) = mu.build_chunks(cfg, p)
    return model


@pytest.mark.usefixtures("te_single")
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("p", [0, 2, L])
def test_pre_ln_layers_are_megatrons_stock_te_layer(normalization, p):
    import transformer_engine.pytorch as te
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear

    cfg = config(normalization)
    stock, mixln = stock_model(cfg), mixln_model(cfg, p)
    assert [l.is_post_ln for l in mixln.decoder.layers] == [i < p for i in range(L)]
    for ours, theirs in zip(mixln.decoder.layers, stock.decoder.layers):
        if ours.is_post_ln:
            continue
        mu.same_as_stock_layer(ours, theirs)
        # the fused TE norm+linear, with the config's norm
        for linear in (ours.self_attention.linear_qkv, ours.mlp.linear_fc1):
            assert isinstance(linear, TELayerNormColumnParallelLinear)
            assert linear.normalization == normalization and linear.eps == 1e-6 and linear.zero_centered_gamma
    final = mixln.decoder.final_layernorm
    assert isinstance(final, te.RMSNorm if normalization == "RMSNorm" else te.LayerNorm)
    assert flags(final) == flags(stock.decoder.final_layernorm)
    if p == 0:  # P = 0 is the stock model, state-dict keys included
        stock_keys = [k for k in stock.state_dict() if "mixln" not in k]
        assert [k for k in mixln.state_dict() if "mixln" not in k] == stock_keys


@pytest.mark.usefixtures("te_single")
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_post_ln_layers_plain_te_linears_and_te_norms(normalization):
    import transformer_engine.pytorch as te
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear,
        TELayerNormColumnParallelLinear,
    )

    cfg = config(normalization)
    stock, mixln = stock_model(cfg), mixln_model(cfg, 2)
    norm_cls = te.RMSNorm if normalization == "RMSNorm" else te.LayerNorm
    reference_norm = flags(stock.decoder.final_layernorm)  # megatron's TENorm for this config
    assert reference_norm["eps"] == 1e-6 and reference_norm["zero_centered_gamma"] is True
    for ours, theirs in zip(mixln.decoder.layers[:2], stock.decoder.layers[:2]):
        assert ours.is_post_ln
        for name in ("self_attention.linear_qkv", "mlp.linear_fc1"):
            linear, ref = ours.get_submodule(name), theirs.get_submodule(name)
            assert isinstance(linear, TEColumnParallelLinear), name
            assert not isinstance(linear, TELayerNormColumnParallelLinear), name
            assert not any(n.startswith("layer_norm") for n, _ in linear.named_parameters()), name
            assert params(linear) == {"weight": tuple(ref.weight.shape)}, name
            for flag in ("parallel_mode", "sequence_parallel", "tp_size", "in_features", "out_features",
                         "use_bias", "return_bias", "fuse_wgrad_accumulation"):
                assert getattr(linear, flag) == getattr(ref, flag), (name, flag)
        assert type(ours.input_layernorm).__name__ == type(ours.pre_mlp_layernorm).__name__ == "IdentityOp"
        for norm in (ours.post_attention_layernorm, ours.post_mlp_layernorm):  # N1, N2
            assert type(norm) is norm_cls
            assert flags(norm) == reference_norm
            assert set(params(norm)) == ({"weight"} if normalization == "RMSNorm" else {"weight", "bias"})
        # everything else is megatron's stock TE module
        for name, module in theirs.named_modules():
            if name and name not in ("self_attention.linear_qkv", "mlp.linear_fc1"):
                assert type(ours.get_submodule(name)) is type(module), name
    assert params(mixln) != params(stock)  # N1 / N2 instead of the fused norms in layers 1, 2


@pytest.mark.usefixtures("te_single")
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_norm_parameters_spike_targets_and_telemetry_find_te_norms(normalization):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from mixln_megatron.training.spike import target_layers
    from mixln_megatron.training.spike.state import find_targets
    from mixln_megatron.training.telemetry import COLUMNS, GradTelemetry, norm_columns

    cfg = config(normalization)
    model = mixln_model(cfg, 2)
    names = ["weight"] if normalization == "RMSNorm" else ["weight", "bias"]
    expected = {}
    for layer in model.decoder.layers:
        if layer.is_post_ln:
            n1, n2 = layer.post_attention_layernorm, layer.post_mlp_layernorm
            want = [getattr(n1, n) for n in names] + [getattr(n2, n) for n in names]
        else:  # the norms fused into TE's LayerNorm+Linear
            qkv, fc1 = layer.self_attention.linear_qkv, layer.mlp.linear_fc1
            want = [getattr(qkv, f"layer_norm_{n}") for n in names] + [getattr(fc1, f"layer_norm_{n}") for n in names]
        got = layer.norm_parameters()
        assert [r for r, _ in got] == [f"norm{i}.{n}" for i in (1, 2) for n in names]
        assert [id(p) for _, p in got] == [id(p) for p in want], layer.layer_number
        expected[layer.layer_number] = got
        columns = norm_columns(layer)
        assert sorted(columns.values()) == sorted([1] * len(names) + [2] * len(names))

    boundary = target_layers("boundary", model.decoder.layers[0].placement)
    assert boundary == (2, 3)  # the last Post-LN and the first Pre-LN layer
    targets, _ = find_targets([model], boundary)
    assert [(t.layer_number, t.role, id(t.param)) for t in targets] == sorted(
        (n, role, id(p)) for n in boundary for role, p in expected[n])

    # telemetry's plan over megatron's DDP-wrapped TE model: 2 norm columns per layer found
    ddp = DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(), module=model)
    telemetry = GradTelemetry(interval=1)
    telemetry._build_plan([ddp])
    rows = sorted(int(r) for part in telemetry._plan["parts"] for r in part["norm_rows"])  # dense (and expert) parts
    assert rows == sorted(COLUMNS * (n - 1) + c for n in range(1, L + 1) for c in (1, 2) for _ in names)


@pytest.mark.usefixtures("te_single")
def test_scoped_cuda_graphs_list_te_post_ln_norms():
    from megatron.core.transformer.enums import CudaGraphModule

    cfg = config()
    model = mixln_model(cfg, 1)
    post, pre = model.decoder.layers[:2]
    for scope, norms in (((CudaGraphModule.attn,), [post.post_attention_layernorm]),
                         ((CudaGraphModule.mlp,), [post.post_mlp_layernorm]),
                         ((CudaGraphModule.attn, CudaGraphModule.mlp),
                          [post.post_attention_layernorm, post.post_mlp_layernorm])):
        cfg.cuda_graph_modules = list(scope)  # read at call time
        got = post._get_submodules_under_cudagraphs()
        assert got[-len(norms):] == norms and all(any(m is n for m in got) for n in norms), scope
        pre_got = pre._get_submodules_under_cudagraphs()
        assert not any(isinstance(m, type(post.post_mlp_layernorm)) for m in pre_got), scope
    cfg.cuda_graph_modules = []
    assert post._get_submodules_under_cudagraphs() == [post]


@pytest.mark.usefixtures("te_single")
def test_post_ln_te_norm_extra_state_left_out_of_sharded_checkpoints():
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    cfg = config()
    model = mixln_model(cfg, 2)
    state = model.state_dict()
    post_extra = [k for k in state if k.endswith("layernorm._extra_state") and ".post_" in k]
    assert post_extra == [f"decoder.layers.{i}.{n}._extra_state" for i in (0, 1)
                          for n in ("post_attention_layernorm", "post_mlp_layernorm")]
    sharded = model.sharded_state_dict()
    assert not any(k.endswith("layernorm._extra_state") and ".post_" in k for k in sharded)
    # the TE linears' extra state stays, stacked over all layers (every layer has those modules)
    qkv = [v for k, v in sharded.items() if k.endswith("linear_qkv._extra_state")]
    assert len(qkv) == L and all(isinstance(v, ShardedObject) for v in qkv)
    assert len({v.key for v in qkv}) == 1
    # a load without the left-out entries is strict-clean: the layer keeps its norms' own state
    reduced = {k: v for k, v in state.items() if k not in post_extra}
    model.load_state_dict(reduced, strict=True)

    # a non-empty TE norm state (e.g. fp8 scales) is refused, not dropped silently
    norm = model.decoder.layers[0].post_attention_layernorm
    norm.get_extra_state = lambda: torch.tensor([7.0])
    with pytest.raises(RuntimeError, match="post_attention_layernorm._extra_state is not empty"):
        model.sharded_state_dict()


@pytest.mark.usefixtures("te_single")
def test_support_table_refusals_on_real_te_configs():
    from mixln_megatron.model.support import MixLNUnsupportedError
    from mixln_megatron.spec import get_mixln_decoder_block_spec

    # fp32_residual_connection: refused in TE Post-LN layers at build, fine at P = 0
    cfg = config(fp32_residual_connection=True)
    with pytest.raises(MixLNUnsupportedError, match=r"fp32_residual_connection .*te backend in Post-LN layers"):
        mixln_model(cfg, 2)
    assert not any(l.is_post_ln for l in mixln_model(cfg, 0).decoder.layers)

    # TE's op fuser: refused by the TE spec (MoE builds: tests/test_moe_te.py)
    for overrides, match in ((dict(use_transformer_engine_op_fuser=True), "op fuser"),):
        with pytest.raises(MixLNUnsupportedError, match=match):
            get_mixln_decoder_block_spec(config(**overrides), backend="te", post_ln_layers=2)

    # local-only refusals are the TE spec's features: CP passes the TE spec (not the local one) and
    # the TE activation builds with real TE modules
    cp = config(context_parallel_size=2)
    get_mixln_decoder_block_spec(cp, backend="te", post_ln_layers=2)
    with pytest.raises(MixLNUnsupportedError, match="context parallelism"):
        get_mixln_decoder_block_spec(cp, backend="local", post_ln_layers=2)
    act = config(use_te_activation_func=True)
    model = mixln_model(act, 2)
    assert all(type(l.mlp.activation_func).__module__.startswith("megatron.core.extensions")
               or "transformer_engine" in type(l.mlp.activation_func).__module__ for l in model.decoder.layers)
    with pytest.raises(MixLNUnsupportedError, match="use_te_activation_func"):
        get_mixln_decoder_block_spec(act, backend="local", post_ln_layers=2)
