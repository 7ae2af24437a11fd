"""The demo's Hugging Face step (scripts/demo_hf.py) on a tiny real run.

A 4-layer Mix-LN model (layer 1 Post-LN) trained for a few iterations by the real entry point on
a slice of the shipped corpus with the shipped tokenizer, saved as torch_dist; then the step the
demo runs: `mixln-megatron convert to-hf --tokenizer-model`, AutoTokenizer / AutoModelForCausalLM,
a greedy continuation, and the HF perplexity on Megatron's own last validation windows, which must
equal the perplexity Megatron recorded for that pass. A flaw in the export (one norm off) is caught
by the same comparison. The whole demo, shortened: tests/test_pretrain.py::test_demo_smoke (slow).
"""

import json
import os
import sys

import pytest
import torch

from harness.testing import run_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "scripts", "demo.py")
ENTRY = [os.path.join(REPO, "tests", "workers", "fork_queue.py"), "-m", "mixln_megatron.training.pretrain"]
MAX_CHARS = 120_000  # the corpus's first ~120K characters: a held-out split of a few K tokens
SEQ, BATCH, ITERS, EVAL_INTERVAL, EVAL_ITERS, SEED = 32, 8, 16, 8, 2, 1234


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint dir, ValidationRun, Megatron's last validation perplexity, the corpus documents)."""
    from mixln_megatron.data.corpus import austen_paragraphs, tokenizer_dir
    from mixln_megatron.data.preprocess import prepare_austen_dataset
    from demo_hf import ValidationRun

    root = tmp_path_factory.mktemp("demo_hf")
    prefix = prepare_austen_dataset(str(root / "data"), max_chars=MAX_CHARS)
    run = ValidationRun(data_prefix=prefix, tokenizer_dir=tokenizer_dir(), cache_dir=str(root / "cache"), seed=SEED,
                        seq_length=SEQ, split="90,10,0", global_batch_size=BATCH, train_iters=ITERS,
                        eval_interval=EVAL_INTERVAL, eval_iters=EVAL_ITERS)
    args = [
        "--cpu", "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "176",
        "--num-attention-heads", "4", "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
        "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
        "--untie-embeddings-and-output-weights", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--micro-batch-size", str(BATCH), "--global-batch-size", str(BATCH), "--train-iters", str(ITERS),
        "--lr", "1e-2", "--seed", str(SEED), "--eval-interval", str(EVAL_INTERVAL), "--eval-iters", str(EVAL_ITERS),
        "--log-interval", "4", "--num-workers", "0", "--use-cpu-initialization",
        "--data-path", prefix, "--split", run.split, "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", run.tokenizer_dir, "--data-cache-path", run.cache_dir,
        "--mixln-alpha", "0.25", "--loss-log", str(root / "losses.json"),
        "--save", str(root / "ckpt"), "--save-interval", str(ITERS), "--ckpt-format", "torch_dist",
    ]
    done = run_python([sys.executable, *ENTRY, *args], timeout=600, env=_env(), cwd=REPO)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    record = json.loads((root / "losses.json").read_text())
    valid = [e for e in record["eval"] if e["split"] == "valid"]
    assert len(valid) == run.passes and valid[-1]["tokens"] == run.pass_samples * SEQ
    return root / "ckpt", run, valid[-1]["ppl"], austen_paragraphs(max_chars=MAX_CHARS, unwrap=True)


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    from demo_hf import hf_step

    checkpoint, run, megatron_ppl, paragraphs = trained
    hf_dir = tmp_path_factory.mktemp("export") / "hf"
    lines = []
    result = hf_step(str(checkpoint), str(hf_dir), run, megatron_ppl, paragraphs, say=lines.append)
    return hf_dir, result, lines


def test_hf_export_reproduces_megatrons_validation_perplexity(trained, exported):
    _, _, megatron_ppl, _ = trained
    hf_dir, result, lines = exported
    assert megatron_ppl < 2000  # trained away from uniform (4096): the comparison has something to compare
    assert result["architecture"] == "MixLNLlamaForCausalLM"
    assert json.loads((hf_dir / "config.json").read_text())["post_ln_layers"] == 1
    assert result["ppl_hf_same_windows"] == pytest.approx(megatron_ppl, rel=1e-6)
    # the held-out text in consecutive windows: the same documents, other window starts
    assert result["ppl_hf_held_out_text"] == pytest.approx(megatron_ppl, rel=0.15)
    assert result["continuation"].strip()
    assert any(f"Megatron {megatron_ppl:.3f}" in line for line in lines), lines


def test_the_exported_tokenizer_gives_the_datasets_tokens(trained, exported):
    """The folder's AutoTokenizer (loaded as the demo loads it) encodes the held-out paragraphs to
    exactly the token ids Megatron trained and validated on."""
    from demo_hf import load_hf, megatron_validation_windows

    _, run, _, paragraphs = trained
    tokenizer, _ = load_hf(str(exported[0]))
    valid, _ = megatron_validation_windows(run)
    for doc in list(valid.indices)[:50]:
        ids = tokenizer(paragraphs[int(doc)]).input_ids + [tokenizer.eos_token_id]
        assert ids == valid.dataset[int(doc)].tolist(), doc


def test_a_faulty_export_is_caught(trained, exported, tmp_path):
    """An export that lost the Mix-LN placement (layer 1 written as a Pre-LN layer, its two norms
    under the Pre-LN names): the same comparison refuses it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from demo_hf import DemoMismatch, check_agreement, load_hf, megatron_validation_windows
    from demo_hf import perplexity_on_windows

    _, run, megatron_ppl, _ = trained
    broken = tmp_path / "hf"
    shutil.copytree(exported[0], broken)
    (shard,) = broken.glob("*.safetensors")
    tensors = load_file(str(shard))
    for post_name, pre_name in (("post_attention_layernorm", "input_layernorm"),
                                ("post_feedforward_layernorm", "post_attention_layernorm")):
        tensors[f"model.layers.0.{pre_name}.weight"] = tensors.pop(f"model.layers.0.{post_name}.weight")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"] = {name: shard.name for name in tensors}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((broken / "config.json").read_text())
    config.update(post_ln_layers=0, mixln_alpha="0")
    (broken / "config.json").write_text(json.dumps(config))
    _, model = load_hf(str(broken))
    assert torch.equal(model.model.layers[0].input_layernorm.weight, tensors["model.layers.0.input_layernorm.weight"])
    valid, indices = megatron_validation_windows(run)
    ppl = perplexity_on_windows(model, [valid[i] for i in indices])
    print(f"the faulty export: {ppl:.4f} against Megatron's {megatron_ppl:.4f}")
    with pytest.raises(DemoMismatch, match="does not reproduce"):
        check_agreement(ppl, megatron_ppl)
    check_agreement(exported[1]["ppl_hf_same_windows"], megatron_ppl)  # the real export passes
    assert torch.isfinite(torch.tensor(ppl))


# ------------------------------------------------------------------ the demo's own outputs
def test_the_demo_refuses_a_folder_it_did_not_write(tmp_path):
    """A run folder holding something else stops the demo in one line, before any work, and the
    file stays."""
    foreign = tmp_path / "mixln" / "notes.txt"
    foreign.parent.mkdir()
    foreign.write_text("mine")
    done = run_python([sys.executable, str(DEMO), "--out", str(tmp_path)],
                      timeout=300, env=_env(), cwd=REPO)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("demo: error: ") and "notes.txt" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "preparing" not in done.stdout
    assert foreign.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["mixln"]


@pytest.mark.slow
def test_the_demo_ends_in_hugging_face(tmp_path):
    """`python scripts/demo.py` with a few iterations, twice into the same folder: the
    HF lines, the RESULT line once and last, the checkpoint and export in place, no temporaries."""
    cmd = [sys.executable, str(DEMO), "--out", str(tmp_path), "--iters", "4",
           "--eval-interval", "2"]
    for _ in range(2):  # the second run replaces the first one's outputs
        done = run_python(cmd, timeout=900, env=_env(), cwd=REPO)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        lines = done.stdout.strip().splitlines()
        assert [line for line in lines if line.startswith("RESULT")] == [lines[-1]]
        assert any("greedy continuation" in line for line in lines)
        assert any(line.startswith("demo: held-out perplexity") for line in lines)
    summary = json.loads((tmp_path / "losses.json").read_text())
    hf = summary["hugging_face"]
    assert hf["ppl_hf_same_windows"] == pytest.approx(summary["final_valid_ppl"]["mixln"], rel=1e-5)
    assert f"demo_ppl_mixln={summary['final_valid_ppl']['mixln']:.3f}" in lines[-1]
    assert (tmp_path / "mixln" / "checkpoint" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert (tmp_path / "mixln" / "hf" / "config.json").exists()
    assert not [p for p in (tmp_path / "mixln").iterdir() if p.name.startswith(".")]
