"""mixln_megatron.model.support: one table of unsupported configurations, used by every consumer."""

import dataclasses
from argparse import Namespace

import pytest

from mixln_megatron.dev import testing as mu
from mixln_megatron.model import support


def test_rows_name_real_fields_and_known_consumers():
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    fields = {f.name for c in (TransformerConfig, MLATransformerConfig) for f in dataclasses.fields(c)}
    for row in support.TABLE:
        assert row.where and row.where <= {support.LAYER, support.PRETRAIN, support.CONVERT, support.ANALYSIS}
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
    """MoE trains, converts (convert.moe_shape refuses the routing HF cannot carry) and is analysed."""
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

    from mixln_megatron.analysis import models
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
    with pytest.raises(models.CheckpointError, match="heterogeneous layers"):
        models.inspect_for_analysis("ckpt", None)
