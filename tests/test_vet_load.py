"""`mixln-megatron pretrain --load` vets the checkpoint before Megatron-LM unpickles it.

A real torch_dist checkpoint (`convert from-hf` of a tiny stock Llama, Mix-LN P = 1, local modules)
and its legacy copy get a payload (tests/payloads.py) in `.metadata` (0.19's layout: no common.pt;
Megatron-LM's --use-checkpoint-args reads it with DCP's plain pickle), common.pt, a .distcp byte
item, or the legacy mp_rank file. `mixln-megatron pretrain --cpu --use-checkpoint-args --load CK`
(a real process, the resume command from-hf prints) exits 2 with one line naming the file and the
global, before Megatron-LM reads anything: the marker is never created. The clean checkpoint
resumes (2 iterations, saved). `convert inspect --check` says clean / refuses the same way.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest

from harness.testing import run_python

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

import payloads as P  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = ["--mixln-post-ln-layers", "1", "--train-iters", "2", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "127", "--num-workers", "0", "--eval-iters", "0", "--eval-interval", "1000",
         "--log-interval", "1", "--use-cpu-initialization"]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    from mixln_megatron.convert import convert_from_hf

    root = tmp_path_factory.mktemp("vet_load")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(root / "hf"))
    for fmt in ("torch_dist", "torch"):
        convert_from_hf(str(root / "hf"), str(root / fmt), transformer_impl="local", post_ln_layers=1,
                        ckpt_format=fmt, progress=False)
    return {"torch_dist": root / "torch_dist", "torch": root / "torch"}


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(
        [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return env


def pretrain(ckpt, save=None, timeout=600):
    cmd = [sys.executable, "-m", "mixln_megatron.training.pretrain", "--cpu", "--load", str(ckpt),
           "--use-checkpoint-args", *TRAIN]
    if save:
        cmd += ["--save", str(save), "--save-interval", "2"]
    return run_python(cmd, capture_output=True, text=True, env=_env(), timeout=timeout, cwd=REPO)


def inspect_check(ckpt):
    return run_python([sys.executable, "-m", "mixln_megatron.cli", "convert", "inspect", "--check", "--load",
                           str(ckpt)], capture_output=True, text=True, env=_env(), timeout=300, cwd=REPO)


def inspect_check_in_process(ckpt, capsys):
    """The same command through mixln_megatron.cli.main in this process (no interpreter start):
    (returncode, stdout, stderr) as the process would give them. The real process's exit status and
    stderr are test_inspect_check_refuses[torch_dist-.metadata]'s."""
    import types

    from mixln_megatron import cli

    capsys.readouterr()
    try:
        rc = cli.main(["convert", "inspect", "--check", "--load", str(ckpt)])
    except SystemExit as e:
        rc = e.code
    captured = capsys.readouterr()
    return types.SimpleNamespace(returncode=rc, stdout=captured.out, stderr=captured.err)


def _lines(text):
    return [line for line in text.splitlines() if line.strip() and "CUDA runtime" not in line]


def plant(bases, tmp_path, kind):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(bases[P.FILE_KINDS[kind][0]], ckpt)
    if kind == "torch_dist-.metadata":
        os.remove(P.target_file("torch_dist-common.pt", ckpt))  # 0.19's layout: the args come from .metadata's items
    marker = tmp_path / "PAYLOAD_RAN"
    payload = P.PAYLOADS["os.system"]
    target = P.plant_payload(kind, ckpt, payload.build(str(marker), str(tmp_path)), protocol=payload.protocol)
    return ckpt, marker, target


def assert_refused(proc, marker, target, prefix):
    assert not marker.exists(), "the payload RAN"
    lines = _lines(proc.stderr)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr
    assert "posix.system" in lines[0] and target in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


KINDS = ["torch_dist-.metadata", "torch_dist-common.pt", "torch_dist-mixln_settings-item",
         "legacy-model_optim_rng.pt"]


# The .metadata case (the file Megatron-LM unpickles first) runs by default and on every release; the other file kinds
# cost a pretrain process each and are covered in-process by test_untrusted_checkpoints' vetting
# cases (the same vet_checkpoint, every file kind), so they are marked slow.
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.compat) if k == "torch_dist-.metadata"
                                  else pytest.param(k, marks=pytest.mark.slow) for k in KINDS])
def test_pretrain_refuses_payload_before_megatron_reads(bases, tmp_path, kind):
    ckpt, marker, target = plant(bases, tmp_path, kind)
    proc = pretrain(ckpt, save=tmp_path / "trained")
    assert_refused(proc, marker, target, "[mixln_megatron] ERROR: ")
    assert not (tmp_path / "trained").exists()


@pytest.mark.parametrize("kind", ["torch_dist-.metadata", "legacy-model_optim_rng.pt"])
def test_inspect_check_refuses(bases, tmp_path, capsys, kind):
    """The .metadata case in its own process (exit status, stderr); the legacy one in-process."""
    ckpt, marker, target = plant(bases, tmp_path, kind)
    proc = inspect_check(ckpt) if kind == "torch_dist-.metadata" else inspect_check_in_process(ckpt, capsys)
    assert_refused(proc, marker, target, "mixln-megatron convert inspect: error: ")


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_inspect_check_clean(bases, capsys, fmt):
    proc = inspect_check_in_process(bases[fmt], capsys)
    assert proc.returncode == 0, proc.stderr
    assert "clean" in proc.stdout and str(bases[fmt]) in proc.stdout, proc.stdout


def test_pretrain_resumes_a_clean_checkpoint(bases, tmp_path):
    proc = pretrain(bases["torch_dist"], save=tmp_path / "trained")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (tmp_path / "trained" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    # what pretrain saved (optimizer and RNG state included) passes the vetting too
    from mixln_megatron.convert.vet import vet_checkpoint

    report = vet_checkpoint(str(tmp_path / "trained"))
    assert report.pickles.get("byte items", 0) > 5, report.line()

