"""A Mix-LN MoE model of every layer kind under DP2, EP2, TP2+SP and uneven PP2 (2 ranks, CPU/gloo):
the same figures everywhere, torch_dist checkpoints resharded across EP (saved at EP2, loaded at
EP1, TP2 and PP2), the settings record refusing another layout, and what megatron's MoE cannot
run on the CPU (the alltoall dispatcher). The worker: tests/workers/moe_parallel_worker.py."""

import json
import os

import pytest

from harness.testing import torchrun

from test_layer_kinds_parallel import assert_close as assert_same_figures  # eval and losses within its REL (1e-5)

WORKER = os.path.join(os.path.dirname(__file__), "workers", "moe_parallel_worker.py")
pytestmark = [pytest.mark.mp, pytest.mark.scale, pytest.mark.slow]


def assert_close(got, ref, what):
    assert "error" not in got, (what, got)
    assert_same_figures(got, ref, what)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_parallel")
    torchrun(WORKER, 2, "--workdir", d)
    with open(os.path.join(d, "moe_parallel.json")) as f:
        return json.load(f)


def test_every_kind_on_moe_layers_reshards_across_ep_tp_and_pp(result):
    assert result["kinds"] == ["post", "deepnorm", "sandwich", "pre"]
    assert result["mlps"] == result["pp2_uneven_mlps"] == ["MLP", "MoELayer", "MoELayer", "MoELayer"]
    assert result["ep2_local_experts"] == [None, 2, 2, 2]  # 4 experts over 2 EP ranks
    ref = result["dp2"]
    # saved at DP2 -> EP2; saved again at EP2 -> EP1, TP2+SP, uneven PP2 (stages of 1 and 3 layers)
    for layout in ("ep2", "ep1_from_ep2", "tp2_sp", "pp2_uneven"):
        assert_close(result[layout], ref, layout)
    # experts are stored by global expert index, whatever the EP size that saved them
    assert "decoder.layers.1.mlp.experts.experts.linear_fc1.weight" in result["ep2_keys"]
    assert "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in result["ep2_keys"]


def test_telemetry_counts_every_expert_once_across_ep_ranks(result):
    ref = result["telemetry_ep1"]  # EP1: every rank holds all 4 experts
    assert len(ref) == 4 and all(row[0] > 0 for row in ref)
    for name in ("telemetry_ep2", "telemetry_ep2_distopt"):
        for got, want in zip(result[name], ref):
            for a, b in zip(got, want):
                assert abs(a - b) <= 1e-5 * abs(b), (name, result[name], ref)


def test_another_layout_is_refused_naming_both(result):
    refusal = result["refusal"]
    assert refusal and "post:1,deepnorm:2,sandwich:3,pre:4" in refusal and "P=2 of L=4" in refusal


def test_the_alltoall_dispatcher_does_not_run_on_the_cpu(result):
    # gloo has all_to_all_single, but megatron hands it the split sizes as host numpy arrays only
    # when they come from CUDA tensors; from CPU tensors it passes tensors, which the call refuses.
    # If a release lifts this, the figures must equal the allgather dispatcher's.
    got = result["ep2_alltoall"]
    if "error" in got:
        assert "all_to_all_single" in got["error"]
    else:
        assert_close(got, result["dp2"], "ep2_alltoall")
