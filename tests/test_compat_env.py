"""`scripts/compat_env.sh main` without the Megatron-LM main snapshot says why in one line.

The script finds the snapshot beside the checkout (../shared/upstream/megatron-lm-main-*.tar.gz,
relative to the checkout it lives in) or at $MEGATRON_MAIN_TARBALL. A copy of the script in a
checkout with no shared folder beside it stands for a clone outside this CI.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def lone_checkout(tmp_path):
    (tmp_path / "clone" / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "compat_env.sh", tmp_path / "clone" / "scripts" / "compat_env.sh")
    return tmp_path / "clone"


def _run(checkout, **env):
    base = {k: v for k, v in os.environ.items() if k != "MEGATRON_MAIN_TARBALL"}
    base.update(PY=sys.executable, HOME=str(checkout.parent), **env)
    return subprocess.run(["bash", str(checkout / "scripts" / "compat_env.sh"), "main"], cwd=str(checkout.parent),
                          env=base, capture_output=True, text=True, timeout=120)


def test_no_snapshot_and_no_variable_is_one_line_naming_what_to_set(lone_checkout):
    proc = _run(lone_checkout)
    assert proc.returncode == 1 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    (line,) = proc.stderr.splitlines()
    assert f"no Megatron-LM main snapshot in {lone_checkout.parent / 'shared' / 'upstream'}/" in line, line
    assert "set it to a megatron-lm-main-<commit>.tar.gz" in line and "MEGATRON_MAIN_TARBALL" in line, line
    assert not (lone_checkout / ".compat").exists()


def test_a_variable_naming_a_missing_file_is_one_line_naming_it(lone_checkout):
    missing = lone_checkout.parent / "megatron-lm-main-0000000.tar.gz"
    proc = _run(lone_checkout, MEGATRON_MAIN_TARBALL=str(missing))
    assert proc.returncode == 1 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"compat_env.sh: MEGATRON_MAIN_TARBALL={missing} is not a file; set it to "), line
