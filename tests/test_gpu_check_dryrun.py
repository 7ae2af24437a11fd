"""benchmarks/gpu_check.sh and te_check.sh with --cpu-dry-run: the GPU checks' own code (parity
against the CPU reference process, the interleaved timing loop, the spike-scaler timing, the TE
check's weight transfer by sharded keys and torch_dist round trip, JSON writing, the RESULT line)
on the CPU with tiny shapes, so that the scripts still run when a GPU machine is next at hand."""

import glob
import json
import math
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks")
WHEELS = glob.glob(os.path.join(BENCH, "wheels", "megatron_core-0.19.*.whl"))


def _run(script, args, env_extra=None, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    # One OpenMP thread: beside the suite's other processes on a small machine, torch's spinning
    # threads make each tiny CPU step several times slower (the figures are noise here anyway).
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", **(env_extra or {}))
    for name in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    return subprocess.run(["bash", os.path.join(BENCH, script), *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _result_line(stdout, pattern):
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stdout[-3000:]
    match = re.fullmatch(pattern, lines[-1])
    assert match, lines[-1]
    return match


def _one_json(folder, prefix):
    files = glob.glob(os.path.join(folder, f"{prefix}-cpu-dry-run-*.json"))
    assert len(files) == 1, files
    with open(files[0]) as f:
        return json.load(f)


def test_gpu_check_cpu_dry_run(tmp_path):
    # Through the carried wheel when it is in the checkout: the path the GPU machine takes.
    env = {"MIXLN_FORCE_WHEEL": "1"} if WHEELS else {}
    proc = _run("gpu_check.sh", ["--cpu-dry-run", "--out-dir", str(tmp_path)], env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    if WHEELS:
        assert "installing megatron_core-0.19" in proc.stdout, proc.stdout[:2000]
    # the dry run's reference is forked from the check after its imports (the GPU run starts a
    # fresh interpreter: test_gpu_run_starts_the_reference_in_a_fresh_interpreter)
    assert re.search(r"parity: CPU reference done .* \(separate process forked after the imports", proc.stdout), \
        proc.stdout[-3000:]
    m = _result_line(proc.stdout, r"RESULT step_ratio=(\S+) mem_ratio=(\S+) gpu_vs_cpu_max_abs=(\S+)")
    step_ratio, mem_ratio, max_abs = m.groups()
    assert math.isfinite(float(step_ratio)) and float(step_ratio) > 0
    assert mem_ratio == "nan"  # no allocator statistics on the CPU
    assert float(max_abs) < 1e-5  # CPU against the CPU reference process

    report = _one_json(tmp_path, "gpu_check")
    assert report["mode"] == "cpu-dry-run"
    assert report["versions"]["megatron_core"].startswith("0.19")
    if WHEELS:
        assert "mixln_mcore." in report["versions"]["megatron_core_path"]
    parity = report["phases"]["parity"]
    assert parity["ok"] and parity["fp32"]["ok"] and parity["bf16"]["ok"]
    assert parity["fp32"]["vs_cpu_fp32"]["param_grads"]["count"] > 0
    timing = report["phases"]["timing"]
    assert set(timing["variants"]) == {"stock_local", "mixln_local_p0", "mixln_local_p2", "mixln_local_p4",
                                       "mixln_local_deepnorm_p2", "mixln_local_sandwich_all"}
    for entry in timing["variants"].values():
        assert entry["step_ms"]["n"] == timing["repeats"]
    assert timing["variants"]["mixln_local_sandwich_all"]["layout"] == "sandwich:*"
    fig = timing["figures"]
    # the comparison arms beside Mix-LN: their step time against Mix-LN P = 0 (Pre-LN)
    assert {a["layout"] for a in fig["arms"].values()} == {"deepnorm:1-2,pre:*", "sandwich:*"}
    assert all(math.isfinite(a["step_ratio_vs_p0"]) and a["step_ratio_vs_p0"] > 0 for a in fig["arms"].values())
    assert fig["step_ratio_p2_vs_stock"] == pytest.approx(float(step_ratio), rel=1e-3)
    assert {"ms", "pre_ln_layer_ms"} <= set(fig["per_post_ln_layer"])
    assert fig["extrapolated_7b"]["layers"] == 32 and fig["extrapolated_7b"]["post_ln_layers"] == 2
    spike = report["phases"]["spike"]
    assert spike["status"] == "measured", spike
    assert spike["targets"] and spike["hook_ms"]["n"] == timing["repeats"]
    assert report["result"]["parity_ok"] is True


def test_te_check_cpu_dry_run(tmp_path):
    proc = _run("te_check.sh", ["--cpu-dry-run", "--out-dir", str(tmp_path)])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    m = _result_line(proc.stdout,
                     r"RESULT te_step_ratio=(\S+) te_mem_ratio=(\S+) te_vs_local_max_abs=(\S+) fp8=(\S+)"
                     r" postln_7b_pct=(\S+)")
    assert math.isfinite(float(m.group(1)))
    assert float(m.group(3)) < 1e-5
    assert m.group(4) == "skipped"
    assert math.isfinite(float(m.group(5)))  # the Post-LN layers' cost at 7B (noise on a CPU)

    report = _one_json(tmp_path, "te_check")
    parity = report["phases"]["parity"]
    assert parity["ok"], parity
    for name in ("fp32", "bf16"):
        mapping = parity[name]["mapping"]
        assert mapping["copied"] > 0 and not mapping["only_in_source"] and not mapping["only_in_target"]
        assert mapping["target_params_without_key"] == 0
    ckpt = report["phases"]["checkpoint"]
    assert ckpt["ok"] and ckpt["same_backend"]["output"]["max_abs"] == 0.0, ckpt
    assert report["te_deterministic"]
    assert report["phases"]["fp8"]["status"] == "skipped"
    assert set(report["phases"]["timing"]["variants"]) == {
        "stock_local", "mixln_local_p0", "mixln_local_p2", "mixln_local_p4"}


def _import_gpu_check():
    sys.path.insert(0, BENCH)
    try:
        import gpu_check
    finally:
        sys.path.remove(BENCH)
    return gpu_check


REFERENCE_WORKER = os.path.join(REPO, "tests", "workers", "gpu_check_reference_worker.py")


def _reference_phase(phase, tmp_path):
    """A phase of the reference worker in a fresh interpreter, as the GPU check runs them."""
    from harness.testing import run_python

    proc = run_python([sys.executable, REFERENCE_WORKER, phase, str(tmp_path)], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / f"{phase}.json") as f:
        return json.load(f)


def test_both_reference_processes_run_the_real_reference_and_agree(tmp_path):
    """The GPU run's reference (a fresh interpreter, run_cpu_reference) and the dry run's (forked
    after the imports, ForkedReference) run the real reference code on the CPU with the same job:
    the same weights and fp32 / bf16 results, bit for bit, though the process carries torchrun's
    variables (the reference must not join a process group through them). The forked one's
    folder is removed once read."""
    got = _reference_phase("agree", tmp_path)
    assert got["fresh_keys"] == ["results", "state"] and got["result_kinds"] == ["bf16", "fp32"], got
    assert got["grads"] > 0, "the reference computed no parameter gradient"
    assert got["difference"] is None, got["difference"]
    assert not got["forked_folder_left"]


def test_a_failing_reference_reports_its_exit_status_and_output(tmp_path):
    """A job the real reference refuses (more Post-LN layers than the model has) fails both
    reference processes with the child's exit status and its own words in the error."""
    got = _reference_phase("refuse", tmp_path)
    failed = r"(?s)the CPU reference process failed \(exit [1-9]\d*\):.*MixLNConfigError"
    assert re.search(failed, got.get("fresh", "")), got
    assert re.search(failed, got.get("forked", "")), got
    assert not got["forked_folder_left"]


def test_te_check_skips_cleanly_without_te(tmp_path):
    pytest.importorskip("torch")
    if _has_te():
        pytest.skip("TransformerEngine is installed here; the real check applies")
    proc = _run("te_check.sh", ["--out-dir", str(tmp_path)], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^SKIP te_check: ", proc.stdout, re.M), proc.stdout
    assert not glob.glob(os.path.join(tmp_path, "*.json"))


def test_gpu_check_refuses_to_run_on_the_cpu_without_the_dry_run_flag(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    proc = _run("gpu_check.sh", ["--out-dir", str(tmp_path)], timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--cpu-dry-run" in proc.stderr


def test_preflight_names_every_missing_package(capsys):
    gpu_check = _import_gpu_check()
    with pytest.raises(SystemExit) as exc:
        gpu_check.preflight(False, extra=(("mixln_no_such_pkg_a", "why a"), ("mixln_no_such_pkg_b", "why b")))
    assert exc.value.code == 3
    err = capsys.readouterr().err
    assert "MISSING: mixln_no_such_pkg_a, mixln_no_such_pkg_b" in err
    assert "why b" in err


def _has_te() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False
