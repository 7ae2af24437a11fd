"""torch's DCP metadata through megatron-core's torch_dist metadata reader (compat.py, section T).

megatron-core's load_tensors_metadata (behind dist_checkpointing.load_tensors_metadata and every
load whose strictness checks the checkpoint's keys) makes each tensor with
torch.empty(size, **TensorProperties.__dict__); torch 2.15's TensorProperties carries `strides`,
which torch.empty does not take. compat probes megatron's own reader; a key-checking load it
cannot serve is refused in one line before Megatron reads the checkpoint, and setup.py keeps a
fresh install on a torch the reader takes. On the venv's torch the probe must agree with a real
load of a real checkpoint; `make test-newest-torch` runs this file on the newest torch pip
resolves, so whichever way that torch goes, the probe is checked against it.
"""

from __future__ import annotations

import argparse
import ast
import os

import pytest

from test_vet_load import bases  # noqa: F401  (a real from-hf torch_dist checkpoint, module scope)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _iteration_dir(load) -> str:
    from mixln_megatron.convert.megatron_reader import resolve_checkpoint_dir

    return resolve_checkpoint_dir(str(load))[0]


def _strided_properties():
    """TensorProperties as torch 2.15 builds them (its new field, None for a contiguous tensor or a
    file saved before it): what megatron's reader then gets."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorProperties

    props = TensorProperties(dtype=torch.float32)
    props.strides = None
    return props


def test_the_probe_agrees_with_megatron_s_reader_on_a_saved_checkpoint(bases):  # noqa: F811
    import torch
    from megatron.core import dist_checkpointing

    from mixln_megatron import compat

    problem = compat.metadata_reader_problem()
    directory = _iteration_dir(bases["torch_dist"])
    if problem is None:
        shapes = {k: v.global_shape for k, v in dist_checkpointing.load_tensors_metadata(directory).items()}
        assert shapes["embedding.word_embeddings.weight"] == (128, 64)
    else:
        with pytest.raises(TypeError) as err:
            dist_checkpointing.load_tensors_metadata(directory)
        assert str(err.value) == problem, torch.__version__


def test_tensor_properties_with_strides_fail_megatron_s_reader():
    from mixln_megatron import compat

    problem = compat.metadata_reader_problem(_strided_properties())
    assert problem is not None and "strides" in problem


def test_a_key_checking_load_is_refused_in_one_line_before_megatron_reads(bases, mcore_single, monkeypatch,  # noqa: F811
                                                                           capsys):
    import torch

    from mixln_megatron import compat, spec
    from mixln_megatron.convert.vet import check_load_dir, vet_load_args
    from harness import testing

    # this torch's reader verdict replaced by the one megatron's reader gives torch 2.15's properties
    monkeypatch.setattr(compat, "_reader_problem", compat.metadata_reader_problem(_strided_properties()))
    load = str(bases["torch_dist"])

    def args(strict):
        return argparse.Namespace(load=load, ckpt_step=None, pretrained_checkpoint=None,
                                  non_persistent_ckpt_type=None, dist_ckpt_strictness=strict)

    for strict in ("log_unexpected", "raise_all", "return_all"):
        with pytest.raises(compat.UnsupportedTorchRelease) as err:
            vet_load_args(args(strict))  # the entry point's check (mixln-megatron pretrain)
        line = str(err.value)
        assert "\n" not in line
        for part in (f"torch {torch.__version__.split('+')[0]} with megatron-core {compat.VERSION}",
                     f"--dist-ckpt-strictness {strict}", "strides", compat.TORCH_REQUIREMENT,
                     "--dist-ckpt-strictness assume_ok_unexpected"):
            assert part in line, line
        capsys.readouterr()
        with pytest.raises(compat.UnsupportedTorchRelease):  # the --spec edge, with Megatron-LM's args
            spec.stock_layer_spec(testing.tiny_config(), "local", environ={}, args=args(strict))
        errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[mixln_megatron] ERROR:")]
        assert errors == [f"[mixln_megatron] ERROR: {line}"], errors
    # megatron's default strictness never reads the tensor metadata: those loads go on
    for strict in (None, "assume_ok_unexpected"):
        vet_load_args(args(strict))
        check_load_dir(load, strict)
        spec.stock_layer_spec(testing.tiny_config(), "local", environ={}, args=args(strict))
        compat.check_readable(_iteration_dir(load), strict)


def test_setup_py_keeps_a_fresh_install_on_the_torch_compat_names():
    from mixln_megatron import compat

    tree = ast.parse(open(os.path.join(REPO, "setup.py"), encoding="utf-8").read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    requires = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "install_requires"))
    assert [r for r in requires if r.startswith("torch")] == [compat.TORCH_REQUIREMENT]


def test_the_newest_torch_target_runs_this_file_and_existing_ones():
    """`make test-newest-torch` (CI, the newest torch pip resolves) names its test files in the Makefile."""
    import re

    text = open(os.path.join(REPO, "Makefile"), encoding="utf-8").read()
    listed = re.search(r"^NEWEST_TORCH_TESTS \?=((?:.*\\\n)*.*)$", text, re.M).group(1).replace("\\\n", " ").split()
    assert "tests/test_torch_metadata_reader.py" in listed
    assert [f for f in listed if not os.path.isfile(os.path.join(REPO, f))] == []
