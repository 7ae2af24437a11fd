"""Mix-LN under every parallel layout, with real torch.distributed (gloo) and megatron-core.

Identical weights come from one checkpoint of a model trained a few steps; each layout loads it
and must reproduce TP1PP1's eval loss, three training losses and gradient norms within 1e-5
relative. One launch per world size (see workers/parallel_worker.py): the one-process reference as
a plain process, the others under torchrun.
"""

import json
import os
import re

import pytest

from harness.testing import single_process, torchrun

WORKER = os.path.join(os.path.dirname(__file__), "workers", "parallel_worker.py")
pytestmark = pytest.mark.mp
REL = 1e-5


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("parallel")
    single_process(WORKER, "--phase", "reference", "--workdir", d)
    return d


def load(workdir, phase):
    with open(os.path.join(workdir, f"{phase}.json")) as f:
        return json.load(f)


def assert_close(got, ref, what):
    pairs = [("eval", got["eval"], ref["eval"])]
    pairs += [(f"loss[{i}]", a, b) for i, (a, b) in enumerate(zip(got["losses"], ref["losses"]))]
    pairs += [(f"grad_norm[{i}]", a, b) for i, (a, b) in enumerate(zip(got["grad_norms"], ref["grad_norms"]))]
    assert len(got["losses"]) == len(ref["losses"]) == 3
    for name, a, b in pairs:
        assert abs(a - b) <= REL * abs(b), f"{what} {name}: {a} vs TP1PP1 {b}"


POST_LN_4 = [[True, True, False, False], [1, 2, 3, 4]]
POST_LN_6 = [[True, True, True, False, False, False], [1, 2, 3, 4, 5, 6]]


@pytest.mark.compat
def test_reference_reruns_and_distributed_optimizer(workdir):
    ref = load(workdir, "reference")
    assert ref["tp1pp1_rerun"] == ref["tp1pp1"]  # bitwise identical within one layout
    assert_close(ref["tp1pp1_distopt"], ref["tp1pp1"], "distributed optimizer")
    assert ref["kinds_pp1"] == POST_LN_4


@pytest.mark.compat
def test_settings_mismatch_is_a_clear_error(workdir):
    ref = load(workdir, "reference")
    for key in ("mismatch_metadata", "mismatch_sharded"):
        assert "checkpoint has scheme=mixln P=2 of L=4" in ref[key], ref[key]
        assert "model has scheme=mixln P=1 of L=4" in ref[key], ref[key]
    # a P > 0 model asks for its norms under the Mix-LN keys, which a stock checkpoint lacks
    assert re.search(r"decoder\.layers\.mixln_norm_[ab]\.weight from model not in state dict", ref["stock_into_p2"])
    assert "checkpoint has scheme=mixln+lns P=1" in ref["lns_scheme_mismatch"], ref["lns_scheme_mismatch"]


def test_alpha_zero_is_interchangeable_with_the_stock_spec(workdir):
    ref = load(workdir, "reference")
    assert abs(ref["stock_into_p0_eval"] - ref["stock_eval"]) <= 1e-6 * abs(ref["stock_eval"])
    assert abs(ref["p0_into_stock_eval"] - ref["stock_eval"]) <= 1e-6 * abs(ref["stock_eval"])


@pytest.mark.compat
def test_two_process_layouts_match_tp1pp1(workdir):
    torchrun(WORKER, 2, "--phase", "world2", "--workdir", workdir)
    ref = load(workdir, "reference")["tp1pp1"]
    got = load(workdir, "world2")
    for layout in ("tp2", "tp2_sp", "pp2", "pp2_vpp2", "dp2_distopt", "tp2_distopt"):
        assert_close(got[layout], ref, layout)
    assert got["tp2_rerun"] == got["tp2"]
    assert got["tp2_sp_norms_identical"] is True
    assert got["kinds_pp2"] == got["kinds_pp2_vpp2"] == POST_LN_4
    assert got["kinds_pp2_uneven"] == POST_LN_6
    lns_ref = load(workdir, "reference")["lns_tp1pp1"]
    assert_close(got["lns_tp2_sp"], lns_ref, "mixln+lns tp2+sp")
    assert_close(got["lns_pp2"], lns_ref, "mixln+lns pp2")
    # Saved at TP2, loaded at PP2 (TP and PP both change): the base checkpoint's TP1PP1 eval loss.
    assert abs(got["tp2_saved_pp2_eval"] - ref["eval"]) <= REL * abs(ref["eval"])


# Four processes on two cores: slow. Its 2-rank twin is test_two_process_layouts_match_tp1pp1
# (TP2, PP2, PP2xVPP2 and uneven PP2 stages against TP1PP1, and a TP2 save resharded to PP2); this
# adds TP and PP together, four stages and a TP2xPP2 save read at TP1. `make test-compat` runs it.
@pytest.mark.slow
@pytest.mark.compat
def test_four_process_layouts_and_resharding(workdir):
    torchrun(WORKER, 4, "--phase", "world4", "--workdir", workdir)
    ref = load(workdir, "reference")["tp1pp1"]
    got = load(workdir, "world4")
    assert_close(got["tp2pp2"], ref, "tp2pp2")
    assert got["kinds_pp4"] == POST_LN_4
    assert got["kinds_pp4_uneven"] == POST_LN_6
    # Saved at TP2xPP2, loaded at TP1PP1: the same eval loss as the base checkpoint at TP1PP1.
    assert abs(got["tp2pp2_saved_tp1_eval"] - ref["eval"]) <= REL * abs(ref["eval"])
