"""`mixln-megatron analyze` on an MoE checkpoint: a tiny Mix-LN MoE model (a dense first layer, then
MoE layers of 4 experts, top-2, with a gated shared expert; Post-LN, Sandwich and Pre-LN layers) is
trained for 3 iterations by `mixln-megatron pretrain` (torch_dist, per-layer keys), then
angular-distance and layer-drop read it with --load through the command line. What stays refused
(an MoE Hugging Face folder, a checkpoint whose tensors the args do not describe) is one line, exit 2.
The loaded model computes what megatron computed in evaluation: sinkhorn's and quantile balancing's
routing (its saved qb_beta), and TE grouped GEMM's GLU-interleaved fc1 rows (put back in order for
the CPU model's sequential experts), each against the megatron model's own logits.
"""

import json
import math
import os

import pytest

from harness import testing as mu

from test_pretrain import TINY, train

VOCAB = ["--vocab-size", "4096"]  # the shipped tokenizer's ids (the analyses' default text) fit
ROUTED = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "allgather",
          "--moe-ffn-hidden-size", "48"]
MOE = [*ROUTED, "--moe-layer-freq", "[0,1,1,1]", "--moe-shared-expert-intermediate-size", "32",
       "--moe-shared-expert-gate"]
LAYOUT = "post:1,sandwich:2,pre:3-4"


def _tiny_args():
    args = list(TINY)
    i = args.index("--vocab-size")
    args[i:i + 2] = VOCAB
    return args


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    save = tmp_path_factory.mktemp("moe") / "ckpt"
    out = train(["--cpu", *_tiny_args(), *MOE, "--mixln-layout", LAYOUT, "--train-iters", "3",
                 "--eval-iters", "0", "--save", str(save), "--save-interval", "3", "--ckpt-format", "torch_dist"])
    assert os.path.isdir(save / "iter_0000003"), out[-3000:]
    return save


def _analyze(*argv):
    from mixln_megatron.analysis.cli import main

    return main(list(argv))


def test_angular_distance_and_layer_drop_read_an_moe_checkpoint(moe_checkpoint, tmp_path, capsys):
    common = ["--load", str(moe_checkpoint), "--tokens", "256", "--seq-length", "32", "--batch-size", "4"]
    assert _analyze("angular-distance", *common, "--out-dir", str(tmp_path / "a")) == 0, capsys.readouterr().err
    res = json.loads((tmp_path / "a" / "angular_distance.json").read_text())
    assert res["num_layers"] == 4 and len(res["matrix"]) == 4 and len(res["adjacent"]) == 4
    assert all(math.isfinite(x) and 0 <= x <= 1 for row in res["matrix"] for x in row if x is not None)
    assert all(x > 0 for x in res["adjacent"])  # every layer, the MoE ones included, moves the stream
    assert "post:1,sandwich:2,pre:3-4" in res["model"] or "Post-LN layers: 1" in res["model"], res["model"]

    assert _analyze("layer-drop", *common, "--out-dir", str(tmp_path / "d")) == 0, capsys.readouterr().err
    res = json.loads((tmp_path / "d" / "layer_drop.json").read_text())
    base = res["baseline"]
    assert res["num_layers"] == 4 and [r["layer"] for r in res["layers"]] == [1, 2, 3, 4]
    assert base["tokens"] == 256 and math.isfinite(base["loss"])
    for row in res["layers"]:  # bypassing any layer, dense or MoE, changes the loss (bit-identical if not bypassed)
        assert math.isfinite(row["loss"]) and abs(row["loss"] - base["loss"]) > 1e-6, row


def test_the_loaded_moe_model_is_the_trained_one(moe_checkpoint, mcore_single):
    """Every expert, the router, the shared expert and its gate come from the checkpoint (not the
    init): each differs from a freshly built model's and equals the checkpoint's own tensor."""
    from mixln_megatron.analysis.loading import inspect_for_analysis, load_megatron_checkpoint

    lm = load_megatron_checkpoint(str(moe_checkpoint))
    layers = lm.layers
    assert type(layers[0].mlp).__name__ == "MLP" and all(type(l.mlp).__name__ == "MoELayer" for l in layers[1:])
    moe = layers[2].mlp
    assert len(moe.experts.local_experts) == 4 and moe.shared_experts is not None
    assert lm.module.config.moe_token_dispatcher_type == "allgather" and not lm.module.config.moe_grouped_gemm
    reader = inspect_for_analysis(str(moe_checkpoint), None).reader
    experts = reader.read("decoder.layers.2.mlp.experts.experts.linear_fc2.weight", (0, 0, 0),
                          reader.global_shape("decoder.layers.2.mlp.experts.experts.linear_fc2.weight"))
    for e in range(4):
        assert (moe.experts.local_experts[e].linear_fc2.weight.detach() == experts[e]).all()
    gate = "decoder.layers.2.mlp.shared_experts.gate_weight"
    assert (moe.shared_experts.gate_weight.detach() == reader.read(gate, (0, 0), reader.global_shape(gate))).all()


def test_what_stays_refused(moe_checkpoint, tmp_path, capsys):
    # an MoE Hugging Face folder: the analyses read MoE models from Megatron checkpoints
    from transformers import MixtralConfig, MixtralForCausalLM

    hf = tmp_path / "hf"
    MixtralForCausalLM(MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2)).save_pretrained(hf)
    capsys.readouterr()
    assert _analyze("layer-drop", "--hf", str(hf), "--out-dir", str(tmp_path / "x")) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(err) == 1 and "MoE" in err[0] and "--load" in err[0], err
    # a Mix-LN override that leaves checkpoint tensors without a place (layer 2's sandwich norms
    # when P = 1 makes it Pre-LN) is refused rather than dropping them
    assert _analyze("angular-distance", "--load", str(moe_checkpoint), "--mixln-post-ln-layers", "1",
                    "--tokens", "64", "--out-dir", str(tmp_path / "y")) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(err) == 1 and "decoder.layers.1.mixln_norm_" in err[0], err


def test_grad_norms_of_fresh_moe_models(mcore_single, tmp_path, capsys):
    """`analyze grad-norms --num-experts 4`: every layer an MoE layer; each layer's norm covers its
    router and experts, so it differs from the dense model's of the same seed."""
    common = ["grad-norms", "--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "2",
              "--seq-length", "16", "--batch-size", "2", "--num-batches", "1", "--seeds", "1",
              "--variants", "pre_ln,mix_ln"]
    assert _analyze(*common, "--num-experts", "4", "--moe-router-topk", "2", "--out-dir", str(tmp_path / "m")) == 0
    moe = json.loads((tmp_path / "m" / "grad_norms.json").read_text())
    assert moe["moe"] == {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48}
    assert "MoE 4 experts top-2" in capsys.readouterr().out
    assert _analyze(*common, "--out-dir", str(tmp_path / "d")) == 0
    dense = json.loads((tmp_path / "d" / "grad_norms.json").read_text())
    for name in ("pre_ln", "mix_ln"):
        norms = moe["variants"][name]["mean"]
        assert len(norms) == 3 and all(math.isfinite(x) and x > 0 for x in norms)
        assert all(abs(m - d) > 1e-6 * d for m, d in zip(norms, dense["variants"][name]["mean"]))
    assert _analyze(*common, "--num-experts", "2", "--moe-router-topk", "3", "--out-dir", str(tmp_path / "x")) == 2


def test_the_saved_routing_is_carried_and_the_execution_is_the_cpu_s():
    """The analysis loader's MoE settings: what changes a layer's output comes from the saved args; how the experts ran
    (grouped GEMM, alltoall, fusions) is replaced by what runs in one CPU process; latent MoE is
    refused in one line naming its flag; a dense model gets nothing."""
    from argparse import Namespace

    from mixln_megatron.analysis import loading

    saved = Namespace(num_experts=8, moe_router_topk=3, moe_ffn_hidden_size=64, moe_layer_freq=[0, 1],
                      moe_router_pre_softmax=True, moe_router_score_function="sigmoid",
                      moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=32,
                      moe_shared_expert_gate=True, moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
                      moe_permute_fusion=True, moe_latent_size=None)
    fields = loading.moe_config_fields(saved)
    assert fields["num_moe_experts"] == 8 and fields["moe_router_topk"] == 3 and fields["moe_layer_freq"] == [0, 1]
    assert fields["moe_router_pre_softmax"] and fields["moe_router_score_function"] == "sigmoid"
    assert fields["moe_router_enable_expert_bias"] and fields["moe_shared_expert_gate"]
    assert fields["moe_token_dispatcher_type"] == "allgather" and not fields["moe_grouped_gemm"]
    assert not fields["moe_permute_fusion"]
    assert loading.moe_config_fields(Namespace(num_experts=None, moe_latent_size=16)) == {}
    saved.moe_latent_size = 16
    with pytest.raises(loading.MoEAnalysisError) as info:
        loading.moe_config_fields(saved)
    assert "\n" not in str(info.value) and "--moe-latent-size=16" in str(info.value)
    from mixln_megatron.convert.torch_dist_reader import local_expert

    assert local_expert("mlp.experts.local_experts.3.linear_fc2.weight") == (3, "fc2")
    assert local_expert("mlp.shared_experts.linear_fc1.weight") is None


@pytest.mark.slow
def test_a_uniform_moe_stack_with_stacked_keys(tmp_path):
    """Every layer MoE (megatron stacks the keys [L, ...], experts [L, E, ...]), every kind in one
    model (deepnorm's and sandwich's norms included): layer-drop reads it and each layer counts."""
    save = tmp_path / "ckpt"
    train(["--cpu", *_tiny_args(), *ROUTED, "--mixln-layout", "post:1,sandwich:2,deepnorm:3,pre:4", "--train-iters",
           "3", "--eval-iters", "0", "--save", str(save), "--save-interval", "3", "--ckpt-format", "torch_dist"])
    assert _analyze("layer-drop", "--load", str(save), "--tokens", "128", "--seq-length", "32",
                    "--out-dir", str(tmp_path / "d")) == 0
    res = json.loads((tmp_path / "d" / "layer_drop.json").read_text())
    assert "deepnorm:3" in res["model"] and [r["layer"] for r in res["layers"]] == [1, 2, 3, 4]
    assert all(abs(r["loss"] - res["baseline"]["loss"]) > 1e-6 for r in res["layers"])


# ------------------------------------------------------------------ the loaded model is megatron's forward
def _interleaved(fc1: "torch.Tensor", size: int) -> "torch.Tensor":
    """Plain [gate; up] fc1 rows -> TE grouped GEMM's [gate s; up s] blocks."""
    import torch

    gate, up = fc1.chunk(2)
    return torch.stack([gate.reshape(-1, size, fc1.shape[1]), up.reshape(-1, size, fc1.shape[1])], 1).reshape(fc1.shape)


def _fc1_interleaved(model, size: int, shared_size: int) -> dict:
    """{parameter: its plain rows} after laying the experts' and the shared expert's fc1 rows out
    GLU-interleaved in place, as a run with TE grouped GEMM (and the fused shared expert) holds them."""
    import torch

    plain = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            block = size if "local_experts" in name else shared_size if "shared_experts" in name else None
            if block is not None and name.endswith("linear_fc1.weight"):
                plain[p] = p.detach().clone()
                p.copy_(_interleaved(p, block))
    return plain


ROUTINGS = {
    "sinkhorn": (dict(moe_router_load_balancing_type="sinkhorn"), {}),
    "quantile": (dict(moe_router_load_balancing_type="quantile_balancing"), {}),
    "glu-interleave": (dict(moe_shared_expert_intermediate_size=32), dict(
        moe_grouped_gemm=True, moe_mlp_glu_interleave_size=8, use_grouped_gemm_for_shared_expert=True,
        moe_shared_expert_glu_interleave_size=4)),
}


@pytest.mark.parametrize("case", list(ROUTINGS))
def test_the_loaded_model_computes_megatron_s_evaluation_forward(case, mcore_single, tmp_path):
    """The analysis model's logits equal those of the megatron model that was saved (in eval()):
    the routing it ran, the buffer it learnt (quantile balancing's qb_beta), the rows as it held them."""
    import torch

    from test_convert_moe import megatron_logits, save_megatron
    from test_convert_moe_routing import build, saved_args

    from mixln_megatron.analysis.loading import load_megatron_checkpoint

    config, args = ROUTINGS[case]
    model, cfg = build(**config)
    if case == "quantile":  # a learnt per-expert bias that changes which experts are chosen
        g = torch.Generator().manual_seed(1)
        for layer in model.decoder.layers:
            layer.mlp.router.qb_beta.copy_(3 * torch.randn(layer.mlp.router.qb_beta.shape, generator=g))
    plain = _fc1_interleaved(model, 8, 4) if case == "glu-interleave" else {}
    ckpt = save_megatron(model, cfg, tmp_path / "ckpt", **{**saved_args(cfg), **args})
    with torch.no_grad():  # back to the rows megatron's sequential experts compute with
        for p, rows in plain.items():
            p.copy_(rows)
    lm = load_megatron_checkpoint(str(ckpt))
    ids, want = megatron_logits(model)
    _, _, pos, mask = mu.batch(seed=11)
    with torch.no_grad():
        got = lm.module(ids, pos, mask)
    diff = float((got - want).abs().max())
    print(f"{case}: max |analysis - megatron| logits {diff:.3g}")
    assert diff <= 1e-5, (case, diff)


def test_glu_interleave_saved_by_several_ranks_is_refused_in_one_line(mcore_single, tmp_path, capsys):
    from argparse import Namespace

    from test_convert_moe import save_megatron
    from test_convert_moe_routing import build, saved_args

    from mixln_megatron.analysis import loading

    model, cfg = build()
    ckpt = save_megatron(model, cfg, tmp_path / "ckpt", **saved_args(cfg), moe_grouped_gemm=True,
                         moe_mlp_glu_interleave_size=8, expert_tensor_parallel_size=2)
    capsys.readouterr()
    assert _analyze("layer-drop", "--load", str(ckpt), "--tokens", "64", "--out-dir", str(tmp_path / "d")) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(err) == 1 and "--moe-mlp-glu-interleave-size=8" in err[0] and "size 2" in err[0], err

    saved = Namespace(num_experts=4, moe_router_topk=2, swiglu=True, moe_grouped_gemm=True,
                      moe_mlp_glu_interleave_size=8, expert_tensor_parallel_size=2)
    with pytest.raises(loading.MoEAnalysisError) as info:
        loading.moe_config_fields(saved)
    assert "\n" not in str(info.value) and "--moe-mlp-glu-interleave-size" in str(info.value)
    saved.moe_grouped_gemm = False  # sequential experts ignored the setting: plain rows, nothing to refuse
    assert "moe_mlp_glu_interleave_size" not in loading.moe_config_fields(saved)
