"""MoE routings megatron-core trains, through `convert to-hf` / `from-hf`: converted exactly or
refused in one line (model.moe_fields.TABLE decides which).

Exact: sinkhorn routing with top-k > 1 (megatron's evaluation routing: softmax over all experts,
top-k, not renormalised, whatever --moe-router-pre-softmax, the score function or the scaling
factor say), and "group" routing that chooses among every group. The megatron model is in eval()
(sinkhorn routes otherwise in training), its logits the reference for the exported HF model (fp32).
Refused (exit 2, one line naming the flag): sinkhorn top-1, quantile balancing, probabilities on
the expert input, fp64 routing, group-limited routing, forced routing; from-hf: renormalised top-1
(megatron does not build it) and Mix-LN MoE folders with linear biases.
"""

from __future__ import annotations

import json
import shutil
from argparse import Namespace

import pytest
import torch

pytest.importorskip("transformers")

from mixln_megatron.convert.shape import moe_shape_of_args  # noqa: E402
from harness import testing as mu  # noqa: E402

from test_convert_moe import (  # noqa: E402
    EXPERTS, LAYERS, hf_logits, local_gpt, megatron_logits, save_megatron)

pytestmark = pytest.mark.usefixtures("mcore_single")

LAYOUT = "post:1,pre:2-4"  # a Post-LN layer: the Mix-LN MoE class, whatever the routing


def build(seed=5, **routing):
    """A 4-layer, 4-expert MoE GPTModel (every layer MoE, no shared expert) with `routing` in its
    config, router weights drawn far apart (no top-k ties), large experts, in eval()."""
    moe = dict(num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=48, moe_layer_freq=1,
               moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0)
    moe.update(routing)
    cfg = mu.tiny_config(num_layers=LAYERS, query_groups=2, **moe)
    model = local_gpt(cfg, seed, layout=LAYOUT)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif "experts" in name:  # experts that move the stream: a wrong routing weight shows
                p.mul_(10)
    return model.eval(), cfg


def saved_args(cfg) -> dict:
    """The routing args Megatron-LM saves for `cfg` beyond test_convert_moe.megatron_args'."""
    names = ("moe_router_load_balancing_type", "moe_router_score_function", "moe_router_topk_scaling_factor",
             "moe_router_num_groups", "moe_router_group_topk", "moe_aux_loss_coeff")
    return {name: getattr(cfg, name) for name in names}


def export_diff(model, cfg, tmp_path, **args):
    """Save as Megatron-LM does, export through the CLI, and return (HF config, max |HF - Megatron|)."""
    from mixln_megatron.convert.cli import main

    ckpt = save_megatron(model, cfg, tmp_path / "megatron", **{**saved_args(cfg), **args})
    assert main(["to-hf", "--load", str(ckpt), "--save", str(tmp_path / "hf"), "--no-progress"]) == 0
    ids, want = megatron_logits(model)
    _, got = hf_logits(tmp_path / "hf", ids)
    return json.loads((tmp_path / "hf" / "config.json").read_text()), float((got - want).abs().max())


# ------------------------------------------------------------------ exact
@pytest.mark.parametrize("ignored", [
    {},
    # megatron's sinkhorn reads none of these: the export must not either
    dict(moe_router_pre_softmax=True, moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=3.0),
], ids=["sinkhorn", "sinkhorn-ignores-pre-softmax-score-scaling"])
def test_sinkhorn_top2_exports_megatron_s_evaluation_routing(tmp_path, ignored):
    model, cfg = build(moe_router_load_balancing_type="sinkhorn", **ignored)
    config, diff = export_diff(model, cfg, tmp_path, moe_router_pre_softmax=cfg.moe_router_pre_softmax)
    print(f"sinkhorn {ignored}: max |HF - Megatron| logits {diff:.3g}")
    assert config["norm_topk_prob"] is False and diff <= 1e-5, (config.get("norm_topk_prob"), diff)


@pytest.mark.parametrize("groups", [dict(moe_router_num_groups=2),
                                    dict(moe_router_num_groups=2, moe_router_group_topk=2)],
                         ids=["groups-without-group-topk", "group-topk-equals-groups"])
def test_group_routing_over_every_group_is_plain_top_k(tmp_path, groups):
    model, cfg = build(**groups)
    config, diff = export_diff(model, cfg, tmp_path)
    print(f"{groups}: max |HF - Megatron| logits {diff:.3g}")
    assert config["norm_topk_prob"] is True and diff <= 1e-5


def test_the_moe_shape_carries_scaling_fp32_routing_and_interleaves():
    """Part A fills the fields (part B writes them): the factor, fp32 routing and the GLU blocks of
    TE grouped-GEMM experts; sequential experts and the non-fused shared expert ignore an interleave."""
    def shape(**args):
        base = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, swiglu=True,
                    moe_shared_expert_intermediate_size=32)
        return moe_shape_of_args(Namespace(**{**base, **args}), 2, False, "args")

    assert shape(moe_router_topk_scaling_factor=2.5).topk_scaling == 2.5
    assert shape(moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type="sinkhorn").topk_scaling == 1.0
    assert shape(moe_router_dtype="fp32").router_fp32 and not shape().router_fp32
    grouped = shape(moe_grouped_gemm=True, moe_mlp_glu_interleave_size=16, use_grouped_gemm_for_shared_expert=True,
                    moe_shared_expert_glu_interleave_size=8)
    assert (grouped.expert_glu_interleave, grouped.shared_glu_interleave) == (16, 8)
    sequential = shape(moe_mlp_glu_interleave_size=16, moe_shared_expert_glu_interleave_size=8)
    assert (sequential.expert_glu_interleave, sequential.shared_glu_interleave) == (None, None)
    from mixln_megatron.convert import ConversionError

    with pytest.raises(ConversionError, match="moe_mlp_glu_interleave_size 5 does not divide"):
        shape(moe_grouped_gemm=True, moe_mlp_glu_interleave_size=5)


# ------------------------------------------------------------------ refused through the CLI
@pytest.fixture(scope="module")
def plain_checkpoint(mcore_single, tmp_path_factory):
    model, cfg = build()
    return model, cfg, tmp_path_factory.mktemp("routing")


@pytest.mark.parametrize("args,flag", [
    (dict(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1), "--moe-router-load-balancing-type"),
    (dict(moe_router_load_balancing_type="quantile_balancing"), "--moe-router-load-balancing-type"),
    (dict(moe_apply_probs_on_input=True), "--moe-apply-probs-on-input"),
    (dict(moe_router_dtype="fp64"), "--moe-router-dtype"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=2), "--moe-router-num-groups"),
    (dict(moe_router_force_load_balancing=True), "--moe-router-force-load-balancing"),
], ids=["sinkhorn-top1", "quantile", "probs-on-input", "fp64", "group-limited", "forced"])
def test_routing_without_an_hf_form_is_refused_in_one_line(plain_checkpoint, tmp_path, capsys, args, flag):
    from mixln_megatron.convert.cli import main

    model, cfg, _ = plain_checkpoint
    ckpt = save_megatron(model, cfg, tmp_path / "ckpt", **args)
    capsys.readouterr()
    assert main(["to-hf", "--load", str(ckpt), "--save", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err, err
    assert not (tmp_path / "out").exists()


def _from_hf_refusal(folder, tmp_path, capsys) -> str:
    from mixln_megatron.convert.cli import main

    capsys.readouterr()
    assert main(["from-hf", "--load", str(folder), "--save", str(tmp_path / "megatron"), "--no-progress"]) == 2
    assert not (tmp_path / "megatron").exists()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_from_hf_refuses_renormalised_top1_which_megatron_does_not_build(tmp_path, capsys):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=mu.VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=1,
                           tie_word_embeddings=False)
    MixtralForCausalLM(config).save_pretrained(tmp_path / "top1")
    assert "num_experts_per_tok" in _from_hf_refusal(tmp_path / "top1", tmp_path, capsys)


def test_from_hf_refuses_top1_renormalised_and_biased_mixln_moe_folders(plain_checkpoint, tmp_path, capsys):
    from mixln_megatron.convert.cli import main

    model, cfg, root = plain_checkpoint
    exported = root / "hf"
    if not exported.exists():
        ckpt = save_megatron(model, cfg, root / "megatron")
        assert main(["to-hf", "--load", str(ckpt), "--save", str(exported), "--no-progress"]) == 0
    for edit, name in ((dict(num_experts_per_tok=1, norm_topk_prob=True), "norm_topk_prob"),
                       (dict(attention_bias=True, mlp_bias=True), "attention_bias")):
        folder = tmp_path / name
        shutil.copytree(exported, folder)
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"] == "mixln_moe"
        config.update(edit)
        (folder / "config.json").write_text(json.dumps(config))
        assert name in _from_hf_refusal(folder, tmp_path, capsys)


def test_inspect_names_the_routing_the_export_carries(plain_checkpoint, tmp_path, capsys):
    from mixln_megatron.convert.cli import main

    model, cfg, _ = plain_checkpoint
    ckpt = save_megatron(model, cfg, tmp_path / "ckpt", moe_router_load_balancing_type="sinkhorn",
                         moe_router_dtype="fp32")
    capsys.readouterr()
    assert main(["inspect", "--load", str(ckpt)]) == 0
    out = capsys.readouterr().out
    for line in ("moe_router_load_balancing_type: sinkhorn (its evaluation routing)", "norm_topk_prob: False",
                 "router_fp32: True"):
        assert line in out, (line, out)
    ckpt = save_megatron(model, cfg, tmp_path / "refused", moe_apply_probs_on_input=True)
    assert main(["inspect", "--load", str(ckpt)]) == 0
    assert "--moe-apply-probs-on-input" in capsys.readouterr().out


def test_the_installed_command_refuses_in_one_line_with_exit_2(plain_checkpoint, tmp_path):
    """`mixln-megatron convert to-hf` as a user runs it (a fresh process): exit 2, one stderr line."""
    import os
    import subprocess
    import sys

    model, cfg, _ = plain_checkpoint
    ckpt = save_megatron(model, cfg, tmp_path / "ckpt", moe_router_load_balancing_type="quantile_balancing")
    proc = subprocess.run([sys.executable, "-m", "mixln_megatron.cli", "convert", "to-hf", "--load", str(ckpt),
                           "--save", str(tmp_path / "out"), "--no-progress"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-2000:])
    assert "--moe-router-load-balancing-type" in lines[0] and "qb_beta" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
