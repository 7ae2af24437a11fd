"""`benchmarks/te_check.sh --cpu-dry-run` where TransformerEngine imports: the dry run says it
uses real TE modules and its te_modules phase builds the TE Mix-LN block from them (weights by
sharded key from the local block, torch_dist round trip into TE and local blocks). Skipped
without TE (tests/test_gpu_check_dryrun.py runs the stand-in dry run)."""

import glob
import json
import os
import subprocess
import sys

import pytest

from harness import testing as mu

WHY = mu.te_missing()
pytestmark = [pytest.mark.te, pytest.mark.skipif(WHY is not None, reason=str(WHY))]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_te_check_dry_run_builds_real_te_modules(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    for name in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "te_check.sh"), "--cpu-dry-run", "--skip-timing",
                           "--out-dir", str(tmp_path)], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "te_check: dry run with real TransformerEngine 2.20.2 modules" in proc.stdout
    (path,) = glob.glob(os.path.join(tmp_path, "te_check-cpu-dry-run-*.json"))
    with open(path) as f:
        report = json.load(f)
    assert report["dry_run_te_modules"] == "real"
    phase = report["phases"]["te_modules"]
    assert phase["ok"], phase
    assert phase["pre_ln_qkv"] == "TELayerNormColumnParallelLinear"
    assert phase["post_ln_qkv"] == "MixLNPostLNColumnParallelLinear"
    assert phase["mapping"]["copied"] > 0 and not phase["mapping"]["only_in_target"]
    assert phase["te_roundtrip_unequal"] == [] and phase["local_via_te_checkpoint"]["max_abs"] == 0.0
