"""A refusal of `mixln-megatron pretrain` reaches the user once per job, first, in one format.

A refusal of the command line alone is every rank's alike: global rank 0 prints the one
`[mixln_megatron] ERROR:` line before Megatron-LM validates the arguments (and prints its
argument table); every other rank exits non-zero and prints nothing (errors.print_once). The
2-rank job runs under the real torchrun in fresh interpreters (the launcher's SIGTERM, its
failure summary, the import-time warnings of each rank); the roles of print_once in-process.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mixln_megatron import errors
from mixln_megatron.cli_parsing import one_line_usage_errors

REPO = Path(__file__).resolve().parents[1]
TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
        "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
ALPHA_LINE = ("[mixln_megatron] ERROR: alpha from --mixln-alpha must lie in [0, 1] (0 = all Pre-LN, "
              "1 = all Post-LN), got '1.5'")
ARGUMENT_TABLE = "------------------------ arguments ------------------------"


def _env():
    """The user's environment: no launcher variables, no MIXLN_*, no PYTHONWARNINGS."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONWARNINGS"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p))
    return env


def _torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "mixln_megatron.training.pretrain", "--cpu", *TINY, *args]


def _rank_exit_codes(text: str) -> dict:
    """{rank: exit code} from torchrun's failure summary."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", text)
    return {int(rank): int(code) for rank, code in found}


@pytest.mark.mp
def test_a_bad_value_is_one_line_once_per_job_before_the_argument_table():
    """The real torchrun, 2 ranks, `--mixln-alpha 1.5`: the line once in the combined output, no
    argument table (the refusal comes before Megatron-LM validates), every rank non-zero (2, or
    torchrun's SIGTERM once the first rank has left), no rank's traceback, no import-time warnings."""
    proc = subprocess.run(_torchrun("--mixln-alpha", "1.5"), env=_env(), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    text = proc.stdout
    assert proc.returncode != 0, text[-4000:]
    assert text.count(ALPHA_LINE) == 1 and text.count("[mixln_megatron] ERROR:") == 1, text[-4000:]
    assert ARGUMENT_TABLE not in text and "using world size" not in text, text[:4000]
    codes = _rank_exit_codes(text)
    assert sorted(codes) == [0, 1] and all(code != 0 for code in codes.values()), (codes, text[-4000:])
    assert 2 in codes.values() and set(codes.values()) <= {2, -15}, codes
    # The one Traceback allowed is torchrun's own (its ChildFailedError summary).
    assert text.count("Traceback (most recent call last)") <= text.count("ChildFailedError"), text[-4000:]
    assert not re.search(r'File ".*mixln_megatron', text), text[-4000:]
    assert "UserWarning" not in text and "No CUDA runtime is found" not in text, text[:4000]


# ------------------------------------------------------------------ print_once, rank by rank
@pytest.fixture
def launched(monkeypatch, tmp_path):
    """This process as one rank of a 2-per-node torchrun job (its claim files under tmp_path)."""
    monkeypatch.setattr(errors.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")

    def as_rank(rank, local_rank):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))

    return as_rank


def test_rank_0_prints_a_line_every_rank_meets_alike(launched, capsys):
    launched(0, 0)
    assert errors.print_once("[mixln_megatron] ERROR: x", alike_on_every_rank=True)
    assert capsys.readouterr().err == "[mixln_megatron] ERROR: x\n"


def test_a_rank_on_another_node_leaves_quietly(launched, capsys):
    launched(3, 1)
    assert not errors.print_once("[mixln_megatron] ERROR: x", alike_on_every_rank=True)
    assert capsys.readouterr().err == ""
    launched(2, 0)  # the first rank of the other node: quiet too
    assert not errors.report(errors.MixLNConfigError("x"), alike_on_every_rank=True)
    assert capsys.readouterr().err == ""


def test_a_peer_of_rank_0_leaves_once_rank_0_printed(launched, capsys):
    line = "[mixln_megatron] ERROR: x"
    launched(0, 0)
    assert errors.print_once(line, alike_on_every_rank=True)  # rank 0 (this process) prints, marks it
    capsys.readouterr()
    launched(1, 1)
    assert not errors.print_once(line, alike_on_every_rank=True)
    assert capsys.readouterr().err == ""


def test_a_peer_of_rank_0_prints_when_rank_0_is_gone_without_the_line(launched, capsys, tmp_path):
    line = "[mixln_megatron] ERROR: x"
    launched(1, 1)
    node = errors.NodeClaim("errors", line)
    folder, claim = node.folder, node.claim
    os.makedirs(folder, exist_ok=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    Path(claim).write_text(str(dead.pid))  # rank 0 claimed the line, then died before printing it
    assert errors.print_once(line, alike_on_every_rank=True)
    assert capsys.readouterr().err == line + "\n"


def test_a_usage_error_of_megatron_s_parser_is_printed_once_per_job(launched, capsys):
    """A parser this project does not own (Megatron-LM's, which every rank runs alike): rank 0
    prints the one line, a rank elsewhere prints nothing; both exit 2."""
    import argparse

    parser = argparse.ArgumentParser(prog="mixln-megatron pretrain")
    for rank, local_rank, shown in ((0, 0, True), (3, 1, False)):
        launched(rank, local_rank)
        with pytest.raises(SystemExit) as left, one_line_usage_errors():
            parser.parse_args(["--no-such-flag", "3"])
        assert left.value.code == 2
        expected = ("mixln-megatron pretrain: error: unrecognized arguments: --no-such-flag 3 "
                    "(see mixln-megatron pretrain --help)\n") if shown else ""
        assert capsys.readouterr().err == expected, (rank, local_rank)
