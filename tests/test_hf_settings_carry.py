"""Megatron's forward scalars carried into the HF export and back: --glu-linear-offset and muP.

muP (megatron-core's TransformerConfig.__post_init__) turns the saved flags into a softmax scale
(1/d_head by default, not 1/sqrt(d_head)), an embedding multiplier and a logits multiplier (1 /
width_mult by default); the GLU offset makes SwiGLU silu(gate) * (up + offset). Parity: a tiny GPT
trained by `mixln-megatron pretrain` (d_head 64, so a wrong attention scale shows), Megatron-LM's
own load_checkpoint + forward vs the exported HF model (fp32), then from-hf back to args whose
scalars are the same.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

transformers = pytest.importorskip("transformers")

from mixln_megatron.convert import ConversionError  # noqa: E402
from mixln_megatron.convert.shape import (  # noqa: E402
    ForwardScalars, args_getter, forward_scalars, mup_flags_for)
from mixln_megatron.convert.shape import shape_from_hf_config  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
D_HEAD = 64  # hidden 64, 4 heads: --kv-channels 64 makes 1/d_head and 1/sqrt(d_head) 8x apart


def _hf_parity():
    spec = importlib.util.spec_from_file_location("hf_parity", os.path.join(REPO, "benchmarks", "hf_parity.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _roundtrip_scalars(workdir) -> ForwardScalars:
    """The forward scalars of the args from-hf wrote (DIR/roundtrip), read as an export reads them."""
    from mixln_megatron.convert.inspect import inspect_checkpoint

    return inspect_checkpoint(os.path.join(workdir, "roundtrip")).shape.forward


# ------------------------------------------------------------------------------ megatron's own rule
MUP_CASES = [
    {},
    {"glu_linear_offset": 1.0},
    {"use_mup": True},
    {"use_mup": True, "mup_base_hidden_size": 32, "mup_embedding_mult": 2.5, "mup_base_head_dim": 16.0},
    {"use_mup": True, "mup_attn_scale_power": 0.5, "mup_output_mult": 0.3, "mup_base_hidden_size": 128},
    {"use_mup": False, "mup_base_hidden_size": 32, "mup_embedding_mult": 3.0},  # inert without use_mup
]


@pytest.mark.compat
@pytest.mark.parametrize("flags", MUP_CASES, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "none")
def test_forward_scalars_are_megatrons_post_init(flags):
    """forward_scalars of saved flags == what megatron-core's TransformerConfig.__post_init__ makes of
    them on the installed release (softmax_scale, mup_embedding_mult, mup_output_mult, offset)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=48, **flags)
    mup = config.use_mup  # megatron multiplies by the muP factors only under use_mup
    megatron = ForwardScalars(config.softmax_scale, config.mup_embedding_mult if mup else 1.0,
                              config.mup_output_mult if mup else 1.0, config.glu_linear_offset)
    assert forward_scalars(lambda name, default: flags.get(name, default), 64, 48) == megatron


@pytest.mark.parametrize("scalars", [
    ForwardScalars(attention_scale=1 / 64),
    ForwardScalars(attention_scale=0.0831, embedding_multiplier=2.5, logits_multiplier=0.37),
    ForwardScalars(embedding_multiplier=10.0),
    ForwardScalars(attention_scale=3.3e-3, logits_multiplier=1 / 3),
])
def test_flags_written_for_hf_scalars_give_them_back_exactly(scalars):
    """A Mix-LN folder without the muP record: from-hf's flags make megatron use its scalars bit for bit
    (no attention_scale: the HF model's head_dim ** -0.5)."""
    flags = mup_flags_for(scalars, 96, 24, None)
    want = scalars if scalars.attention_scale else ForwardScalars(24 ** -0.5, scalars.embedding_multiplier,
                                                                  scalars.logits_multiplier)
    assert flags["use_mup"] and forward_scalars(args_getter(type("A", (), flags)), 96, 24) == want


def _mixln_config(**over) -> dict:
    config = dict(model_type="mixln_llama", vocab_size=97, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  post_ln_layers=1, mixln_scheme="mixln")
    config.update(over)
    return config


def test_hf_config_reads_the_scalars_and_checks_the_record():
    mup = {"use_mup": True, "mup_base_hidden_size": 32, "mup_base_head_dim": 16.0}
    shape = shape_from_hf_config(_mixln_config(attention_scale=4 / 64, logits_multiplier=0.5, glu_linear_offset=-1,
                                               megatron_mup=mup))
    assert shape.forward == ForwardScalars(4 / 64, 1.0, 0.5, -1.0) and shape.mup["mup_base_hidden_size"] == 32
    with pytest.raises(ConversionError, match="megatron_mup gives attention_scale 0.0625.*disagree"):
        shape_from_hf_config(_mixln_config(attention_scale=1 / 64, megatron_mup=mup))
    with pytest.raises(ConversionError, match="embedding_multiplier must be a number"):
        shape_from_hf_config(_mixln_config(embedding_multiplier=0))
    # a stock Llama folder has LLaMA's forward whatever extra keys it holds
    assert shape_from_hf_config(_mixln_config(model_type="llama", attention_scale=0.5)).forward == ForwardScalars()


def test_hf_classes_apply_the_scalars_and_export_decides_the_class(tmp_path):
    """MixLNLlamaForCausalLM with the scalars equals LLaMA's modules recomputed by hand; any scalar
    set means the Mix-LN class (never the stock LlamaForCausalLM), and defaults stay out of config.json."""
    import torch

    from mixln_megatron.hf import MixLNLlamaConfig, MixLNLlamaForCausalLM, is_stock_llama
    from mixln_megatron.hf.export_code import config_for_export, moe_export_config_fields

    assert is_stock_llama(0, "mixln") and not is_stock_llama(0, "mixln", forward={"glu_linear_offset": 0.5})
    assert not is_stock_llama(0, "mixln", forward={"attention_scale": 0.1})
    assert is_stock_llama(0, "mixln", forward={"logits_multiplier": 1.0})
    forward = {"attention_scale": 0.05, "embedding_multiplier": 3.0, "logits_multiplier": 0.25,
               "glu_linear_offset": 0.75}
    config = config_for_export(0, "mixln", forward=forward, vocab_size=61, hidden_size=32, intermediate_size=48,
                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    assert type(config) is MixLNLlamaConfig
    torch.manual_seed(0)
    model = MixLNLlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    saved = json.load(open(tmp_path / "config.json"))
    assert {k: saved[k] for k in forward} == forward and "megatron_mup" not in saved
    plain = dict(config.to_dict(), model_type="llama")
    for key in forward:
        plain.pop(key)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**plain)).eval()
    ref.load_state_dict(model.state_dict())
    ids = torch.randint(0, 61, (2, 7))

    def by_hand():  # LLaMA's modules, the four scalars applied around them
        def mlp(m):
            return lambda x: m.down_proj(m.act_fn(m.gate_proj(x)) * (m.up_proj(x) + 0.75))
        for layer in ref.model.layers:
            layer.mlp.forward = mlp(layer.mlp)
            layer.self_attn.scaling = 0.05
        h = ref.model(inputs_embeds=ref.model.embed_tokens(ids) * 3.0).last_hidden_state
        return ref.lm_head(h) * 0.25

    with torch.no_grad():
        got, want = model(ids).logits, by_hand()
    assert torch.equal(got, want)
    assert MixLNLlamaConfig.from_pretrained(tmp_path).attention_scale == 0.05
    with pytest.raises(ValueError, match="glu_linear_offset = 0.5 is not supported by the MoE model"):
        moe_export_config_fields(0, "mixln", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                 forward={"glu_linear_offset": 0.5})
    fields = moe_export_config_fields(0, "mixln", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                      forward={"attention_scale": 0.1})
    assert fields["model_type"] == "mixln_moe" and fields["attention_scale"] == 0.1  # not Mixtral


# ------------------------------------------------------------------------------ parity (torchrun)
@pytest.mark.mp
@pytest.mark.parametrize("extra,want", [
    # P = 0: without the carry this exports as the stock LlamaForCausalLM
    (["--mixln-post-ln-layers", "0", "--use-mup", "--glu-linear-offset", "0.5"],
     {"attention_scale": 1 / D_HEAD, "glu_linear_offset": 0.5}),
    (["--use-mup", "--mup-base-hidden-size", "32", "--mup-embedding-mult", "2.5", "--mup-base-head-dim", "16"],
     {"attention_scale": 4 / D_HEAD, "embedding_multiplier": 2.5, "logits_multiplier": 0.5}),
], ids=["mup-alone+glu-offset", "mup-base-width"])
def test_megatron_hf_parity_of_forward_scalars(tmp_path, extra, want):
    hf_parity = _hf_parity()
    hf_parity.run_worker(str(tmp_path), 1, 1, "torch_dist", extra_args=["--kv-channels", str(D_HEAD), *extra])
    res = hf_parity.compare(str(tmp_path))
    assert res["class"] == "MixLNLlamaForCausalLM"
    assert res["max_abs_logit_diff"] <= 1e-5, res
    assert res["generate_match"], res
    assert res["roundtrip_max_abs_diff"] == 0.0
    cfg = json.load(open(tmp_path / "hf" / "config.json"))
    assert cfg["model_type"] == "mixln_llama" and cfg["head_dim"] == D_HEAD
    assert {k: cfg.get(k) for k in want} == want and cfg["megatron_mup"]["use_mup"] is True
    assert _roundtrip_scalars(tmp_path) == ForwardScalars(**want)  # from-hf's args give them back


def test_paths_that_cannot_carry_the_scalars_refuse_them_in_one_line():
    """The Megatron-Bridge bridges refuse muP / a softmax scale / a GLU offset of a built
    TransformerConfig (their provider) with convert.shape.config_problem."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mixln_megatron.convert.shape import config_problem

    def config(**flags):
        return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **flags)

    assert config_problem(config()) is None
    assert config_problem(config(use_mup=True)).startswith("muP (use_mup=True")
    assert "softmax_scale=0.25" in config_problem(config(softmax_scale=0.25))
    line = config_problem(config(use_mup=True, glu_linear_offset=1.0))
    assert "glu_linear_offset=1.0" in line and "\n" not in line and "convert to-hf" in line
