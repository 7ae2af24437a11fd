"""A Mix-LN checkpoint must not load into a stock model; P = 0 stays interchangeable with stock.

Each step is a process that saves or loads through Megatron-LM's own checkpointing
(megatron.training.checkpointing, default --dist-ckpt-strictness), with megatron's stock local
spec or `--spec mixln_megatron.spec mixln_local_layer_spec` (tests/workers/ckpt_keys_worker.py:
one launch, whose steps are processes forked from it once it has imported megatron.training).
"""

import json
import os
import sys

from harness.testing import start_python

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "ckpt_keys_worker.py")


def _run(*plan, timeout=300):
    """{step number: [its results, one per action]} of the worker's plan (see its docstring)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = start_python([sys.executable, WORKER, *map(str, plan)], env=env, merge_stderr=True)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-6000:]
    steps = {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            steps.setdefault(result.pop("step"), []).append(result)
    return steps


def test_mixln_checkpoint_refused_by_stock_model_p0_interchangeable(tmp_path):
    p2, p0, stock = tmp_path / "p2", tmp_path / "p0", tmp_path / "stock"
    steps = _run(
        "mixln", "MIXLN_POST_LN_LAYERS=2", "save", p2, "--and", "mixln", "MIXLN_ALPHA=0", "save", p0,
        "--then", "stock", "load", p0, "load", p2, "save", stock,
        "--then", "mixln", "MIXLN_ALPHA=0", "load", stock,
    )
    assert sorted(steps) == [0, 1, 2, 3]
    (saved_p2,), (saved_p0,) = steps[0], steps[1]
    assert saved_p2["post_ln"] == [1, 2] and saved_p0["post_ln"] == []

    # The stock spec: a P = 0 checkpoint loads, a P = 2 one fails at load (before: silently loaded).
    load_p0, load_p2, saved_stock = steps[2]
    assert load_p0["layer_class"] == "TransformerLayer"
    assert "error" not in load_p0 and load_p0["sums"] == saved_p0["sums"]
    error = load_p2.get("error", "")
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight from model not in state dict" in error
    # megatron lists the checkpoint's keys: the Mix-LN ones say what the checkpoint is
    assert "decoder.layers.mixln_norm_a.weight" in error and "decoder.layers.mixln_settings" in error

    # And the other way: a stock checkpoint loads into the Mix-LN spec with P = 0.
    (load_stock,) = steps[3]
    assert "error" not in load_stock and load_stock["sums"] == saved_stock["sums"]
