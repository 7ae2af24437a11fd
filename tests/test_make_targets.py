"""`make test-te` / `make test-bridge` where the overlay cannot be laid out: skipped (exit 0) by
default, a failure with the one-line reason when TE_TESTS_REQUIRED=1 / BRIDGE_TESTS_REQUIRED=1 is
in make's environment (what CONTRIBUTING.md says).

The real Makefile and scripts/install_te.sh / install_bridge.sh run in a temporary copy of the
checkout whose `.venv/bin/python` is a stub that answers the scripts' torch / Python question with
the versions the overlays are built for and refuses anything else (so pytest or pip would show
up as a failure here); TE_WHEEL_DIR names an empty folder, so there is no TE extension wheel and
the overlay cannot be laid out. Nothing is downloaded and the real .venv is not touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

STUB_PYTHON = r"""#!/bin/sh
# stands in for the venv's python: answers the install scripts' torch / Python question only
case "$*" in
  *"import sys, torch"*) echo "2.14.1+cu130 cp312"; exit 0 ;;
esac
echo "stub python: not expected here: $*" >&2
exit 3
"""

TARGETS = {  # make target: (the variable that makes it required, the script that lays it out)
    "test-te": ("TE_TESTS_REQUIRED", "install_te.sh"),
    "test-bridge": ("BRIDGE_TESTS_REQUIRED", "install_bridge.sh"),
}

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


@pytest.fixture
def checkout(tmp_path):
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    for name in ("Makefile", "setup.py"):
        shutil.copy(REPO / name, root / name)
    for name in ("install_te.sh", "install_bridge.sh", "find_python.sh"):
        shutil.copy(REPO / "scripts" / name, root / "scripts" / name)
    python = root / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STUB_PYTHON)
    python.chmod(0o755)
    stamp = root / ".venv" / ".installed"  # the set-up is done: make must not run pip
    stamp.touch()
    later = (root / "setup.py").stat().st_mtime + 60
    os.utime(stamp, (later, later))
    (tmp_path / "no-wheels").mkdir()
    return root


def _make(root: Path, target: str, **env_extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TE_TESTS_REQUIRED", "BRIDGE_TESTS_REQUIRED", "PYTHONPATH", "MAKEFLAGS", "PY")}
    env.update(TE_WHEEL_DIR=str(root.parent / "no-wheels"),
               BRIDGE_OVERLAY=str(root.parent / "bridge-overlay"), **env_extra)
    return subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", "-C", str(root), target],
                          env=env, capture_output=True, text=True, timeout=120)


def _script_lines(proc, script: str) -> list:
    return [line for line in proc.stderr.splitlines() if line.startswith(f"{script}:")]


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_without_the_variable_the_tests_are_skipped(checkout, target):
    _, script = TARGETS[target]
    proc = _make(checkout, target)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{target}: skipped" in proc.stdout, proc.stdout + proc.stderr
    lines = _script_lines(proc, script)
    assert len(lines) == 1 and "skipped" in lines[0], proc.stderr
    assert "stub python: not expected" not in proc.stderr, proc.stderr
    assert not (checkout.parent / "bridge-overlay").exists()


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_required_and_not_laid_out_fails_with_the_reason(checkout, target):
    variable, script = TARGETS[target]
    proc = _make(checkout, target, **{variable: "1"})
    assert proc.returncode != 0, proc.stdout + proc.stderr
    lines = _script_lines(proc, script)
    assert len(lines) == 1, proc.stderr
    # what was wrong (required, and why it cannot be laid out) and what to do (the wheel's folder)
    assert f"{variable}=1" in lines[0] and "cannot be laid out" in lines[0], lines[0]
    assert "no transformer_engine_torch-" in lines[0] and "TE_WHEEL_DIR" in lines[0], lines[0]
    assert f"{target}: skipped" not in proc.stdout, proc.stdout
    assert "stub python: not expected" not in proc.stderr, proc.stderr  # pytest never started
    others = [line for line in proc.stderr.splitlines()
              if line != lines[0] and not line.startswith(("make:", "make["))]
    assert not others, proc.stderr


def test_the_scripts_themselves_fail_when_required(checkout):
    """scripts/install_te.sh run on its own (as install_bridge.sh runs it): exit 1, nothing on stdout."""
    env = {k: v for k, v in os.environ.items() if k not in ("TE_TESTS_REQUIRED", "PY")}
    env.update(TE_WHEEL_DIR=str(checkout.parent / "no-wheels"))
    script = str(checkout / "scripts" / "install_te.sh")
    skipped = subprocess.run([script], env=env, capture_output=True, text=True, timeout=60)
    required = subprocess.run([script], env={**env, "TE_TESTS_REQUIRED": "1"}, capture_output=True,
                              text=True, timeout=60)
    assert (skipped.returncode, skipped.stdout) == (0, ""), skipped.stderr
    assert (required.returncode, required.stdout) == (1, ""), required.stderr
    assert len(required.stderr.splitlines()) == 1, required.stderr


def test_in_the_tests_the_same_variable_turns_a_skip_into_a_failure(monkeypatch):
    """The te tests read the same variable with the same meaning (set to 1: required)."""
    from mixln_megatron import cpu
    from harness import testing

    if cpu.te_unavailable_reason() is None:
        pytest.skip("TransformerEngine is importable here: no skip to turn into a failure")
    monkeypatch.setenv("TE_TESTS_REQUIRED", "0")
    assert testing.te_missing()  # a reason: the tests skip
    monkeypatch.setenv("TE_TESTS_REQUIRED", "1")
    with pytest.raises(RuntimeError, match="TE_TESTS_REQUIRED=1 requires the TE tests, but: "):
        testing.te_missing()
