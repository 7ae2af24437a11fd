"""mixln_megatron.model.support: one table of unsupported configurations, used by every consumer."""

import dataclasses
from argparse import Namespace

import pytest

from harness import testing as mu
from mixln_megatron.model import support


def test_rows_name_real_fields_and_known_consumers():
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    fields = {f.name for c in (TransformerConfig, MLATransformerConfig) for f in dataclasses.fields(c)}
    for row in support.TABLE:
        assert row.where and row.where <= {support.LAYER, support.PRETRAIN, support.CONVERT, support.ANALYSIS, support.STOCK}
        assert row.what and row.why, row.names
        if support.LAYER in row.where:  # the layer sees a TransformerConfig: its field comes first
            assert row.names[0] in fields, f"{row.names[0]} is not a TransformerConfig field"


def test_config_field_and_argument_alias_are_both_rejected():
    cfg = mu.tiny_config(num_layers=2)
    cfg.heterogeneous_block_specs = True
    with pytest.raises(support.MixLNUnsupportedError, match=r"heterogeneous .*\[heterogeneous_block_specs=True\]"):
        support.check(cfg, support.CONVERT)
    found = support.problems(Namespace(heterogeneous_layers_config_path="x.json"), support.CONVERT)
    assert len(found) == 1 and "[heterogeneous_layers_config_path='x.json']" in found[0]
    assert support.problems(Namespace(heterogeneous_layers_config_path=None), support.CONVERT) == []


def test_moe_is_refused_by_no_consumer():
    """MoE trains, converts (convert.shape.moe_shape_of_args refuses the routing HF cannot carry) and is analysed."""
    for where in (support.LAYER, support.PRETRAIN, support.CONVERT, support.ANALYSIS):
        assert support.problems(Namespace(num_experts=8, num_moe_experts=8), where) == []


def test_te_op_fuser_is_rejected_under_its_real_field_name():
    """The old check read `use_te_op_fuser`, which TransformerConfig does not have: it never fired."""
    cfg = mu.tiny_config(num_layers=2)
    cfg.use_transformer_engine_op_fuser = True
    with pytest.raises(support.MixLNUnsupportedError, match="op fuser"):
        support.check_supported(cfg, backend="te")


def test_backend_rows_apply_to_their_backend_only():
    cfg = mu.tiny_config(num_layers=2)
    cfg.use_te_activation_func = True
    support.check_supported(cfg, backend="te")
    with pytest.raises(support.MixLNUnsupportedError, match="use_te_activation_func .*local backend"):
        support.check_supported(cfg, backend="local")


def test_all_problems_in_one_line():
    cfg = mu.tiny_config(num_layers=2)
    cfg.heterogeneous_block_specs, cfg.multi_latent_attention = True, True
    with pytest.raises(support.MixLNUnsupportedError) as info:
        support.check_supported(cfg)
    assert "\n" not in str(info.value) and "heterogeneous" in str(info.value) and "multi-latent" in str(info.value)


def test_entry_point_converter_and_analysis_use_the_table(monkeypatch):
    from types import SimpleNamespace

    from mixln_megatron.analysis import loading
    from mixln_megatron.convert import inspect as ckpt_inspect
    from mixln_megatron.convert import UnsupportedModelError
    from mixln_megatron.convert.shape import check_megatron_args_supported
    from mixln_megatron.training.pretrain import MixLNPretrainUnsupported, check_supported_args

    with pytest.raises(MixLNPretrainUnsupported, match="op fuser"):
        check_supported_args(Namespace(use_transformer_engine_op_fuser=True, transformer_impl="transformer_engine"))
    with pytest.raises(UnsupportedModelError, match="hybrid"):
        check_megatron_args_supported(Namespace(hybrid_layer_pattern="M*M*", normalization="RMSNorm", swiglu=True,
                                                position_embedding_type="rope"))
    saved = Namespace(heterogeneous_layers_config_path="x.json", num_layers=2)
    monkeypatch.setattr(ckpt_inspect, "inspect_checkpoint",
                        lambda path, iteration=None, moe=False: SimpleNamespace(format="torch_dist", path=path, args=saved))
    with pytest.raises(loading.CheckpointError, match="heterogeneous layers"):
        loading.inspect_for_analysis("ckpt", None)


# ------------------------------------------------------------------ the FSDP wrappers, on every path
FSDP_FLAGS = (("use_megatron_fsdp", "Megatron-FSDP (--use-megatron-fsdp)"), ("use_torch_fsdp2", "torch FSDP2 (--use-torch-fsdp2)"))


@pytest.mark.parametrize("name, what", FSDP_FLAGS)
def test_fsdp_is_refused_by_the_entry_point_in_the_tables_words(name, what):
    from mixln_megatron.training.pretrain import MixLNPretrainUnsupported, check_supported_args

    with pytest.raises(MixLNPretrainUnsupported) as info:
        check_supported_args(Namespace(**{name: True}))
    assert str(info.value) == support.message_of(name) and str(info.value).startswith(f"{what} is not supported: ")


@pytest.mark.parametrize("name, what", FSDP_FLAGS)
def test_fsdp_is_refused_by_the_stock_spec_in_one_line_before_the_build(name, what, monkeypatch, capsys):
    """pretrain_gpt.py --spec mixln_megatron.spec mixln_local_layer_spec with an FSDP flag: the spec
    function Megatron-LM calls prints one line and leaves with exit 2 (a Refusal), as the entry point does."""
    import megatron.training.global_vars as global_vars

    from mixln_megatron import spec
    from mixln_megatron.errors import PREFIX, Refusal

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", Namespace(**{name: True}), raising=False)
    monkeypatch.setattr(spec, "get_mixln_decoder_block_spec", lambda *a, **k: pytest.fail("built despite the refusal"))
    with pytest.raises(Refusal) as info:
        spec.mixln_local_layer_spec(mu.tiny_config(num_layers=2))
    assert info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(PREFIX)]
    assert lines == [f"{PREFIX} {support.message_of(name)}"]
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", Namespace(**{name: False}), raising=False)
    assert support.problems(global_vars._GLOBAL_ARGS, support.STOCK) == []


def test_the_spike_scaler_refuses_fsdp_chunks_in_the_tables_words():
    """A megatron-core user's own loop (no Megatron-LM run): the scaler's targets raise the
    table's refusal, not a bare NotImplementedError."""
    from types import SimpleNamespace

    import torch

    from mixln_megatron.training.spike.state import Target, TargetSet

    param = torch.nn.Parameter(torch.ones(4))
    param.main_grad = torch.zeros(4)
    target = Target(1, "norm1.weight", param)
    megatron_fsdp = SimpleNamespace(ddp_config=SimpleNamespace(use_megatron_fsdp=True))
    TorchFullyShardedDataParallel = type("TorchFullyShardedDataParallel", (), {})  # megatron's FSDP2 wrapper's name
    for chunk, name in ((megatron_fsdp, "use_megatron_fsdp"), (TorchFullyShardedDataParallel(), "use_torch_fsdp2")):
        with pytest.raises(support.MixLNUnsupportedError) as info:
            TargetSet([target], {id(param): chunk}, (1, 4))
        assert str(info.value) == "mixln spike scaler: " + support.message_of(name)


def test_fp8_is_refused_with_the_local_backend_only():
    """megatron-core's local modules ignore fp8 (the run trains in the base precision): the spec
    refuses it with the local backend; with TE it is TE's fp8."""
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.model.specs import checked_layer_spec

    cfg = mu.tiny_config(num_layers=2)
    cfg.fp8 = "hybrid"
    with pytest.raises(support.MixLNUnsupportedError, match=r"fp8 .*local backend.*\[fp8='hybrid'\]"):
        checked_layer_spec(cfg, "local", MixLNSettings(alpha=0.5))
    support.check_supported(cfg, backend="te")
    cfg.fp8 = None
    checked_layer_spec(cfg, "local", MixLNSettings(alpha=0.5))
