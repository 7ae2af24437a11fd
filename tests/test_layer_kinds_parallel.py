"""Every layer kind under TP2+SP, PP2, PP2xVPP3, uneven PP2 and uneven PP2xVPP2 (2 ranks, CPU/gloo): the same figures as DP2,
torch_dist checkpoints saved at one layout and loaded at another (sandwich norms stacked over the
sandwich layers, reassembled from two pipeline stages), DeepNorm's init through TP2."""

import json
import os

import pytest

from harness.testing import torchrun

WORKER = os.path.join(os.path.dirname(__file__), "workers", "layer_kinds_worker.py")
pytestmark = pytest.mark.mp
KINDS = ["deepnorm", "sandwich", "post", "sandwich", "pre", "pre"]
REL = 1e-5


def assert_close(got, ref, what):
    assert abs(got["eval"] - ref["eval"]) <= REL * abs(ref["eval"]), (what, got["eval"], ref["eval"])
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= REL * abs(b), (what, got["losses"], ref["losses"])


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    d = tmp_path_factory.mktemp("layer_kinds")
    torchrun(WORKER, 2, "--workdir", d)
    with open(os.path.join(d, "layer_kinds.json")) as f:
        return json.load(f)


def test_every_kind_saves_and_reshards_across_tp_and_pp(result):
    assert result["kinds"] == result["pp2_kinds"] == result["pp2_uneven_kinds"] == result["pp2_vpp3_kinds"] == KINDS
    assert result["pp2_uneven_vpp2_kinds"] == KINDS
    assert result["pp2_uneven_vpp2_stage_layers"] == [[[1], [5]], [[2, 3, 4], [6]]]  # rank -> chunk -> layers
    ref = result["dp2"]
    # saved at DP2 -> TP2+SP; saved again at TP2 -> PP2, PP2xVPP3 and uneven PP2 (stages of 2 and 4 layers)
    for layout in ("tp2_sp", "pp2", "pp2_uneven", "pp2_vpp3", "pp2_uneven_vpp2"):
        assert_close(result[layout], ref, layout)
    assert result["tp2_sp_norms_identical"] is True
    shapes = result["shapes"]
    assert shapes["decoder.layers.mixln_norm_a.weight"] == shapes["decoder.layers.mixln_norm_b.weight"] == [6, 64]
    assert shapes["decoder.layers.mixln_norm_c.weight"] == shapes["decoder.layers.mixln_norm_d.weight"] == [2, 64]


def test_deepnorm_init_through_tp2_equals_tp1(result):
    import math

    assert result["qkv_tp2_equals_tp1"] is True  # CPU init: the value rows found on each TP shard
    for shard in result["gpu_style_tp2_value_ratios"]:  # TP-sharded init: beta within sampling error
        assert shard["kind"] == "deepnorm"
        q, v = shard["numel"]
        assert abs(shard["ratio"] / shard["beta"] - 1) <= 6 * math.sqrt(1 / (2 * q) + 1 / (2 * v)), shard
