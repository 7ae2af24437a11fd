"""The TransformerEngine path's own logic, on the real TE classes under `make test-te` (marker
`te`) and on stand-ins for them where TE is absent, so that the default suite still covers it.

- Post-LN layers derive plain TE linears from the fused norm+linear classes of the TE spec,
  without mutating the shared spec.
- A norm with `_extra_state` (as TE's RMSNorm has) in Post-LN layers only still saves and loads
  with torch_dist, whose per-layer stacking would otherwise reject a key some layers lack; a
  non-empty one is refused rather than dropped (real TE: tests/test_te_modules.py).
- Scoped CUDA graphs list N1 / N2; Post-LN TE linears honour the overlap disable switches;
  fp32_residual_connection is rejected for TE Post-LN layers.
TE's forward needs a GPU: the LNS output scaling of a fused norm+linear is checked on megatron's
ColumnParallelLinear (the same map), TE or not.
"""

import functools

import pytest
import torch

from harness import testing as mu

TE_WHY = mu.te_missing()
# A test on the real TE classes (marked te: make test-te); its stand-in twin runs only where TE is absent.
needs_te = pytest.mark.skipif(TE_WHY is not None, reason=str(TE_WHY))
stand_in = pytest.mark.skipif(TE_WHY is None, reason="TE is here: its real classes are tested (marker te)")


def check_post_ln_variant(te_like, fused, plain):
    """post_ln_submodules of a TE layer's submodules: plain linears for qkv / fc1, the rest kept,
    and the shared spec untouched."""
    from mixln_megatron.model.layer import POST_LN_KEYS_MAP, post_ln_submodules

    metainfo = dict(te_like.self_attention.metainfo)
    post = post_ln_submodules(te_like)
    for linear in (post.self_attention.submodules.linear_qkv, post.mlp.keywords["submodules"].linear_fc1):
        assert issubclass(linear, plain) and not issubclass(linear, fused), linear
    assert post.self_attention.metainfo == metainfo
    assert post.sharded_state_dict_keys_map == POST_LN_KEYS_MAP
    # the shared spec is untouched
    assert te_like.self_attention.submodules.linear_qkv is fused
    assert te_like.mlp.keywords["submodules"].linear_fc1 is fused
    assert te_like.self_attention.metainfo == metainfo


@stand_in
def test_post_ln_variant_replaces_fused_te_linears(monkeypatch):
    import megatron.core.extensions.transformer_engine as te_ext
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    import mixln_megatron.model.layer  # noqa: F401  (imported before HAVE_TE is patched: megatron's MoE imports TE then)

    # Without TE, megatron's TE classes are MagicMocks: stand in real classes for them.
    class FusedNormLinear:  # TELayerNormColumnParallelLinear
        pass

    class PlainLinear:  # TEColumnParallelLinear
        pass

    monkeypatch.setattr(te_ext, "HAVE_TE", True)
    monkeypatch.setattr(te_ext, "TELayerNormColumnParallelLinear", FusedNormLinear)
    monkeypatch.setattr(te_ext, "TEColumnParallelLinear", PlainLinear)
    fused, plain = FusedNormLinear, PlainLinear
    te_like = TransformerLayerSubmodules(
        self_attention=ModuleSpec(
            module=SelfAttention,
            submodules=SelfAttentionSubmodules(linear_qkv=fused, core_attention=object,
                                              linear_proj=object),
            metainfo={"fuse_input_layernorm": True},
        ),
        mlp=functools.partial(
            MLP.as_mlp_submodule,
            submodules=MLPSubmodules(linear_fc1=fused, linear_fc2=object),
        ),
    )
    check_post_ln_variant(te_like, fused, plain)


@pytest.mark.te
@needs_te
@pytest.mark.usefixtures("mcore_single")
def test_post_ln_variant_of_megatrons_te_spec_has_plain_te_linears():
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear,
        TELayerNormColumnParallelLinear,
    )

    cfg = mu.tiny_config(num_layers=2)
    te_layer = mu.stock_te_spec(cfg).layer_specs[0].submodules  # megatron's own TE layer spec
    assert te_layer.self_attention.submodules.linear_qkv is TELayerNormColumnParallelLinear
    check_post_ln_variant(te_layer, TELayerNormColumnParallelLinear, TEColumnParallelLinear)


WORKER_CODE = r'''
import os, sys, torch
from harness import testing as mu
from mixln_megatron.model.backends import MixLNNorm

class NormWithExtraState(MixLNNorm):
    """Stands in for TE's RMSNorm, which always emits `_extra_state` (empty without fp8)."""
    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)
    def set_extra_state(self, state):
        self.loaded_extra = state

def build(cfg, real_te):
    """The TE spec with TE's own norms, or the local one whose Post-LN norms carry extra state."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from mixln_megatron.spec import MixLNTransformerLayerSpec
    if real_te:
        (model,) = mu.build_chunks(cfg, 2)
        return model
    layer = MixLNTransformerLayerSpec(backend="local", post_ln_layers=2)
    layer.params["post_ln_norm"] = NormWithExtraState
    return mu.build_gpt(cfg, TransformerBlockSubmodules(layer_specs=[layer] * 4, layer_norm=MixLNNorm))

def main():
    from megatron.core import dist_checkpointing
    real_te = sys.argv[2] == "te"
    mu.init_distributed()
    cfg = mu.tiny_config(num_layers=4)
    model = build(cfg, real_te)
    state = model.state_dict()
    assert "decoder.layers.0.post_mlp_layernorm._extra_state" in state
    assert "decoder.layers.2.post_mlp_layernorm._extra_state" not in state  # Pre-LN layers have none
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn(p.shape))
    ckpt = sys.argv[1]
    os.makedirs(ckpt, exist_ok=True)
    dist_checkpointing.save({"model": model.sharded_state_dict()}, ckpt)
    torch.manual_seed(99)
    other = build(cfg, real_te)
    loaded = dist_checkpointing.load({"model": other.sharded_state_dict()}, ckpt)
    other.load_state_dict(loaded["model"])  # strict: the dropped extra states must not be missing
    for (n, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        if torch.is_tensor(a) and "extra_state" not in n:
            assert torch.equal(a, b), n
    print("OK", flush=True)

if __name__ == "__main__":
    main()
'''


@pytest.mark.parametrize("norms", [
    pytest.param("stand-in", marks=stand_in),
    pytest.param("te", marks=[pytest.mark.te, needs_te]),  # TE's RMSNorm and linears, built on the CPU
])
def test_norm_extra_state_in_post_ln_layers_only_saves_and_loads(tmp_path, norms):
    from harness.testing import torchrun

    script = tmp_path / "worker.py"
    script.write_text(WORKER_CODE)
    proc = torchrun(str(script), 1, tmp_path / "ckpt", norms)
    assert "OK" in proc.stdout


@pytest.mark.usefixtures("mcore_single")
@pytest.mark.parametrize("bias, skip_bias_add", [(False, False), (True, False), (True, True)])
def test_lns_output_scaling_of_a_fused_norm_linear_is_exact(bias, skip_bias_add):
    """TE's fused LayerNormLinear cannot scale its norm output; scaling its GEMM output is the
    same map. Checked on megatron's ColumnParallelLinear standing in for the fused module."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from mixln_megatron.model.backends import scale_linear_output

    cfg = mu.tiny_config(num_layers=4)
    torch.manual_seed(0)
    linear = ColumnParallelLinear(64, 96, config=cfg, init_method=torch.nn.init.normal_, bias=bias,
                                  skip_bias_add=skip_bias_add, gather_output=False)
    if bias:
        with torch.no_grad():
            linear.bias.normal_()
    x = torch.randn(8, 2, 64)
    scale = 0.5 ** 0.5
    expected_out, expected_bias = linear(x * scale)
    handle = scale_linear_output(linear, scale)
    out, out_bias = linear(x)
    handle.remove()
    # same map up to fp32 rounding (the scalar moves across the GEMM)
    assert (out - expected_out).abs().max().item() <= 1e-6 * expected_out.abs().max().item()
    assert (out_bias is None) == (expected_bias is None)


@stand_in  # with TE: tests/test_te_modules.py, on TE's own RMSNorm
@pytest.mark.usefixtures("mcore_single")
def test_non_empty_post_ln_extra_state_is_not_dropped_silently():
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from mixln_megatron.model.backends import MixLNNorm
    from mixln_megatron.spec import MixLNTransformerLayerSpec

    class NormWithFp8State(MixLNNorm):
        def get_extra_state(self):
            return torch.tensor([7.0])  # e.g. fp8 scaling factors

        def set_extra_state(self, state):
            pass

    layer = MixLNTransformerLayerSpec(backend="local", post_ln_layers=1)
    layer.params["post_ln_norm"] = NormWithFp8State
    model = mu.build_gpt(mu.tiny_config(num_layers=2),
                         TransformerBlockSubmodules(layer_specs=[layer] * 2, layer_norm=MixLNNorm))
    with pytest.raises(RuntimeError, match="post_attention_layernorm._extra_state is not empty"):
        model.sharded_state_dict()


@pytest.mark.usefixtures("mcore_single")
def test_scoped_cuda_graphs_cover_post_ln_norms():
    """With cuda_graph_modules attn / mlp, N1 runs inside the attention path and N2 inside the MLP
    path, so DDP's pre-replay hooks must know their parameters."""
    from megatron.core.transformer.enums import CudaGraphModule

    from mixln_megatron.spec import get_mixln_decoder_block_spec

    cfg = mu.tiny_config(num_layers=2)
    model = mu.build_gpt(cfg, get_mixln_decoder_block_spec(cfg, backend="local", post_ln_layers=1))
    post, pre = model.decoder.layers
    assert post.is_post_ln and not pre.is_post_ln
    cases = {
        (CudaGraphModule.attn,): [post.input_layernorm, post.self_attention, post.pre_cross_attn_layernorm,
                                  post.cross_attention, post.post_attention_layernorm],
        (CudaGraphModule.mlp,): [post.pre_mlp_layernorm, post.mlp, post.post_mlp_layernorm],
        (CudaGraphModule.attn, CudaGraphModule.mlp): [
            post.input_layernorm, post.self_attention, post.pre_cross_attn_layernorm, post.cross_attention,
            post.pre_mlp_layernorm, post.mlp, post.post_attention_layernorm, post.post_mlp_layernorm],
    }
    for scope, expected in cases.items():
        cfg.cuda_graph_modules = list(scope)  # read at call time; set after validation
        got = post._get_submodules_under_cudagraphs()
        assert [id(m) for m in got] == [id(m) for m in expected], scope
        assert not any(m is getattr(pre, "post_mlp_layernorm", None) for m in pre._get_submodules_under_cudagraphs())
    cfg.cuda_graph_modules = []
    assert post._get_submodules_under_cudagraphs() == [post]  # unscoped: the whole layer


@stand_in
def test_post_ln_te_linear_honours_overlap_disable_switches(monkeypatch):
    """megatron's fused TE class turns userbuffer overlap off for qkv / fc1 on request; the plain
    linear of a Post-LN layer ignored the switch."""
    from types import SimpleNamespace

    import megatron.core.extensions.transformer_engine as te_ext

    from mixln_megatron.model.backends import post_ln_linear

    class FusedNormLinear:
        pass

    class PlainLinear:
        def __init__(self, input_size, output_size, *, config, tp_comm_buffer_name=None):
            self.config = config

    monkeypatch.setattr(te_ext, "HAVE_TE", True)
    monkeypatch.setattr(te_ext, "TELayerNormColumnParallelLinear", FusedNormLinear)
    monkeypatch.setattr(te_ext, "TEColumnParallelLinear", PlainLinear)
    cls = post_ln_linear(FusedNormLinear)
    cfg = SimpleNamespace(tp_comm_overlap=True, tp_comm_overlap_disable_qkv=True,
                          tp_comm_overlap_disable_fc1=False)
    qkv = cls(8, 24, config=cfg, tp_comm_buffer_name="qkv")
    fc1 = cls(8, 32, config=cfg, tp_comm_buffer_name="fc1")
    assert qkv.config.tp_comm_overlap is False and qkv.config is not cfg
    assert fc1.config is cfg and cfg.tp_comm_overlap is True  # the shared config is untouched
    assert post_ln_linear(PlainLinear) is PlainLinear  # only the fused class is replaced


@pytest.mark.parametrize("backend, post_ln, rejected", [
    ("te", True, True), ("te", False, False), ("local", True, False)])
def test_fp32_residual_connection_rejected_for_te_post_ln_layers(backend, post_ln, rejected):
    from mixln_megatron.model.support import MixLNUnsupportedError, check_supported

    cfg = mu.tiny_config(num_layers=2, fp32_residual_connection=True)
    if rejected:
        with pytest.raises(MixLNUnsupportedError, match="fp32_residual_connection"):
            check_supported(cfg, backend=backend, post_ln=post_ln)
    else:
        check_supported(cfg, backend=backend, post_ln=post_ln)


@pytest.mark.te
@needs_te
@pytest.mark.usefixtures("mcore_single")
def test_post_ln_te_linear_honours_overlap_disable_switches_in_real_te():
    """The real TE linear: userbuffer overlap is off for the disabled GEMM only (TE is given no
    userbuffer name for it), and the config the other modules share still asks for overlap."""
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear,
        TELayerNormColumnParallelLinear,
    )

    from mixln_megatron import cpu
    from mixln_megatron.model.backends import post_ln_linear

    cfg = mu.tiny_config(num_layers=2)
    cfg.tp_comm_overlap, cfg.tp_comm_overlap_disable_qkv, cfg.tp_comm_overlap_disable_fc1 = True, True, False
    cls = post_ln_linear(TELayerNormColumnParallelLinear)
    assert issubclass(cls, TEColumnParallelLinear) and not issubclass(cls, TELayerNormColumnParallelLinear)
    kw = dict(config=cfg, init_method=torch.nn.init.zeros_, gather_output=False, bias=False,
              skip_bias_add=False, is_expert=False)
    with cpu.te_modules():
        qkv = cls(64, 192, tp_comm_buffer_name="qkv", **kw)
        fc1 = cls(64, 256, tp_comm_buffer_name="fc1", **kw)
    assert qkv.config.tp_comm_overlap is False and qkv.config is not cfg and qkv.ub_name is None
    assert fc1.config is cfg and fc1.ub_name == "fc1"
    assert cfg.tp_comm_overlap is True  # the shared config is untouched
    assert post_ln_linear(TEColumnParallelLinear) is TEColumnParallelLinear  # only the fused class is replaced
