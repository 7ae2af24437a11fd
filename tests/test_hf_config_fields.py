"""Every config.json field `convert from-hf` meets is carried, refused or of no effect (convert.hf_config_fields).

- the table names every field of the installed transformers classes (LlamaConfig and
  PretrainedConfig's common fields, MixtralConfig, Qwen2MoeConfig, the Mix-LN classes), and no
  Llama row names a field LlamaConfig lacks (older transformers' keys are marked legacy);
- a refused value is one stderr line through `mixln-megatron convert from-hf`, exit 2, nothing written;
- the carried fields that change the math (head_dim != hidden / heads, biases, llama3 RoPE, tied
  embeddings, epsilon; the Mix-LN forward scalars) and two of no effect (pretraining_tp,
  attention_dropout): from-hf, then megatron-core's GPTModel (the analysis loader) gives the HF
  model's logits.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mixln_megatron import cli  # noqa: E402
from mixln_megatron.convert import hf_config_fields as T  # noqa: E402
from mixln_megatron.convert.shape import shape_from_hf_config  # noqa: E402
from mixln_megatron.errors import UnsupportedModelError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")


def _fields(cls) -> set:
    """The installed class's fields: its dataclass fields, its __init__ arguments and what to_dict writes."""
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    names |= {p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "kwargs")}
    return names | set(transformers.LlamaConfig().to_dict() if cls is transformers.LlamaConfig else cls().to_dict())


def _classes():
    from mixln_megatron.hf import MixLNLlamaConfig, MixLNMoeConfig

    return {T.LLAMA: transformers.LlamaConfig, T.MIXTRAL: transformers.MixtralConfig,
            T.QWEN2_MOE: transformers.Qwen2MoeConfig, T.MIXLN: MixLNLlamaConfig, T.MIXLN_MOE: MixLNMoeConfig}


@pytest.mark.parametrize("model_type", T.ALL)
def test_table_names_every_field_of_the_installed_class(model_type):
    cls = _classes()[model_type]
    fields = _fields(cls) | (_fields(transformers.LlamaConfig) if model_type in (T.MIXLN, T.MIXLN_MOE) else set())
    missing = sorted(fields - set(T.rows(model_type)))
    assert not missing, (f"{cls.__name__} (transformers {transformers.__version__}) has fields that "
                         f"convert/hf_config_fields.py does not classify: {missing}")
    for row in T.rows(model_type).values():
        assert row.status in (T.CARRIED, T.NO_EFFECT, T.REFUSED) and row.what, row
        assert row.check is None or row.refused, f"{row.name}: a check without saying what it refuses"


def test_no_llama_row_names_a_field_llamaconfig_lacks():
    fields = _fields(transformers.LlamaConfig)
    extra = sorted(name for name, row in T.rows(T.LLAMA).items() if not row.legacy and name not in fields)
    assert not extra, f"rows for fields LlamaConfig {transformers.__version__} lacks (mark them legacy?): {extra}"


# ------------------------------------------------------------------------------ refusals through the CLI
TINY = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_fields") / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("change,names", [
    ({"hidden_act": "gelu"}, ["hidden_act 'gelu'"]),
    ({"attention_bias": True}, ["attention_bias=True with mlp_bias=False"]),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, ["rope type 'yarn'"]),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "rope_theta": 1e4}},
     ["low_freq_factor=2.0"]),
    ({"sliding_window": 16}, ["sliding_window=16"]),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, ["quantization_config"]),
], ids=["hidden_act", "biases", "yarn", "llama3-factors", "sliding_window", "quantized"])
def test_refused_fields_are_one_line_through_the_cli(llama_folder, tmp_path, capsys, change, names):
    import shutil

    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(llama_folder, src)
    config = json.load(open(src / "config.json"))
    config.update(change)
    json.dump(config, open(src / "config.json", "w"))
    capsys.readouterr()
    try:
        rc = cli.main(["convert", "from-hf", "--load", str(src), "--save", str(out)])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, f"exit {rc}, stderr:\n{err}"
    assert lines[0].startswith("mixln-megatron convert from-hf: error: ") and "Traceback" not in err
    for name in names:
        assert name in lines[0], lines[0]
    assert not out.exists() and os.listdir(tmp_path) == ["src"]


def test_qwen2_moe_sliding_layers_are_refused():
    """layer_types decides the window in transformers 5's Qwen2-MoE, whatever use_sliding_window says."""
    config = dict(model_type="qwen2_moe", vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=32, use_sliding_window=False)
    shape_from_hf_config(dict(config, layer_types=["full_attention"] * 2))
    with pytest.raises(UnsupportedModelError, match="layer_types .*sliding_attention"):
        shape_from_hf_config(dict(config, layer_types=["full_attention", "sliding_attention"]))


# ------------------------------------------------------------------------------ carried: Megatron's forward
def _randomized(model):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim == 1 else 0.08) + (1.0 if p.ndim == 1 else 0))
    return model


LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("make", [
    # carried: head_dim 32 != 64 / 4, biases, llama3 RoPE, tied embeddings, epsilon; no effect:
    # pretraining_tp, attention_dropout
    lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(
        TINY, head_dim=32, attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3, tie_word_embeddings=True,
        rms_norm_eps=1e-6, pretraining_tp=2, attention_dropout=0.1))),
    # the Mix-LN class's forward scalars without a muP record (from-hf derives the flags)
    lambda: _mixln(attention_scale=0.07, embedding_multiplier=2.0, logits_multiplier=0.4, glu_linear_offset=0.25),
], ids=["llama-fields", "mixln-forward-scalars"])
def test_carried_fields_give_megatrons_forward_the_hf_logits(mcore_single, tmp_path, make):
    from mixln_megatron.analysis.loading import load_megatron_checkpoint
    from mixln_megatron.convert import convert_from_hf

    hf = _randomized(make()).eval()
    hf.save_pretrained(str(tmp_path / "hf"))
    if hf.config.model_type == "mixln_llama":
        from mixln_megatron.hf.export_code import write_model_code

        write_model_code(str(tmp_path / "hf"))
    convert_from_hf(str(tmp_path / "hf"), str(tmp_path / "megatron"), progress=False)
    megatron = load_megatron_checkpoint(str(tmp_path / "megatron"))
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = megatron.module(*megatron._inputs(ids)).float()[..., :TINY["vocab_size"]]
    assert float(want.abs().max()) > 0.5  # logits large enough for a wrong factor to show
    assert float((got - want).abs().max()) <= 1e-5


def _mixln(**forward):
    from mixln_megatron.hf.export_code import config_for_export
    from mixln_megatron.hf import MixLNLlamaForCausalLM

    config = config_for_export(1, "mixln", forward=forward, **dict(TINY, head_dim=32))
    return MixLNLlamaForCausalLM(config)


def test_docs_table_is_current(tmp_path):
    """docs/conversion.md shows every row of the table as convert.hf_config_fields has it."""
    import hf_config_fields_table as table

    doc = Path(__file__).resolve().parents[1] / "docs" / "conversion.md"
    assert table.main(["--check", str(doc)]) == 0, (
        "docs/conversion.md is stale: python scripts/hf_config_fields_table.py --write "
        "docs/conversion.md")
    rendered = table.render()
    assert all(f"| `{row.name}`" in rendered for row in T.TABLE)
    stale = tmp_path / "hf-conversion.md"
    stale.write_text(doc.read_text().replace("`head_dim`", "`head_dims`"))
    assert table.main(["--check", str(stale)]) == 1
