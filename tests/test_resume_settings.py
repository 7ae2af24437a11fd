"""A resume reads the checkpoint's Mix-LN settings as strictly as `convert inspect` does:
with --use-checkpoint-args, the saved args, the settings record and the content metadata
are cross-checked, and a checkpoint whose sources disagree is one line naming both, exit 2, before
Megatron-LM builds anything, instead of the saved args silently winning."""

from __future__ import annotations

import shutil

import torch

from test_vet_load import bases, pretrain  # noqa: F401  (bases: the module fixture, a real from-hf checkpoint)


def test_resume_refuses_a_checkpoint_whose_args_and_record_disagree(bases, tmp_path):  # noqa: F811
    ckpt = tmp_path / "ckpt"
    shutil.copytree(bases["torch_dist"], ckpt)
    common = ckpt / "release" / "common.pt"
    state = torch.load(common, weights_only=False)  # our own fixture file, written by from-hf
    assert state["args"].mixln_post_ln_layers == 1
    state["args"].mixln_post_ln_layers = 2  # the record and the content metadata still say P = 1
    torch.save(state, common)
    proc = pretrain(ckpt, save=tmp_path / "trained")
    lines = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "settings record" in lines[0] and "--mixln-* args" in lines[0], lines[0]
    assert not (tmp_path / "trained").exists()
