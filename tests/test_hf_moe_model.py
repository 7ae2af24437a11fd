"""The Hugging Face Mix-LN mixture-of-experts model (mixln_megatron.hf, model_type "mixln_moe") and its export helpers.

CPU, fp32, tiny configs. The reference below is plain PyTorch written from the formulas: each layer kind's norm
placement around F = attention, then the FFN (test_hf_layer_kinds' RMSNorm, RoPE and causal GQA attention), with
the MoE FFN in Megatron's own routing form, so that equality also checks the HF routing against Megatron's:
    norm_topk_prob True   top-k over the router logits, softmax over the k selected
    norm_topk_prob False  softmax over all E experts, top-k, no renormalisation (--moe-router-pre-softmax)
    MoE(h) = sum_e w_e * down_e(silu(gate_e h) * up_e h)  [+ shared(h), times sigmoid(h @ g^T) with the gate]
every expert computed densely and weighted by w_e (0 off the top k). It reads the parameters by the contract's
names: the fused experts `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `down_proj` [E, H, I].
It imports nothing of the project's model code nor transformers' MoE classes.
"""

import ast
import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
# The MoE model is built from transformers 5's fused Qwen2-MoE experts (absent from 4.x).
pytest.importorskip("transformers.conversion_mapping", reason="the Mix-LN MoE model needs transformers >= 5")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig  # noqa: E402

from mixln_megatron.hf import (  # noqa: E402
    MOE_AUTO_MAP,
    MOE_CODE_FILES,
    MixLNConfigValueError,
    MixLNLlamaConfig,
    MixLNMoeConfig,
    MixLNMoeForCausalLM,
    MixLNMoeModel,
    MixLNMoeSparseMoeBlock,
    moe_config_for_export,
    moe_export_config_fields,
    save_hf_folder,
    stock_moe_model_type,
    write_model_code,
)
from mixln_megatron.hf.modeling_mixln_moe import MixLNMoePreTrainedModel  # noqa: E402
from test_hf_layer_kinds import attn, rms  # noqa: E402  (the dense reference's attention and norm)

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
DN_ALPHA = 8 ** 0.25
MIXED = ["deepnorm", "sandwich", "post", "pre"]


def moe_config(kinds=MIXED, scheme="mixln", **over):
    kw = dict(TINY, **MOE, num_hidden_layers=len(kinds))
    kw.update(over)
    deep = "deepnorm" in kinds
    return MixLNMoeConfig(layer_kinds=list(kinds), post_ln_layers=sum(k in ("post", "deepnorm") for k in kinds),
                          mixln_scheme=scheme, deepnorm_alpha=DN_ALPHA if deep else None, **kw)


def randomize_(model, seed=0):
    """Random weights; norm weights far from 1; router weights large enough to route tokens differently."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight") or "shared_expert_gate" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model.eval()


def build(kinds=MIXED, scheme="mixln", seed=0, **over):
    torch.manual_seed(seed)
    return randomize_(MixLNMoeForCausalLM(moe_config(kinds, scheme, **over)), seed)


# ----------------------------------------------------------------------------- independent reference


def swiglu(x, gate, up, down):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def ref_moe(x, W, p, cfg, norm_topk):
    E, k, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    t = x.reshape(-1, x.shape[-1])
    logits = t @ W[p + "mlp.gate.weight"].T
    if norm_topk:  # Megatron's default: softmax over the k selected logits
        top, idx = logits.topk(k, dim=-1)
        weights = top.softmax(-1)
    else:  # --moe-router-pre-softmax
        weights, idx = logits.softmax(-1).topk(k, dim=-1)
    out = torch.zeros_like(t)
    for e in range(E):
        gate_up, down = W[p + "mlp.experts.gate_up_proj"][e], W[p + "mlp.experts.down_proj"][e]
        w_e = (weights * (idx == e)).sum(-1, keepdim=True)
        out = out + w_e * swiglu(t, gate_up[:I], gate_up[I:], down)
    if cfg.shared_expert_intermediate_size is not None:
        s = p + "mlp.shared_expert."
        shared = swiglu(t, W[s + "gate_proj.weight"], W[s + "up_proj.weight"], W[s + "down_proj.weight"])
        if cfg.shared_expert_gate:
            shared = torch.sigmoid(t @ W[p + "mlp.shared_expert_gate.weight"].T) * shared
        out = out + shared
    return out.reshape(x.shape)


def ref_ffn(x, W, p, cfg, i, norm_topk):
    if i in cfg.mlp_only_layers:
        return swiglu(x, W[p + "mlp.gate_proj.weight"], W[p + "mlp.up_proj.weight"], W[p + "mlp.down_proj.weight"])
    return ref_moe(x, W, p, cfg, norm_topk)


def reference_spec(kinds, scheme="mixln", **over):
    """What the reference reads (the case's own values, not the model's config): TINY, MOE and the case."""
    spec = dict(TINY, **MOE, num_hidden_layers=len(kinds), layer_kinds=list(kinds), mixln_scheme=scheme,
                norm_topk_prob=True, shared_expert_intermediate_size=None, shared_expert_gate=False,
                mlp_only_layers=[], tie_word_embeddings=False,
                head_dim=TINY["hidden_size"] // TINY["num_attention_heads"])
    spec.update(over)
    return SimpleNamespace(**spec)


def ref_logits(W, ids, cfg, norm_topk=None):
    """cfg: a reference_spec; norm_topk overrides its routing normalisation."""
    norm_topk = cfg.norm_topk_prob if norm_topk is None else norm_topk
    x = W["model.embed_tokens.weight"][ids]
    for i in range(cfg.num_hidden_layers):
        kind, p, eps = cfg.layer_kinds[i], f"model.layers.{i}.", cfg.rms_norm_eps
        s = 1.0 / (i + 1) ** 0.5 if cfg.mixln_scheme != "mixln" and kind in ("pre", "sandwich") else 1.0

        def n(name, t):
            return rms(t, W[p + name + ".weight"], eps)

        def ffn(t):
            return ref_ffn(t, W, p, cfg, i, norm_topk)

        if kind == "pre":
            h = x + attn(s * n("input_layernorm", x), W, p, cfg)
            x = h + ffn(s * n("post_attention_layernorm", h))
        elif kind in ("post", "deepnorm"):
            a = DN_ALPHA if kind == "deepnorm" else 1.0
            h = n("post_attention_layernorm", a * x + attn(x, W, p, cfg))
            x = n("post_feedforward_layernorm", a * h + ffn(h))
        else:
            h = x + n("post_attention_layernorm", attn(s * n("input_layernorm", x), W, p, cfg))
            x = h + n("post_feedforward_layernorm", ffn(s * n("pre_feedforward_layernorm", h)))
    head = W["model.embed_tokens.weight"] if cfg.tie_word_embeddings else W["lm_head.weight"]
    return rms(x, W["model.norm.weight"], cfg.rms_norm_eps) @ head.T


# ----------------------------------------------------------------------------- the model against the reference

REF_CASES = {
    # every kind, routed experts only, Megatron's default routing
    "kinds": dict(kinds=MIXED),
    # LNS on Mix-LN, a gated shared expert, pre-softmax routing
    "lns-gated-shared-presoftmax": dict(kinds=["post", "pre", "sandwich", "pre"], scheme="mixln+lns",
                                        shared_expert_intermediate_size=24, shared_expert_gate=True,
                                        norm_topk_prob=False),
    # LNS only on pre / sandwich, an ungated shared expert, a dense first layer
    "lns-dense-first-ungated": dict(kinds=["sandwich", "pre", "sandwich", "pre"], scheme="lns",
                                    shared_expert_intermediate_size=24, mlp_only_layers=[0]),
    # dense layers between MoE ones, Post-LN kinds on MoE and dense layers, gated shared expert
    "mixed-dense-gated": dict(kinds=["pre", "post", "deepnorm", "pre"], mlp_only_layers=[0, 2],
                              shared_expert_intermediate_size=24, shared_expert_gate=True, tie_word_embeddings=True),
}


@pytest.mark.parametrize("case", list(REF_CASES))
def test_logits_and_gradients_equal_reference(case):
    over = dict(REF_CASES[case])
    kinds, scheme = over.pop("kinds"), over.pop("scheme", "mixln")
    model = build(kinds, scheme, seed=3, **over)
    cfg = reference_spec(kinds, scheme, **over)
    moe_layers = [i for i in range(4) if i not in cfg.mlp_only_layers]
    assert [isinstance(model.model.layers[i].mlp, MixLNMoeSparseMoeBlock) for i in range(4)] == \
        [i in moe_layers for i in range(4)]
    W = {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}
    ids = torch.randint(3, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))

    out = model(ids, labels=ids)
    out.loss.backward()
    want = ref_logits(W, ids, cfg)
    F.cross_entropy(want[:, :-1].reshape(-1, want.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    assert torch.allclose(out.logits, want, rtol=1e-5, atol=1e-5), (out.logits - want).abs().max()
    for name, p in model.named_parameters():
        assert p.grad is not None and W[name].grad is not None, name
        assert torch.allclose(p.grad, W[name].grad, rtol=1e-5, atol=1e-5), (name, (p.grad - W[name].grad).abs().max())
    # The reference discriminates: the other routing normalisation changes the logits.
    with torch.no_grad():
        assert not torch.allclose(out.logits, ref_logits(W, ids, cfg, norm_topk=not cfg.norm_topk_prob), atol=1e-4)


def test_routing_uses_top_k_experts_and_init():
    model = build(seed=1)
    block = model.model.layers[3].mlp
    h = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    _, weights, idx = block.gate(h)
    assert idx.shape == (5, 2) and len(set(idx.flatten().tolist())) > 1  # tokens go to different experts
    assert torch.allclose(weights.sum(-1), torch.ones(5))  # renormalised (Megatron's default routing)
    assert set(MixLNMoePreTrainedModel._no_split_modules) == {
        "MixLNMoePreLNDecoderLayer", "MixLNMoePostLNDecoderLayer", "MixLNMoeDeepNormDecoderLayer",
        "MixLNMoeSandwichDecoderLayer"}
    # A fresh model: router and fused experts get transformers' normal(0, initializer_range) init.
    torch.manual_seed(0)
    fresh = MixLNMoeForCausalLM(moe_config(initializer_range=0.02))
    mlp = fresh.model.layers[0].mlp
    for p in (mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj):
        assert torch.isfinite(p).all() and 0.015 < float(p.std()) < 0.025 and abs(float(p.mean())) < 0.005
    with pytest.raises(TypeError, match="MixLNMoeConfig"):
        MixLNMoeModel(MixLNLlamaConfig(**TINY, num_hidden_layers=2))


# ----------------------------------------------------------------------------- cache and generation


def test_kv_cache_generate_and_incremental_decoding():
    model = build(["pre", "sandwich", "post", "pre"], "mixln+lns", seed=7, mlp_only_layers=[1],
                  shared_expert_intermediate_size=24, shared_expert_gate=True)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(3, 61, (2, 6), generator=g)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
              output_logits=True)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kw)
        plain = model.generate(ids, use_cache=False, **kw)
        assert torch.equal(cached.sequences, plain.sequences)
        assert max(float((a - b).abs().max()) for a, b in zip(cached.logits, plain.logits)) < 1e-4
        # Incremental decoding: a prefix with the cache, then one token at a time == the full forward.
        seq = torch.randint(3, 61, (2, 10), generator=g)
        full = model(seq).logits
        out = model(seq[:, :4], use_cache=True)
        steps = [out.logits]
        cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
        assert cache is not None
        for t in range(4, 10):
            out = model(seq[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
            steps.append(out.logits)
        assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- save / load

def contract_names(cfg):
    """The file names the contract gives a mixln_moe / qwen2_moe folder (per expert), besides embeddings / head."""
    names = set()
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        if i in cfg.mlp_only_layers:
            names |= {p + f"{n}_proj.weight" for n in ("gate", "up", "down")}
            continue
        names.add(p + "gate.weight")
        names |= {p + f"experts.{e}.{n}_proj.weight" for e in range(cfg.num_experts) for n in ("gate", "up", "down")}
        if cfg.shared_expert_intermediate_size is not None:
            names |= {p + f"shared_expert.{n}_proj.weight" for n in ("gate", "up", "down")}
            if cfg.shared_expert_gate:
                names.add(p + "shared_expert_gate.weight")
    return names


def contract_state_dict(model):
    """The model's weights under the contract's per-expert names (the fused experts split)."""
    I = model.config.moe_intermediate_size
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().clone().contiguous()
        if name.endswith("mlp.experts.gate_up_proj"):
            p = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{p}{e}.gate_proj.weight"] = t[e, :I].clone()
                out[f"{p}{e}.up_proj.weight"] = t[e, I:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            p = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


REMOTE_SCRIPT = textwrap.dedent(
    r"""
    import json, sys
    sys.modules["mixln_megatron"] = None  # any import of the project now raises ImportError
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder, ref, resaved = sys.argv[1:4]
    ref = torch.load(ref)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        equal = bool(torch.equal(model(ref["ids"]).logits, ref["logits"]))
    model.save_pretrained(resaved)  # split again by the conversion the remote code registers
    keys = sorted(load_file(resaved + "/model.safetensors"))
    print("RESULT " + json.dumps({"class": type(model).__name__, "module": type(model).__module__,
                                  "layers": [type(l).__name__ for l in model.model.layers],
                                  "logits_equal": equal, "resaved_keys": keys}))
    """
)


def test_save_names_and_remote_code_roundtrip(tmp_path):
    kinds = ["post", "sandwich", "pre", "deepnorm"]
    over = dict(mlp_only_layers=[2], shared_expert_intermediate_size=24, shared_expert_gate=True)
    model = build(kinds, "mixln+lns", seed=11, **over)
    folder = tmp_path / "hf_moe"
    save_hf_folder(model, folder)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["model_type"] == "mixln_moe" and saved["auto_map"] == MOE_AUTO_MAP
    assert saved["architectures"] == ["MixLNMoeForCausalLM"] and saved["layer_kinds"] == kinds
    assert (saved["num_experts"], saved["num_experts_per_tok"], saved["moe_intermediate_size"]) == (4, 2, 16)
    assert (saved["shared_expert_intermediate_size"], saved["shared_expert_gate"], saved["mlp_only_layers"],
            saved["norm_topk_prob"]) == (24, True, [2], True)
    for name in MOE_CODE_FILES:
        assert (folder / name).is_file(), name
    keys = set(load_file(str(folder / "model.safetensors")))
    mlp_keys = {k for k in keys if ".mlp." in k}
    assert mlp_keys == contract_names(reference_spec(kinds, **over))
    assert keys == set(contract_state_dict(model))
    # Norm names as for the dense export.
    assert {"model.layers.0.post_feedforward_layernorm.weight",
            "model.layers.1.pre_feedforward_layernorm.weight"} <= keys

    ids = torch.randint(3, 61, (1, 8), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        logits = model(ids).logits
    torch.save({"ids": ids, "logits": logits}, tmp_path / "ref.pt")
    script = tmp_path / "load_remote.py"
    script.write_text(REMOTE_SCRIPT)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"),
               HF_MODULES_CACHE=str(tmp_path / "hf_modules"), PYTHONWARNINGS="ignore")
    argv = [sys.executable, str(script), str(folder), str(tmp_path / "ref.pt"), str(tmp_path / "resaved")]
    proc = subprocess.run(argv, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["class"] == "MixLNMoeForCausalLM" and "mixln_megatron" not in res["module"]
    assert res["layers"] == ["MixLNMoePostLNDecoderLayer", "MixLNMoeSandwichDecoderLayer",
                             "MixLNMoePreLNDecoderLayer", "MixLNMoeDeepNormDecoderLayer"]
    assert res["logits_equal"]
    assert set(res["resaved_keys"]) == keys

    # In-process, with the project installed: register_auto_classes loads it without remote code.
    from mixln_megatron.hf import register_auto_classes

    register_auto_classes()
    back = AutoModelForCausalLM.from_pretrained(folder)
    assert type(back) is MixLNMoeForCausalLM
    base = transformers.AutoModel.from_pretrained(folder)  # the base model serving backends load
    assert type(base) is MixLNMoeModel
    with torch.no_grad():
        assert torch.equal(back(ids).logits, logits)
        assert torch.equal(base(ids).last_hidden_state, model.model(ids).last_hidden_state)


def test_clear_error_without_fused_experts(monkeypatch):
    """With a transformers that lacks the checkpoint conversion / fused experts (4.x), importing the MoE model
    file fails with one line saying it needs transformers >= 5."""
    import importlib.util

    import mixln_megatron.hf.modeling_mixln_moe as real

    monkeypatch.setitem(sys.modules, "transformers.conversion_mapping", None)  # an import of it now fails
    spec = importlib.util.spec_from_file_location("mixln_megatron.hf._moe_probe", real.__file__)
    with pytest.raises(ImportError, match=r"needs transformers >= 5 \(fused Qwen2-MoE experts\); installed: 5") as err:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert "\n" not in str(err.value)


def test_model_code_is_self_contained(tmp_path):
    paths = write_model_code(tmp_path, "mixln_moe")
    assert sorted(os.path.basename(p) for p in paths) == sorted(MOE_CODE_FILES)
    local = {"." + os.path.splitext(n)[0] for n in MOE_CODE_FILES}
    for p in paths:
        for node in ast.walk(ast.parse(open(p).read())):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {"." + node.module} if node.level else {node.module.split(".")[0]}
            else:
                continue
            assert roots <= {"math", "typing", "torch", "transformers"} | local, (p, roots)
    with pytest.raises(ValueError, match="no model code"):
        write_model_code(tmp_path, "llama")


# ----------------------------------------------------------------------------- stock classes

def llama_kwargs(cfg):
    """The LlamaConfig arguments of `cfg`, as a converter passes them to moe_config_for_export."""
    d = LlamaConfig(**TINY, num_hidden_layers=cfg.num_hidden_layers,
                    tie_word_embeddings=cfg.tie_word_embeddings).to_dict()
    return {k: v for k, v in d.items() if k not in ("model_type", "architectures", "transformers_version")}


def write_folder(path, config_dict, tensors):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config_dict))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def mixtral_names(sd):
    """The contract's names to Mixtral's: block_sparse_moe, w1 (gate) / w3 (up) / w2 (down)."""
    out = {}
    for k, v in sd.items():
        k = k.replace(".mlp.", ".block_sparse_moe.")
        for old, new in ((".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2.")):
            if ".experts." in k:
                k = k.replace(old, new)
        out[k] = v
    return out


def folder_config(model, fields):
    """config.json as a converter writes it: the LLaMA fields plus moe_export_config_fields' keys."""
    base = llama_kwargs(model.config)
    if fields["model_type"] != "mixln_moe":
        for key in ("attention_bias", "mlp_bias", "pretraining_tp"):
            base.pop(key)
    return {**base, **fields}


STOCK_CASES = {
    # (a) routed experts only -> Mixtral
    "mixtral": (dict(), "mixtral", "MixtralForCausalLM"),
    # (b) gated shared expert, dense first layer -> Qwen2-MoE, with either routing
    "qwen2_moe": (dict(shared_expert_intermediate_size=24, shared_expert_gate=True, mlp_only_layers=[0]),
                  "qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen2_moe-presoftmax": (dict(shared_expert_intermediate_size=24, shared_expert_gate=True, norm_topk_prob=False),
                             "qwen2_moe", "Qwen2MoeForCausalLM"),
    # (c) an ungated shared expert: no stock class
    "ungated": (dict(shared_expert_intermediate_size=24), None, "MixLNMoeForCausalLM"),
}


@pytest.mark.parametrize("case", list(STOCK_CASES))
def test_all_pre_exports_as_stock_class_where_exact(case, tmp_path):
    over, want_type, want_class = STOCK_CASES[case]
    model = build(["pre"] * 3, seed=13, **over)
    placement = dict(post_ln_layers=0, mixln_scheme="mixln", layer_kinds=None)
    moe = {k: v for k, v in over.items()}
    assert stock_moe_model_type(**placement, **MOE, **moe) == want_type
    fields = moe_export_config_fields(**placement, **MOE, **moe, num_hidden_layers=3)
    assert fields["model_type"] == (want_type or "mixln_moe")
    assert fields["architectures"] == [want_class]
    config = moe_config_for_export(**placement, **MOE, **moe, **llama_kwargs(model.config))
    assert type(config).model_type == fields["model_type"]

    sd = contract_state_dict(model)
    if want_type == "mixtral":
        sd = mixtral_names(sd)
    folder = tmp_path / case
    write_folder(folder, folder_config(model, fields), sd)
    if want_type is None:
        write_model_code(folder, "mixln_moe")
        from mixln_megatron.hf import register_auto_classes

        register_auto_classes()
    loaded_config = AutoConfig.from_pretrained(folder)
    assert type(loaded_config) is type(config)
    for key, value in config.to_diff_dict().items():
        if key not in ("transformers_version", "auto_map"):
            assert getattr(loaded_config, key) == value, key
    back = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(back).__name__ == want_class
    ids = torch.randint(3, 61, (2, 8), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        assert torch.allclose(back(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_stock_choice_rules():
    pre = dict(post_ln_layers=0, mixln_scheme="mixln")
    gated = dict(shared_expert_intermediate_size=8, shared_expert_gate=True)
    # The stock classes' own spellings.
    assert moe_export_config_fields(**pre, **MOE) == {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
        "num_experts_per_tok": 2, "intermediate_size": 16, "router_jitter_noise": 0.0}
    assert moe_export_config_fields(**pre, **MOE, **gated, mlp_only_layers=[1, 0], num_hidden_layers=3) == {
        "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 8, "mlp_only_layers": [0, 1],
        "decoder_sparse_step": 1, "norm_topk_prob": True, "qkv_bias": False, "use_sliding_window": False}
    assert stock_moe_model_type(**pre) == "mixtral"
    assert stock_moe_model_type(**pre, norm_topk_prob=False) is None  # Mixtral always renormalises
    assert stock_moe_model_type(**pre, mlp_only_layers=[0]) is None  # dense layers without a gated shared expert
    assert stock_moe_model_type(**pre, **gated) == "qwen2_moe"
    assert stock_moe_model_type(**pre, **gated, qkv_bias=True) == "qwen2_moe"
    assert stock_moe_model_type(**pre, qkv_bias=True) is None
    assert stock_moe_model_type(**pre, **gated, attention_bias=True) is None  # LLaMA's bias on o_proj too
    assert stock_moe_model_type(1, "mixln", **gated) is None
    assert stock_moe_model_type(0, "lns") is None
    assert stock_moe_model_type(0, "mixln", ["pre", "sandwich"]) is None
    assert stock_moe_model_type(0, "mixln", ["pre", "pre"], mixln_alpha="0", num_experts=4) == "mixtral"
    fields = moe_export_config_fields(0, "mixln", **MOE, **gated, qkv_bias=True)
    assert fields["qkv_bias"] is True and fields["model_type"] == "qwen2_moe"
    # the stock classes route in the model's dtype: exact for an fp32 router only in a float32 export
    assert stock_moe_model_type(**pre, router_dtype="float32", dtype="bfloat16") is None
    assert stock_moe_model_type(**pre, **gated, router_dtype="float32", dtype=torch.bfloat16) is None
    assert stock_moe_model_type(**pre, router_dtype="float32", dtype="float32") == "mixtral"
    assert stock_moe_model_type(**pre, **gated, router_dtype="float32", dtype=torch.float32) == "qwen2_moe"
    # A Mix-LN layout keeps export_config_fields' Mix-LN keys.
    fields = moe_export_config_fields(1, "mixln", "0.25", **MOE)
    assert (fields["post_ln_layers"], fields["mixln_scheme"], fields["mixln_alpha"]) == (1, "mixln", "0.25")
    assert fields["auto_map"] == MOE_AUTO_MAP and "layer_kinds" not in fields
    fields = moe_export_config_fields(1, "mixln", None, ["pre", "deepnorm"], 2.0, 0.5, **MOE)
    assert (fields["layer_kinds"], fields["deepnorm_alpha"], fields["deepnorm_beta"]) == (["pre", "deepnorm"], 2.0, 0.5)


# ----------------------------------------------------------------------------- validation

REFUSALS = [
    (dict(num_experts=0), "num_experts must be an integer >= 1"),
    (dict(num_experts=True), "num_experts must be an integer >= 1"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok must be an integer >= 1"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok = 5 exceeds num_experts = 4"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size must be an integer >= 1"),
    (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size must be an integer >= 1"),
    (dict(shared_expert_gate=True), "shared_expert_gate is true but there is no shared expert"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob must be true or false"),
    (dict(mlp_only_layers=[4]), "mlp_only_layers has 4, not a layer index in 0..3"),
    (dict(mlp_only_layers=[-1]), "mlp_only_layers has -1"),
    (dict(mlp_only_layers=[1, 1]), "mlp_only_layers lists a layer twice"),
    (dict(mlp_only_layers="0"), "mlp_only_layers must be a list"),
    (dict(post_ln_layers=1, mixln_scheme="lns"), "mixln_scheme 'lns' keeps every layer Pre-LN"),  # Mix-LN's rules too
    (dict(qkv_bias="yes"), "qkv_bias must be true or false"),
    (dict(router_dtype="bfloat16"), "or one of float32, got 'bfloat16'"),
    (dict(router_dtype=32), "router_dtype must be null"),
]


@pytest.mark.parametrize("over,message", REFUSALS, ids=[m.split(" ")[0] + str(i) for i, (_, m) in enumerate(REFUSALS)])
def test_config_refusals(over, message):
    kw = dict(TINY, **MOE, num_hidden_layers=4)
    kw.update(over)
    with pytest.raises(MixLNConfigValueError, match=message.replace("(", r"\(").replace(".", r"\.")) as err:
        MixLNMoeConfig(**kw)
    assert "\n" not in str(err.value)
    # The export helper applies the same rules.
    placement = dict(post_ln_layers=kw.pop("post_ln_layers", 0), mixln_scheme=kw.pop("mixln_scheme", "mixln"))
    moe_kw = {k: kw[k] for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}
    moe_kw.update({k: v for k, v in over.items() if k not in moe_kw and k not in placement})
    with pytest.raises(MixLNConfigValueError):
        moe_export_config_fields(**placement, **moe_kw, num_hidden_layers=4)


def test_qkv_only_bias_and_fp32_router_in_the_mixln_moe_model(tmp_path):
    """A q/k/v-only bias (Megatron's --add-qkv-bias) and fp32 routing: fields of the Mix-LN MoE config, written
    to config.json only when set, and honoured by the model (q, k, v biased, o not; the fp32 router)."""
    fields = moe_export_config_fields(1, "mixln", **MOE, qkv_bias=True, router_dtype="float32")
    assert fields["model_type"] == "mixln_moe" and fields["qkv_bias"] is True and fields["router_dtype"] == "float32"
    assert "qkv_bias" not in moe_export_config_fields(1, "mixln", **MOE)
    model = build(["post", "pre"], qkv_bias=True, router_dtype="float32")
    attn = model.model.layers[1].self_attn
    assert attn.q_proj.bias is not None and attn.v_proj.bias is not None and attn.o_proj.bias is None
    assert type(model.model.layers[0].mlp.gate).__name__ == "MixLNMoeFp32Router"
    save_hf_folder(model, tmp_path / "folder")
    saved = json.load(open(tmp_path / "folder" / "config.json"))
    assert saved["qkv_bias"] is True and saved["router_dtype"] == "float32"
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "folder", trust_remote_code=True, dtype=torch.float32)
    ids = torch.randint(3, 61, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
    save_hf_folder(build(["post", "pre"]), tmp_path / "plain")
    plain = json.load(open(tmp_path / "plain" / "config.json"))
    assert "qkv_bias" not in plain and "router_dtype" not in plain  # earlier folders' config.json unchanged


def test_fp32_router_routes_in_fp32_in_a_bf16_model():
    """The same weights in bf16: the fp32 router's choices are those of the fp32 logits; the bf16 router's
    are not (near-tied logits); the weights come back in the model's dtype."""
    from mixln_megatron.hf.modeling_mixln_moe import MixLNMoeFp32Router
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    g = torch.Generator().manual_seed(1)
    cfg = moe_config(["pre"], num_experts=32, num_experts_per_tok=4, router_dtype="float32")
    weight = (torch.randn(1, 32, generator=g) + 1e-3 * torch.randn(32, 32, generator=g)).bfloat16()
    tokens = torch.randn(256, 32, generator=g).bfloat16()
    fp32, bf16 = MixLNMoeFp32Router(cfg), Qwen2MoeTopKRouter(cfg)
    fp32.weight.data, bf16.weight.data = weight.clone(), weight.clone()
    with torch.no_grad():
        _, want = (tokens.float() @ weight.float().T).topk(4, dim=-1)
        _, weights, index = fp32(tokens)
        _, _, bf16_index = bf16(tokens)
    assert torch.equal(index.sort(-1).values, want.sort(-1).values) and weights.dtype == torch.bfloat16
    assert not torch.equal(bf16_index.sort(-1).values, want.sort(-1).values)


def test_config_roundtrip_and_edit_validation(tmp_path):
    cfg = moe_config(["post", "pre", "pre"], mlp_only_layers=[2, 0], shared_expert_intermediate_size=24)
    assert cfg.mlp_only_layers == [0, 2] and [cfg.is_moe_layer(i) for i in range(3)] == [False, True, False]
    cfg.save_pretrained(tmp_path)
    back = MixLNMoeConfig.from_pretrained(tmp_path)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "shared_expert_intermediate_size", "shared_expert_gate", "mlp_only_layers", "layer_kinds"):
        assert getattr(back, key) == getattr(cfg, key), key
    cfg.num_experts_per_tok = 9
    with pytest.raises(MixLNConfigValueError, match="exceeds"):
        cfg.save_pretrained(tmp_path / "bad")
