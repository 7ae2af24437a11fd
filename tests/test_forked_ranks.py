"""The test suite's launcher (tests/harness/forked_ranks.py): python and single-node torchrun
commands run as children of one preloaded fork server, and behave as the commands would."""

import os
import signal
import sys
import time

import pytest

from harness import forked_ranks

PY = sys.executable
PROBE = """
import atexit, os, sys
atexit.register(lambda: print("atexit ran", flush=True))
print("argv", sys.argv[1:], "cwd", os.getcwd(), "torch_preloaded", "torch" in sys.modules,
      "rank", os.environ.get("RANK"), "flag", os.environ.get("PROBE_FLAG"))
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
"""
ALL_REDUCE = """
import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item():g} args {sys.argv[1:]}", flush=True)
if os.environ.get("FAIL_RANK") == str(dist.get_rank()):
    sys.exit(3)
if os.environ.get("FAIL_RANK"):
    dist.barrier()  # the failed rank never arrives: only the launcher's SIGTERM ends this one
dist.destroy_process_group()
"""


def test_a_plain_command_runs_as_python_would(tmp_path):
    proc = forked_ranks.run([PY, "-c", PROBE, "a", "b"], cwd=tmp_path, env=dict(os.environ, PROBE_FLAG="x"),
                            timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"argv ['a', 'b'] cwd {tmp_path} torch_preloaded True rank None flag x" in proc.stdout
    assert "atexit ran" in proc.stdout
    failed = forked_ranks.run([PY, "-c", PROBE], env=dict(os.environ, PROBE_EXIT="7"), timeout=300)
    assert failed.returncode == 7


def test_a_script_and_a_module_run_with_their_argv(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc = forked_ranks.run([PY, str(script), "--x", "1"], timeout=300)
    assert proc.returncode == 0 and "argv ['--x', '1']" in proc.stdout, proc.stderr
    module = forked_ranks.run([PY, "-m", "mixln_megatron.cli", "placement", "--num-layers", "8", "--mixln-alpha", "0.25"],
                              timeout=300)
    assert module.returncode == 0, module.stderr
    assert "Post-LN" in module.stdout or "post" in module.stdout.lower(), module.stdout


def test_torchrun_ranks_form_one_group(tmp_path):
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), "z"]
    proc = forked_ranks.run(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 of 2 sum 3 args ['z']" in proc.stdout and "rank 1 of 2 sum 3 args ['z']" in proc.stdout


def test_a_failing_rank_ends_the_others_and_the_job_fails_as_torchrun_does(tmp_path):
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    started = forked_ranks.start(cmd, env=dict(os.environ, FAIL_RANK="1"))  # rank 0 would wait forever
    stdout, stderr = started.communicate(timeout=600)
    assert started.returncode == 1, stderr[-3000:]
    assert "rank 1 of 2 sum 3" in stdout
    # what torchrun's summary would name: rank 1's 3 as the root cause, rank 0 ended by its SIGTERM
    assert started.first_failure == 3 and started.exit_statuses == [-signal.SIGTERM, 3], started.exit_statuses


def test_a_signal_reaches_a_started_command(tmp_path):
    marker = tmp_path / "up"
    code = f"import pathlib, time\npathlib.Path({str(marker)!r}).touch()\ntime.sleep(3600)\n"
    started = forked_ranks.start([PY, "-c", code])
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert started.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    started.send_signal(signal.SIGTERM)
    assert started.wait(timeout=300) == -signal.SIGTERM


def _with_pythonpath(entry):
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(entry), os.environ.get("PYTHONPATH")])))


@pytest.mark.parametrize("shadow", ["megatron/core/__init__.py", "torch.py", "sitecustomize.py"])
def test_what_would_import_otherwise_runs_in_a_fresh_interpreter(tmp_path, shadow):
    """A PYTHONPATH entry holding a package the server imported (another megatron tree), or a
    module a fresh interpreter runs at startup."""
    other = tmp_path / "elsewhere"
    (other / shadow).parent.mkdir(parents=True)
    (other / shadow).write_text("")
    env = _with_pythonpath(other)
    assert forked_ranks.start([PY, "-c", PROBE], env=env) is None
    if shadow.startswith("megatron"):
        proc = forked_ranks.run([PY, "-c", PROBE], env=env, timeout=300)
        assert proc.returncode == 0 and "torch_preloaded False" in proc.stdout, proc.stderr
    assert forked_ranks.start(["bash", "-c", "true"]) is None


def test_a_pythonpath_entry_of_other_names_is_forked_and_importable(tmp_path):
    other = tmp_path / "test_modules"
    other.mkdir()
    (other / "mixln_forked_probe_module.py").write_text("WHERE = __file__\n")
    code = "import mixln_forked_probe_module as m\nprint('from', m.WHERE)\n" + PROBE  # PROBE exits
    proc = forked_ranks.run([PY, "-c", code], env=_with_pythonpath(other), timeout=300)
    assert proc.returncode == 0 and "torch_preloaded True" in proc.stdout, proc.stderr
    assert f"from {other / 'mixln_forked_probe_module.py'}" in proc.stdout


@pytest.mark.parametrize("command", [
    [PY, "-m", "torch.distributed.run", "--nnodes=2", "x.py"],
    [PY, "-m", "torch.distributed.run", "--standalone", "x.py"],
    [PY, "-m", "torch.distributed.run", "--nproc_per_node=2", "-c", "pass"],
    [PY, "-X", "importtime", "x.py"],
])
def test_commands_it_cannot_stand_in_for_are_left_alone(command):
    assert forked_ranks._parse(command) is None


def test_the_job_s_pythonwarnings_decides_as_in_a_fresh_interpreter():
    code = "import warnings\nwarnings.warn('probe warning', UserWarning)\n"
    shown = forked_ranks.run([PY, "-c", code], env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"},
                             timeout=300)
    hidden = forked_ranks.run([PY, "-c", code], env=dict(os.environ, PYTHONWARNINGS="ignore"), timeout=300)
    assert "probe warning" in shown.stderr and hidden.returncode == 0
    assert "probe warning" not in hidden.stderr, hidden.stderr
