"""The Hugging Face Mix-LN / LNS LLaMA model (mixln_megatron.hf): layer math, LLaMA equivalence, export.

CPU, fp32, tiny configs. The layer references below are written from the method's equations, independently
of transformers' modules (they only read the weights).
"""

import ast
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

from mixln_megatron.hf import (
    AUTO_MAP,
    MixLNConfigValueError,
    MixLNLlamaConfig,
    MixLNLlamaForCausalLM,
    MixLNLlamaModel,
    MixLNLlamaPostLNDecoderLayer,
    MixLNLlamaPreLNDecoderLayer,
    config_for_export,
    export_config_fields,
    is_stock_llama,
    save_hf_folder,
    write_model_code,
)
from mixln_megatron.hf import export_code  # noqa: E402

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(**over):
    kw = dict(TINY)
    kw.update(over)
    return MixLNLlamaConfig(**kw)


def randomize_(model, seed=0):
    """Random weights everywhere, including distinct norm weights far from 1 (and biases if any)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model.eval()


def build(seed=0, **over):
    torch.manual_seed(seed)
    return randomize_(MixLNLlamaForCausalLM(tiny_config(**over)), seed)


# ----------------------------------------------------------------------------- independent reference


def ref_rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def ref_rope(x, pos, theta):
    """HF/NeoX 'rotate half' RoPE on [b, heads, s, d]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos[:, None].float() * inv[None, :]  # [s, d/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def ref_attn(x, a, cfg):
    """Causal GQA self-attention with the weights of LlamaAttention `a` (no bias, no padding)."""
    b, s, _ = x.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = (x @ a.q_proj.weight.T).view(b, s, nh, hd).transpose(1, 2)
    k = (x @ a.k_proj.weight.T).view(b, s, nkv, hd).transpose(1, 2)
    v = (x @ a.v_proj.weight.T).view(b, s, nkv, hd).transpose(1, 2)
    pos = torch.arange(s)
    theta = cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters") else cfg.rope_theta
    q, k = ref_rope(q, pos, theta), ref_rope(k, pos, theta)
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ v
    return out.transpose(1, 2).reshape(b, s, nh * hd) @ a.o_proj.weight.T


def ref_mlp(x, m):
    return (F.silu(x @ m.gate_proj.weight.T) * (x @ m.up_proj.weight.T)) @ m.down_proj.weight.T


def ref_post_ln(x, layer, cfg, n1, n2):
    """h = N1(x + Attn(x)); y = N2(h + MLP(h))."""
    eps = cfg.rms_norm_eps
    h = ref_rms(x + ref_attn(x, layer.self_attn, cfg), n1, eps)
    return ref_rms(h + ref_mlp(h, layer.mlp), n2, eps)


def ref_pre_ln(x, layer, cfg, scale):
    """h = x + Attn(N_in(x) * s); y = h + MLP(N_post(h) * s)."""
    eps = cfg.rms_norm_eps
    h = x + ref_attn(ref_rms(x, layer.input_layernorm.weight, eps) * scale, layer.self_attn, cfg)
    return h + ref_mlp(ref_rms(h, layer.post_attention_layernorm.weight, eps) * scale, layer.mlp)


def layer_io(model, input_ids):
    """(input, output) hidden states of every decoder layer during one forward of `model`."""
    seen = {}
    hooks = [
        layer.register_forward_hook(
            lambda mod, args, kwargs, out, i=i: seen.__setitem__(
                i, ((args[0] if args else kwargs["hidden_states"]).detach(), out.detach())
            ),
            with_kwargs=True,
        )
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return [seen[i] for i in range(len(model.model.layers))]


def close(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- layer math


def test_layer_types_and_parameter_names():
    model = build(num_hidden_layers=4, post_ln_layers=2)
    layers = model.model.layers
    assert [type(l).__name__ for l in layers] == ["MixLNLlamaPostLNDecoderLayer"] * 2 + [
        "MixLNLlamaPreLNDecoderLayer"
    ] * 2
    keys = set(model.state_dict())
    common = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    for i in range(4):
        want = {f"model.layers.{i}.{n}" for n in common}
        if i < 2:
            want |= {f"model.layers.{i}.post_attention_layernorm.weight",
                     f"model.layers.{i}.post_feedforward_layernorm.weight"}
        else:
            want |= {f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.post_attention_layernorm.weight"}
        assert {k for k in keys if k.startswith(f"model.layers.{i}.")} == want
    assert {k for k in keys if not k.startswith("model.layers.")} == {
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}


def test_post_ln_layer_matches_functional_reference():
    model = build(num_hidden_layers=3, post_ln_layers=2)
    cfg = model.config
    ids = torch.randint(3, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    io = layer_io(model, ids)
    for i in (0, 1):
        layer = model.model.layers[i]
        assert isinstance(layer, MixLNLlamaPostLNDecoderLayer) and not hasattr(layer, "input_layernorm")
        n1, n2 = layer.post_attention_layernorm.weight, layer.post_feedforward_layernorm.weight
        assert not torch.allclose(n1, n2)
        x, y = io[i]
        with torch.no_grad():
            assert close(y, ref_post_ln(x, layer, cfg, n1, n2))
            # The reference discriminates: N1 and N2 swapped does not match.
            assert not close(y, ref_post_ln(x, layer, cfg, n2, n1))
    # The Pre-LN layer after them is plain LLaMA (scale 1).
    with torch.no_grad():
        assert close(io[2][1], ref_pre_ln(io[2][0], model.model.layers[2], cfg, 1.0))


def _llama_layer_like(layer, cfg, idx):
    llama_cfg = LlamaConfig(**{k: v for k, v in cfg.to_dict().items() if k != "model_type"})
    llama_cfg._attn_implementation = cfg._attn_implementation  # same attention kernel as the model's layers
    ref = LlamaDecoderLayer(llama_cfg, idx)
    ref.load_state_dict(layer.state_dict(), strict=True)
    return ref.eval()


def test_pre_ln_layer_equals_llama_decoder_layer():
    model = build(num_hidden_layers=3, post_ln_layers=1)
    cfg = model.config
    x = torch.randn(2, 6, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(6)[None]
    emb = model.model.rotary_emb(x, pos)
    for i in (1, 2):
        layer = model.model.layers[i]
        assert isinstance(layer, MixLNLlamaPreLNDecoderLayer) and layer.norm_output_scale == 1.0
        ref = _llama_layer_like(layer, cfg, i)
        with torch.no_grad():
            got = layer(x, attention_mask=None, position_ids=pos, position_embeddings=emb)
            want = ref(x, attention_mask=None, position_ids=pos, position_embeddings=emb)
        assert torch.equal(got, want)


@pytest.mark.parametrize("tied", [False, True])
def test_p0_mixln_equals_llama_exactly(tied):
    model = build(post_ln_layers=0, tie_word_embeddings=tied)
    llama_cfg = LlamaConfig(**dict(TINY, tie_word_embeddings=tied))
    llama = LlamaForCausalLM(llama_cfg).eval()
    assert set(llama.state_dict()) == set(model.state_dict())
    llama.load_state_dict(model.state_dict(), strict=True)
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(3, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, llama(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("scheme,P", [("lns", 0), ("mixln+lns", 2)])
def test_layernorm_scaling_by_hand(scheme, P):
    model = build(num_hidden_layers=4, post_ln_layers=P, mixln_scheme=scheme)
    cfg = model.config
    expected = [1.0 if i < P else 1.0 / math.sqrt(i + 1) for i in range(4)]
    assert [cfg.norm_output_scale(i) for i in range(4)] == expected
    before = {k: v.clone() for k, v in model.state_dict().items() if "norm" in k}
    ids = torch.randint(3, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(4))
    io = layer_io(model, ids)
    for i, layer in enumerate(model.model.layers):
        x, y = io[i]
        with torch.no_grad():
            if i < P:
                want = ref_post_ln(x, layer, cfg, layer.post_attention_layernorm.weight,
                                   layer.post_feedforward_layernorm.weight)
            else:
                l = i + 1
                eps = cfg.rms_norm_eps
                # x + F(N(x)/sqrt(l)) for each sub-block, with the module's own attention and MLP.
                emb = model.model.rotary_emb(x, torch.arange(x.shape[1])[None])
                a, _ = layer.self_attn(ref_rms(x, layer.input_layernorm.weight, eps) / math.sqrt(l),
                                       position_embeddings=emb, attention_mask=None)
                h = x + a
                want = h + layer.mlp(ref_rms(h, layer.post_attention_layernorm.weight, eps) / math.sqrt(l))
                assert close(y, ref_pre_ln(x, layer, cfg, 1.0 / math.sqrt(l)))
                if l > 1:  # the scale matters
                    assert not close(y, ref_pre_ln(x, layer, cfg, 1.0))
        assert close(y, want), (scheme, i)
    # Scaling is applied to norm outputs, never to the stored weights.
    for k, v in model.state_dict().items():
        if "norm" in k:
            assert torch.equal(v, before[k])


def test_all_post_ln_and_hidden_states_output():
    model = build(num_hidden_layers=3, post_ln_layers=3)
    ids = torch.randint(3, TINY["vocab_size"], (1, 5))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert len(out.hidden_states) == 4 and torch.isfinite(out.logits).all()


def test_training_step_with_gradient_checkpointing():
    model = build(num_hidden_layers=2, post_ln_layers=1, mixln_scheme="mixln+lns").train()
    model.gradient_checkpointing_enable()
    ids = torch.randint(3, TINY["vocab_size"], (2, 6))
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert model.model.layers[0].post_feedforward_layernorm.weight.grad is not None
    assert model.model.layers[1].input_layernorm.weight.grad is not None


def test_model_builds_every_attribute_llama_model_has():
    """MixLNLlamaModel skips LlamaModel.__init__ but reuses LlamaModel.forward: guard against drift."""
    cfg = tiny_config(num_hidden_layers=1)
    llama_attrs = set(vars(transformers.LlamaModel(LlamaConfig(**dict(TINY, num_hidden_layers=1)))))
    ours = set(vars(MixLNLlamaModel(cfg)))
    assert llama_attrs <= ours
    lm_attrs = set(vars(LlamaForCausalLM(LlamaConfig(**dict(TINY, num_hidden_layers=1)))))
    assert lm_attrs <= set(vars(MixLNLlamaForCausalLM(cfg)))


# ----------------------------------------------------------------------------- config


def test_config_validation_errors():
    with pytest.raises(MixLNConfigValueError, match=r"post_ln_layers = 5 is outside \[0, num_hidden_layers = 4\]"):
        tiny_config(post_ln_layers=5)
    with pytest.raises(ValueError, match=r"outside"):
        tiny_config(post_ln_layers=-1)
    with pytest.raises(MixLNConfigValueError, match="mixln_scheme must be one of mixln, lns, mixln\\+lns"):
        tiny_config(mixln_scheme="pre")
    with pytest.raises(MixLNConfigValueError, match="'lns' keeps every layer Pre-LN.*mixln\\+lns"):
        tiny_config(post_ln_layers=1, mixln_scheme="lns")
    for bad in (True, 1.0, "2"):
        with pytest.raises(MixLNConfigValueError, match="must be an integer"):
            tiny_config(post_ln_layers=bad)
    with pytest.raises(MixLNConfigValueError, match="mixln_alpha"):
        tiny_config(mixln_alpha=[0.25])
    cfg = tiny_config(post_ln_layers=4, mixln_scheme="mixln+lns", mixln_alpha=0.25)
    assert (cfg.post_ln_layers, cfg.mixln_scheme, cfg.mixln_alpha, cfg.model_type) == (4, "mixln+lns", "0.25",
                                                                                       "mixln_llama")
    # Edited after construction: building a model or saving re-validates.
    cfg.post_ln_layers = 7
    with pytest.raises(MixLNConfigValueError):
        MixLNLlamaModel(cfg)
    with pytest.raises(MixLNConfigValueError):
        cfg.save_pretrained("/nonexistent-never-written")


def test_config_roundtrip_keeps_fields(tmp_path):
    cfg = tiny_config(post_ln_layers=1, mixln_scheme="mixln+lns", mixln_alpha="0.25",
                      rope_scaling={"rope_type": "linear", "factor": 2.0})
    cfg.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["model_type"], saved["post_ln_layers"], saved["mixln_scheme"], saved["mixln_alpha"]) == (
        "mixln_llama", 1, "mixln+lns", "0.25")
    back = MixLNLlamaConfig.from_pretrained(tmp_path)
    assert (back.post_ln_layers, back.mixln_scheme, back.mixln_alpha) == (1, "mixln+lns", "0.25")


# ----------------------------------------------------------------------------- export


def test_export_helpers():
    assert is_stock_llama(0, "mixln")
    assert not is_stock_llama(0, "lns") and not is_stock_llama(1, "mixln") and not is_stock_llama(2, "mixln+lns")
    assert AUTO_MAP == {"AutoConfig": "configuration_mixln_llama.MixLNLlamaConfig",
                        "AutoModel": "modeling_mixln_llama.MixLNLlamaModel",  # serving backends (test_hf_serving)
                        "AutoModelForCausalLM": "modeling_mixln_llama.MixLNLlamaForCausalLM"}
    stock = config_for_export(0, "mixln", **TINY)
    assert type(stock) is LlamaConfig and stock.model_type == "llama"
    assert stock.architectures == ["LlamaForCausalLM"] and getattr(stock, "auto_map", None) is None
    # A LlamaConfig dict may be passed as is: its model_type "llama" / architectures are dropped.
    mix = config_for_export(2, "mixln", mixln_alpha="0.5", **stock.to_dict())
    assert type(mix) is MixLNLlamaConfig and mix.model_type == "mixln_llama" and mix.post_ln_layers == 2
    assert mix.auto_map == AUTO_MAP and mix.architectures == ["MixLNLlamaForCausalLM"]
    assert mix.hidden_size == TINY["hidden_size"] and mix.num_key_value_heads == 2
    assert export_config_fields(0, "mixln") == {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    f = export_config_fields(0, "lns", "0")
    assert f["auto_map"] == AUTO_MAP and (f["post_ln_layers"], f["mixln_scheme"]) == (0, "lns")
    with pytest.raises(ValueError):
        config_for_export(1, "lns", **TINY)


def test_model_code_is_self_contained(tmp_path):
    paths = write_model_code(tmp_path)
    assert sorted(os.path.basename(p) for p in paths) == sorted(export_code.CODE_FILES)
    for p in paths:
        tree = ast.parse(open(p).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {"." + node.module} if node.level else {node.module.split(".")[0]}
            else:
                continue
            assert roots <= {"math", "typing", "torch", "transformers", ".configuration_mixln_llama"}, (p, roots)


def test_stock_export_loads_as_llama_without_remote_code(tmp_path):
    cfg = config_for_export(0, "mixln", **TINY)
    torch.manual_seed(0)
    llama = randomize_(LlamaForCausalLM(cfg))
    save_hf_folder(llama, tmp_path)
    assert not (tmp_path / "modeling_mixln_llama.py").exists()
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "llama" and "auto_map" not in saved
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(back) is LlamaForCausalLM


def test_register_auto_classes_and_bf16(tmp_path):
    from mixln_megatron.hf import register_auto_classes

    model = build(post_ln_layers=1, mixln_scheme="mixln+lns")
    save_hf_folder(model, tmp_path)
    register_auto_classes()
    register_auto_classes()  # idempotent
    ids = torch.randint(3, TINY["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(7))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)  # no remote code needed in-process
    assert type(back) is MixLNLlamaForCausalLM
    with torch.no_grad():
        want = model(ids).logits
        assert torch.equal(back(ids).logits, want)
        half = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
        got = half(ids).logits
    assert got.dtype == torch.bfloat16 and (got.float() - want).abs().max() < 0.1


# The remote-code check runs in a fresh interpreter where importing mixln_megatron fails, with its own
# HF cache and HF_HUB_OFFLINE=1, so it proves the exported folder is self-contained. One interpreter
# checks every export of the tests below (each folder under its own name, so transformers copies and
# imports each folder's code as a module of its own); a folder whose check raises is reported as
# ERROR with its traceback and the others are still checked.
REMOTE_SCRIPT = textwrap.dedent(
    r"""
    import json, sys, traceback
    sys.modules["mixln_megatron"] = None  # any import of the project now raises ImportError
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM


    def check(folder, ref):
        cfg = AutoConfig.from_pretrained(folder, trust_remote_code=True)
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
        res = {"class": type(model).__name__, "module": type(model).__module__, "config": type(cfg).__name__,
               "layers": [type(l).__name__ for l in model.model.layers]}
        with torch.no_grad():
            res["logits_equal"] = bool(torch.equal(model(ref["ids"]).logits, ref["logits"]))
            g = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
            ids, mask = ref["batch_ids"], ref["batch_mask"]
            out_c = model.generate(ids, attention_mask=mask, use_cache=True, return_dict_in_generate=True,
                                   output_logits=True, **g)
            out_n = model.generate(ids, attention_mask=mask, use_cache=False, return_dict_in_generate=True,
                                   output_logits=True, **g)
            cached, uncached = out_c.sequences, out_n.sequences
            res["gen_cache_equals_no_cache"] = bool(torch.equal(cached, uncached))
            # Stronger than the tokens: every step's logits (tiny random models tend to repeat tokens).
            res["gen_logits_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(out_c.logits, out_n.logits))
            kv = model(ids, attention_mask=mask, use_cache=True)
            kv = getattr(kv, "past_key_values", None) or getattr(kv, "cache", None)
            res["cache_class"] = type(kv).__name__
            # Left padding: each row equals generating from its unpadded prompt alone.
            rows = []
            for b in range(ids.shape[0]):
                keep = mask[b].bool()
                alone = model.generate(ids[b][keep][None], use_cache=True, **g)
                rows.append(bool(torch.equal(alone[0, -8:], cached[b, -8:])))
            res["left_padded_rows_equal_alone"] = rows
            # Forward of the padded batch at real positions vs each prompt alone.
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            lp = model(ids, attention_mask=mask, position_ids=pos).logits
            diffs = []
            for b in range(ids.shape[0]):
                keep = mask[b].bool()
                diffs.append(float((lp[b][keep] - model(ids[b][keep][None]).logits[0]).abs().max()))
            res["left_padded_max_abs_diff"] = max(diffs)
            res["generated"] = cached[:, ids.shape[1]:].tolist()
        return res


    for name, folder, ref in zip(*[iter(sys.argv[1:])] * 3):  # NAME FOLDER REF, for each export
        try:
            res = check(folder, torch.load(ref))
        except Exception:
            print(f"ERROR {name}\n{traceback.format_exc()}", flush=True)
        else:
            print(f"RESULT {name} " + json.dumps(res), flush=True)
    """
)

REMOTE_CASES = {
    "mixln": dict(post_ln_layers=2, mixln_scheme="mixln", mixln_alpha="0.5"),
    # Every LLaMA option at once: LNS on Mix-LN, biases, head_dim != hidden/heads, llama3 RoPE, tied.
    "lns-all-options": dict(post_ln_layers=1, mixln_scheme="mixln+lns", attention_bias=True, mlp_bias=True, head_dim=24,
                            tie_word_embeddings=True,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
}


def save_for_remote_check(model, root, name, seed):
    """`model` saved as the HF folder root/hf_<name>, and root/<name>.pt: the reference the fresh
    interpreter compares with (logits of one sequence, a left-padded batch to generate from)."""
    folder = root / f"hf_{name.replace('-', '_')}"
    save_hf_folder(model, folder)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, 10), generator=g)
    batch = torch.randint(3, vocab, (3, 7), generator=g)
    mask = torch.ones_like(batch)
    mask[1, :3] = 0  # left padding
    mask[2, :5] = 0
    batch = batch.masked_fill(mask == 0, 0)
    with torch.no_grad():
        logits = model(ids).logits
    torch.save({"ids": ids, "logits": logits, "batch_ids": batch, "batch_mask": mask}, root / f"{name}.pt")
    return folder


@pytest.fixture(scope="module")
def remote_roundtrip(tmp_path_factory):
    """remote_roundtrip(name) -> (exported folder, the fresh interpreter's result dict) of each case
    of REMOTE_CASES and of "every-kind" (test_hf_layer_kinds' model with all four layer kinds),
    all checked by REMOTE_SCRIPT in one fresh interpreter."""
    from test_hf_layer_kinds import MIXED
    from test_hf_layer_kinds import build as build_kinds

    root = tmp_path_factory.mktemp("remote_code")
    folders = {name: save_for_remote_check(build(seed=5, **over), root, name, seed=6)
               for name, over in REMOTE_CASES.items()}
    folders["every-kind"] = save_for_remote_check(build_kinds(MIXED, "mixln+lns", seed=9, tie_word_embeddings=True),
                                                  root, "every-kind", seed=10)
    script = root / "load_remote.py"
    script.write_text(REMOTE_SCRIPT)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(root / "hf_home"),
               HF_MODULES_CACHE=str(root / "hf_modules"), PYTHONWARNINGS="ignore")
    argv = [str(a) for name, folder in folders.items() for a in (name, folder, root / f"{name}.pt")]
    proc = subprocess.run([sys.executable, str(script), *argv], cwd=str(root), env=env, capture_output=True,
                          text=True, timeout=300)

    def result(name):
        lines = [l for l in proc.stdout.splitlines() if l.startswith(f"RESULT {name} ")]
        error = proc.stdout.find(f"ERROR {name}\n")
        shown = proc.stdout[error:error + 6000] if error >= 0 else proc.stdout[-3000:]
        assert proc.returncode == 0 and lines, f"{name} (exit {proc.returncode}):\n{shown}\n{proc.stderr[-3000:]}"
        return folders[name], json.loads(lines[-1][len(f"RESULT {name} "):])

    return result


@pytest.mark.parametrize("name", list(REMOTE_CASES))
def test_export_remote_code_roundtrip(remote_roundtrip, name):
    over = REMOTE_CASES[name]
    folder, res = remote_roundtrip(name)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["auto_map"] == AUTO_MAP and saved["architectures"] == ["MixLNLlamaForCausalLM"]
    assert saved["model_type"] == "mixln_llama" and saved["post_ln_layers"] == over["post_ln_layers"]
    assert res["class"] == "MixLNLlamaForCausalLM" and res["config"] == "MixLNLlamaConfig"
    assert "mixln_megatron" not in res["module"]  # the copied remote code, not the project
    P = over["post_ln_layers"]
    assert res["layers"] == ["MixLNLlamaPostLNDecoderLayer"] * P + ["MixLNLlamaPreLNDecoderLayer"] * (4 - P)
    assert res["logits_equal"]
    assert res["gen_cache_equals_no_cache"]
    assert res["gen_logits_max_abs_diff"] < 1e-4, res
    assert res["cache_class"] == "DynamicCache", res
    assert all(res["left_padded_rows_equal_alone"]), res
    assert res["left_padded_max_abs_diff"] < 1e-4, res


# test_hf_layer_kinds' remote-code check: every layer kind in one network (here, to share the interpreter).
def test_export_remote_code_roundtrip_every_kind(remote_roundtrip):
    from test_hf_layer_kinds import CLASSES, DN_ALPHA, DN_BETA, MIXED

    folder, res = remote_roundtrip("every-kind")
    saved = json.loads((folder / "config.json").read_text())
    assert saved["auto_map"] == AUTO_MAP and saved["model_type"] == "mixln_llama"
    assert (saved["layer_kinds"], saved["deepnorm_alpha"], saved["deepnorm_beta"]) == (MIXED, DN_ALPHA, DN_BETA)
    assert res["class"] == "MixLNLlamaForCausalLM" and "mixln_megatron" not in res["module"]
    assert res["layers"] == [CLASSES[k] for k in MIXED]
    assert res["logits_equal"] and res["gen_cache_equals_no_cache"], res
    assert res["gen_logits_max_abs_diff"] < 1e-4, res
    assert all(res["left_padded_rows_equal_alone"]) and res["left_padded_max_abs_diff"] < 1e-4, res
