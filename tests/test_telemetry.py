"""Per-layer gradient-norm telemetry equals norms computed directly from the same gradients."""

import json
import os

import pytest

from harness.testing import single_process, torchrun

WORKER = os.path.join(os.path.dirname(__file__), "workers", "telemetry_worker.py")
pytestmark = pytest.mark.mp


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("telemetry")
    single_process(WORKER, "--phase", "reference", "--workdir", d)  # one rank: no launcher
    return d


def load(workdir, phase):
    with open(os.path.join(workdir, f"telemetry_{phase}.json")) as f:
        return json.load(f)


def assert_rows_close(logged, direct, what, rel=1e-5):
    assert len(logged) == len(direct) == 4
    for layer, (a_row, b_row) in enumerate(zip(logged, direct), start=1):
        for name, a, b in zip(("layer", "norm1", "norm2"), a_row, b_row):
            assert abs(a - b) <= rel * abs(b), f"{what} layer {layer} {name}: {a} vs direct {b}"


def test_tp1pp1_logged_equals_direct(workdir):
    got = load(workdir, "reference")["tp1pp1"]
    assert_rows_close(got["logged"], got["direct"], "tp1pp1", rel=1e-6)  # fp32 norms
    post = sum(r[0] ** 2 for r in got["direct"][:2]) ** 0.5
    pre = sum(r[0] ** 2 for r in got["direct"][2:]) ** 0.5
    assert abs(got["post_group"] - post) <= 1e-6 * post and abs(got["pre_group"] - pre) <= 1e-6 * pre


def test_interval_and_spike_counts_join_the_stream(workdir):
    got = load(workdir, "reference")
    assert got["interval_steps"] == [2, 4]
    assert got["interval_has_spike"] is True


def test_dp2_tp2_pp2_with_and_without_distributed_optimizer(workdir):
    torchrun(WORKER, 2, "--phase", "world2", "--workdir", workdir)
    direct = load(workdir, "reference")["tp1pp1"]["direct"]
    got = load(workdir, "world2")
    assert_rows_close(got["dp2"]["logged"], direct, "dp2")
    assert_rows_close(got["dp2_distopt"]["logged"], direct, "dp2 distributed optimizer")
    assert_rows_close(got["tp2"]["logged"], direct, "tp2")
    assert_rows_close(got["pp2"]["logged"], direct, "pp2")


# Four processes on two cores: slow. Its 2-rank twin is test_dp2_tp2_pp2_with_and_without_distributed_optimizer
# (DP2 with and without the distributed optimizer, TP2, PP2: each reduction the TP2xPP2 layouts combine).
@pytest.mark.slow
def test_tp2pp2_with_and_without_distributed_optimizer(workdir):
    torchrun(WORKER, 4, "--phase", "world4", "--workdir", workdir)
    direct = load(workdir, "reference")["tp1pp1"]["direct"]
    got = load(workdir, "world4")
    assert_rows_close(got["tp2pp2"]["logged"], direct, "tp2pp2")
    assert_rows_close(got["tp2pp2_distopt"]["logged"], direct, "tp2pp2 distributed optimizer")


def test_interval_from_env():
    from mixln_megatron.model.settings import MixLNSettings

    assert MixLNSettings.from_environ({}).telemetry.interval is None
    got = MixLNSettings.from_environ({"MIXLN_TELEMETRY_INTERVAL": "10", "MIXLN_TELEMETRY_PATH": "/x/t.jsonl"}).telemetry
    assert (got.interval, got.path, got.source("interval")) == (10, "/x/t.jsonl", "MIXLN_TELEMETRY_INTERVAL")
    with pytest.raises(ValueError, match="MIXLN_TELEMETRY_INTERVAL"):
        MixLNSettings.from_environ({"MIXLN_TELEMETRY_INTERVAL": "often"})
