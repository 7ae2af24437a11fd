"""Megatron-LM's own argument parser and GPT builder build the Mix-LN model from --spec."""

import json
import os
import sys

from harness.testing import run_python

WORKER = os.path.join(os.path.dirname(__file__), "workers", "megatron_builder_worker.py")


def run_builder(env_extra, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    env.update(env_extra)
    proc = run_python([sys.executable, WORKER, *args], env=env, capture_output=True, text=True, timeout=300)
    return proc


def result(proc):
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):]), proc.stdout


def test_spec_from_megatron_args_builds_post_ln_layers():
    built, out = result(run_builder({"MIXLN_ALPHA": "0.5"}))
    assert built == {"layer_class": "MixLNTransformerLayer", "post_ln": [1, 2], "final_norm": "MixLNNorm"}
    assert "[mixln_megatron] scheme=mixln L=4 P=2 alpha=0.5 (from MIXLN_ALPHA)" in out


def test_bad_environment_fails_the_build():
    proc = run_builder({"MIXLN_ALPHA": "quarter"})
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("[mixln_megatron] ERROR:")]
    assert errors == ["[mixln_megatron] ERROR: alpha from MIXLN_ALPHA must be a number in [0, 1] "
                      "(e.g. 0.25, or 0.0625 for a 32-layer 7B model), got 'quarter'"], proc.stderr[-3000:]
