"""Mix-LN MoE checkpoints through `convert to-hf`, `convert from-hf` and `convert inspect`.

The Megatron side is megatron-core's own GPTModel (local spec, sequential experts, allgather
dispatcher) of every layer kind, with a dense first layer (moe_layer_freq [0, 1, 1, 1]), 4 experts
top-2 and a shared expert, saved as Megatron-LM saves it (torch_dist, args in the common state,
per-layer keys for the mixed stack). Its logits on a batch are the reference: the exported HF
model (transformers, trust_remote_code, fp32) gives the same within 1e-5, also as stock Mixtral /
Qwen2-MoE where one of them is the network. HF -> Megatron -> HF is bit-identical, and the
from-hf checkpoint loads back into the GPTModel with the same logits. Saves at EP2 and at TP2
(tests/workers/moe_convert_worker.py, 2 ranks) export the same tensors as the EP1 one.
Refusals: each routing flag a conversion cannot carry, a truncated or forged expert tensor, legacy
output and GPT <-> hybrid conversion of MoE models. The export reads one expert at a time.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mixln_megatron.convert import ConversionError, UnsupportedModelError  # noqa: E402
from mixln_megatron.convert import convert_from_hf as from_hf  # noqa: E402
from mixln_megatron.convert import convert_to_hf as to_hf  # noqa: E402
from harness import testing as mu  # noqa: E402

from test_convert import tensors  # noqa: E402

pytestmark = pytest.mark.usefixtures("mcore_single")

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS, EXPERTS, TOPK, EXPERT_FFN, SHARED_FFN = 4, 4, 2, 48, 40
MIXED = [0, 1, 1, 1]  # a dense first layer, as DeepSeek and Qwen do


def moe_settings(freq=MIXED, shared=SHARED_FFN, gate=False, pre_softmax=False):
    return dict(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN, moe_layer_freq=freq,
                moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=gate,
                moe_router_pre_softmax=pre_softmax, moe_grouped_gemm=False, moe_token_dispatcher_type="allgather")


def local_gpt(cfg, seed, **settings):
    """GPTModel of `cfg` on the local Mix-LN spec of MixLNSettings(**settings), untied, seeded as the
    MoE conversion tests build theirs (torch: `seed`, megatron's model-parallel RNG: `seed + 100`)."""
    from megatron.core import tensor_parallel

    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec

    spec = get_mixln_decoder_block_spec(cfg, backend="local", settings=MixLNSettings(**settings))
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed + 100)
    return mu.build_gpt(cfg, spec, untie=True)


def build_moe_gpt(layout, seed=3, scheme="mixln", **moe):
    """GPTModel of `layout` (model.layout) with MoE layers, weights drawn so that routing has no near ties."""
    cfg = mu.tiny_config(num_layers=LAYERS, query_groups=2, **moe_settings(**moe))
    model = local_gpt(cfg, seed, layout=layout, scheme=scheme)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # not all ones: a swapped norm must show
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "router" in name:  # logits far apart: no top-k choice is a float tie
                p.copy_(torch.randn(p.shape, generator=g))
            elif "gate_weight" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model.eval(), cfg


def megatron_args(cfg, **extra):
    """The args Megatron-LM saves for this model (what the converter reads); `extra` wins."""
    args = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, group_query_attention=True, num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
        position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0, untie_embeddings_and_output_weights=True,
        padded_vocab_size=mu.VOCAB, vocab_size=mu.VOCAB, max_position_embeddings=mu.SEQ, norm_epsilon=cfg.layernorm_epsilon,
        tokenizer_model=None, num_experts=cfg.num_moe_experts, moe_router_topk=cfg.moe_router_topk,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size, moe_layer_freq=cfg.moe_layer_freq,
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=cfg.moe_shared_expert_gate, moe_router_pre_softmax=cfg.moe_router_pre_softmax,
        moe_router_score_function="softmax", moe_router_topk_scaling_factor=None, moe_expert_capacity_factor=None,
        moe_router_enable_expert_bias=False, moe_router_num_groups=None, moe_router_group_topk=None,
        moe_latent_size=None, moe_aux_loss_coeff=0.01, moe_input_jitter_eps=None,  # training-only: carried as nothing
        moe_token_dispatcher_type="allgather")
    args.update(extra)
    return argparse.Namespace(**args)


def save_megatron(model, cfg, path, **extra_args):
    """torch_dist as Megatron-LM saves it: <path>/iter_0000001 with the args in the common state."""
    from megatron.core import dist_checkpointing

    metadata = {}
    sharded = model.sharded_state_dict(metadata=metadata)
    ckpt = os.path.join(str(path), "iter_0000001")
    os.makedirs(ckpt)
    dist_checkpointing.save({"model": sharded, "args": megatron_args(cfg, **extra_args), "iteration": 1}, ckpt,
                            content_metadata=metadata)
    with open(os.path.join(str(path), "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")
    return path


def megatron_logits(model):
    ids, _, pos, mask = mu.batch(seed=11)
    with torch.no_grad():
        return ids, model(ids, pos, mask)


def hf_logits(folder, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        return type(model).__name__, model(ids).logits


def assert_parity(model, cfg, tmp_path, name):
    ckpt = save_megatron(model, cfg, tmp_path / f"{name}_megatron")
    summary = to_hf(str(ckpt), str(tmp_path / f"{name}_hf"), progress=False)
    ids, want = megatron_logits(model)
    cls, got = hf_logits(tmp_path / f"{name}_hf", ids)
    diff = float((got - want).abs().max())
    print(f"{name}: {cls} max |HF - Megatron| logit difference {diff:.3g}")
    assert diff <= 1e-5, (name, cls, diff)
    assert summary["architecture"] == cls and summary["remote_code"] == cls.startswith("MixLN")
    return cls, json.load(open(tmp_path / f"{name}_hf" / "config.json")), ckpt


KINDS = "post:1,deepnorm:2,sandwich:3,pre:4"


@pytest.fixture(scope="module")
def exported(mcore_single, tmp_path_factory):
    """The every-kind MoE model, its Megatron checkpoint and HF export (built once for the module)."""
    root = tmp_path_factory.mktemp("moe_convert")
    model, cfg = build_moe_gpt(KINDS)
    cls, config, ckpt = assert_parity(model, cfg, root, "kinds")
    return {"root": root, "model": model, "cfg": cfg, "ckpt": ckpt, "hf": root / "kinds_hf", "cls": cls,
            "config": config}


# ------------------------------------------------------------------ every kind: Megatron logits == HF logits
def test_every_kind_on_moe_layers_exports_the_same_logits(exported):
    cls, config, hf = exported["cls"], exported["config"], exported["hf"]
    assert cls == "MixLNMoeForCausalLM" and config["model_type"] == "mixln_moe"
    assert config["layer_kinds"] == ["post", "deepnorm", "sandwich", "pre"]
    assert config["mlp_only_layers"] == [0] and config["shared_expert_intermediate_size"] == SHARED_FFN
    assert config["num_experts"] == EXPERTS and config["num_experts_per_tok"] == TOPK
    assert {"configuration_mixln_moe.py", "modeling_mixln_moe.py"} <= set(os.listdir(hf))
    names = tensors(hf)
    assert names["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (64, EXPERT_FFN)
    assert names["model.layers.1.mlp.shared_expert.up_proj.weight"].shape == (SHARED_FFN, 64)
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names


def test_lns_and_pre_softmax_routing_export_the_same_logits(tmp_path):
    """LayerNorm Scaling on MoE layers, a gated shared expert in a Mix-LN model, and the k weights
    not renormalised (--moe-router-pre-softmax -> norm_topk_prob false)."""
    model, cfg = build_moe_gpt("pre:1-2,sandwich:3-4", scheme="mixln+lns", gate=True, pre_softmax=True)
    cls, config, _ = assert_parity(model, cfg, tmp_path, "presoftmax")
    assert cls == "MixLNMoeForCausalLM" and config["norm_topk_prob"] is False and config["shared_expert_gate"] is True
    assert config["mixln_scheme"] == "mixln+lns"


def test_an_export_reads_one_expert_at_a_time(exported, tmp_path, monkeypatch):
    """Memory: an MoE layer's experts are read as one expert's box each, never the layer's [E, ...] tensor."""
    from mixln_megatron.convert.dcp_files import DCPFiles
    from mixln_megatron.convert.torch_dist_reader import TorchDistCheckpoint

    boxes, calls, read, read_layer = [], [], DCPFiles.read, TorchDistCheckpoint.read_layer

    def recording(self, wanted):
        boxes.extend((key, tuple(box[1].shape)) for key, box in wanted.items())
        return read(self, wanted)

    def layer_reads(self, layer, roles):
        roles = list(roles)
        calls.append({role.split(".")[1] for role in roles if role.startswith("experts.")})
        return read_layer(self, layer, roles)

    monkeypatch.setattr(DCPFiles, "read", recording)
    monkeypatch.setattr(TorchDistCheckpoint, "read_layer", layer_reads)
    to_hf(str(exported["ckpt"]), str(tmp_path / "hf"), progress=False)
    experts = [shape for key, shape in boxes if ".experts.experts." in key]
    assert len(experts) == 3 * EXPERTS * 2 and all(shape[0] == 1 for shape in experts), experts
    assert {shape[1:] for shape in experts} == {(2 * EXPERT_FFN, 64), (64, EXPERT_FFN)}
    assert all(len(experts) <= 1 for experts in calls), calls  # never two experts' tensors in memory at once


# ------------------------------------------------------------------ HF -> Megatron -> HF
def test_round_trip_is_bit_identical_and_loads_into_the_gpt_model(exported):
    root = exported["root"]
    summary = from_hf(str(exported["hf"]), str(root / "back_megatron"), progress=False)
    assert "--num-experts" in summary["launch_flags"] and "[0,1,1,1]" in summary["launch_flags"]
    to_hf(str(root / "back_megatron"), str(root / "back_hf"), progress=False)
    a, b = tensors(exported["hf"]), tensors(root / "back_hf")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # megatron-core loads the from-hf checkpoint into the GPTModel: the same logits, bit for bit
    fresh, _ = build_moe_gpt(KINDS, seed=99)
    mu.load_chunks([fresh], str(root / "back_megatron" / "release"))
    ids, want = megatron_logits(exported["model"])
    assert torch.equal(megatron_logits(fresh.eval())[1], want)


# ------------------------------------------------------------------ all-pre models: stock classes
def test_all_pre_without_shared_expert_exports_as_mixtral_and_back(tmp_path):
    """Every layer MoE (megatron then stacks the layer keys), no shared expert: stock Mixtral."""
    model, cfg = build_moe_gpt("pre:*", freq=1, shared=None)
    cls, config, _ = assert_parity(model, cfg, tmp_path, "mixtral")
    assert cls == "MixtralForCausalLM" and config["model_type"] == "mixtral" and "auto_map" not in config
    assert config["num_local_experts"] == EXPERTS and config["intermediate_size"] == EXPERT_FFN
    assert not [f for f in os.listdir(tmp_path / "mixtral_hf") if f.endswith(".py")]
    assert "model.layers.2.block_sparse_moe.experts.1.w3.weight" in tensors(tmp_path / "mixtral_hf")
    from_hf(str(tmp_path / "mixtral_hf"), str(tmp_path / "mixtral_back"), progress=False)
    fresh, _ = build_moe_gpt("pre:*", seed=99, freq=1, shared=None)
    mu.load_chunks([fresh], str(tmp_path / "mixtral_back" / "release"))
    assert torch.equal(megatron_logits(fresh.eval())[1], megatron_logits(model)[1])


def test_all_pre_with_gated_shared_expert_and_dense_layer_exports_as_qwen2_moe(tmp_path):
    model, cfg = build_moe_gpt("pre:*", gate=True)
    cls, config, _ = assert_parity(model, cfg, tmp_path, "qwen")
    assert cls == "Qwen2MoeForCausalLM" and config["model_type"] == "qwen2_moe"
    assert config["mlp_only_layers"] == [0] and config["norm_topk_prob"] is True and config["qkv_bias"] is False
    from_hf(str(tmp_path / "qwen_hf"), str(tmp_path / "qwen_back"), progress=False)
    to_hf(str(tmp_path / "qwen_back"), str(tmp_path / "qwen_again"), progress=False)
    a, b = tensors(tmp_path / "qwen_hf"), tensors(tmp_path / "qwen_again")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_stock_qwen2_moe_folder_converts(tmp_path):
    """A folder transformers itself saved (Qwen2-MoE: routing without renormalisation by default)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    hf = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=mu.VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], qkv_bias=False, tie_word_embeddings=False))
    hf.save_pretrained(str(tmp_path / "stock"))
    summary = from_hf(str(tmp_path / "stock"), str(tmp_path / "megatron"), progress=False)
    assert "--moe-router-pre-softmax" in summary["launch_flags"] and "[1,0,1]" in summary["launch_flags"]
    to_hf(str(tmp_path / "megatron"), str(tmp_path / "again"), progress=False)
    assert json.load(open(tmp_path / "again" / "config.json"))["norm_topk_prob"] is False
    a, b = tensors(tmp_path / "stock"), tensors(tmp_path / "again")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_folder_the_hf_mixln_moe_model_saved_converts(tmp_path):
    """A MixLNMoeForCausalLM saved by transformers (hf.save_hf_folder: per-expert hub names on disk)."""
    from mixln_megatron.hf import export_code
    from mixln_megatron.hf.configuration_mixln_moe import MixLNMoeConfig
    from mixln_megatron.hf.modeling_mixln_moe import MixLNMoeForCausalLM

    torch.manual_seed(0)
    cfg = MixLNMoeConfig(vocab_size=mu.VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         layer_kinds=["sandwich", "post", "pre"], post_ln_layers=1, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32, shared_expert_intermediate_size=24, mlp_only_layers=[2],
                         tie_word_embeddings=False)
    export_code.save_hf_folder(MixLNMoeForCausalLM(cfg), str(tmp_path / "saved"))
    from_hf(str(tmp_path / "saved"), str(tmp_path / "megatron"), progress=False)
    to_hf(str(tmp_path / "megatron"), str(tmp_path / "again"), progress=False)
    a, b = tensors(tmp_path / "saved"), tensors(tmp_path / "again")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert json.load(open(tmp_path / "again" / "config.json"))["layer_kinds"] == ["sandwich", "post", "pre"]


# ------------------------------------------------------------------ inspect, refusals
def test_inspect_names_the_experts(exported, capsys):
    from mixln_megatron.convert.cli import main

    assert main(["inspect", "--load", str(exported["ckpt"])]) == 0
    out = capsys.readouterr().out
    for line in ("num_experts: 4", "moe_router_topk: 2", "moe_ffn_hidden_size: 48", "dense_layers: [1]",
                 "moe_layers: [2, 3, 4]", "shared_expert_intermediate_size: 40", "layout: post:1,deepnorm:2,sandwich:3,pre:4"):
        assert line in out, (line, out)
    assert main(["inspect", "--check", "--load", str(exported["ckpt"])]) == 0  # every pickle through the allow-list


@pytest.mark.parametrize("flag,value", [
    ("moe_router_score_function", "sigmoid"),
    ("moe_router_enable_expert_bias", True),
    ("moe_expert_capacity_factor", 1.0),
    ("moe_latent_size", 16),
    ("add_bias_linear", True),
])
def test_routing_a_conversion_cannot_carry_is_refused_in_one_line(exported, tmp_path, capsys, flag, value):
    from mixln_megatron.convert.cli import main

    ckpt = save_megatron(exported["model"], exported["cfg"], tmp_path / "ckpt", **{flag: value})
    assert main(["to-hf", "--load", str(ckpt), "--save", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    name = "--disable-bias-linear" if flag == "add_bias_linear" else "--" + flag.replace("_", "-")
    assert len(err.splitlines()) == 1 and name in err, err
    assert not (tmp_path / "out").exists()


def test_a_truncated_or_forged_expert_tensor_is_refused(exported, tmp_path):
    import shutil

    # the args say experts of FFN 32, the tensors hold 48: refused before anything is written
    forged = save_megatron(exported["model"], exported["cfg"], tmp_path / "forged", moe_ffn_hidden_size=32)
    with pytest.raises(ConversionError, match=r"experts\.linear_fc1\.weight has shape \(4, 96, 64\), the args imply "
                                              r"\(4, 64, 64\)"):
        to_hf(str(forged), str(tmp_path / "out"), progress=False)
    # a layer the args call dense holds experts
    with pytest.raises(ConversionError, match="moe_layer_freq"):
        to_hf(str(save_megatron(exported["model"], exported["cfg"], tmp_path / "freq", moe_layer_freq=[0, 0, 1, 1])),
              str(tmp_path / "out"), progress=False)
    # the file holding the experts cut short
    cut = tmp_path / "cut"
    shutil.copytree(exported["ckpt"], cut)
    for f in (cut / "iter_0000001").glob("*.distcp"):
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) - 64)
    with pytest.raises(ConversionError):
        to_hf(str(cut), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ expert / tensor parallel saves (2 ranks)
@pytest.mark.mp
def test_ep2_and_tp2_saves_export_the_ep1_tensors_and_from_hf_loads_at_ep2(exported):
    """Saved at EP2 (each rank 2 of the 4 experts) and at TP2 + SP: DCP reads reshard them, so the
    export is the EP1 one, tensor for tensor; the from-hf checkpoint loads at EP2 with EP1's logits."""
    root = exported["root"]
    back = root / "ep_back_megatron"
    from_hf(str(exported["hf"]), str(back), progress=False)
    out = root / "parallel"
    out.mkdir()
    mu.torchrun(os.path.join(HERE, "workers", "moe_convert_worker.py"), 2,
                exported["ckpt"] / "iter_0000001", back / "release", out)
    want = tensors(exported["hf"])
    for name in ("ep2", "tp2"):
        to_hf(str(out / name), str(out / f"{name}_hf"), progress=False)
        got = tensors(out / f"{name}_hf")
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), name
    ep2 = torch.load(out / "ep2_from_hf.pt")
    assert ep2["local_experts"] == 2
    assert float((ep2["logits"] - megatron_logits(exported["model"])[1]).abs().max()) <= 1e-6


# ------------------------------------------------------------------ the from-hf checkpoint trains (slow)
PRETRAIN_MOE = ["--cpu", "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128",
                "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
                "--seq-length", "16", "--max-position-embeddings", "16", "--normalization", "RMSNorm",
                "--norm-epsilon", "1e-5", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
                "--untie-embeddings-and-output-weights", "--micro-batch-size", "2", "--global-batch-size", "4",
                "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0", "--eval-interval", "1000",
                "--log-interval", "1", "--num-workers", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
                "--vocab-size", "128", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
                "--moe-shared-expert-intermediate-size", "40", "--moe-token-dispatcher-type", "allgather",
                "--moe-layer-freq", "[0,1,1,1]", "--mixln-layout", KINDS, "--ckpt-format", "torch_dist"]


@pytest.mark.slow
@pytest.mark.mp
@pytest.mark.parametrize("ep", [1, 2])
def test_the_from_hf_checkpoint_trains_with_pretrain(exported, tmp_path, ep):
    from test_pretrain import train

    ckpt = tmp_path / "from_hf"
    from_hf(str(exported["hf"]), str(ckpt), transformer_impl="local", progress=False)
    out = train(PRETRAIN_MOE + ["--load", str(ckpt), "--expert-model-parallel-size", str(ep),
                                "--save", str(tmp_path / "cont"), "--save-interval", "2"], nproc=ep, timeout=600)
    assert "loading release" in out and " iteration        2/       2 |" in out, out[-3000:]
    assert open(tmp_path / "cont" / "latest_checkpointed_iteration.txt").read().strip() == "2"


def test_what_stays_refused(exported, tmp_path):
    """Legacy per-rank files and GPT <-> hybrid conversion do not carry experts: one line each."""
    from mixln_megatron.convert import convert_gpt_to_hybrid

    with pytest.raises(ConversionError, match="torch_dist checkpoints only"):
        from_hf(str(exported["hf"]), str(tmp_path / "legacy"), ckpt_format="torch", progress=False)
    with pytest.raises(UnsupportedModelError, match="MoE layers"):
        convert_gpt_to_hybrid(str(exported["ckpt"]), str(tmp_path / "hybrid"))
    assert not (tmp_path / "legacy").exists() and not (tmp_path / "hybrid").exists()
