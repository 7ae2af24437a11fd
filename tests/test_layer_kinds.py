"""The four layer kinds (pre, post, deepnorm, sandwich) on the Megatron side, one process.

Each kind against a plain PyTorch reference written from its formula (not from the project's
modules): a single layer (outputs and every parameter's gradient, with and without linear biases)
and a tiny GPTModel of mixed layout against a reference model (logits and gradients). DeepNorm's
init against its formula; the settings record and the mismatch refusal for layouts; sandwich's
stacked checkpoint keys; LayerNorm Scaling on sandwich layers; the HybridModel refusal; the spike
scaler's boundary and the telemetry's columns for kinds. Multi-process resharding:
tests/test_layer_kinds_parallel.py.

    pre       h = x + Attn(Na(x))               y = h + MLP(Nc(h))
    post      h = N1(x + Attn(x))               y = N2(h + MLP(h))
    deepnorm  h = N1(a * x + Attn(x))           y = N2(a * h + MLP(h))
    sandwich  h = x + Nb(Attn(Na(x)))           y = h + Nd(MLP(Nc(h)))
"""

import math

import pytest
import torch
import torch.nn.functional as F

from harness import testing as mu

pytestmark = pytest.mark.usefixtures("mcore_single")

S, B = 8, 2
MIXED = "deepnorm:1,sandwich:2,post:3,pre:4"


# ------------------------------------------------------------------ the reference (plain PyTorch)
def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(t, positions):
    """Rotary embedding, non-interleaved halves, base 10000, on [s, b, heads, d]."""
    d = t.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(positions.float(), inv)
    emb = torch.cat((freqs, freqs), -1)[:, None, None, :]
    x1, x2 = t.chunk(2, dim=-1)
    return t * emb.cos() + torch.cat((-x2, x1), -1) * emb.sin()


def ref_attention(x, w, p, cfg, use_rope):
    """Causal attention from raw weights `w` (names under prefix `p`), megatron's per-group QKV rows."""
    s, b, _ = x.shape
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
    d, per = cfg.hidden_size // heads, heads // groups
    qkv = x @ w[p + "self_attention.linear_qkv.weight"].T
    if p + "self_attention.linear_qkv.bias" in w:
        qkv = qkv + w[p + "self_attention.linear_qkv.bias"]
    qkv = qkv.view(s, b, groups, (per + 2) * d)
    q = qkv[..., : per * d].reshape(s, b, heads, d)
    k = qkv[..., per * d: (per + 1) * d].repeat_interleave(per, dim=2)
    v = qkv[..., (per + 1) * d:].repeat_interleave(per, dim=2)
    if use_rope:
        q, k = rope(q, torch.arange(s)), rope(k, torch.arange(s))
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, -1)
    out = out @ w[p + "self_attention.linear_proj.weight"].T
    return out + w.get(p + "self_attention.linear_proj.bias", 0)


def ref_mlp(x, w, p):
    h = x @ w[p + "mlp.linear_fc1.weight"].T + w.get(p + "mlp.linear_fc1.bias", 0)
    gate, up = h.chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w[p + "mlp.linear_fc2.weight"].T + w.get(p + "mlp.linear_fc2.bias", 0)


def ref_layer(x, w, p, kind, cfg, alpha=1.0, lns=1.0, use_rope=False):
    """One layer of `kind` from its formula; `lns` scales a Pre-LN kind's pre-norm outputs."""
    eps = cfg.layernorm_epsilon

    def n(name, t):
        return rms(t, w[p + name + ".weight"], eps)

    if kind == "pre":
        h = x + ref_attention(lns * n("input_layernorm", x), w, p, cfg, use_rope)
        return h + ref_mlp(lns * n("pre_mlp_layernorm", h), w, p)
    if kind == "sandwich":
        h = x + n("attn_output_layernorm", ref_attention(lns * n("input_layernorm", x), w, p, cfg, use_rope))
        return h + n("mlp_output_layernorm", ref_mlp(lns * n("pre_mlp_layernorm", h), w, p))
    a = alpha if kind == "deepnorm" else 1.0
    h = n("post_attention_layernorm", a * x + ref_attention(x, w, p, cfg, use_rope))
    return n("post_mlp_layernorm", a * h + ref_mlp(h, w, p))


def ref_gpt(ids, w, kinds, cfg, alpha):
    """Tied-embedding GPT with RoPE: logits [b, s, vocab]."""
    x = w["embedding.word_embeddings.weight"][ids].transpose(0, 1)  # [s, b, h]
    for i, kind in enumerate(kinds):
        x = ref_layer(x, w, f"decoder.layers.{i}.", kind, cfg, alpha=alpha, use_rope=True)
    x = rms(x, w["decoder.final_layernorm.weight"], cfg.layernorm_epsilon)
    return (x @ w["embedding.word_embeddings.weight"].T).transpose(0, 1)


def leaf_copy(module):
    """{name: a fresh leaf tensor with the parameter's value} for the reference."""
    return {n: p.detach().clone().requires_grad_(True) for n, p in module.named_parameters()}


def randomize(module, seed, scale=0.5):
    """Norm weights 1 + noise and biases noise, so that placements and biases show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1 + scale * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def assert_grads_equal(module, ref, rel=1e-4):
    for name, p in module.named_parameters():
        want = ref[name].grad
        assert p.grad is not None and want is not None, name
        err = (p.grad - want).abs().max().item()
        assert err <= rel * max(want.abs().max().item(), 1e-6), f"{name}: grad differs by {err}"


def build_layer(cfg, layout, layer_number, **settings):
    from megatron.core.transformer.spec_utils import build_module

    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.spec import MixLNTransformerLayerSpec

    spec = MixLNTransformerLayerSpec(backend="local", settings=MixLNSettings(layout=layout, **settings))
    torch.manual_seed(layer_number)
    return build_module(spec, config=cfg, layer_number=layer_number)


def build_model(cfg, layout, seed=0, **settings):
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec

    torch.manual_seed(seed)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed + 1)
    spec = get_mixln_decoder_block_spec(cfg, backend="local", settings=MixLNSettings(layout=layout, **settings))
    return mu.build_gpt(cfg, spec)


# ------------------------------------------------------------------ each kind = its formula
@pytest.mark.compat
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("kind", ["pre", "post", "deepnorm", "sandwich"])
def test_each_kind_equals_its_formula_in_output_and_gradients(kind, bias):
    cfg = mu.tiny_config(num_layers=4, query_groups=2, add_bias_linear=bias)
    layer = build_layer(cfg, f"{kind}:2,pre:*", layer_number=2)
    assert layer.kind == kind and layer.is_post_ln == (kind in ("post", "deepnorm"))
    randomize(layer, seed=5)
    ref = leaf_copy(layer)
    x = torch.randn(S, B, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    x_ref = x.clone().requires_grad_(True)
    x = x.clone().requires_grad_(True)
    out, _ = layer(x, attention_mask=torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), 1))
    alpha = layer.placement.deepnorm_alpha or 1.0
    want = ref_layer(x_ref, ref, "", kind, cfg, alpha=alpha)
    assert (out - want).abs().max().item() <= 1e-5
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * g).sum().backward()
    (want * g).sum().backward()
    assert_grads_equal(layer, ref)
    assert (x.grad - x_ref.grad).abs().max().item() <= 1e-4 * x_ref.grad.abs().max().item()
    if kind == "deepnorm":  # DeepNet's alpha for L = 4 layers, and it matters
        assert alpha == pytest.approx((2 * 4) ** 0.25)
        assert (out - ref_layer(x_ref, ref, "", "post", cfg)).abs().max().item() > 1e-3
    if kind == "sandwich":  # N_b / N_d matter
        assert (out - ref_layer(x_ref, ref, "", "pre", cfg)).abs().max().item() > 1e-3


@pytest.mark.compat
def test_mixed_layout_model_equals_reference_in_logits_and_gradients():
    cfg = mu.tiny_config(num_layers=4)
    model = build_model(cfg, MIXED)
    kinds = [layer.kind for layer in model.decoder.layers]
    assert kinds == ["deepnorm", "sandwich", "post", "pre"]
    randomize(model, seed=11)
    ref = leaf_copy(model)
    ids, labels, pos, mask = mu.batch(seed=3)
    logits = model(ids, pos, mask)  # [b, s, vocab]
    alpha = model.decoder.layers[0].placement.deepnorm_alpha
    want = ref_gpt(ids, ref, kinds, cfg, alpha)
    err = (logits - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item()
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
    F.cross_entropy(want.reshape(-1, want.shape[-1]), labels.reshape(-1)).backward()
    assert_grads_equal(model, ref)
    with torch.no_grad():  # each kind is what makes the difference, not a coincidence (at init the
        # sublayers' outputs are small next to the residual, so a kind changes the logits a little)
        for other in (["post", "sandwich", "post", "pre"], ["deepnorm", "pre", "post", "pre"]):
            assert (logits - ref_gpt(ids, ref, other, cfg, alpha)).abs().max().item() > 20 * max(err, 1e-7)


def test_deepnorm_alpha_override_reaches_the_residual():
    cfg = mu.tiny_config(num_layers=4)
    layer = build_layer(cfg, "deepnorm:*", layer_number=3, deepnorm_alpha="2.8284271247461903")
    randomize(layer, seed=2)
    ref = leaf_copy(layer)
    x = torch.randn(S, B, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    out, _ = layer(x, attention_mask=torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), 1))
    with torch.no_grad():
        want = ref_layer(x, ref, "", "deepnorm", cfg, alpha=2.8284271247461903)
    assert (out - want).abs().max().item() <= 1e-5


# ------------------------------------------------------------------ DeepNorm's init
def _qkv_rows(weight, cfg):
    """(query rows, key rows, value rows) of megatron's fused QKV weight, per group [q..., k, v]."""
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
    d, per = cfg.hidden_size // heads, heads // groups
    w = weight.view(groups, (per + 2) * d, -1)
    return w[:, : per * d], w[:, per * d: (per + 1) * d], w[:, (per + 1) * d:]


SCALED = ("self_attention.linear_proj.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
# megatron draws these two with its output-layer init, base / sqrt(2L); DeepNet's rule (and so a
# deepnorm layer) draws them with the base init: same normal draws, sqrt(2L) times larger.
OUTPUT_LAYERS = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


def deepnet_factor(name, beta, num_layers):
    """A deepnorm weight over the same seed's post-layer weight, from DeepNet's rule (tests/test_deepnorm_init.py
    checks the rule itself against absolute stds)."""
    return beta * (math.sqrt(2 * num_layers) if name in OUTPUT_LAYERS else 1.0)


@pytest.mark.parametrize("cpu_init", [True, False], ids=["cpu_init", "gpu_style_init"])
def test_deepnorm_init_scales_exactly_the_formula_s_weights(cpu_init):
    """Same seed: the deepnorm model is the post model with fc1 and the value rows times beta, and
    linear_proj and fc2 at the base init times beta (the post model's, which megatron draws at
    base / sqrt(2L), times sqrt(2L) beta), exactly; query and key rows and the norms unchanged."""
    cfg = mu.tiny_config(num_layers=4, query_groups=2, use_cpu_initialization=cpu_init)
    post = build_model(cfg, "post:*", seed=3)
    deep = build_model(cfg, "deepnorm:*", seed=3)
    beta = deep.decoder.layers[0].placement.deepnorm_beta
    assert beta == pytest.approx((8 * 4) ** -0.25)
    for a, b in zip(post.decoder.layers, deep.decoder.layers):
        pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
        for name in pa:
            if name in SCALED:
                torch.testing.assert_close(pb[name], deepnet_factor(name, beta, 4) * pa[name], rtol=1e-5, atol=0)
            elif name == "self_attention.linear_qkv.weight":
                (qa, ka, va), (qb, kb, vb) = _qkv_rows(pa[name], cfg), _qkv_rows(pb[name], cfg)
                assert torch.equal(qa, qb) and torch.equal(ka, kb)
                torch.testing.assert_close(vb, beta * va, rtol=1e-6, atol=0)
            else:
                assert torch.equal(pa[name], pb[name]), name


@pytest.mark.parametrize("cpu_init", [True, False], ids=["cpu_init", "gpu_style_init"])
def test_deepnorm_init_std_ratio_matches_beta_within_sampling_error(cpu_init):
    """Against a post twin of another seed: std ratio = DeepNet's factor within 6 sigma of sampling
    error; inside linear_qkv the value rows' std over the query rows' std is beta as well."""
    cfg = mu.tiny_config(num_layers=4, hidden=128, heads=4, use_cpu_initialization=cpu_init)
    twin = build_model(cfg, "post:*", seed=21)
    deep = build_model(cfg, "deepnorm:*", seed=22)
    beta = deep.decoder.layers[0].placement.deepnorm_beta
    for a, b in zip(twin.decoder.layers, deep.decoder.layers):
        pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
        for name in SCALED:
            n = pb[name].numel()
            tolerance = 6 * math.sqrt(1 / (2 * n) + 1 / (2 * pa[name].numel()))  # std error of a std ratio
            ratio = pb[name].std().item() / pa[name].std().item()
            want = deepnet_factor(name, beta, 4)
            assert abs(ratio / want - 1) <= tolerance, (name, ratio, want)
        q, _, v = _qkv_rows(pb["self_attention.linear_qkv.weight"], cfg)
        ratio = v.std().item() / q.std().item()
        assert abs(ratio / beta - 1) <= 6 * math.sqrt(1 / (2 * v.numel()) + 1 / (2 * q.numel())), ratio


def test_deepnorm_init_is_skipped_without_initialisation_and_refused_where_ill_defined():
    from types import SimpleNamespace

    from mixln_megatron.model.support import MixLNUnsupportedError, check_kind_supported

    cfg = mu.tiny_config(num_layers=4, perform_initialization=False)
    layer = build_layer(cfg, "deepnorm:*", layer_number=1)
    assert layer.kind == "deepnorm"  # built, weights left to the checkpoint
    with pytest.raises(MixLNUnsupportedError, match="gated attention output"):
        build_layer(mu.tiny_config(num_layers=4, attention_output_gate=True), "deepnorm:*", layer_number=1)
    build_layer(mu.tiny_config(num_layers=4, attention_output_gate=True), "sandwich:*", layer_number=1)
    odd = SimpleNamespace(perform_initialization=True, num_query_groups=1, tensor_model_parallel_size=2)
    with pytest.raises(MixLNUnsupportedError, match="1 query groups over tensor parallelism 2") as err:
        check_kind_supported(odd, "deepnorm")
    assert "\n" not in str(err.value)
    check_kind_supported(odd, "post")
    check_kind_supported(SimpleNamespace(perform_initialization=False, num_query_groups=1,
                                         tensor_model_parallel_size=2), "deepnorm")
    with pytest.raises(MixLNUnsupportedError, match="meta-device"):
        check_kind_supported(SimpleNamespace(init_model_with_meta_device=True), "deepnorm")


# ------------------------------------------------------------------ checkpoints: keys, record, refusal
def _sharded_tensors(model):
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return {v.key: v for v in nested_values(model.sharded_state_dict()) if hasattr(v, "global_shape")}


@pytest.mark.compat
def test_sandwich_norms_are_stacked_over_the_sandwich_layers_only():
    cfg = mu.tiny_config(num_layers=6)
    model = build_model(cfg, "sandwich:1,deepnorm:2,sandwich:3,post:4,sandwich:5,pre:6")
    tensors = _sharded_tensors(model)
    for key in ("mixln_norm_a.weight", "mixln_norm_b.weight"):
        assert {t.global_shape for k, t in tensors.items() if k == "decoder.layers." + key} == {(6, 64)}
    sd = model.sharded_state_dict()
    for name, key in (("attn_output_layernorm", "mixln_norm_c"), ("mlp_output_layernorm", "mixln_norm_d")):
        rows = {}
        for i in (0, 2, 4):
            t = sd[f"decoder.layers.{i}.{name}.weight"]
            assert t.key == f"decoder.layers.{key}.weight" and t.global_shape == (3, 64)
            rows[i + 1] = t.global_offset[0]
        assert rows == {1: 0, 3: 1, 5: 2}
    assert not any("extra_state" in k for k in tensors if k.startswith("decoder.layers.mixln_norm"))
    # no stray module names: every layer tensor is under a stacked Mix-LN or megatron key
    assert not any("output_layernorm" in k or "post_attention_layernorm" in k for k in tensors)


def _save(model, path):
    from megatron.core import dist_checkpointing

    path.mkdir(parents=True, exist_ok=True)
    metadata = {}
    dist_checkpointing.save({"model": model.sharded_state_dict(metadata=metadata)}, str(path),
                            content_metadata=metadata)


def _load(model, path, metadata=True):
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_content_metadata(str(path)) if metadata else None
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict(metadata=meta)}, str(path))["model"])


def test_layout_round_trips_through_torch_dist_and_a_different_layout_is_refused(tmp_path):
    from megatron.core import dist_checkpointing

    from mixln_megatron.model.checkpoint import MixLNCheckpointMismatch

    cfg = mu.tiny_config(num_layers=4)
    saved = build_model(cfg, MIXED, seed=1)
    randomize(saved, seed=8)
    _save(saved, tmp_path / "ckpt")
    meta = dist_checkpointing.load_content_metadata(str(tmp_path / "ckpt"))
    assert meta["mixln"]["format"] == 2 and meta["mixln"]["layout"] == MIXED
    assert meta["mixln"]["deepnorm_alpha"] == pytest.approx(8 ** 0.25)
    shapes = {k.removeprefix("model."): v.global_shape for k, v in dist_checkpointing.load_tensors_metadata(str(tmp_path / "ckpt")).items()}
    assert shapes["decoder.layers.mixln_norm_c.weight"] == shapes["decoder.layers.mixln_norm_d.weight"] == (1, 64)
    loaded = build_model(cfg, MIXED, seed=2)
    _load(loaded, tmp_path / "ckpt")
    for (name, a), b in zip(saved.named_parameters(), loaded.parameters()):
        assert torch.equal(a, b), name

    # another layout (kinds moved), or the same layout with another DeepNorm alpha: one-line refusals
    for layout, extra in (("sandwich:1,deepnorm:2,post:3,pre:4", {}), (MIXED, {"deepnorm_alpha": 2.0})):
        other = build_model(cfg, layout, seed=2, **extra)
        for metadata in (True, False):  # content metadata first; without it, the sharded record
            with pytest.raises(MixLNCheckpointMismatch) as err:
                _load(other, tmp_path / "ckpt", metadata=metadata)
            assert "\n" not in str(err.value)
            assert f"layout={MIXED}" in str(err.value), str(err.value)
    # a first-P checkpoint into a layout model
    first_p = build_model(cfg, "post:1-2,pre:3-4", seed=3)
    assert first_p.decoder.layers[0].placement.record()["format"] == 1
    _save(first_p, tmp_path / "p2")
    with pytest.raises(MixLNCheckpointMismatch, match="P=2 of L=4"):
        _load(build_model(cfg, "post:1,sandwich:2,pre:3-4"), tmp_path / "p2")


def test_every_non_stock_layout_keeps_the_record():
    cfg = mu.tiny_config(num_layers=4)
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    def records(model):
        return [v.data for v in nested_values(model.sharded_state_dict())
                if getattr(v, "key", None) == "decoder.layers.mixln_settings"]

    for layout in ("sandwich:*", "pre:1-3,sandwich:4", "deepnorm:*"):
        (record,) = records(build_model(cfg, layout))
        assert record["layout"] == layout.replace("*", "1-4") and record["format"] == 2
    assert records(build_model(cfg, "pre:*")) == []  # stock: no record, stock keys


# ------------------------------------------------------------------ LayerNorm Scaling on sandwich layers
def test_lns_scales_the_pre_norms_of_sandwich_layers_only():
    cfg = mu.tiny_config(num_layers=4)
    mask = torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), 1)
    x = torch.randn(S, B, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    for number, kind in ((1, "post"), (3, "sandwich"), (4, "pre")):
        layer = build_layer(cfg, "post:1,sandwich:2-3,pre:4", layer_number=number, scheme="mixln+lns")
        assert layer.kind == kind
        randomize(layer, seed=number)
        ref = leaf_copy(layer)
        out, _ = layer(x, attention_mask=mask)
        with torch.no_grad():
            lns = 1.0 if kind == "post" else 1 / math.sqrt(number)
            want = ref_layer(x, ref, "", kind, cfg, lns=lns)
            unscaled = ref_layer(x, ref, "", kind, cfg)
        assert (out - want).abs().max().item() <= 1e-5, kind
        if kind != "post":
            assert (out - unscaled).abs().max().item() > 1e-3


# ------------------------------------------------------------------ roles, HybridModel, spike, telemetry
def test_norm_parameters_roles_of_every_kind():
    model = build_model(mu.tiny_config(num_layers=4), MIXED)
    expect = {
        "deepnorm": ("post_attention_layernorm", "post_mlp_layernorm"),
        "sandwich": ("input_layernorm", "pre_mlp_layernorm", "attn_output_layernorm", "mlp_output_layernorm"),
        "post": ("post_attention_layernorm", "post_mlp_layernorm"),
        "pre": ("input_layernorm", "pre_mlp_layernorm"),
    }
    for layer in model.decoder.layers:
        got = layer.norm_parameters()
        modules = expect[layer.kind]
        assert [r for r, _ in got] == [f"norm{i}.weight" for i in range(1, len(modules) + 1)]
        assert [id(p) for _, p in got] == [id(getattr(layer, m).weight) for m in modules]
        named = {id(p): n for n, p in layer.named_parameters()}
        assert sorted(named[id(p)] for _, p in got) == sorted(n for n in named.values() if "layernorm" in n)


def test_hybrid_model_builds_every_layer_kind_by_block():
    """Each kind of a layout, in a `*-` HybridModel: both layers of a block are of the block's kind
    (the same network as GPTModel's: tests/test_hybrid_model.py), any placement of them."""
    from mixln_megatron import compat

    if not compat.HYBRID_MODEL:
        pytest.skip("HybridModel Mix-LN needs megatron-core 0.19+")
    from mixln_megatron.model.specs import get_mixln_hybrid_stack_spec

    cfg = mu.tiny_config(num_layers=8)
    for layout, kinds in (("deepnorm:1,pre:*", ["deepnorm", "pre", "pre", "pre"]),
                          ("post:1,sandwich:2-3,pre:4", ["post", "sandwich", "sandwich", "pre"]),
                          ("pre:1,post:2,pre:3,post:4", ["pre", "post", "pre", "post"])):
        model = mu.build_hybrid(cfg, get_mixln_hybrid_stack_spec(cfg, backend="local", layout=layout), "*-" * 4)
        assert [l.kind for l in model.decoder.layers] == [k for k in kinds for _ in "*-"], layout
        assert [l.is_post_ln for l in model.decoder.layers] == [k in ("post", "deepnorm") for k in kinds for _ in "*-"]


def test_spike_boundary_is_every_post_to_pre_change_and_none_is_announced(capsys):
    from mixln_megatron.model.placement import resolve_placement
    from mixln_megatron.model.settings import MixLNSettings, SpikeSettings
    from mixln_megatron.training.spike.scaler import install_on_config, resolve_spike_settings
    from mixln_megatron.training.spike.state import find_targets, target_layers

    def placement(layout, n=8):
        return resolve_placement(n, MixLNSettings(layout=layout))

    assert target_layers("boundary", placement("post:every4,pre:*")) == (4, 5)
    assert target_layers("boundary", placement("post:every2,pre:*")) == (2, 3, 4, 5, 6, 7)
    assert target_layers("boundary", placement("deepnorm:1-2,sandwich:3-")) == (2, 3)
    assert target_layers("boundary", placement("pre:1-4,post:5-")) == ()
    assert target_layers("boundary", placement("sandwich:*")) == ()

    cfg = mu.tiny_config(num_layers=8)
    settings = resolve_spike_settings(SpikeSettings(enabled=True))
    assert settings.targets == "boundary"
    assert install_on_config(cfg, placement("pre:1-4,post:5-"), settings) is None
    line = capsys.readouterr().out
    assert "gradient-spike scaler disabled: the model has no Post/Pre-LN boundary" in line
    assert "layout pre:1-4,post:5-8 of L=8, Post/Pre boundaries: none" in line
    assert line.count("\n") == 1

    model = build_model(mu.tiny_config(num_layers=4), MIXED)  # boundaries 1|2 (deepnorm|sandwich), 3|4
    blocks = target_layers("boundary", model.decoder.layers[0].placement)
    assert blocks == (1, 2, 3, 4)
    targets, _ = find_targets([model], (2,))
    assert [t.role for t in targets] == ["norm1.weight", "norm2.weight", "norm3.weight", "norm4.weight"]


def test_telemetry_names_each_layer_s_kind_and_logs_the_sandwich_norms():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from mixln_megatron.training.telemetry import GradTelemetry

    cfg = mu.tiny_config(num_layers=4)
    model = build_model(cfg, MIXED)
    ddp = DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  module=model)
    ids, labels, pos, mask = mu.batch(seed=5)
    ddp.zero_grad_buffer()
    ddp(ids, pos, mask, labels=labels).float().mean().backward()
    ddp.finish_grad_sync()
    record = GradTelemetry(1).after_finalize([ddp])
    assert record["layer_kinds"] == ["deepnorm", "sandwich", "post", "pre"]

    def norm(params):
        return math.sqrt(sum(p.main_grad.double().pow(2).sum().item() for p in params))

    layers = model.decoder.layers
    for i, layer in enumerate(layers):
        assert record["layer_grad_norm"][i] == pytest.approx(norm(layer.parameters()), rel=1e-6)
        assert record["norm1_grad_norm"][i] == pytest.approx(norm([layer.norm_parameters()[0][1]]), rel=1e-6)
    sandwich = layers[1]
    assert record["norm3_grad_norm"][1] == pytest.approx(norm([sandwich.attn_output_layernorm.weight]), rel=1e-6)
    assert record["norm4_grad_norm"][1] == pytest.approx(norm([sandwich.mlp_output_layernorm.weight]), rel=1e-6)
    assert record["norm3_grad_norm"][0] == 0.0 and record["norm3_grad_norm"][1] > 0
    post = math.sqrt(record["layer_grad_norm"][0] ** 2 + record["layer_grad_norm"][2] ** 2)
    assert record["post_ln_group_grad_norm"] == pytest.approx(post, rel=1e-9)  # deepnorm + post layers


# ------------------------------------------------------------------ TransformerEngine modules (construction)
@pytest.mark.te
def test_te_kinds_build_with_te_modules_and_their_checkpoint_round_trips(tmp_path):
    """TE's forward needs a GPU; on the CPU: the modules each kind gets, DeepNorm's init on TE
    linears, the sandwich norms' keys without TE's empty _extra_state, a torch_dist round trip."""
    why = mu.te_missing()
    if why:
        pytest.skip(str(why))
    import transformer_engine.pytorch as te
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear

    from mixln_megatron import cpu
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec

    cfg = mu.tiny_config(num_layers=4, query_groups=2)

    def build(layout, seed):
        torch.manual_seed(seed)
        with cpu.te_modules():
            spec = get_mixln_decoder_block_spec(cfg, backend="te", settings=MixLNSettings(layout=layout))
            return mu.build_gpt(cfg, spec)

    model = build(MIXED, seed=1)
    deep, sandwich, post, pre = model.decoder.layers
    assert [l.kind for l in model.decoder.layers] == ["deepnorm", "sandwich", "post", "pre"]
    for layer in (sandwich, pre):  # Pre-LN kinds keep TE's fused norm + linear
        assert isinstance(layer.self_attention.linear_qkv, TELayerNormColumnParallelLinear)
        assert isinstance(layer.mlp.linear_fc1, TELayerNormColumnParallelLinear)
    for layer in (deep, post):
        assert not isinstance(layer.self_attention.linear_qkv, TELayerNormColumnParallelLinear)
        assert isinstance(layer.post_attention_layernorm, te.RMSNorm)  # what megatron's TENorm builds
    assert isinstance(sandwich.attn_output_layernorm, te.RMSNorm) and isinstance(sandwich.mlp_output_layernorm, te.RMSNorm)
    qkv, fc1 = sandwich.self_attention.linear_qkv, sandwich.mlp.linear_fc1
    assert [id(p) for _, p in sandwich.norm_parameters()] == [
        id(qkv.layer_norm_weight), id(fc1.layer_norm_weight),
        id(sandwich.attn_output_layernorm.weight), id(sandwich.mlp_output_layernorm.weight)]

    twin = build("post:1,sandwich:2,post:3,pre:4", seed=1)  # same seed: layer 1 unscaled
    beta = deep.placement.deepnorm_beta
    a, b = dict(twin.decoder.layers[0].named_parameters()), dict(deep.named_parameters())
    for name in SCALED:  # proj and fc2 at TE's base init too (DeepNet's rule), not its output init
        torch.testing.assert_close(b[name], deepnet_factor(name, beta, cfg.num_layers) * a[name], rtol=1e-5, atol=0)
    (qa, ka, va), (qb, kb, vb) = (_qkv_rows(w["self_attention.linear_qkv.weight"], cfg) for w in (a, b))
    assert torch.equal(qa, qb) and torch.equal(ka, kb)
    torch.testing.assert_close(vb, beta * va, rtol=1e-6, atol=0)

    tensors = _sharded_tensors(model)
    assert tensors["decoder.layers.mixln_norm_c.weight"].global_shape == (1, 64)
    assert not any(k.startswith("decoder.layers.mixln_norm") and "extra_state" in k for k in tensors)
    randomize(model, seed=4)
    _save(model, tmp_path / "te")
    loaded = build(MIXED, seed=2)
    _load(loaded, tmp_path / "te")
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name
