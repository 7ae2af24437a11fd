"""An export walks one way: read the checkpoint's facts once (convert.inspect, which reads the args
through convert.shape once), map the roles once (convert.mapping.map_roles), then write
(convert.to_hf, turning each role's tensor into its HF tensors through the same role table). Each of
these modules is entered in that order and never again once left: the writing never goes back to
the shape or the inspection.

A module is *entered* when one of its functions is called while no frame of it is on the stack
(its own helpers, nested calls and returns are not entries). Traced with sys.setprofile during a
small conversion of each checkpoint format. Before this walk was made one way, the same trace read
to_hf, inspect, shape, mapping, shape, mapping, ... (shape and mapping entered 11 times each: the
writing asked the shape for every layer's roles and names, the reader asked mapping for each key);
with the facts in a module of their own, the walk entered five modules, now four.
"""

from __future__ import annotations

import itertools
import os
import sys

import pytest

pytest.importorskip("transformers")

import mixln_megatron.convert as convert_package  # noqa: E402
from mixln_megatron.convert import convert_from_hf, convert_to_hf  # noqa: E402

from test_convert import make_mixln_folder  # noqa: E402

PACKAGE = os.path.dirname(convert_package.__file__) + os.sep
# The modules of the walk, in the order an export enters them.
WALK = ["to_hf", "inspect", "shape", "mapping"]
CO_NEWLOCALS = 0x2  # a function's frame (module and class bodies run without it)


def _module(code) -> str:
    name = code.co_filename
    return name[len(PACKAGE):-3] if name.startswith(PACKAGE) and name.endswith(".py") else ""


def traced_walk(fn, *args, **kwargs):
    """(result, [(module, function) of every entry into a WALK module, in order])."""
    entries = []

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_flags & CO_NEWLOCALS:
            return
        module = _module(frame.f_code)
        if module not in WALK:
            return
        caller = frame.f_back
        while caller is not None:
            if _module(caller.f_code) == module:
                return  # already inside the module: not an entry
            caller = caller.f_back
        entries.append((module, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        result = fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return result, entries


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("walk")
    make_mixln_folder(root / "src")
    out = {}
    for fmt in ("torch_dist", "torch"):
        out[fmt] = root / f"ckpt_{fmt}"
        convert_from_hf(str(root / "src"), str(out[fmt]), ckpt_format=fmt, progress=False)
    convert_to_hf(str(out["torch_dist"]), str(root / "warm"), progress=False)  # imports done before tracing
    return out


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_an_export_enters_each_module_once_in_order(checkpoints, tmp_path, fmt):
    summary, entries = traced_walk(convert_to_hf, str(checkpoints[fmt]), str(tmp_path / "hf"), progress=False)
    assert summary["post_ln_layers"] == 2 and summary["format"] == fmt
    stretches = [module for module, _ in itertools.groupby(entries, key=lambda e: e[0])]
    assert stretches == WALK, f"the export walked {stretches} ({entries})"
    mapped = entries.index(("mapping", "map_roles")) + 1
    assert entries[:mapped] == [("to_hf", "convert_to_hf"), ("inspect", "read_checkpoint_facts"),
                                ("shape", "read_checkpoint_shape"), ("shape", "forward_fields"),
                                ("mapping", "map_roles")], entries
    # then only the role table's row transforms: the legacy reader merging TP shards, the writing
    # turning each role's tensor into its HF tensors
    assert {name for _, name in entries[mapped:]} <= {"merge_tp_shards", "hf_layer_tensors"}, entries[mapped:]


def test_the_trace_sees_a_walk_back():
    """The tracer itself: a second entry into a module after another one is a new stretch."""
    from mixln_megatron.convert import mapping, shape

    def back_and_forth():
        s = shape.ModelShape(num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                             num_query_groups=1, kv_channels=4, vocab_size=10, max_position_embeddings=8)
        return [mapping.layer_roles(s), s.megatron_layer_shapes(), mapping.map_roles(s, 0)]

    _, entries = traced_walk(back_and_forth)
    assert [m for m, _ in itertools.groupby(entries, key=lambda e: e[0])] == ["shape", "mapping", "shape", "mapping"]
