"""One fact, one place: the GPT <-> hybrid key rule (model.checkpoint)
against the keys built models write; which kind a checkpoint is; one cross-check of the saved settings.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mixln_megatron import compat

BLOCKS = 4


def _sharded_keys(model) -> set:
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return {v.key for v in nested_values(model.sharded_state_dict()) if getattr(v, "key", None)}


@pytest.mark.skipif(not compat.HYBRID_MODEL, reason="HybridModel Mix-LN needs megatron-core 0.19+")
@pytest.mark.parametrize("post_ln", [0, 1, BLOCKS])
def test_every_hybrid_key_the_model_writes_is_the_gpt_key_the_converter_reads(mcore_single, post_ln):
    """Built GPTModel and HybridModel of one Mix-LN network: each hybrid layer's key sits in the
    layer model.checkpoint says, and names the stacked GPT key; and every GPT key has its hybrid twin."""
    from harness.testing import build_gpt, build_hybrid, tiny_config
    from mixln_megatron.model import checkpoint as K
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec, get_mixln_hybrid_stack_spec

    s = MixLNSettings(post_ln_layers=post_ln)
    gpt_cfg, hyb_cfg = tiny_config(num_layers=BLOCKS), tiny_config(num_layers=2 * BLOCKS)
    gpt = _sharded_keys(build_gpt(gpt_cfg, get_mixln_decoder_block_spec(gpt_cfg, backend="local", settings=s)))
    hyb = _sharded_keys(build_hybrid(hyb_cfg, get_mixln_hybrid_stack_spec(hyb_cfg, backend="local", settings=s),
                                     "*-" * BLOCKS))
    assert any(k.startswith(K.LAYERS + K.MIXLN_NORM_A) for k in gpt) == (post_ln > 0)
    from mixln_megatron.convert.gpt_hybrid import OUTPUT_EXTRA_STATE

    as_gpt = set()
    for key in hyb - {OUTPUT_EXTRA_STATE.split("/")[0]}:  # HybridModel saves it, GPTModel drops it
        m = K.HYBRID_LAYER.match(key)
        if m is None:
            as_gpt.add(K.GPT_FINAL_NORM + key[len(K.HYBRID_FINAL_NORM):] if key.startswith(K.HYBRID_FINAL_NORM)
                       else key)
            continue
        index, name = int(m.group(1)), m.group(2)
        block = K.block_of_hybrid_index(index)
        assert K.hybrid_layer_of(block, name, block < post_ln) == index, key
        as_gpt.add(K.LAYERS + name)
    assert as_gpt == gpt
    if post_ln:
        assert K.HYBRID_RECORD_KEY in hyb and K.GPT_RECORD_KEY in gpt


def test_hybrid_state_key_follows_the_rule():
    from mixln_megatron.model.checkpoint import hybrid_state_key

    assert hybrid_state_key("decoder.layers.1.self_attention.linear_qkv.weight") == \
        "decoder.layers.2.self_attention.linear_qkv.weight"
    assert hybrid_state_key("decoder.layers.1.post_mlp_layernorm.weight") == "decoder.layers.3.post_mlp_layernorm.weight"
    assert hybrid_state_key("decoder.layers.0.mixln_norm_a.weight", post_ln=True) == "decoder.layers.1.mixln_norm_a.weight"
    assert hybrid_state_key("decoder.final_layernorm.weight") == "decoder.final_norm.weight"
    with pytest.raises(ValueError, match="neither"):
        hybrid_state_key("decoder.layers.0.mixer.in_proj.weight")


def test_model_kind_tells_stacked_gpt_from_hybrid_and_refuses_per_layer_gpt():
    from mixln_megatron.convert.megatron_reader import GPT, HYBRID, model_kind
    from mixln_megatron.errors import UnsupportedModelError

    assert model_kind(["decoder.layers.mlp.linear_fc1.weight", "decoder.final_layernorm.weight",
                       "decoder.layers.mixln_spike_scaler.layer2.norm1.momentum"]) == GPT
    assert model_kind(["decoder.layers.0.self_attention.linear_qkv.weight", "decoder.final_norm.weight"]) == HYBRID
    # megatron-core writes these for a GPTModel only with non_homogeneous_layers / singleton_local_shards
    with pytest.raises(UnsupportedModelError, match="one key per layer"):
        model_kind(["decoder.layers.0.self_attention.linear_qkv.weight", "decoder.final_layernorm.weight"])


def test_blocks_are_read_one_way():
    from mixln_megatron.convert.shape import args_num_blocks
    from mixln_megatron.errors import UnsupportedModelError
    from mixln_megatron.model.hybrid_pattern import blocks_of_args

    for args in (SimpleNamespace(num_layers=6), SimpleNamespace(num_layers=8, hybrid_layer_pattern="*-*-|*-*-")):
        assert blocks_of_args(args) == args_num_blocks(args)
    with pytest.raises(UnsupportedModelError, match="Mamba"):
        args_num_blocks(SimpleNamespace(num_layers=4, hybrid_layer_pattern="M*M*"))


RECORD_P2 = {"format": 1, "scheme": "mixln", "num_layers": 4, "post_ln_layers": 2, "alpha": None}


def test_resume_cross_checks_args_and_record_as_inspect_does():
    from mixln_megatron.errors import ConversionError
    from mixln_megatron.convert.inspect import mixln_record
    from mixln_megatron.model.settings import MixLNSavedSettingsDisagree, MixLNSettings

    args = SimpleNamespace(num_layers=4, mixln_post_ln_layers=1, mixln_alpha=None, mixln_scheme="mixln")
    says = r"the settings record says scheme=mixln P=2, the saved --mixln-\* args says scheme=mixln P=1"
    with pytest.raises(MixLNSavedSettingsDisagree, match=says):
        MixLNSettings.from_checkpoint(args, record=RECORD_P2)
    with pytest.raises(MixLNSavedSettingsDisagree, match="content metadata"):
        MixLNSettings.from_checkpoint(args, metadata=RECORD_P2)
    reader = SimpleNamespace(settings_record=RECORD_P2, content_metadata={}, args=args, norm_layout="mixln",
                             path="ckpt")
    with pytest.raises(ConversionError, match=says):
        mixln_record(reader, 4)
    # the args alone: P and alpha that disagree are no longer settled silently in favour of P
    with pytest.raises(MixLNSavedSettingsDisagree, match=r"--mixln-post-ln-layers says P=1.*--mixln-alpha 0.5"):
        MixLNSettings.from_checkpoint(SimpleNamespace(num_layers=4, mixln_post_ln_layers=1, mixln_alpha="0.5"))
    agreed = MixLNSettings.from_checkpoint(SimpleNamespace(num_layers=4, mixln_post_ln_layers=2), record=RECORD_P2)
    assert (agreed.post_ln_layers, agreed.source("post_ln_layers")) == (2, "the checkpoint")
    assert mixln_record(SimpleNamespace(**{**vars(reader), "args": SimpleNamespace(num_layers=4)}), 4)[0][
        "post_ln_layers"] == 2
