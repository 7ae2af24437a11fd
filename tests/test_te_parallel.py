"""The Mix-LN TE spec with real TransformerEngine modules at parallel layouts (torchrun, 2 gloo
processes, tests/workers/te_worker.py): TP2 with sequence parallelism, PP2, PP2 x VPP2, each at
P = 0, 2 and L. Every Pre-LN layer is megatron's stock TE layer of the same layout (classes,
flags, parameter shapes and TP/SP attributes); every Post-LN layer has plain TE linears with
this layout's TP / SP and TE norms whose weights carry `sequence_parallel` under SP (so that
finalize_model_grads all-reduces them over TP); torch_dist save, then a strict load into fresh
chunks gives every tensor back. Skipped without TE (make test-te installs it)."""

import os

import pytest

from harness import testing as mu

WHY = mu.te_missing()
pytestmark = [pytest.mark.te, pytest.mark.mp, pytest.mark.skipif(WHY is not None, reason=str(WHY))]
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "te_worker.py")


def run(nproc, *args):
    return mu.last_result(mu.torchrun(WORKER, nproc, *args, env={"OMP_NUM_THREADS": "1"}))


@pytest.mark.parametrize("layout, per_rank_layers", [
    (("--tp", "2", "--sp"), [[1, 2, 3, 4], [1, 2, 3, 4]]),
    (("--pp", "2"), [[1, 2], [3, 4]]),
    (("--pp", "2", "--vpp", "2"), [[1, 3], [2, 4]]),
], ids=["tp2-sp", "pp2", "pp2-vpp2"])
def test_te_spec_at_parallel_layouts(tmp_path, layout, per_rank_layers):
    ranks = run(2, "layout", *layout, "--dir", tmp_path)
    assert len(ranks) == 2
    for results, layers in zip(ranks, per_rank_layers):
        assert [r["P"] for r in results] == [0, 2, 4]
        for r in results:
            assert r["post"] == [n for n in layers if n <= r["P"]]
            assert r["pre"] == [n for n in layers if n > r["P"]]
            assert r["tensors"] > 0
