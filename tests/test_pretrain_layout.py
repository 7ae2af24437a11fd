"""`mixln-megatron pretrain` with a per-layer layout: the entry point's --mixln-layout
builds every kind in Megatron-LM's training loop, saves the layout with the checkpoint, resumes it
from the checkpoint alone, and refuses a resume under another layout in one line, exit 2; for
GPTModel and for HybridModel (--hybrid-layer-pattern, L `*-` blocks)."""

import os

import pytest

from test_pretrain import TINY, finish, start, train

pytestmark = pytest.mark.mp

LAYOUT = "deepnorm:1,sandwich:2-3,post:4"  # boundaries 1|2; every kind but pre, sandwich at rows 0, 1


def _hybrid(flags):
    """TINY as a HybridModel of the same 4 blocks: the depth is the pattern's."""
    i = flags.index("--num-layers")
    return [*flags[:i], *flags[i + 2:], "--hybrid-layer-pattern", "*-" * 4]


MODELS = {"gpt": TINY, "hybrid": _hybrid(TINY)}


def run_args(tmp_path, model, *extra):
    ckpt = str(tmp_path / "ckpt")
    return ["--cpu", *MODELS[model], "--save", ckpt, "--load", ckpt, "--save-interval", "3", "--ckpt-format",
            "torch_dist", *extra]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_layout_trains_saves_resumes_and_refuses_another(tmp_path, model):
    from mixln_megatron import compat

    if model == "hybrid" and not compat.HYBRID_MODEL:
        pytest.skip("HybridModel Mix-LN needs megatron-core 0.19+")
    out = train(run_args(tmp_path, model, "--mixln-layout", LAYOUT, "--exit-interval", "3"))
    assert ("layout=deepnorm:1,sandwich:2-3,post:4 (from --mixln-layout); Post/Pre boundaries: 1|2; "
            "deepnorm alpha=1.68179 beta=0.420448") in out, out[-3000:]
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000003")
    # another layout (sandwich moved): one line, exit 2, no traceback, nothing trained
    refused = finish(start(run_args(tmp_path, model, "--mixln-layout", "deepnorm:1,sandwich:2,post:3-4")),
                     expect_rc=2)
    lines = [line for line in refused.splitlines() if "[mixln_megatron] ERROR:" in line]
    assert len(lines) == 1 and "layout=deepnorm:1,sandwich:2-3,post:4" in lines[0], refused[-3000:]
    assert "Traceback" not in refused and " iteration        4/" not in refused
    # the checkpoint alone: the layout comes from it and training continues
    resumed = train(run_args(tmp_path, model, "--use-checkpoint-args"))
    assert "layout=deepnorm:1,sandwich:2-3,post:4 (from the checkpoint)" in resumed, resumed[-3000:]
    assert " iteration        6/       6 |" in resumed and os.path.isdir(tmp_path / "ckpt" / "iter_0000006")
