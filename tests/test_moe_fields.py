"""model.moe_fields: the one table of megatron-core's MoE settings names every one of the installed
release's (`make test-compat` runs the walk and the flag check on 0.17, 0.18 and main too), each
with a handling and the Megatron-LM flag its args hold it under; it is what convert, the analysis
and the Bridge read, and what docs/conversion.md shows."""

from __future__ import annotations

import dataclasses
from argparse import Namespace

import pytest

from mixln_megatron.model import moe_fields as mf


def _release() -> str:
    from mixln_megatron import compat

    return compat.RELEASE_NAME


@pytest.mark.compat
def test_every_moe_field_of_this_release_is_in_the_table_and_no_other():
    from megatron.core.transformer.transformer_config import TransformerConfig

    release = _release()
    assert release in mf.RELEASES, release
    installed = {f.name for f in dataclasses.fields(TransformerConfig) if mf.MOE_FIELD_NAME.search(f.name)}
    named = set(mf.fields_of_release(release))
    assert not installed - named, (f"megatron-core {release} has MoE fields model.moe_fields.TABLE does not name "
                                   f"(add a row: carried / folded / refused / training / execution): "
                                   f"{sorted(installed - named)}")
    assert not named - installed, f"rows for fields megatron-core {release} does not have: {sorted(named - installed)}"


def test_rows_are_well_formed():
    names = [row.name for row in mf.TABLE]
    assert len(names) == len(set(names))
    for row in mf.TABLE:
        assert row.handling in mf.HANDLINGS and row.where, row.name
        assert row.releases and set(row.releases) <= set(mf.RELEASES), row.name
        assert (row.handling == mf.REFUSED) == bool(row.why), row.name  # a refusal says why and what instead
        assert row.analysis in ("carry", "omit", "refuse", "rows") or row.analysis[0] == "cpu", row.name
        if row.handling in (mf.TRAINING, mf.EXECUTION):  # nothing of the forward to check or refuse
            assert row.check is None and row.analysis in ("omit",) + ((row.analysis,) if row.analysis[0] == "cpu"
                                                                     else ()), row.name


@pytest.mark.compat
def test_each_flag_is_a_megatron_lm_argument_of_this_release():
    """The args a checkpoint saves hold each row under its flag's dest (num_experts for
    num_moe_experts); rows without a flag have none in Megatron-LM's parser."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    dests = {action.dest: action.option_strings for action in parser._actions}
    release = _release()
    for row in mf.TABLE:
        if release not in row.releases:
            continue
        if row.flag is None:
            assert row.name not in dests, row.name
            continue
        assert row.dests[0] in dests and row.flag in dests[row.dests[0]], (row.name, row.flag)
    assert mf.BY_NAME["num_moe_experts"].flag == "--num-experts"


def test_conversion_refusals_name_their_flag_and_plain_routing_has_none():
    plain = Namespace(num_experts=8, moe_router_topk=2, moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                      moe_router_score_function="softmax", moe_expert_capacity_factor=-1.0,
                      moe_router_num_groups=4, moe_router_group_topk=4, moe_aux_loss_coeff=[0.01, 0.001])
    assert mf.conversion_problems(plain) == [] and mf.bridge_problems(plain) == []
    for setting, flag in [(dict(moe_router_score_function="sigmoid"), "--moe-router-score-function"),
                          (dict(moe_latent_size=16), "--moe-latent-size"),
                          (dict(moe_router_force_biased=0.1), "--moe-router-force-biased"),
                          (dict(moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor"),
                          (dict(moe_router_group_topk=2), "--moe-router-num-groups")]:
        problems = mf.conversion_problems(Namespace(**{**vars(plain), **setting}))
        assert len(problems) == 1 and flag in problems[0] and "\n" not in problems[0], (setting, problems)
    # the deprecated spelling: groups of the expert-parallel size, all of them chosen -> plain top-k
    limited = Namespace(num_experts=8, moe_router_topk_limited_devices=2, expert_model_parallel_size=2)
    assert mf.conversion_problems(limited) == []
    limited.expert_model_parallel_size = 4
    assert "[moe_router_topk_limited_devices]" in mf.conversion_problems(limited)[0]


def test_the_bridge_refuses_what_its_config_does_not_write():
    """A provider (a TransformerConfig) whose routing hf_moe_fields would describe as another one."""
    for setting, flag in [(dict(moe_router_load_balancing_type="sinkhorn"), "--moe-router-load-balancing-type"),
                          (dict(moe_router_topk_scaling_factor=2.0), "--moe-router-topk-scaling-factor"),
                          (dict(moe_router_dtype="fp64"), "--moe-router-dtype"),
                          (dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"),
                           "--moe-router-enable-expert-bias"),
                          (dict(moe_apply_probs_on_input=True), "--moe-apply-probs-on-input"),
                          (dict(moe_expert_capacity_factor=1.25), "--moe-expert-capacity-factor"),
                          (dict(moe_latent_size=16), "--moe-latent-size"),
                          (dict(gated_linear_unit=True, moe_grouped_gemm=True, moe_mlp_glu_interleave_size=16),
                           "--moe-mlp-glu-interleave-size")]:
        provider = Namespace(num_moe_experts=8, moe_router_topk=2, moe_router_pre_softmax=True, **setting)
        problems = mf.bridge_problems(provider)
        assert any(flag in p for p in problems), (setting, problems)
    assert mf.bridge_problems(Namespace(num_moe_experts=8, moe_router_topk=2, moe_router_pre_softmax=True,
                                        moe_router_topk_scaling_factor=1.0, moe_token_drop_policy="probs",
                                        moe_router_dtype="fp32")) == []  # router_dtype "float32"


def test_docs_moe_table_is_current(tmp_path):
    """docs/conversion.md shows the MoE table as model.moe_fields has it (python scripts/moe_table.py --write)."""
    from pathlib import Path

    import moe_table

    doc = Path(__file__).resolve().parents[1] / "docs" / "conversion.md"
    assert moe_table.main(["--check", str(doc)]) == 0, (
        "docs/conversion.md is stale: python scripts/moe_table.py --write docs/conversion.md")
    for row in mf.TABLE:
        assert f"| `{row.name}` |" in moe_table.render()
    stale = tmp_path / "moe.md"
    stale.write_text(doc.read_text().replace("`--moe-router-dtype`", "`--moe-router-precision`"))
    assert moe_table.main(["--check", str(stale)]) == 1
    assert moe_table.main(["--write", str(stale)]) == 0 and stale.read_text() == doc.read_text()
