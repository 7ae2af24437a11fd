"""The commands print no import-time warnings of a CPU machine; the user's warnings still show.

Reading a Megatron-LM checkpoint's args imports megatron-core (its enums), which on a machine
without TransformerEngine, Apex or absl warns about each absence, and torch logs that no CUDA
runtime is found. The commands ignore exactly those (mixln_megatron/known_warnings.py), so a
refusal is one stderr line with no PYTHONWARNINGS set. The commands run in fresh interpreters
(an interpreter forked from the suite's preloaded server has imported megatron already and would
print nothing either way); the checkpoint is a real one, saved by `mixln-megatron pretrain`.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from mixln_megatron import known_warnings
from harness.testing import run_python

REPO = Path(__file__).resolve().parents[1]
# Megatron-LM's defaults: LayerNorm and a GELU MLP, which the Llama export cannot express.
LAYERNORM_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
                   "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
                   "--lr", "1e-3", "--train-iters", "1", "--eval-iters", "0", "--eval-interval", "1000",
                   "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
                   "--use-cpu-initialization", "--num-workers", "0", "--ckpt-format", "torch_dist", "--save-interval", "1"]
REFUSAL = "mixln-megatron convert to-hf: error: this checkpoint's model cannot be converted to Hugging Face Llama: "


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONWARNINGS"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
               **extra)
    return env


@pytest.fixture(scope="module")
def layernorm_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("quiet") / "ckpt"
    proc = run_python([sys.executable, str(REPO / "tests" / "workers" / "fork_queue.py"), "-m",
                       "mixln_megatron.training.pretrain", "--cpu", *LAYERNORM_MODEL, "--save", str(path)],
                      env=_env(PYTHONWARNINGS="ignore"), cwd=str(REPO), timeout=600)
    assert proc.returncode == 0 and (path / "iter_0000001").is_dir(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return path


def _command(*args):
    """`mixln-megatron ...` in a fresh interpreter, as the user runs it."""
    script = Path(sys.executable).parent / "mixln-megatron"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "mixln_megatron.cli"]
    return subprocess.run([*command, *map(str, args)], env=_env(), cwd=str(REPO), capture_output=True, text=True,
                          timeout=600)


def test_a_refused_conversion_is_one_stderr_line(layernorm_checkpoint, tmp_path):
    proc = _command("convert", "to-hf", "--load", layernorm_checkpoint, "--save", tmp_path / "hf", "--no-progress")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(REFUSAL) and "normalization 'LayerNorm'" in lines[0], proc.stderr
    assert proc.stdout == "" and not (tmp_path / "hf").exists()


def test_a_warning_about_the_user_s_input_still_shows(layernorm_checkpoint, tmp_path):
    """The deprecated --iteration spelling: its warning line, then the refusal; nothing else."""
    proc = _command("convert", "to-hf", "--load", layernorm_checkpoint, "--save", tmp_path / "hf", "--iteration", "1",
                    "--no-progress")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 2, proc.stderr
    assert lines[0] == "mixln-megatron convert to-hf: warning: --iteration is deprecated, use --ckpt-step"
    assert lines[1].startswith(REFUSAL), proc.stderr


def test_inspect_of_a_megatron_lm_checkpoint_prints_nothing_on_stderr(layernorm_checkpoint):
    proc = _command("convert", "inspect", "--load", layernorm_checkpoint)
    assert proc.returncode == 0 and "normalization: LayerNorm" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr == ""


def test_preprocess_prints_nothing_on_stderr(tmp_path):
    """Writing the dataset imports megatron-core's indexed dataset: its CPU-machine warnings stay off."""
    source = tmp_path / "docs.jsonl"
    source.write_text('{"text": "It is a truth universally acknowledged."}\n{"text": "A second one."}\n')
    proc = _command("preprocess", "--input", source, "--output-prefix", tmp_path / "out" / "austen", "--workers", "1",
                    "--no-progress")
    assert proc.returncode == 0 and "2 documents" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr == ""


# ------------------------------------------------------------------ only the known ones
def _shown(message: str, module: str, category=UserWarning) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        known_warnings.quiet_known_warnings()
        warnings.warn_explicit(message, category, "x.py", 1, module=module)
    return bool(caught)


def test_only_the_known_warnings_of_their_own_modules_are_ignored(monkeypatch):
    monkeypatch.setattr(sys, "warnoptions", [])
    apex = "Apex is not installed. Falling back to Torch Norm"
    assert not _shown(apex, "megatron.core.models.backends")
    assert not _shown("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                      "megatron.core.optimizer")
    assert not _shown("absl.logging is not installed. Using logging.getLogger(__name__) instead.",
                      "megatron.core.hyper_comm_grid")
    assert _shown(apex, "users_own_module")  # the same text from elsewhere
    assert _shown("the dataset has 3 documents shorter than the sequence", "megatron.core.datasets.gpt_dataset")
    assert _shown(apex, "megatron.core.models.backends", category=RuntimeWarning)


def test_the_user_s_warning_options_are_kept(monkeypatch):
    monkeypatch.setattr(sys, "warnoptions", ["default"])
    assert _shown("Apex is not installed. Falling back to Torch Norm", "megatron.core.models.backends")


def test_a_bad_shard_size_is_a_usage_line_not_a_traceback(tmp_path, capsys):
    from mixln_megatron.convert import cli as convert_cli

    with pytest.raises(SystemExit) as left:
        convert_cli.main(["to-hf", "--load", str(tmp_path), "--save", str(tmp_path / "hf"), "--max-shard-size", "lots"])
    assert left.value.code == 2
    assert capsys.readouterr().err == ("mixln-megatron convert to-hf: error: argument --max-shard-size: 'lots' is not "
                                       "a size (e.g. 5GB, 500MB, 2GiB or a number of bytes) (see mixln-megatron "
                                       "convert to-hf --help)\n")
