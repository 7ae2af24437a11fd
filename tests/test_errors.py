"""Configuration errors reach the user as one clear line (issue 12 item 4)."""

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mixln_megatron import cli, errors
from mixln_megatron.errors import MixLNConfigError, MixLNError

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BUILDER = HERE / "workers" / "megatron_builder_worker.py"
TINY = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
    "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "1", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--normalization", "RMSNorm",
    "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope", "--use-cpu-initialization",
]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO), **extra)
    return env


def _command():
    script = Path(sys.executable).parent / "mixln-megatron"  # the installed console script
    return [str(script)] if script.exists() else [sys.executable, "-m", "mixln_megatron.cli"]


@pytest.fixture
def fresh_report(monkeypatch):
    monkeypatch.setattr(errors, "_reported", False)


def test_report_once_prints_one_line_the_first_time(fresh_report):
    out = io.StringIO()
    assert errors.report_once(MixLNConfigError("alpha from MIXLN_ALPHA is bad\n  second line"), file=out)
    assert not errors.report_once(MixLNConfigError("another"), file=out)
    assert out.getvalue() == "[mixln_megatron] ERROR: alpha from MIXLN_ALPHA is bad | second line\n"


def test_placement_command_prints_one_line_and_exits_2():
    proc = subprocess.run([*_command(), "placement", "--num-layers", "32"], env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("mixln-megatron placement: error: the model has 32 layers and no Mix-LN setting")


def test_every_project_error_is_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    """cli.main handles the base class, so each command's refusals (convert, analyze, ...) ride on it."""
    (tmp_path / "mixln_failing_command.py").write_text(
        "from mixln_megatron.convert import ConversionError\n"
        "def main(argv):\n    raise ConversionError('refusing: --save lies inside --load')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "convert", ("mixln_failing_command", "test"))
    assert cli.main(["convert", "to-hf"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "mixln-megatron convert: error: refusing: --save lies inside --load\n"
    from mixln_megatron.analysis.models import CheckpointError
    from mixln_megatron.data.preprocess import PreprocessError
    from mixln_megatron.training.pretrain import MixLNPretrainUnsupported
    from mixln_megatron.model.support import MixLNUnsupportedError

    for kind in (CheckpointError, PreprocessError, MixLNPretrainUnsupported, MixLNUnsupportedError):
        assert issubclass(kind, MixLNError), kind


def test_pretrain_bad_flag_is_one_line_and_exit_2():
    proc = subprocess.run([*_command(), "pretrain", "--cpu", *TINY, "--mixln-alpha", "2"], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors_ = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors_ == ["mixln-megatron pretrain: error: alpha from --mixln-alpha must lie in [0, 1] "
                       "(0 = all Pre-LN, 1 = all Post-LN), got '2'"], proc.stderr[-2000:]


def test_stock_path_prints_the_error_line_once_across_ranks():
    """Two torchrun'd ranks build the model the way Megatron-LM's pretrain_gpt.py does; both fail,
    rank 0 alone prints the one line, once, before the tracebacks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(BUILDER), "--global-batch-size", "4"]
    proc = subprocess.run(cmd, env=_env(MIXLN_ALPHA="a quarter"), capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    lines = [line for line in text.splitlines() if "[mixln_megatron] ERROR:" in line]
    assert len(lines) == 1, text[-4000:]
    assert lines[0].endswith("[mixln_megatron] ERROR: alpha from MIXLN_ALPHA must be a number in [0, 1] "
                             "(e.g. 0.25, or 0.0625 for a 32-layer 7B model), got 'a quarter'")
    rank0 = proc.stderr.find("[rank0]: Traceback")  # torchrun tags each worker's traceback
    assert 0 <= proc.stderr.find("[mixln_megatron] ERROR:") < rank0, proc.stderr[-4000:]
