"""`mixln-megatron pretrain` with a per-layer layout (issue 29): the entry point's --mixln-layout
builds every kind in Megatron-LM's training loop, saves the layout with the checkpoint, resumes it
from the checkpoint alone, and refuses a resume under another layout in one line, exit 2."""

import os

import pytest

from test_pretrain import TINY, finish, start, train

pytestmark = pytest.mark.mp

LAYOUT = "deepnorm:1,sandwich:2-3,post:4"  # boundaries 1|2; every kind but pre, sandwich at rows 0, 1


def run_args(tmp_path, *extra):
    ckpt = str(tmp_path / "ckpt")
    return ["--cpu", *TINY, "--save", ckpt, "--load", ckpt, "--save-interval", "3", "--ckpt-format", "torch_dist",
            *extra]


def test_a_layout_trains_saves_resumes_and_refuses_another(tmp_path):
    out = train(run_args(tmp_path, "--mixln-layout", LAYOUT, "--exit-interval", "3"))
    assert ("layout=deepnorm:1,sandwich:2-3,post:4 (from --mixln-layout); Post/Pre boundaries: 1|2; "
            "deepnorm alpha=1.68179 beta=0.420448") in out, out[-3000:]
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000003")
    # another layout (sandwich moved): one line, exit 2, no traceback, nothing trained
    refused = finish(start(run_args(tmp_path, "--mixln-layout", "deepnorm:1,sandwich:2,post:3-4")), expect_rc=2)
    lines = [line for line in refused.splitlines() if "[mixln_megatron] ERROR:" in line]
    assert len(lines) == 1 and "layout=deepnorm:1,sandwich:2-3,post:4" in lines[0], refused[-3000:]
    assert "Traceback" not in refused and " iteration        4/" not in refused
    # the checkpoint alone: the layout comes from it and training continues
    resumed = train(run_args(tmp_path, "--use-checkpoint-args"))
    assert "layout=deepnorm:1,sandwich:2-3,post:4 (from the checkpoint)" in resumed, resumed[-3000:]
    assert " iteration        6/       6 |" in resumed and os.path.isdir(tmp_path / "ckpt" / "iter_0000006")
