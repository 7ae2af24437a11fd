"""MoE tensors a conversion must rewrite, not copy: GLU-interleaved fc1 rows, the top-k
scaling factor, fp32 routing and a q/k/v-only bias.

The Megatron side is test_convert_moe's: megatron-core's GPTModel with MoE layers (local spec,
sequential experts), saved as Megatron-LM saves it; its logits are the reference for the exported
HF model (transformers, fp32).
  * --moe-mlp-glu-interleave-size / the fused shared expert's: TE grouped GEMM keeps fc1 rows as
    blocks [gate s; up s] (megatron undoes it on the fc1 output: _remove_glu_interleaving). The CPU
    has no grouped GEMM, so the interleaved save is the plain model's with those rows permuted into
    blocks: its export must give the plain model's logits. Saved at (expert) tensor parallel size 2
    the rows are rank-dependent: refused in one line.
  * --moe-router-topk-scaling-factor: folded into each routed expert's fc2.
  * --moe-router-dtype fp32: on near-tied logits a bf16 router picks other experts; the Mix-LN MoE
    model's fp32 router picks megatron's. A bf16 export is that class, an fp32 export may be stock.
  * --add-qkv-bias (no other bias): Qwen2-MoE's qkv_bias, or the Mix-LN MoE model's; both ways.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.conversion_mapping", reason="the Mix-LN MoE model needs transformers >= 5")

from mixln_megatron.convert import convert_from_hf as from_hf  # noqa: E402
from mixln_megatron.convert import convert_to_hf as to_hf  # noqa: E402
from mixln_megatron.convert.mapping import split_glu_rows  # noqa: E402
from harness import testing as mu  # noqa: E402

from test_convert import tensors  # noqa: E402
from test_convert_moe import (  # noqa: E402
    EXPERT_FFN, LAYERS, SHARED_FFN, hf_logits, local_gpt, megatron_logits, moe_settings, save_megatron)

pytestmark = pytest.mark.usefixtures("mcore_single")

EXPERT_BLOCK, SHARED_BLOCK = 8, 4  # interleave sizes: 48 = 3 x 2 x 8 expert rows, 40 = 5 x 2 x 4 shared rows


def build(layout, seed=3, moe=None, **config):
    """test_convert_moe's MoE GPTModel of `layout` with more TransformerConfig fields (`config`);
    every bias drawn too (megatron starts them at zero)."""
    cfg = mu.tiny_config(num_layers=LAYERS, query_groups=2, **moe_settings(**(moe or {})), **config)
    model = local_gpt(cfg, seed, layout=layout)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "router" in name:  # logits far apart: no top-k choice is a float tie
                p.copy_(torch.randn(p.shape, generator=g))
            elif "gate_weight" in name or name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model.eval(), cfg


def export_diff(model, cfg, root, name, dtype="auto", **args):
    """Save (args: Megatron-LM's saved args on top of the model's), export; (HF class, config.json,
    max |HF - Megatron| logits, checkpoint)."""
    ckpt = save_megatron(model, cfg, root / f"{name}_megatron", **args)
    to_hf(str(ckpt), str(root / f"{name}_hf"), dtype=dtype, progress=False)
    ids, want = megatron_logits(model)
    cls, got = hf_logits(root / f"{name}_hf", ids)
    diff = float((got - want).abs().max())
    print(f"{name}: {cls} max |HF - Megatron| logit difference {diff:.3g}")
    return cls, json.load(open(root / f"{name}_hf" / "config.json")), diff, ckpt


def reloaded_logits(folder, root, name, layout, moe=None, **config):
    """from-hf of `folder`, loaded into a fresh GPTModel of that build: (its logits, the written args)."""
    back = root / f"{name}_back"
    summary = from_hf(str(folder), str(back), progress=False)
    fresh, _ = build(layout, seed=99, moe=moe, **config)
    mu.load_chunks([fresh], str(back / "release"))
    common = torch.load(back / "release" / "common.pt", weights_only=False)
    return megatron_logits(fresh.eval())[1], common["args"], summary


# ------------------------------------------------------------------ GLU-interleaved fc1 rows
def interleave_rows(fc1, block):
    """Plain [gate; up] rows -> TE grouped GEMM's [gate block; up block] repeated."""
    gate, up = fc1.chunk(2, dim=0)
    rest = fc1.shape[1:]
    return torch.stack([gate.reshape(-1, block, *rest), up.reshape(-1, block, *rest)], 1).reshape(fc1.shape)


def test_split_glu_rows_is_megatrons_own_reading_of_interleaved_rows():
    """split_glu_rows(W, s) gives the gate / up rows megatron's _remove_glu_interleaving reads from the
    fc1 output of W; None: the plain halves."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 16, generator=g), torch.randn(5, 16, generator=g)
    for block in (1, 4, 8, 24):
        gate, up = split_glu_rows(w, block)
        megatron_gate, megatron_up = TEGroupedMLP._remove_glu_interleaving(x @ w.T, block).chunk(2, dim=-1)
        assert torch.equal(x @ gate.T, megatron_gate) and torch.equal(x @ up.T, megatron_up), block
        # and it undoes the test's interleaving
        assert all(torch.equal(a, b) for a, b in zip(split_glu_rows(interleave_rows(w, block), block), w.chunk(2)))
    assert all(torch.equal(a, b) for a, b in zip(split_glu_rows(w, None), w.chunk(2)))
    from mixln_megatron.convert import ConversionError

    with pytest.raises(ConversionError, match="GLU blocks of 5"):
        split_glu_rows(w, 5)


INTERLEAVED_ARGS = dict(moe_grouped_gemm=True, moe_mlp_glu_interleave_size=EXPERT_BLOCK,
                        use_grouped_gemm_for_shared_expert=True, moe_shared_expert_glu_interleave_size=SHARED_BLOCK)


@pytest.fixture(scope="module")
def interleaved(mcore_single, tmp_path_factory):
    """The plain model's logits, then the same model with every routed and shared fc1 permuted into
    interleaved blocks (what TE grouped GEMM saves)."""
    model, cfg = build("post:1,pre:2-4", moe=dict(gate=True))
    _, want = megatron_logits(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_fc1.weight" in name and ".experts." in name:
                p.copy_(interleave_rows(p, EXPERT_BLOCK))
            elif "linear_fc1.weight" in name and "shared_experts" in name:
                p.copy_(interleave_rows(p, SHARED_BLOCK))
    return {"model": model, "cfg": cfg, "want": want, "root": tmp_path_factory.mktemp("interleaved")}


def test_glu_interleaved_fc1_rows_export_the_plain_models_logits(interleaved):
    root, model, cfg = interleaved["root"], interleaved["model"], interleaved["cfg"]
    ckpt = save_megatron(model, cfg, root / "megatron", **INTERLEAVED_ARGS)
    to_hf(str(ckpt), str(root / "hf"), progress=False)
    ids, _ = megatron_logits(model)
    cls, got = hf_logits(root / "hf", ids)
    diff = float((got - interleaved["want"]).abs().max())
    print(f"interleaved fc1 rows: {cls} max |HF - plain Megatron| logit difference {diff:.3g}")
    assert diff <= 1e-5, diff
    # from-hf writes plain rows and says so: no interleave in its args, and back to the same folder
    back = root / "back"
    from_hf(str(root / "hf"), str(back), progress=False)
    args = torch.load(back / "release" / "common.pt", weights_only=False)["args"]
    assert args.moe_mlp_glu_interleave_size is None and args.moe_shared_expert_glu_interleave_size is None
    to_hf(str(back), str(root / "again"), progress=False)
    a, b = tensors(root / "hf"), tensors(root / "again")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("parallel,flag", [
    (dict(expert_tensor_parallel_size=2), f"--moe-mlp-glu-interleave-size={EXPERT_BLOCK}"),
    (dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1),
     f"--moe-shared-expert-glu-interleave-size={SHARED_BLOCK}"),
])
def test_interleaved_rows_saved_over_tensor_parallel_ranks_are_refused(interleaved, tmp_path, capsys, parallel, flag):
    from mixln_megatron.convert.cli import main

    ckpt = save_megatron(interleaved["model"], interleaved["cfg"], tmp_path / "ckpt", **INTERLEAVED_ARGS, **parallel)
    assert main(["to-hf", "--load", str(ckpt), "--save", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and "tensor parallel size 2" in err, err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ the top-k scaling factor
def test_topk_scaling_factor_is_folded_into_the_experts_fc2(tmp_path):
    layout = "sandwich:1,pre:2-4"
    model, cfg = build(layout, moe_router_topk_scaling_factor=2.5)
    cls, config, diff, _ = export_diff(model, cfg, tmp_path, "scaled", moe_router_topk_scaling_factor=2.5)
    assert cls == "MixLNMoeForCausalLM" and diff <= 1e-5, (cls, diff)
    # imported back: the factor is in the weights, none in the args; the GPTModel without it, same logits
    got, args, _ = reloaded_logits(tmp_path / "scaled_hf", tmp_path, "scaled", layout)
    assert args.moe_router_topk_scaling_factor is None
    assert float((got - megatron_logits(model)[1]).abs().max()) <= 1e-5


# ------------------------------------------------------------------ fp32 routing
def near_tied_router(seed=0, experts=64, hidden=64, tokens=512):
    """(bf16 router weight, bf16 tokens) whose expert logits differ by far less than bf16's precision:
    rows of one base vector plus 1e-3 noise (still far apart in fp32)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1, hidden, generator=g)
    weight = (base + 1e-3 * torch.randn(experts, hidden, generator=g)).bfloat16()
    return weight, torch.randn(tokens, hidden, generator=g).bfloat16()


def test_fp32_router_picks_megatrons_experts_where_bf16_does_not():
    """Megatron's TopKRouter (--moe-router-dtype fp32, bf16 params) vs the Mix-LN MoE router on the same
    bf16 weight and tokens: the same experts and weights; Qwen2-MoE's bf16 router picks others."""
    from megatron.core.transformer.moe.router import TopKRouter
    from mixln_megatron.hf.configuration_mixln_moe import MixLNMoeConfig
    from mixln_megatron.hf.modeling_mixln_moe import MixLNMoeSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    weight, tokens = near_tied_router()
    experts, topk = weight.shape[0], 6
    cfg = mu.tiny_config(num_layers=1, num_moe_experts=experts, moe_router_topk=topk, moe_router_dtype="fp32",
                         params_dtype=torch.bfloat16, moe_token_dispatcher_type="allgather", bf16=True)
    from megatron.core.process_groups_config import ProcessGroupCollection

    megatron = TopKRouter(config=cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups()).eval()
    hf_cfg = MixLNMoeConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                            num_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=8,
                            router_dtype="float32")
    ours = MixLNMoeSparseMoeBlock(hf_cfg).gate
    hf_cfg.router_dtype = None
    stock = Qwen2MoeTopKRouter(hf_cfg)
    with torch.no_grad():
        megatron.weight.copy_(weight)
        ours.weight.data = weight.clone()
        stock.weight.data = weight.clone()
        probs, routing_map = megatron(tokens.unsqueeze(1))
        _, our_weights, our_index = ours(tokens)
        _, _, stock_index = stock(tokens)
    chosen = torch.zeros(len(tokens), experts, dtype=torch.bool)
    assert torch.equal(chosen.scatter(1, our_index, True), routing_map)
    assert our_weights.dtype == torch.bfloat16
    assert torch.allclose(our_weights.float(), probs.gather(1, our_index).float(), atol=1e-2)
    differ = int((chosen.scatter(1, stock_index, True) != routing_map).any(-1).sum())
    print(f"near-tied logits: bf16 routing picks other experts for {differ} of {len(tokens)} tokens")
    assert differ > 0


def test_fp32_router_exports_the_remote_class_in_bf16_and_may_stay_stock_in_fp32(tmp_path):
    """All pre, routed experts only: Mixtral, except that a bf16 Mixtral routes in bf16."""
    layout = "pre:*"
    model, cfg = build(layout, moe=dict(freq=1, shared=None), moe_router_dtype="fp32")
    cls, config, diff, ckpt = export_diff(model, cfg, tmp_path, "fp32", dtype="float32", moe_router_dtype="fp32")
    assert cls == "MixtralForCausalLM" and diff <= 1e-5, (cls, diff)
    to_hf(str(ckpt), str(tmp_path / "bf16"), dtype="bfloat16", progress=False)
    config = json.load(open(tmp_path / "bf16" / "config.json"))
    assert config["model_type"] == "mixln_moe" and config["router_dtype"] == "float32"
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), trust_remote_code=True, dtype=torch.bfloat16)
    gates = [layer.mlp.gate for layer in hf.model.layers]
    assert all(type(g).__name__ == "MixLNMoeFp32Router" and isinstance(g, Qwen2MoeTopKRouter) for g in gates)
    # from-hf of that folder: Megatron-LM routes in fp32 again
    summary = from_hf(str(tmp_path / "bf16"), str(tmp_path / "back"), progress=False)
    args = torch.load(tmp_path / "back" / "release" / "common.pt", weights_only=False)["args"]
    assert args.moe_router_dtype == "fp32" and "--moe-router-dtype fp32" in " ".join(summary["launch_flags"])


# ------------------------------------------------------------------ q/k/v-only bias
@pytest.mark.parametrize("layout,moe,want", [
    ("pre:*", dict(gate=True), "Qwen2MoeForCausalLM"),
    ("post:1,deepnorm:2,sandwich:3,pre:4", dict(), "MixLNMoeForCausalLM"),
])
def test_qkv_only_bias_exports_and_comes_back(tmp_path, layout, moe, want):
    model, cfg = build(layout, moe=moe, add_qkv_bias=True)
    cls, config, diff, _ = export_diff(model, cfg, tmp_path, "qkv", add_qkv_bias=True)
    assert cls == want and diff <= 1e-5, (cls, diff)
    assert config["qkv_bias"] is True and config.get("attention_bias", False) is False
    names = tensors(tmp_path / "qkv_hf")
    assert "model.layers.1.self_attn.k_proj.bias" in names and "model.layers.1.self_attn.o_proj.bias" not in names
    got, args, summary = reloaded_logits(tmp_path / "qkv_hf", tmp_path, "qkv", layout, moe=moe, add_qkv_bias=True)
    assert args.add_qkv_bias is True and args.add_bias_linear is False and "--add-qkv-bias" in summary["launch_flags"]
    assert float((got - megatron_logits(model)[1]).abs().max()) <= 1e-5


def test_a_stock_qwen2_moe_folder_with_qkv_bias_converts_with_its_logits(tmp_path):
    """Every hub Qwen1.5 / Qwen2-MoE checkpoint has qkv_bias: Megatron's GPTModel with --add-qkv-bias
    gives the folder's logits, and the export gives the folder back."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    hf = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=mu.VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=EXPERT_FFN,
        shared_expert_intermediate_size=SHARED_FFN, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], qkv_bias=True,
        norm_topk_prob=True, tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "mlp.gate." in name:
                p.copy_(torch.randn(p.shape))
    hf.save_pretrained(str(tmp_path / "stock"))
    got, args, _ = reloaded_logits(tmp_path / "stock", tmp_path, "stock", "pre:*", moe=dict(gate=True),
                                   add_qkv_bias=True)
    ids, _, _, _ = mu.batch(seed=11)
    with torch.no_grad():
        want = hf(ids).logits
    assert args.add_qkv_bias is True
    assert float((got - want).abs().max()) <= 1e-5
    to_hf(str(tmp_path / "stock_back"), str(tmp_path / "again"), progress=False)
    a, b = tensors(tmp_path / "stock"), tensors(tmp_path / "again")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
