"""A stock Llama (rms_norm_eps 1e-6) through from-hf, a resume with --use-checkpoint-args, and back.

stock Llama -> `convert from-hf` (Mix-LN P = 1, local names: the args record the Mix-LN --spec)
-> `mixln-megatron pretrain --use-checkpoint-args` 2 iterations (Megatron-LM itself does not copy
the norm epsilon from the checkpoint) -> `convert to-hf`: the export keeps eps 1e-6 and its
logits equal the trained model's own, as the analysis loader (same inspection code) rebuilds it.
"""

import json
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness.testing import run_python
from mixln_megatron.convert import convert_from_hf, convert_to_hf  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPS = 1e-6


def _stock_llama(path):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=EPS, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            # norms far from 1 and small activations, so that the epsilon matters in the logits
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim == 1 else 0.01) + (1.0 if p.ndim == 1 else 0))
    model.save_pretrained(str(path))


@pytest.mark.slow
def test_stock_llama_from_hf_resume_to_hf_keeps_epsilon_and_logits(mcore_single, tmp_path):
    src, ckpt, trained, hf = (tmp_path / n for n in ("src", "ckpt", "trained", "hf"))
    _stock_llama(src)
    summary = convert_from_hf(str(src), str(ckpt), transformer_impl="local", post_ln_layers=1, progress=False)
    flags = summary["launch_flags"]
    assert flags[flags.index("--norm-epsilon") + 1] == "1e-06" and "--mixln-post-ln-layers" in flags

    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=REPO)
    run = run_python(
        [sys.executable, "-m", "mixln_megatron.training.pretrain", "--cpu", "--load", str(ckpt), "--use-checkpoint-args",
         "--mixln-post-ln-layers", "1", "--save", str(trained), "--save-interval", "2", "--train-iters", "2",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--num-workers", "0",
         "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1", "--use-cpu-initialization"],
        capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert open(trained / "latest_checkpointed_iteration.txt").read().strip() == "2"

    convert_to_hf(str(trained), str(hf), progress=False)
    config = json.loads((hf / "config.json").read_text())
    assert config["rms_norm_eps"] == EPS and config["post_ln_layers"] == 1

    from mixln_megatron.analysis.loading import load_hf_model, load_megatron_checkpoint

    megatron = load_megatron_checkpoint(str(trained))
    assert megatron.module.config.layernorm_epsilon == EPS
    export = load_hf_model(str(hf))
    ids = torch.randint(0, 127, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pos = torch.arange(16).unsqueeze(0).expand(2, 16)
        mask = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), 1)
        theirs = export.module(input_ids=ids, use_cache=False).logits.float()
        ours = megatron.module(ids, pos, mask).float()[..., :theirs.shape[-1]]  # the export trims padding
    assert (ours - theirs).abs().max().item() <= 1e-6
    # the training moved the weights (the comparison is of the trained model, not the source)
    original = transformers.LlamaForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        assert (original(input_ids=ids).logits[..., :theirs.shape[-1]] - theirs).abs().max().item() > 1e-6
