"""Reading a checkpoint through the allow-list leaves torch's safe-globals registry as it found it.

megatron-core registers argparse.Namespace (and its enums) with torch at import; Megatron-LM's own
load of common.pt relies on it. `pretrain --load` vets the checkpoint first, in the same process,
so a vetting read that dropped megatron's registration broke the resume that followed."""

from __future__ import annotations

import argparse
import io

import torch

from mixln_megatron.safe_unpickle import load_torch


def test_the_registry_is_restored_exactly():
    torch.serialization.add_safe_globals([argparse.Namespace])  # as megatron.core does at import
    before = set(map(repr, torch.serialization.get_safe_globals()))
    buf = io.BytesIO()
    torch.save({"args": argparse.Namespace(num_layers=2), "iteration": 3}, buf)
    assert load_torch(buf.getvalue(), "common.pt")["args"].num_layers == 2
    assert set(map(repr, torch.serialization.get_safe_globals())) == before
    # what Megatron-LM does next: a plain weights-only load that needs megatron's registration
    assert torch.load(io.BytesIO(buf.getvalue()), weights_only=True)["iteration"] == 3


def test_nothing_is_left_registered_that_was_not_before():
    registered = list(torch.serialization.get_safe_globals())  # megatron-core's, when imported
    torch.serialization.clear_safe_globals()
    try:
        buf = io.BytesIO()
        torch.save(argparse.Namespace(a=1), buf)
        assert load_torch(buf.getvalue(), "x").a == 1
        assert torch.serialization.get_safe_globals() == []
    finally:  # the process's registry as it was: later tests load with megatron's registrations
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(registered)
