"""model.config_fields: with model.moe_fields, one row for every TransformerConfig field of the
installed release (`make test-compat` runs the walk on 0.17, 0.18 and main too), each carried,
refused or of no effect; the refusals are model.support's and what `convert to-hf` prints; the
"no effect" rows that touch the forward pass are run; docs/conversion.md shows the table."""

from __future__ import annotations

import dataclasses
import shutil
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from mixln_megatron.model import config_fields as cf
from mixln_megatron.model import moe_fields as mf
from mixln_megatron.model import support

REPO = Path(__file__).resolve().parents[1]


def _release() -> str:
    from mixln_megatron import compat

    return compat.RELEASE_NAME


@pytest.mark.compat
def test_the_two_tables_name_every_field_of_this_release_once_and_no_other():
    from megatron.core.transformer.transformer_config import TransformerConfig

    release = _release()
    assert release in cf.RELEASES, release
    installed = {f.name for f in dataclasses.fields(TransformerConfig)}
    ours, moe = cf.fields_of_release(release), mf.fields_of_release(release)
    named = set(ours) | set(moe)
    assert not installed - named, (f"megatron-core {release} has TransformerConfig fields no table names (add a row "
                                   f"to model.config_fields.TABLE: carried / refused / no effect): "
                                   f"{sorted(installed - named)}")
    assert not named - installed, f"rows for fields megatron-core {release} does not have: {sorted(named - installed)}"
    assert not set(ours) & set(moe), sorted(set(ours) & set(moe))
    assert sum(cf.counts(release).values()) == len(installed)


@pytest.mark.compat
def test_argument_rows_are_megatron_lm_arguments_of_this_release():
    """The rows outside the config name what a checkpoint's saved args hold (parser dests)."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    dests = {action.dest for action in parser._actions}
    rows = [row for row in cf.TABLE if row.kind == cf.ARGUMENT and _release() in row.releases]
    assert len(rows) >= 20
    assert not [row.name for row in rows if row.name not in dests]


def test_rows_are_well_formed():
    names = [row.name for row in cf.TABLE]
    assert len(names) == len(set(names))
    for row in cf.TABLE:
        assert row.handling in cf.HANDLINGS and row.where, row.name
        assert row.releases and set(row.releases) <= set(cf.RELEASES), row.name
        assert (row.handling == cf.REFUSED) == bool(row.why), row.name  # a refusal says why and what instead
        assert (row.handling == cf.NO_EFFECT) == (row.category in cf.CATEGORIES), row.name
    assert cf.AUDITED <= {row.name for row in cf.TABLE if row.handling == cf.NO_EFFECT}


def test_support_is_a_view_of_the_table():
    """Every refusal model.support checks is a row's; every refused row is refused by convert."""
    refusals = [r for row in cf.TABLE for r in row.refusals]
    assert set(support.TABLE) | set(support.DEEPNORM_INIT_TABLE) == set(refusals)
    convert = {r.names[0] for r in support.TABLE if support.CONVERT in r.where}
    assert convert == {row.name for row in cf.TABLE if row.handling == cf.REFUSED}


# One value per refused row that turns it on; a new refused row needs one here.
REFUSED_VALUES = {
    "multi_latent_attention": True, "experimental_attention_variant": "gated_delta_net",
    "heterogeneous_block_specs": True, "mtp_num_layers": 1, "qk_layernorm": True, "qk_l2_norm": True,
    "attention_output_gate": True, "softmax_type": "off_by_one", "softmax_scale": 0.5, "window_size": [8, 0],
    "no_rope_freq": 2, "mrope_section": [4, 2, 2], "activation_func_clamp_value": 7.0,
    "apply_residual_connection_post_layernorm": True, "linear_attention_freq": 2, "enable_mhc_connections": True,
    "squared_relu": True, "quick_geglu": True,
}


def _refused_rows():
    return [row for row in cf.TABLE if row.handling == cf.REFUSED and _release() in row.releases]


def _arm(row) -> dict:
    return {row.name: REFUSED_VALUES[row.name]}


def test_each_refused_row_is_refused_on_saved_args_and_its_off_value_is_not():
    plain = Namespace(softmax_type="vanilla", window_size=None, qk_layernorm=False, no_rope_freq=None)
    assert support.problems(plain, support.CONVERT) == []
    for row in _refused_rows():
        assert row.name in REFUSED_VALUES, f"add a value that turns {row.name} on to REFUSED_VALUES"
        found = support.problems(Namespace(**_arm(row)), support.CONVERT)
        value = REFUSED_VALUES[row.name]
        assert any(f"[{row.name}={value!r}]" in p for p in found), (row.name, found)
        assert all("\n" not in p for p in found)


def test_rope_scaling_in_a_hybrid_model_is_refused_where_it_would_be_lost():
    """HybridModel takes no RoPE scaling: the flag with a pattern (either name) is refused by the
    entry point, the stock --spec edge and the export's shape reader; a GPT run keeps it (carried)."""
    from mixln_megatron.convert.shape import UnsupportedModelError, check_megatron_args_supported

    gpt = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False)
    with pytest.raises(UnsupportedModelError, match=r"in a HybridModel, which takes none.*\[use_rope_scaling=True\]"):
        check_megatron_args_supported(Namespace(**gpt, use_rope_scaling=True, hybrid_layer_pattern="*-*-"))
    check_megatron_args_supported(Namespace(**gpt, use_rope_scaling=True, hybrid_layer_pattern=None))
    check_megatron_args_supported(Namespace(**gpt, use_rope_scaling=False, hybrid_layer_pattern="*-*-"))
    for pattern in ({"hybrid_layer_pattern": "*-*-"}, {"hybrid_override_pattern": "*-*-"}):
        for scope in (support.PRETRAIN, support.STOCK):
            found = support.problems(Namespace(use_rope_scaling=True, **pattern), scope)
            assert len(found) == 1 and "in a HybridModel" in found[0], (pattern, scope, found)
            assert support.problems(Namespace(use_rope_scaling=False, **pattern), scope) == []
    for scope in (support.PRETRAIN, support.CONVERT):
        assert support.problems(Namespace(use_rope_scaling=True, hybrid_layer_pattern=None,
                                          rope_scaling_factor=32.0), scope) == []


def _write_args(ckpt: Path, base: Namespace, changes: dict) -> None:
    f = ckpt / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)  # our own fixture file
    state["args"] = Namespace(**{**vars(base), **changes})
    torch.save(state, f)


def test_convert_to_hf_refuses_each_refused_row_in_one_line(mixln_checkpoints, tmp_path, capsys):
    """The real CLI on a real checkpoint whose saved args turn one refused row on at a time (in
    this process, one arm after the other): exit 2, one stderr line naming the flag and its value,
    nothing written."""
    from mixln_megatron import cli

    ckpt = tmp_path / "ckpt"
    shutil.copytree(mixln_checkpoints["torch"], ckpt)
    base = torch.load(ckpt / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)["args"]
    out = tmp_path / "hf"
    for row in _refused_rows():
        _write_args(ckpt, base, _arm(row))
        capsys.readouterr()
        try:
            rc = cli.main(["convert", "to-hf", "--load", str(ckpt), "--save", str(out), "--no-progress"])
        except SystemExit as exit_:
            rc = exit_.code
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2, (row.name, err)
        assert len(err) == 1 and f"[{row.name}={REFUSED_VALUES[row.name]!r}]" in err[0], (row.name, err)
        assert not out.exists(), row.name


@pytest.mark.slow  # a fresh interpreter: the in-process test above covers every row by default
def test_a_refusal_through_the_console_command_is_its_last_stderr_line(mixln_checkpoints, tmp_path):
    """The installed `mixln-megatron` command in its own process: exit 2, the refusal said once."""
    import os
    import subprocess
    import sys

    ckpt = tmp_path / "ckpt"
    shutil.copytree(mixln_checkpoints["torch"], ckpt)
    base = torch.load(ckpt / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)["args"]
    _write_args(ckpt, base, {"window_size": [8, 0], "qk_layernorm": True})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    command = Path(sys.executable).parent / "mixln-megatron"  # the console script the venv installed
    proc = subprocess.run([str(command), "convert", "to-hf", "--load", str(ckpt), "--save", str(tmp_path / "hf"), "--no-progress"],
                          capture_output=True, text=True, timeout=300, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert "[window_size=[8, 0]]" in lines[-1] and "[qk_layernorm=True]" in lines[-1], proc.stderr
    assert sum("window_size" in line for line in lines) == 1, proc.stderr
    assert not (tmp_path / "hf").exists()


# --------------------------------------------------------------------------- the audit, by running
# Each arm changes "no effect" rows (model.config_fields.AUDITED, all of them) of a tiny Mix-LN GPT
# (2 Post-LN of 4 layers, local spec, fp32); CONTROL changes carried rows, which must show.
ARMS = {
    "attention": dict(attention_softmax_in_fp32=False, masked_softmax_fusion=True, attention_backend="unfused"),
    "query-key layer scaling": dict(apply_query_key_layer_scaling=True),
    "dropout in evaluation": dict(hidden_dropout=0.3, attention_dropout=0.3),
    "init": dict(init_method_std=0.5, embedding_init_method_std=0.3, perform_initialization=False,
                 use_cpu_initialization=False, init_model_with_meta_device=True),
    "fusion": dict(bias_dropout_fusion=True, bias_activation_fusion=True, memory_efficient_layer_norm=True,
                   use_fused_weighted_squared_relu=True, fused_residual_rmsnorm=True,
                   activation_func_fp8_input_store=True),
    "execution": dict(fp32_residual_connection=True, test_mode=True, deterministic_mode=True,
                      recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                      clone_scatter_output_in_embedding=False, cross_entropy_loss_fusion=True,
                      calculate_per_token_loss=True, mlp_chunks_for_prefill=2,
                      disable_bf16_reduced_precision_matmul=True, use_kitchen_attention=True,
                      log_max_attention_logit=True),
    "training": dict(qk_clip=True, qk_clip_alpha=0.3, qk_clip_threshold=5),
    "inert": dict(window_attn_skip_freq=2, mtp_loss_scaling_factor=0.5, mtp_use_repeated_layer=True,
                  linear_conv_kernel_dim=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                  linear_num_value_heads=2, dsa_indexer_n_heads=2, dsa_indexer_head_dim=8, dsa_indexer_topk=4,
                  dsa_indexer_loss_coeff=0.1, mamba_state_dim=16, mamba_head_dim=8, mamba_num_groups=2,
                  mamba_num_heads=4, use_mamba_mem_eff_path=False),
}
CONTROL = {"glu offset": dict(glu_linear_offset=1.0), "muP alone": dict(use_mup=True)}  # carried, not no effect


def _logits(ids, pos, mask, state=None, **overrides):
    """(logits, state dict) of the tiny model with `overrides`, loaded with `state` (else its own
    seeded weights moved off megatron's init, so that no setting meets a special value)."""
    import warnings

    from megatron.core import tensor_parallel

    from harness import testing as mu
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron's deprecation notes on GPTModel and the settings
        cfg = mu.tiny_config(num_layers=4, query_groups=2, **overrides)
        spec = get_mixln_decoder_block_spec(cfg, backend="local", settings=MixLNSettings(post_ln_layers=2))
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(100)
        model = mu.build_gpt(cfg, spec, untie=True)
    if state is None:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    else:
        model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return model(ids, pos, mask), model.state_dict()


def test_no_effect_rows_leave_the_logits_unchanged(mcore_single):
    from harness import testing as mu

    assert {name for arm in ARMS.values() for name in arm} == cf.AUDITED
    ids, _, pos, mask = mu.batch()
    want, state = _logits(ids, pos, mask)
    tol = 1e-6 * want.abs().max().item()  # fp32 rounding: query-key layer scaling divides, then multiplies back
    for arm, overrides in ARMS.items():
        got, _ = _logits(ids, pos, mask, state, **overrides)
        diff = (got - want).abs().max().item()
        assert diff <= tol, f"{arm} {sorted(overrides)}: logits differ by {diff:.3g}: not 'no effect'"
    for arm, overrides in CONTROL.items():  # the harness sees a change in the function
        got, _ = _logits(ids, pos, mask, state, **overrides)
        assert (got - want).abs().max().item() > 1e3 * tol, arm


def test_docs_table_is_current(tmp_path):
    """docs/conversion.md shows the table as model.config_fields has it."""
    import config_fields_table as table

    doc = REPO / "docs" / "conversion.md"
    assert table.main(["--check", str(doc)]) == 0, (
        "docs/conversion.md is stale: python scripts/config_fields_table.py --write "
        "docs/conversion.md")
    rendered = table.render()
    for row in cf.TABLE:
        assert f"| `{row.name}`" in rendered
    stale = tmp_path / "megatron-settings.md"
    stale.write_text(doc.read_text().replace("`window_size`", "`window_sizes`"))
    assert table.main(["--check", str(stale)]) == 1
    assert table.main(["--write", str(stale)]) == 0 and stale.read_text() == doc.read_text()
