"""The training hooks on shapes the small tests never build.

  * Fewer query groups than TP ranks (TP2, one group): megatron deep-copies the model config for
    each attention module. Every hook (spike scaler, telemetry, LNS, a layout of post / sandwich
    / pre, and deepnorm's refusal there) through the entry point and through the stock `--spec`
    object; the copies drive the same scaler and telemetry.
  * Several distributed-optimizer instances (DP2, k = 2 against k = 1, the same batches): the
    telemetry's norms and the spike scaler's statistics and state are those of k = 1.
  * Full-iteration CUDA graphs capture the hooks: refused at start-up in one line.
Workers: tests/workers/scale_hooks_worker.py; entry-point runs as in test_pretrain.py.
"""

import json
import os
import re

import pytest

from harness.testing import torchrun
from test_pretrain import TINY, finish, start

WORKER = os.path.join(os.path.dirname(__file__), "workers", "scale_hooks_worker.py")
pytestmark = [pytest.mark.scale, pytest.mark.mp]

ONE_GROUP_TP2 = ["--tensor-model-parallel-size", "2", "--group-query-attention", "--num-query-groups", "1",
                 "--train-iters", "2", "--global-batch-size", "2", "--eval-iters", "0", "--eval-interval", "1000"]
# Every hook at once: a layout of three kinds, LNS on its Pre-LN kinds, the scaler on every block, telemetry.
EVERY_HOOK_ENV = {"MIXLN_LAYOUT": "post:1,sandwich:2,pre:3-4", "MIXLN_SCHEME": "mixln+lns",
                  "MIXLN_SPIKE_SCALER": "1", "MIXLN_SPIKE_TARGETS": "all", "MIXLN_TELEMETRY_INTERVAL": "1"}
EVERY_HOOK_FLAGS = ["--mixln-layout", "post:1,sandwich:2,pre:3-4", "--mixln-scheme", "mixln+lns",
                    "--mixln-spike-scaler", "--mixln-spike-targets", "all", "--mixln-telemetry-interval", "1"]
ERROR_LINE = "[mixln_megatron] ERROR:"


def _result(workdir, phase):
    with open(os.path.join(workdir, f"scale_hooks_{phase}.json")) as f:
        return json.load(f)


# ------------------------------------------------------------------ query groups < TP
@pytest.mark.compat
def test_stock_spec_one_query_group_at_tp2_trains_with_every_hook(tmp_path):
    env = {**EVERY_HOOK_ENV, "MIXLN_TELEMETRY_PATH": str(tmp_path / "telemetry.jsonl")}
    torchrun(WORKER, 2, "--phase", "stock_spec", "--workdir", tmp_path, env=env)
    got = _result(tmp_path, "stock_spec")
    assert got["kinds"] == ["post", "sandwich", "pre", "pre"]
    assert got["norm_output_scale"][1:] == pytest.approx([2 ** -0.5, 3 ** -0.5, 0.5])  # LNS 1/sqrt(l)
    assert all(loss == loss and 0 < loss < 10 for loss in got["losses"]), got["losses"]
    assert got["config_copied"], "megatron no longer copies the config here: the test tests nothing"
    assert got["copies_share_scaler"] and got["copies_share_telemetry"]
    assert got["copies_build_callbacks"] == ["SpikeScaler:same"]
    assert got["telemetry_rows"] == [4, 4] and got["spike_committed_steps"] == 2
    assert len(got["spike_targets"]) == 10  # two norms per block, four in the sandwich block


@pytest.mark.compat
@pytest.mark.slow
def test_entry_point_one_query_group_at_tp2_trains_with_every_hook(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    out = finish(start(["--cpu", *TINY, *ONE_GROUP_TP2, *EVERY_HOOK_FLAGS, "--mixln-telemetry-path", str(path)],
                       nproc=2))
    assert "gradient-spike scaler on the norms of global layers 1, 2, 3, 4" in out
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["layer_kinds"] == ["post", "sandwich", "pre", "pre"]
    assert all(v > 0 for v in records[-1]["layer_grad_norm"])
    # each record is written in the finalize hook, before that step's optimizer commits the scaler
    assert [r["spike"]["committed_steps"] for r in records] == [0, 1]


@pytest.mark.compat
def test_stock_spec_deepnorm_with_one_query_group_at_tp2_is_one_line(tmp_path):
    """The stock --spec path: refused at the spec edge (before megatron builds a layer), one line,
    a Refusal (exit 2) on every rank, no traceback."""
    proc = torchrun(WORKER, 2, "--phase", "stock_spec_deepnorm", "--workdir", tmp_path,
                    env={"MIXLN_LAYOUT": "deepnorm:1,pre:2-"})
    assert _result(tmp_path, "stock_spec_deepnorm") == {"exit": 2, "refusal": "Refusal"}
    out = proc.stdout + proc.stderr
    lines = [line for line in out.splitlines() if ERROR_LINE in line]
    assert len(lines) == 1 and "query groups" in lines[0], out[-4000:]
    assert "Traceback" not in out, out[-4000:]


@pytest.mark.compat
def test_entry_point_deepnorm_with_one_query_group_at_tp2_is_one_line(tmp_path):
    """DeepNorm's init needs whole query groups per TP shard: refused where the layer is built,
    which the entry point's provider turns into one line and exit 2 (no traceback)."""
    proc = start(["--cpu", *TINY, *ONE_GROUP_TP2, "--mixln-layout", "deepnorm:1,pre:2-", "--mixln-spike-scaler",
                  "--mixln-telemetry-interval", "1"], nproc=2)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode != 0, out[-4000:]
    lines = {line for line in out.splitlines() if ERROR_LINE in line}
    assert len(lines) == 1 and "query groups" in lines.pop(), out[-4000:]
    # a failed rank fails the launch (torchrun: 1, with each rank's exit 2 in its report, which
    # the tests' forked launcher does not print); no traceback runs through the project's code
    assert proc.returncode in (1, 2), (proc.returncode, out[-4000:])
    if "exitcode" in out:
        assert re.search(r"exitcode\s*:\s*2\b", out), out[-4000:]
    assert not re.search(r'File ".*mixln_megatron', out), out[-4000:]


# ------------------------------------------------------------------ optimizer instances
def test_two_optimizer_instances_log_and_scale_as_one(tmp_path):
    torchrun(WORKER, 2, "--phase", "instances", "--workdir", tmp_path)
    got = _result(tmp_path, "instances")
    one, two = got["k1"], got["k2"]
    assert len(one["telemetry"]) == len(two["telemetry"]) == 3
    for step, (a, b) in enumerate(zip(one["telemetry"], two["telemetry"]), start=1):
        for column, (row_a, row_b) in enumerate(zip(a, b)):
            assert all(x > 0 for x in row_a), (step, column, row_a)
            assert row_b == pytest.approx(row_a, rel=1e-6), f"step {step} column {column}: k=2 {row_b} vs k=1 {row_a}"
    assert one["spike_totals"]["scaled"] > 0, "no element was scaled: the comparison would hold trivially"
    assert two["spike_totals"] == one["spike_totals"]
    assert two["spike_step"] == one["spike_step"]
    flat = lambda rows: [x for row in rows for x in row]  # noqa: E731
    assert flat(two["spike_momentum"]) == pytest.approx(flat(one["spike_momentum"]), rel=1e-6)


# ------------------------------------------------------------------ full-iteration CUDA graphs
@pytest.mark.compat
def test_hooks_under_a_full_iteration_cuda_graph_are_refused_at_start_up_in_one_line():
    from mixln_megatron import compat

    graph = ["--cuda-graph-impl", "full_iteration"] if compat.RELEASE >= (0, 18) else \
        ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]
    for hook in (["--mixln-spike-scaler"], ["--mixln-telemetry-interval", "5"]):
        proc = start(["--cpu", *TINY, "--mixln-post-ln-layers", "1", *hook, *graph,
                      "--no-check-for-nan-in-loss-and-grad"])
        out = finish(proc, expect_rc=2)
        errors = [line for line in out.splitlines() if "error:" in line.lower()]
        assert len(errors) == 1 and "cannot run under" in errors[0] and hook[0] in errors[0], out[-3000:]
        assert "full_iteration" in errors[0] and "Traceback" not in out
    # per-layer graphs do not capture the hooks: nothing is refused
    from mixln_megatron.training.hooks import check_no_full_iteration_graph
    from types import SimpleNamespace

    check_no_full_iteration_graph(SimpleNamespace(cuda_graph_impl="local", cuda_graph_scope=["attn"]), True, True)
    check_no_full_iteration_graph(SimpleNamespace(cuda_graph_impl="full_iteration"), False, False)
