"""A TE Mix-LN checkpoint written by Megatron-LM's own save_checkpoint (args included, as a TE
training run writes it: --transformer-impl transformer_engine --spec mixln_megatron.spec
mixln_layer_spec, the model built by Megatron-LM's GPTModelBuilder from real TransformerEngine
modules) converts with `mixln-megatron convert to-hf`; the Hugging Face logits equal those of the
local-backend model that Megatron-LM's load_checkpoint loads from the same checkpoint (forward on
the local path; TE's forward needs a GPU) within 1e-5; and `convert from-hf` output loads into a
TE model with every parameter equal. Each step is a process (tests/workers/te_megatron_lm_worker.py
or the CLI). Skipped without TE (make test-te installs it)."""

import json
import os
import sys

import pytest

from harness.testing import run_python
from harness import testing as mu

WHY = mu.te_missing()
pytestmark = [pytest.mark.te, pytest.mark.mp, pytest.mark.skipif(WHY is not None, reason=str(WHY))]
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "te_megatron_lm_worker.py")


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1", MIXLN_POST_LN_LAYERS="2")
    return env


def worker(*args):
    proc = run_python([sys.executable, WORKER, *map(str, args)], capture_output=True, text=True,
                          env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (line,) = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def convert(*args):
    proc = run_python([sys.executable, "-m", "mixln_megatron.cli", "convert", *map(str, args), "--no-progress"],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_megatron_lm_te_checkpoint_converts_to_hf_and_back_into_te(tmp_path):
    ckpt, hf, back = tmp_path / "ckpt", tmp_path / "hf", tmp_path / "back"
    saved = worker("save", ckpt)
    assert saved["layers"] == [["MixLNTransformerLayer", True, "MixLNPostLNColumnParallelLinear"]] * 2 + [
        ["MixLNTransformerLayer", False, "TELayerNormColumnParallelLinear"]] * 2
    with open(ckpt / "latest_checkpointed_iteration.txt") as f:
        assert f.read().strip() == "1"

    out = convert("to-hf", "--load", ckpt, "--save", hf)
    assert "MixLNLlamaForCausalLM, scheme=mixln P=2" in out
    with open(hf / "config.json") as f:
        assert json.load(f)["architectures"] == ["MixLNLlamaForCausalLM"]

    logits = worker("logits", ckpt, hf)
    assert logits["layers"] == [["MixLNTransformerLayer", True]] * 2 + [["MixLNTransformerLayer", False]] * 2
    assert logits["hf_class"] == "MixLNLlamaForCausalLM" and logits["hf_vocab"] == logits["megatron_vocab"] == 128
    assert logits["logit_scale"] > 0.1  # not a degenerate model
    assert logits["max_abs"] <= 1e-5, logits

    convert("from-hf", "--load", hf, "--save", back, "--transformer-impl", "transformer_engine")
    loaded = worker("te-load", back, tmp_path / "te_params.pt")
    assert "error" not in loaded, loaded["error"]
    assert loaded["names"] and loaded["count"] > 20 and loaded["unequal"] == [], loaded
