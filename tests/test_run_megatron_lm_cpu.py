"""scripts/run_megatron_lm_cpu.py runs the checkout's megatron, and says how to get the helpers."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "run_megatron_lm_cpu.py"

# A stand-in for the checkout's pretrain_gpt.py: Megatron-LM's own parser, nothing trained.
PRETRAIN_GPT = """
import json
from megatron.training import arguments
args = arguments.parse_args()
print("RESULT " + json.dumps({"mixln_alpha": args.mixln_alpha, "arguments": arguments.__file__}))
"""
ARGV = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]


def _env(mlm):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_") and k not in ("MLM_DIR", "MEGATRON_LM_DIR")}
    env.update(MEGATRON_LM_DIR=str(mlm), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def _cli_patch() -> Path:
    """patches/<release>/0001-mixln-cli-flags.patch for core 0.19 (wherever the tree keeps it)."""
    found = sorted(REPO.glob("patches/**/0001-mixln-cli-flags.patch"))
    found = [p for p in found if "0.19" in str(p.parent)] or found
    assert found, "no 0001-mixln-cli-flags.patch under patches/"
    return found[-1]


def test_a_patched_checkout_recognises_mixln_flags(tmp_path):
    wheel = Path(importlib.util.find_spec("megatron.core").origin).resolve().parents[1]
    mlm = tmp_path / "Megatron-LM"
    shutil.copytree(wheel, mlm / "megatron", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (mlm / "pretrain_gpt.py").write_text(PRETRAIN_GPT)
    applied = subprocess.run(["git", "apply", str(_cli_patch())], cwd=mlm, capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    proc = subprocess.run([sys.executable, str(SCRIPT), *ARGV, "--mixln-alpha", "0.5"], env=_env(mlm),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["mixln_alpha"] == "0.5"
    assert Path(got["arguments"]).resolve().is_relative_to(mlm.resolve())


def test_missing_helpers_without_pybind11_is_one_line(tmp_path):
    if importlib.util.find_spec("pybind11") is not None:
        pytest.skip("pybind11 is installed: Megatron's make step would build the helpers")
    mlm = tmp_path / "Megatron-LM"
    datasets = mlm / "megatron" / "core" / "datasets"
    datasets.mkdir(parents=True)
    (datasets / "Makefile").write_text("all:\n\tfalse\n")
    (mlm / "pretrain_gpt.py").write_text("raise SystemExit('never reached')\n")
    proc = subprocess.run([sys.executable, str(SCRIPT), *ARGV], env=_env(mlm), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "no built helpers_cpp" in lines[0] and "pip install pybind11" in lines[0]
    assert f"make -C {datasets}" in lines[0]


def test_the_old_variable_name_is_refused_in_one_line(tmp_path):
    """MEGATRON_LM_DIR names the checkout everywhere; MLM_DIR alone is not taken silently."""
    env = _env(tmp_path)
    del env["MEGATRON_LM_DIR"]
    env["MLM_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "run_megatron_lm_cpu: MLM_DIR is not read: set MEGATRON_LM_DIR to the Megatron-LM checkout instead"], proc.stderr
