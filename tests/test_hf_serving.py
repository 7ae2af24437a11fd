"""Servable exports: what the Transformers backend of vLLM / SGLang
(`--model-impl transformers`) relies on, checked with transformers alone (no serving engine here).

The folder is a real export: a tiny Mix-LN model (P = 2 of 4 layers, GQA, fp32) written as a
torch_dist checkpoint by `convert from-hf` and exported again by `convert to-hf`. The contract:
  - config.json's auto_map names AutoModel (the base model, where every Mix-LN change lives) besides
    AutoConfig and AutoModelForCausalLM, and AutoModel loads the folder's own code (trust_remote_code);
  - the base model class says `_supports_attention_backend = True`;
  - an attention function registered through transformers' AttentionInterface (with a mask function
    through AttentionMaskInterface, as an engine registers its own) and set as attn_implementation is
    called by every layer, Post-LN and Pre-LN, with the kwargs given to the model's forward, and the
    outputs equal sdpa's exactly (the probe computes with sdpa's own function).
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

PROBE = "mixln_serving_probe"
NUM_LAYERS, POST_LN = 4, 2


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from mixln_megatron.convert import convert_from_hf, convert_to_hf
    from test_convert import make_mixln_folder

    root = tmp_path_factory.mktemp("serving")
    make_mixln_folder(root / "src", dtype=torch.float32, post_ln_layers=POST_LN, num_hidden_layers=NUM_LAYERS)
    convert_from_hf(str(root / "src"), str(root / "megatron"), progress=False)
    convert_to_hf(str(root / "megatron"), str(root / "hf"), progress=False)
    return root / "hf"


@pytest.fixture
def probe():
    """A registered attention function that records each call, then computes exactly as sdpa."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    calls = []

    def attention(module, query, key, value, attention_mask, **kwargs):
        calls.append({"layer": module.layer_idx, "module": type(module).__name__,
                      "tag": kwargs.get("serving_tag")})
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(PROBE, attention)
    AttentionMaskInterface.register(PROBE, sdpa_mask)
    yield calls
    # GeneralInterface has no unregister: drop the test's name from the shared mappings again.
    AttentionInterface._global_mapping.pop(PROBE, None)
    AttentionMaskInterface._global_mapping.pop(PROBE, None)


def _inputs():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 97, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second row: the mask function is exercised too
    return ids, mask


def test_auto_map_names_the_base_model(exported):
    from mixln_megatron.hf.export_code import AUTO_MAP

    config = json.loads((exported / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP
    assert config["auto_map"]["AutoModel"] == "modeling_mixln_llama.MixLNLlamaModel"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_mixln_llama.MixLNLlamaForCausalLM"
    assert (exported / "modeling_mixln_llama.py").is_file() and (exported / "configuration_mixln_llama.py").is_file()


# Run in a fresh interpreter, as a serving engine would: in this one another test may have
# registered the package's own classes (mixln_megatron.hf.register_auto_classes), which transformers
# then prefers to the folder's code.
LOAD_BASE_MODEL = """
import json, sys
from transformers import AutoModel
model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True)
cls = type(model)
print(json.dumps({"name": cls.__name__, "module": cls.__module__, "backend": cls._supports_attention_backend,
                  "kinds": [type(layer).__name__ for layer in model.layers]}))
"""


def test_automodel_loads_the_exported_base_model(exported):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, "-c", LOAD_BASE_MODEL, str(exported)], capture_output=True, text=True,
                          env=env, cwd=str(exported.parent), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["name"] == "MixLNLlamaModel"
    assert got["module"].startswith("transformers_modules"), got["module"]  # the folder's code, not ours
    assert got["backend"] is True
    assert got["kinds"] == (["MixLNLlamaPostLNDecoderLayer"] * POST_LN
                            + ["MixLNLlamaPreLNDecoderLayer"] * (NUM_LAYERS - POST_LN))


def test_registered_attention_runs_in_every_layer_and_equals_sdpa(exported, probe):
    from transformers import AutoModel, AutoModelForCausalLM

    ids, mask = _inputs()
    base_sdpa = AutoModel.from_pretrained(str(exported), trust_remote_code=True, attn_implementation="sdpa")
    base_probe = AutoModel.from_pretrained(str(exported), trust_remote_code=True, attn_implementation=PROBE)
    assert base_probe.config._attn_implementation == PROBE
    with torch.no_grad():
        want = base_sdpa(input_ids=ids, attention_mask=mask).last_hidden_state
        got = base_probe(input_ids=ids, attention_mask=mask, serving_tag="from-forward").last_hidden_state
    assert [c["layer"] for c in probe] == list(range(NUM_LAYERS))
    assert {c["module"] for c in probe} == {"LlamaAttention"}
    assert all(c["tag"] == "from-forward" for c in probe), probe  # kwargs reach attention in every layer
    assert torch.equal(got, want)

    # The causal LM, switched after loading, and cached decoding: every layer, every step.
    lm_sdpa = AutoModelForCausalLM.from_pretrained(str(exported), trust_remote_code=True, attn_implementation="sdpa")
    lm = AutoModelForCausalLM.from_pretrained(str(exported), trust_remote_code=True)
    lm.set_attn_implementation(PROBE)
    probe.clear()
    with torch.no_grad():
        assert torch.equal(lm(input_ids=ids, attention_mask=mask).logits,
                           lm_sdpa(input_ids=ids, attention_mask=mask).logits)
        assert [c["layer"] for c in probe] == list(range(NUM_LAYERS))
        probe.clear()
        new = 3
        out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        ref = lm_sdpa.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    assert torch.equal(out, ref)
    assert [c["layer"] for c in probe] == list(range(NUM_LAYERS)) * new
