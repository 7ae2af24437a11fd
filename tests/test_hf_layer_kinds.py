"""Per-layer kinds in the Hugging Face model: pre, post, deepnorm, sandwich in one network.

CPU, fp32, tiny configs. The reference below is a plain PyTorch forward written from the formulas
(F = attention, then MLP; N an RMSNorm; s the LayerNorm-Scaling factor; a DeepNorm's alpha):
    pre       h = x + F(s * N_a(x))
    post      h = N(x + F(x))
    deepnorm  h = N(a * x + F(x))
    sandwich  h = x + N_b(F(s * N_a(x)))
with its own RMSNorm, RoPE, causal GQA attention and SwiGLU MLP, over a dict of leaf tensors keyed by the
parameter names the contract gives (Gemma 2's four norm names for sandwich). It imports nothing of the
project's model code, so logits and gradients equal to it check the norm placement and residual scaling.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from mixln_megatron.hf import (  # noqa: E402
    AUTO_MAP,
    MixLNConfigValueError,
    MixLNLlamaConfig,
    MixLNLlamaDeepNormDecoderLayer,
    MixLNLlamaForCausalLM,
    MixLNLlamaModel,
    MixLNLlamaPostLNDecoderLayer,
    MixLNLlamaPreLNDecoderLayer,
    MixLNLlamaSandwichDecoderLayer,
    config_for_export,
    export_config_fields,
    is_stock_llama,
    placement_export_fields,
)
from mixln_megatron.hf.modeling_mixln_llama import MixLNLlamaPreTrainedModel  # noqa: E402

# the dense model's tiny config and weight draw (norm weights far from 1, distinct per norm)
from test_hf_model import TINY, randomize_  # noqa: E402

MIXED = ["deepnorm", "sandwich", "post", "pre"]
DN_ALPHA = (2 * 4) ** 0.25  # DeepNet's alpha for 4 layers
DN_BETA = (8 * 4) ** -0.25

# The contract's parameter names per kind (besides the attention and MLP projections).
NORMS = {
    "pre": {"input_layernorm", "post_attention_layernorm"},
    "post": {"post_attention_layernorm", "post_feedforward_layernorm"},
    "deepnorm": {"post_attention_layernorm", "post_feedforward_layernorm"},
    "sandwich": {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"},
}
PROJ = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"}
CLASSES = {"pre": "MixLNLlamaPreLNDecoderLayer", "post": "MixLNLlamaPostLNDecoderLayer",
           "deepnorm": "MixLNLlamaDeepNormDecoderLayer", "sandwich": "MixLNLlamaSandwichDecoderLayer"}


def kinds_config(kinds=MIXED, scheme="mixln", alpha=DN_ALPHA, beta=DN_BETA, **over):
    kw = dict(TINY, num_hidden_layers=len(kinds))
    kw.update(over)
    deep = "deepnorm" in kinds
    return MixLNLlamaConfig(layer_kinds=list(kinds), post_ln_layers=sum(k in ("post", "deepnorm") for k in kinds),
                            mixln_scheme=scheme, deepnorm_alpha=alpha if deep else None,
                            deepnorm_beta=beta if deep else None, **kw)


def build(kinds=MIXED, scheme="mixln", seed=0, **over):
    torch.manual_seed(seed)
    return randomize_(MixLNLlamaForCausalLM(kinds_config(kinds, scheme, **over)), seed)


# ----------------------------------------------------------------------------- independent reference


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, theta):
    """'Rotate half' RoPE on [b, heads, s, d] at positions 0..s-1."""
    d, s = x.shape[-1], x.shape[-2]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.arange(s, dtype=torch.float32)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin()


def attn(x, W, p, cfg):
    b, s, _ = x.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    theta = cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta
    q = rope((x @ W[p + "self_attn.q_proj.weight"].T).view(b, s, nh, hd).transpose(1, 2), theta)
    k = rope((x @ W[p + "self_attn.k_proj.weight"].T).view(b, s, nkv, hd).transpose(1, 2), theta)
    v = (x @ W[p + "self_attn.v_proj.weight"].T).view(b, s, nkv, hd).transpose(1, 2)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, nh * hd)
    return out @ W[p + "self_attn.o_proj.weight"].T


def mlp(x, W, p):
    gate, up = x @ W[p + "mlp.gate_proj.weight"].T, x @ W[p + "mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ W[p + "mlp.down_proj.weight"].T


def ref_layer(kind, x, W, i, cfg, scale, alpha):
    p, eps = f"model.layers.{i}.", cfg.rms_norm_eps

    def n(name, t):
        return rms(t, W[p + name + ".weight"], eps)

    if kind == "pre":
        h = x + attn(scale * n("input_layernorm", x), W, p, cfg)
        return h + mlp(scale * n("post_attention_layernorm", h), W, p)
    if kind in ("post", "deepnorm"):
        a = alpha if kind == "deepnorm" else 1.0
        h = n("post_attention_layernorm", a * x + attn(x, W, p, cfg))
        return n("post_feedforward_layernorm", a * h + mlp(h, W, p))
    assert kind == "sandwich"
    h = x + n("post_attention_layernorm", attn(scale * n("input_layernorm", x), W, p, cfg))
    return h + n("post_feedforward_layernorm", mlp(scale * n("pre_feedforward_layernorm", h), W, p))


def lns_scale(kind, i, scheme):
    return 1.0 / math.sqrt(i + 1) if scheme != "mixln" and kind in ("pre", "sandwich") else 1.0


def ref_logits(W, ids, cfg, kinds, scheme, alpha, scales=None):
    x = W["model.embed_tokens.weight"][ids]
    for i, kind in enumerate(kinds):
        s = lns_scale(kind, i, scheme) if scales is None else scales[i]
        x = ref_layer(kind, x, W, i, cfg, s, alpha)
    return rms(x, W["model.norm.weight"], cfg.rms_norm_eps) @ W["lm_head.weight"].T


def ref_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


# ----------------------------------------------------------------------------- layers and parameters


def test_layer_classes_and_parameter_names_per_kind():
    model = build()
    layers = model.model.layers
    assert [type(l).__name__ for l in layers] == [CLASSES[k] for k in MIXED]
    assert isinstance(layers[0], MixLNLlamaDeepNormDecoderLayer)
    assert isinstance(layers[0], MixLNLlamaPostLNDecoderLayer)  # deepnorm is a Post-LN layer
    assert isinstance(layers[1], MixLNLlamaSandwichDecoderLayer)
    assert isinstance(layers[1], MixLNLlamaPreLNDecoderLayer)  # sandwich keeps the Pre-LN attention input
    assert layers[0].deepnorm_alpha == pytest.approx(DN_ALPHA)
    keys = set(model.state_dict())
    for i, kind in enumerate(MIXED):
        want = {f"model.layers.{i}.{n}.weight" for n in NORMS[kind] | PROJ}
        assert {k for k in keys if k.startswith(f"model.layers.{i}.")} == want, kind
    assert {k for k in keys if not k.startswith("model.layers.")} == {
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert set(MixLNLlamaPreTrainedModel._no_split_modules) == set(CLASSES.values())
    # LLaMA's init for every kind: every norm starts at 1 (DeepNet's init is the Megatron side's).
    fresh = MixLNLlamaForCausalLM(kinds_config())
    for name, p in fresh.named_parameters():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name


@pytest.mark.parametrize(
    "kinds,scheme",
    [(MIXED, "mixln"), (MIXED, "mixln+lns"), (["sandwich", "pre", "sandwich", "pre"], "lns"),
     (["pre", "deepnorm", "pre", "deepnorm"], "mixln")],
    ids=["mixed", "mixed-lns", "sandwich-pre-lns", "pre-deepnorm"],
)
def test_logits_and_gradients_equal_reference(kinds, scheme):
    model = build(kinds, scheme, seed=3)
    cfg = model.config
    W = {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}
    ids = torch.randint(3, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))

    out = model(ids, labels=ids)
    out.loss.backward()
    want_logits = ref_logits(W, ids, cfg, kinds, scheme, DN_ALPHA)
    want_loss = ref_loss(want_logits, ids)
    want_loss.backward()
    assert torch.allclose(out.logits, want_logits, rtol=1e-5, atol=1e-5)
    assert torch.allclose(out.loss, want_loss, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        assert p.grad is not None and W[name].grad is not None, name
        scale = W[name].grad.abs().max()
        assert torch.allclose(p.grad, W[name].grad, rtol=1e-4, atol=1e-5 * float(scale) + 1e-8), name
    # The reference discriminates: DeepNorm's alpha and the LNS scale each change the logits.
    with torch.no_grad():
        if "deepnorm" in kinds:
            assert not torch.allclose(out.logits, ref_logits(W, ids, cfg, kinds, scheme, 1.0), atol=1e-3)
        if scheme != "mixln":
            assert not torch.allclose(out.logits, ref_logits(W, ids, cfg, kinds, scheme, DN_ALPHA, [1.0] * 4),
                                      atol=1e-3)
        if "sandwich" in kinds:  # sandwich's norms in Pre-LN order (input, post_attention) would not match
            pre_like = ["pre" if k == "sandwich" else k for k in kinds]
            assert not torch.allclose(out.logits, ref_logits(W, ids, cfg, pre_like, scheme, DN_ALPHA), atol=1e-3)


def test_each_layer_equals_its_reference_with_llama_modules():
    """Per layer, with the layer's own transformers attention / MLP modules as F (the other half of the check:
    the layer passes its inputs to LLaMA's modules the way the formulas say)."""
    model = build(MIXED, "mixln+lns", seed=5)
    cfg = model.config
    x = torch.randn(2, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    pos = torch.arange(7)[None]
    emb = model.model.rotary_emb(x, pos)
    eps = cfg.rms_norm_eps
    for i, (kind, layer) in enumerate(zip(MIXED, model.model.layers)):
        s = lns_scale(kind, i, "mixln+lns")

        def A(t):
            return layer.self_attn(t, position_embeddings=emb, attention_mask=None)[0]

        def N(name, t):
            return rms(t, getattr(layer, name).weight, eps)

        with torch.no_grad():
            got = layer(x, attention_mask=None, position_ids=pos, position_embeddings=emb)
            if kind == "deepnorm":
                h = N("post_attention_layernorm", DN_ALPHA * x + A(x))
                want = N("post_feedforward_layernorm", DN_ALPHA * h + layer.mlp(h))
            elif kind == "post":
                h = N("post_attention_layernorm", x + A(x))
                want = N("post_feedforward_layernorm", h + layer.mlp(h))
            elif kind == "sandwich":
                h = x + N("post_attention_layernorm", A(s * N("input_layernorm", x)))
                want = h + N("post_feedforward_layernorm", layer.mlp(s * N("pre_feedforward_layernorm", h)))
            else:
                h = x + A(s * N("input_layernorm", x))
                want = h + layer.mlp(s * N("post_attention_layernorm", h))
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), kind


def test_training_step_with_gradient_checkpointing_every_kind():
    model = build(MIXED, "mixln+lns").train()
    model.gradient_checkpointing_enable()
    ids = torch.randint(3, TINY["vocab_size"], (2, 6))
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_kv_cache_equals_no_cache_every_kind():
    model = build(MIXED, "mixln+lns", seed=7)
    ids = torch.randint(3, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :6], use_cache=True)
        cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
        steps = [out.logits]
        for t in range(6, ids.shape[1]):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
            steps.append(out.logits)
        assert (torch.cat(steps, 1) - full).abs().max() < 1e-4
        g = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
                 output_logits=True)
        cached = model.generate(ids[:, :5], use_cache=True, **g)
        uncached = model.generate(ids[:, :5], use_cache=False, **g)
    assert torch.equal(cached.sequences, uncached.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(cached.logits, uncached.logits)) < 1e-4


# ----------------------------------------------------------------------------- config


def test_layer_kind_defaults_to_first_p():
    cfg = MixLNLlamaConfig(post_ln_layers=2, **TINY)
    assert cfg.layer_kinds is None and cfg.deepnorm_alpha is None and cfg.deepnorm_beta is None
    assert [cfg.layer_kind(i) for i in range(4)] == ["post", "post", "pre", "pre"]
    assert [cfg.is_post_ln_layer(i) for i in range(4)] == [True, True, False, False]
    with pytest.raises(IndexError):
        cfg.layer_kind(4)
    cfg = kinds_config(MIXED, "mixln+lns")
    assert [cfg.layer_kind(i) for i in range(4)] == MIXED
    assert [cfg.is_post_ln_layer(i) for i in range(4)] == [True, False, True, False]
    # LNS on the pre norms of pre and sandwich layers only.
    assert [cfg.norm_output_scale(i) for i in range(4)] == [1.0, 1 / math.sqrt(2), 1.0, 0.5]
    assert [kinds_config(MIXED).norm_output_scale(i) for i in range(4)] == [1.0] * 4


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(layer_kinds=["pre", "post", "pre", "bogus"], post_ln_layers=1), r"layer_kinds\[3\] = 'bogus' is not one of"),
        (dict(layer_kinds="post:1-2,pre:3-", post_ln_layers=2), "layer_kinds must be None or a list"),
        (dict(layer_kinds=["pre", "pre", "pre"]), "layer_kinds has 3 entries but num_hidden_layers = 4"),
        (dict(layer_kinds=["post", "sandwich", "deepnorm", "pre"], post_ln_layers=1, deepnorm_alpha=2.0),
         "post_ln_layers = 1 but layer_kinds has 2 Post-LN-kind layers"),
        (dict(layer_kinds=["sandwich"] * 4, post_ln_layers=1), "post_ln_layers = 1 but layer_kinds has 0"),
        (dict(layer_kinds=["post", "pre", "pre", "pre"], post_ln_layers=1, mixln_scheme="lns"),
         "'lns' keeps every layer Pre-LN"),
        (dict(layer_kinds=["deepnorm", "pre", "pre", "pre"], post_ln_layers=1, mixln_scheme="lns",
              deepnorm_alpha=2.0), "'lns' keeps every layer Pre-LN"),
        (dict(layer_kinds=["deepnorm", "pre", "pre", "pre"], post_ln_layers=1), "deepnorm layers but deepnorm_alpha is None"),
        (dict(layer_kinds=["post", "pre", "pre", "pre"], post_ln_layers=1, deepnorm_alpha=2.0),
         "deepnorm_alpha is set but no layer is deepnorm"),
        (dict(post_ln_layers=1, deepnorm_alpha=2.0), "deepnorm_alpha is set but no layer is deepnorm"),
        (dict(post_ln_layers=1, deepnorm_beta=0.5), "deepnorm_beta is set but no layer is deepnorm"),
        (dict(layer_kinds=["deepnorm", "pre", "pre", "pre"], post_ln_layers=1, deepnorm_alpha=0.0), "deepnorm_alpha must be"),
        (dict(layer_kinds=["deepnorm", "pre", "pre", "pre"], post_ln_layers=1, deepnorm_alpha=float("nan")),
         "deepnorm_alpha must be"),
        (dict(layer_kinds=["deepnorm", "pre", "pre", "pre"], post_ln_layers=1, deepnorm_alpha=True), "deepnorm_alpha must be"),
        (dict(layer_kinds=["deepnorm", "pre", "pre", "pre"], post_ln_layers=1, deepnorm_alpha="2"), "deepnorm_alpha must be"),
        (dict(layer_kinds=["deepnorm", "pre", "pre", "pre"], post_ln_layers=1, deepnorm_alpha=2.0, deepnorm_beta=-1.0),
         "deepnorm_beta must be"),
    ],
)
def test_config_validation_errors(over, match):
    with pytest.raises(MixLNConfigValueError, match=match):
        MixLNLlamaConfig(**dict(TINY, **over))


def test_config_edited_after_construction_is_revalidated(tmp_path):
    cfg = kinds_config(MIXED)
    cfg.layer_kinds = ["deepnorm", "post", "post", "pre"]  # P still 2
    with pytest.raises(MixLNConfigValueError, match="post_ln_layers = 2 but layer_kinds has 3"):
        MixLNLlamaModel(cfg)
    with pytest.raises(MixLNConfigValueError):
        cfg.save_pretrained(tmp_path / "never")
    assert not (tmp_path / "never" / "config.json").exists()


def test_config_json_unchanged_without_layer_kinds_and_roundtrip_with_them(tmp_path):
    plain = MixLNLlamaConfig(post_ln_layers=1, mixln_scheme="mixln+lns", mixln_alpha="0.25", **TINY)
    plain.save_pretrained(tmp_path / "plain")
    saved = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert not {"layer_kinds", "deepnorm_alpha", "deepnorm_beta"} & set(saved)  # as a config without per-layer kinds always saved
    back = MixLNLlamaConfig.from_pretrained(tmp_path / "plain")
    assert back.layer_kinds is None and back.deepnorm_alpha is None
    assert [back.layer_kind(i) for i in range(4)] == ["post", "pre", "pre", "pre"]

    cfg = kinds_config(MIXED, "mixln+lns", alpha=2.8284271247461903, beta=None)
    cfg.save_pretrained(tmp_path / "kinds")
    saved = json.loads((tmp_path / "kinds" / "config.json").read_text())
    assert (saved["layer_kinds"], saved["post_ln_layers"], saved["deepnorm_alpha"], saved["deepnorm_beta"]) == (
        MIXED, 2, 2.8284271247461903, None)
    back = MixLNLlamaConfig.from_pretrained(tmp_path / "kinds")
    assert back.layer_kinds == MIXED and back.deepnorm_alpha == 2.8284271247461903 and back.deepnorm_beta is None


# ----------------------------------------------------------------------------- export


def test_export_fields_of_layouts():
    # All "pre": stock LLaMA, with or without layer_kinds.
    assert is_stock_llama(0, "mixln", ["pre"] * 4) and is_stock_llama(0, "mixln")
    assert not is_stock_llama(0, "mixln", ["sandwich"] * 4) and not is_stock_llama(0, "lns", ["pre"] * 4)
    assert export_config_fields(0, "mixln", None, ["pre"] * 4) == export_config_fields(0, "mixln")
    # Mix-LN's own first-P layout given as kinds: today's fields, no layer_kinds.
    assert export_config_fields(2, "mixln", "0.5", ["post", "post", "pre", "pre"]) == export_config_fields(2, "mixln", "0.5")
    assert "layer_kinds" not in export_config_fields(4, "mixln", None, ["post"] * 4)
    f = export_config_fields(0, "mixln", None, ["sandwich"] * 4)
    assert f["model_type"] == "mixln_llama" and f["auto_map"] == AUTO_MAP and f["layer_kinds"] == ["sandwich"] * 4
    assert "deepnorm_alpha" not in f
    f = export_config_fields(2, "mixln+lns", None, MIXED, DN_ALPHA, DN_BETA)
    assert (f["layer_kinds"], f["post_ln_layers"], f["deepnorm_alpha"], f["deepnorm_beta"]) == (MIXED, 2, DN_ALPHA, DN_BETA)
    with pytest.raises(MixLNConfigValueError, match="deepnorm_alpha is None"):
        export_config_fields(2, "mixln", None, MIXED)
    with pytest.raises(MixLNConfigValueError, match="post_ln_layers = 1"):
        export_config_fields(1, "mixln", None, MIXED, DN_ALPHA)
    # config_for_export builds the MixLNLlamaConfig (or LlamaConfig) those fields describe.
    cfg = config_for_export(2, "mixln", None, MIXED, DN_ALPHA, DN_BETA, **TINY)
    assert type(cfg) is MixLNLlamaConfig and cfg.layer_kinds == MIXED and cfg.auto_map == AUTO_MAP
    assert type(config_for_export(0, "mixln", None, ["pre"] * 4, **TINY)) is LlamaConfig


def test_placement_export_fields():
    from mixln_megatron.model.placement import Placement

    first_p = Placement(4, 1, "mixln+lns", "0.25")
    f = placement_export_fields(first_p)
    assert f == dict(post_ln_layers=1, mixln_scheme="mixln+lns", mixln_alpha="0.25", layer_kinds=None,
                     deepnorm_alpha=None, deepnorm_beta=None)
    assert export_config_fields(**f) == export_config_fields(1, "mixln+lns", "0.25")
    stock = placement_export_fields(Placement(4, 0, "mixln"))
    assert is_stock_llama(**{k: stock[k] for k in ("post_ln_layers", "mixln_scheme", "layer_kinds")})
    assert export_config_fields(**stock)["model_type"] == "llama"
    sandwich = placement_export_fields(Placement(4, 0, "mixln", kinds=("sandwich",) * 4))
    assert sandwich["layer_kinds"] == ["sandwich"] * 4
    assert export_config_fields(**sandwich)["model_type"] == "mixln_llama"
    mixed = Placement(4, 2, "mixln", kinds=tuple(MIXED), deepnorm_alpha=DN_ALPHA, deepnorm_beta=DN_BETA)
    f = placement_export_fields(mixed)
    assert (f["layer_kinds"], f["deepnorm_alpha"], f["deepnorm_beta"], f["post_ln_layers"]) == (MIXED, DN_ALPHA, DN_BETA, 2)
    cfg = config_for_export(**f, **TINY)
    assert [cfg.layer_kind(i) for i in range(4)] == MIXED and cfg.deepnorm_alpha == DN_ALPHA


# The remote-code check of every kind (an export of MIXED loaded in a fresh interpreter where importing
# mixln_megatron fails) is test_hf_model.test_export_remote_code_roundtrip_every_kind: it shares that
# file's one interpreter with the other exports' checks.


def test_all_pre_layer_kinds_equal_llama():
    model = build(["pre"] * 4, "mixln")
    llama = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    llama.load_state_dict(model.state_dict(), strict=True)
    ids = torch.randint(3, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, llama(ids).logits)
