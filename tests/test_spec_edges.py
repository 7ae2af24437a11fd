"""The stock `--spec mixln_megatron.spec <name>` edge refuses in one line what it cannot build.

Megatron-LM's own parser makes the arguments (the flags' real names), the edge (spec.stock_*)
checks them as Megatron-LM's builder would call it: multi-token prediction, and a spec whose
backend disagrees with --transformer-impl. Also: the release refusal names a command that exists.
"""

import sys

import pytest

from mixln_megatron import compat, spec
from mixln_megatron.convert import cli as convert_cli
from harness import testing as mu
from mixln_megatron.errors import MixLNConfigError
from mixln_megatron.model.support import MixLNUnsupportedError

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1"]


def megatron_lm_args(*flags):
    """Megatron-LM's parsed arguments (not validated) for these flags."""
    from megatron.training.arguments import parse_args

    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *BASE, *flags]
    try:
        return parse_args()
    finally:
        sys.argv = saved


def _error_lines(err: str) -> list:
    return [line for line in err.splitlines() if line.startswith("[mixln_megatron] ERROR:")]


def test_mtp_is_refused_at_the_spec_edge_in_one_line(mcore_single, capsys):
    args = megatron_lm_args("--transformer-impl", "local", "--mtp-num-layers", "1", "--spec", "mixln_megatron.spec",
                            "mixln_local_layer_spec")
    with pytest.raises(MixLNUnsupportedError, match=r"multi-token prediction \(--mtp-num-layers\) is not supported"):
        spec.stock_decoder_spec(mu.tiny_config(num_layers=4), "local", environ={}, args=args)
    (line,) = _error_lines(capsys.readouterr().err)
    assert line.endswith("[mtp_num_layers=1]"), line


def test_a_rope_scaling_factor_megatron_lm_drops_is_refused_at_the_spec_edge(mcore_single, capsys):
    """Megatron-LM's builders never pass --rope-scaling-factor to GPTModel: the model would train
    with 8 while the saved args (and so the export) say 32."""
    args = megatron_lm_args("--transformer-impl", "local", "--use-rope-scaling", "--rope-scaling-factor", "32")
    with pytest.raises(MixLNUnsupportedError, match="--rope-scaling-factor other than 8 with the stock --spec"):
        spec.stock_decoder_spec(mu.tiny_config(num_layers=4), "local", environ={}, args=args)
    (line,) = _error_lines(capsys.readouterr().err)
    assert line.endswith("[rope_scaling_factor=32.0]"), line
    for fine in (("--use-rope-scaling",), ("--rope-scaling-factor", "32")):  # the default, or scaling off
        args = megatron_lm_args("--transformer-impl", "local", *fine)
        spec.stock_decoder_spec(mu.tiny_config(num_layers=4), "local", environ={"MIXLN_POST_LN_LAYERS": "1"},
                                args=args)


@pytest.mark.parametrize("backend, impl, other", [("te", "local", "mixln_local_layer_spec"),
                                                  ("local", "transformer_engine", "mixln_layer_spec")])
def test_a_spec_whose_backend_disagrees_with_transformer_impl_is_one_line(mcore_single, capsys, backend, impl, other):
    args = megatron_lm_args("--transformer-impl", impl)
    with pytest.raises(MixLNConfigError, match="but --transformer-impl is " + impl):
        spec.stock_decoder_spec(mu.tiny_config(num_layers=4), backend, environ={}, args=args)
    (line,) = _error_lines(capsys.readouterr().err)
    assert f"use --spec mixln_megatron.spec {other} with it, or --transformer-impl" in line, line


def test_hybrid_spec_names_the_hybrid_twin():
    args = megatron_lm_args("--transformer-impl", "local")
    with pytest.raises(MixLNConfigError, match="mixln_hybrid_stack_spec builds TransformerEngine modules.*"
                                               "use --spec mixln_megatron.spec mixln_hybrid_local_stack_spec"):
        spec.check_spec_backend(args, "te", hybrid=True)


def test_a_matching_backend_builds(mcore_single):
    args = megatron_lm_args("--transformer-impl", "local")
    built = spec.stock_decoder_spec(mu.tiny_config(num_layers=4), "local", environ={"MIXLN_POST_LN_LAYERS": "1"},
                                    args=args)
    assert len(built.layer_specs) == 4


def test_the_newer_release_refusal_names_a_command_that_exists(tmp_path, monkeypatch):
    (tmp_path / ".metadata").write_bytes(b"")  # a 0.19 torch_dist folder: .metadata, no common.pt
    monkeypatch.setattr(compat, "RELEASE", (0, 18))
    with pytest.raises(compat.CheckpointFromNewerRelease) as refused:
        compat.check_readable(str(tmp_path))
    message = str(refused.value)
    assert "mixln-megatron convert to-hf" in message and "convert from-hf" in message, message
    for command in ("to-hf", "from-hf"):  # what the message names parses as a command
        assert convert_cli.build_parser().parse_args([command, "--load", "a", "--save", "b"]).command == command
