"""`mixln-megatron pretrain` on an MoE model: a Post-LN MoE layout (a dense first layer, then MoE
layers of 4 experts, top-2) trains under expert parallelism 2 through Megatron-LM's loop, saves
torch_dist, resumes at EP2 with --use-checkpoint-args (its settings read through the project's
checkpoint reader), loads its weights at EP1 (one process), and refuses a resume under another
layout in one line, exit 2; `convert to-hf` exports it (the Mix-LN MoE class: tests/test_convert_moe.py)."""

import os

import pytest

from mixln_megatron.convert import cli as convert_cli
from test_pretrain import TINY, finish, start, train

pytestmark = [pytest.mark.mp, pytest.mark.scale, pytest.mark.slow]

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "allgather",
       "--moe-ffn-hidden-size", "48", "--moe-layer-freq", "[0,1,1,1]"]
LAYOUT = "post:1-2,pre:3-4"


def run_args(tmp_path, *extra, save="ckpt"):
    return ["--cpu", *TINY, *MOE, "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / save),
            "--save-interval", "3", "--ckpt-format", "torch_dist", *extra]


def test_a_post_ln_moe_layout_trains_under_ep2_saves_resumes_and_reshards(tmp_path, capsys):
    ep2 = ["--expert-model-parallel-size", "2", "--mixln-layout", LAYOUT]
    out = train(run_args(tmp_path, *ep2, "--exit-interval", "3"), nproc=2)
    assert "layout=post:1-2,pre:3-4" in out or "Post-LN layers: 1, 2" in out, out[-3000:]
    assert " iteration        3/       6 |" in out and "load_balancing_loss" in out, out[-3000:]
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000003")
    # another layout (one process, so that its exit status is the entry point's): one line, exit 2
    refused = finish(start(run_args(tmp_path, "--mixln-layout", "post:1,pre:2-4")), expect_rc=2)
    lines = {line for line in refused.splitlines() if "[mixln_megatron] ERROR:" in line}
    assert len(lines) == 1 and "the checkpoint has scheme=mixln P=2 of L=4" in next(iter(lines)), refused[-3000:]
    assert "Traceback" not in refused and " iteration        4/" not in refused
    # resume at EP2 to the end, the settings from the checkpoint: pretrain reads its record through
    # the checkpoint reader that conversions use, which must not refuse the experts here
    resumed = train(run_args(tmp_path, "--expert-model-parallel-size", "2", "--use-checkpoint-args"), nproc=2)
    assert "P=2" in resumed and "(from the checkpoint)" in resumed, resumed[-3000:]
    assert " iteration        6/       6 |" in resumed and os.path.isdir(tmp_path / "ckpt" / "iter_0000006")
    # ... and exports to Hugging Face (the Mix-LN MoE class; parity in tests/test_convert_moe.py)
    capsys.readouterr()
    out = tmp_path / "hf"
    assert convert_cli.main(["to-hf", "--load", str(tmp_path / "ckpt"), "--save", str(out), "--no-progress"]) == 0
    assert '"model_type": "mixln_moe"' in open(out / "config.json").read()
    # the EP2 weights at EP1 in one process (megatron's optimizer state does not reshard across EP
    # sizes: its parameter groups differ, so the optimizer starts afresh)
    ep1 = train(run_args(tmp_path, "--mixln-layout", LAYOUT, "--no-load-optim", "--no-load-rng", "--finetune",
                         "--train-iters", "2", "--save-interval", "2", save="ep1"))
    assert "successfully loaded checkpoint" in ep1 and " iteration        2/       2 |" in ep1, ep1[-3000:]
    assert os.path.isdir(tmp_path / "ep1" / "iter_0000002")
