"""Configuration errors reach the user as one clear line."""

import contextlib
import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.testing import run_python
from mixln_megatron import cli, errors
from mixln_megatron.errors import MixLNConfigError, MixLNError

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
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
    # The checkout first, then what the caller has (a compat overlay: the workers run its release).
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=path, **extra)
    return env


def _command():
    script = Path(sys.executable).parent / "mixln-megatron"  # the installed console script
    return [str(script)] if script.exists() else [sys.executable, "-m", "mixln_megatron.cli"]


def test_report_prints_each_error_once_and_every_other_error_too():
    """Per error, not a process-wide latch: the same error (or one re-raised from it, as megatron's
    build_module does) prints once; another error still gets its line."""
    out = io.StringIO()
    first = MixLNConfigError("alpha from MIXLN_ALPHA is bad\n  second line")
    assert errors.report(first, file=out)
    assert not errors.report(first, file=out)
    try:
        try:
            raise first
        except MixLNConfigError as caught:
            raise MixLNConfigError(f"{caught} when instantiating MixLNHybridStack")
    except MixLNConfigError as rewrapped:
        assert not errors.report(rewrapped, file=out)
        assert errors.reported(rewrapped) is first
    assert errors.report(MixLNConfigError("another"), file=out)
    assert out.getvalue() == ("[mixln_megatron] ERROR: alpha from MIXLN_ALPHA is bad | second line\n"
                              "[mixln_megatron] ERROR: another\n")


def test_refusal_is_exit_2_without_a_traceback(capsys):
    with pytest.raises(SystemExit) as left:
        with errors.refusals_leave():
            raise MixLNConfigError("refused")
    assert left.value.code == 2 and isinstance(left.value, errors.Refusal)
    assert str(left.value) == "refused" and isinstance(left.value.error, MixLNConfigError)
    assert capsys.readouterr().err == "[mixln_megatron] ERROR: refused\n"
    with pytest.raises(ValueError):  # not ours: left alone
        with errors.refusals_leave():
            raise ValueError("a bug")


def test_placement_command_prints_one_line_and_exits_2():
    proc = run_python([*_command(), "placement", "--num-layers", "32"], env=_env(),
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
    from mixln_megatron.analysis.loading import CheckpointError
    from mixln_megatron.data.preprocess import PreprocessError
    from mixln_megatron.training.pretrain import MixLNPretrainUnsupported
    from mixln_megatron.model.support import MixLNUnsupportedError
    from mixln_megatron.model.checkpoint import MixLNCheckpointMismatch
    from mixln_megatron.compat import CheckpointFromNewerRelease

    for kind in (CheckpointError, PreprocessError, MixLNPretrainUnsupported, MixLNUnsupportedError,
                 MixLNCheckpointMismatch, CheckpointFromNewerRelease):
        assert issubclass(kind, MixLNError), kind


def test_pretrain_bad_flag_is_one_line_and_exit_2():
    proc = run_python([*_command(), "pretrain", "--cpu", *TINY, "--mixln-alpha", "2"], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors_ = [line for line in proc.stderr.splitlines() if "error:" in line.lower()]
    assert errors_ == ["[mixln_megatron] ERROR: alpha from --mixln-alpha must lie in [0, 1] "
                       "(0 = all Pre-LN, 1 = all Post-LN), got '2'"], proc.stderr[-2000:]


# ------------------------------------------------------------------ the stock path, every rank
REFUSAL_WORKER = HERE / "workers" / "stock_refusal_worker.py"
LINE = "[mixln_megatron] ERROR:"
CASES = {  # case: (environment, what the line says, on which releases)
    "bad_alpha": ({"MIXLN_ALPHA": "a quarter"}, "alpha from MIXLN_ALPHA must be a number in [0, 1] "
                  "(e.g. 0.25, or 0.0625 for a 32-layer 7B model), got 'a quarter'", "all"),
    "settings_mismatch": ({}, "Mix-LN settings differ: the checkpoint has scheme=mixln P=2 of L=4, the model "
                          "has scheme=mixln P=1 of L=4", "all"),
    "newer_checkpoint": ({}, "was saved by megatron-core 0.19 or newer", "before 0.19"),
    "hybrid_pattern": ({}, "the last pipeline stage ends at hybrid layer 2, but the model has 4 layers", "0.19+"),
}


def _error_lines(text):
    return [line for line in text.splitlines() if LINE in line]


def newer_release_checkpoint(root):
    """A --load folder as megatron-core 0.19+ saves it (iteration 5, DCP metadata, no common.pt),
    written once before any rank starts (ranks that wrote it themselves could read it half-written)."""
    os.makedirs(os.path.join(root, "iter_0000005"))
    open(os.path.join(root, "iter_0000005", ".metadata"), "wb").close()
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("5")
    return root


def _ranks(case, tmp_path, nproc=2, timeout=300):
    """Every rank of a job as a child of this test (no launcher in between, so each rank's own exit
    status is seen, not a launcher's SIGTERM): [(returncode, output)] by rank. A rank still running
    at the timeout (the others left it waiting in a collective) is killed and reads as None."""
    import torch

    # The rendezvous store is hosted here, as torchrun's agent hosts it: the OS picks the port (no
    # race with another test for a "free" one), and the ranks connect as clients.
    store = torch.distributed.TCPStore("127.0.0.1", 0, world_size=nproc, is_master=True, wait_for_workers=False)
    env0, port = CASES[case][0], store.port
    extra = ["--load", newer_release_checkpoint(str(tmp_path / "load"))] if case == "newer_checkpoint" else []
    procs = [subprocess.Popen(
        [sys.executable, str(REFUSAL_WORKER), case, *extra], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env=_env(**env0, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                 LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 TORCHELASTIC_USE_AGENT_STORE="True"))
        for rank in range(nproc)]
    deadline, outputs = time.monotonic() + timeout, []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outputs.append(p.communicate()[0] + "\n[test: killed at the timeout]")
            p.returncode = None
    return [(p.returncode, out) for p, out in zip(procs, outputs)]


# Each case is a 2-rank job. The default run (0.19) keeps bad_alpha and newer_checkpoint (which
# skips there); settings_mismatch and hybrid_pattern are marked slow, and run on every other
# release in `make test-compat` (which selects by the compat marker alone).
DEFAULT_CASES = ("bad_alpha", "newer_checkpoint")


@pytest.mark.mp
@pytest.mark.compat
@pytest.mark.parametrize("case", [c if c in DEFAULT_CASES else pytest.param(c, marks=pytest.mark.slow)
                                  for c in sorted(CASES)])
def test_stock_path_refusal_is_one_line_and_exit_2_on_every_rank(case, tmp_path):
    """Each stock-path refusal, met as Megatron-LM's own scripts meet it (the --spec object resolved
    as this release's pretrain_gpt.py / pretrain_hybrid.py does, the checkpoint record checked as its
    load_checkpoint does): the line once in the whole job, no traceback from any rank, every rank
    exits 2."""
    from mixln_megatron import compat

    releases = CASES[case][2]
    if (releases == "before 0.19" and compat.RELEASE >= (0, 19)) or (releases == "0.19+" and not compat.HYBRID_MODEL):
        pytest.skip(f"{case}: not a refusal on megatron-core {compat.VERSION}")
    ranks = _ranks(case, tmp_path)
    text = "".join(out for _, out in ranks)
    assert [rc for rc, _ in ranks] == [2, 2], text[-6000:]
    lines = _error_lines(text)
    assert len(lines) == 1 and CASES[case][1] in lines[0], text[-6000:]
    assert "Traceback" not in text and "NOT REFUSED" not in text, text[-6000:]


@contextlib.contextmanager
def _one_loaded_cpu(hogs=1):
    """Busy-loop processes and the job under test on one CPU (the job's ranks and torchrun inherit
    the mask of the thread that starts them): a loaded machine for the job (a busy loop for each CPU
    it may use), while the rest of the suite (the other
    pytest-xdist worker) keeps the other CPUs. Yields a function that starts a
    command there; the hogs are killed after."""
    cpu = min(os.sched_getaffinity(0))
    previous = os.sched_getaffinity(0)

    def start(cmd, **kwargs):
        os.sched_setaffinity(0, {cpu})  # this thread only, for the fork below
        try:
            return subprocess.Popen(cmd, **kwargs)
        finally:
            os.sched_setaffinity(0, previous)

    busy = [start([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    try:
        yield start
    finally:
        for hog in busy:
            hog.kill()
            hog.wait()


@pytest.mark.mp
@pytest.mark.parametrize("repetitions", [2, pytest.param(5, marks=pytest.mark.slow)])
def test_the_line_survives_when_rank_0_is_the_slow_one(repetitions):
    """Under torchrun, rank 1 fails while rank 0 never gets there (it sleeps): torchrun stops rank 0
    with SIGTERM as soon as rank 1 exits. The line must still be in the log, once, with no
    traceback, and torchrun's summary names exit code 2. Repeated with a CPU hog on the job's own
    CPU (2 runs in the default suite, 5 marked slow); nothing here depends on timing (rank 0 cannot print: the
    line can only come from rank 1, and it prints before it exits)."""
    with _one_loaded_cpu() as start:
        for attempt in range(repetitions):
            proc = start(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 str(REFUSAL_WORKER), "bad_alpha", "--rank-0-never-gets-there"],
                env=_env(MIXLN_ALPHA="a quarter"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                cwd=REPO)
            try:
                text = proc.communicate(timeout=900)[0]
            finally:
                proc.kill()  # a no-op once it has exited; a hung launcher does not outlive the test
            assert proc.returncode != 0, text[-4000:]
            lines = _error_lines(text)
            assert len(lines) == 1 and lines[0].endswith(CASES["bad_alpha"][1]), (attempt, text[-4000:])
            # No rank's traceback: the one Traceback allowed is torchrun's own (its ChildFailedError
            # summary, the launcher's), with no frame of the worker or the plugin.
            assert text.count("Traceback (most recent call last)") <= text.count("ChildFailedError"), text[-4000:]
            assert not re.search(r'File ".*(mixln_megatron|stock_refusal_worker)', text), (attempt, text[-4000:])
            assert re.search(r"exitcode\s*:\s*2\b", text), (attempt, text[-4000:])


# ------------------------------------------------------------------ legacy (--ckpt-format torch) resume
LEGACY_TRAIN = ["--train-iters", "2", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
                "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
                "--num-workers", "0", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
                "--use-cpu-initialization"]


@pytest.mark.compat
def test_legacy_resume_with_other_settings_is_one_line_and_exit_2(tmp_path):
    """A real resume of a legacy (--ckpt-format torch) Mix-LN checkpoint (P = 1, `convert from-hf`)
    with P = 2, through Megatron-LM's load_checkpoint (its load_state_dict of model_optim_rng.pt,
    retried non-strictly under `except Exception`): the line once, no traceback, exit 2."""
    transformers = pytest.importorskip("transformers")
    from mixln_megatron.convert import convert_from_hf

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "hf"))
    convert_from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), transformer_impl="local", post_ln_layers=1,
                    ckpt_format="torch", progress=False)
    proc = run_python([sys.executable, "-m", "mixln_megatron.training.pretrain", "--cpu", "--load",
                           str(tmp_path / "ckpt"), "--use-checkpoint-args", "--ckpt-format", "torch",
                           "--mixln-post-ln-layers", "2", *LEGACY_TRAIN, "--save", str(tmp_path / "out"),
                           "--save-interval", "2"],
                          env=_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-6000:]
    lines = _error_lines(text)
    assert len(lines) == 1 and "Mix-LN settings differ: the checkpoint has scheme=mixln P=1 of L=4, the model " \
        "has scheme=mixln P=2 of L=4" in lines[0], text[-6000:]
    assert "Traceback" not in text and "loading release" in text, text[-6000:]
    assert not (tmp_path / "out").exists()
