"""Checkpoint conversion Megatron-LM <-> Hugging Face (mixln_megatron.convert).

Parity (torchrun workers, real Megatron-LM checkpoints written by `mixln-megatron pretrain`):
  a tiny Mix-LN GPT (GQA, untied output, vocab 250 padded by Megatron for TP, fp32) trained a few
  iterations, saved at TP2 x PP2 torch_dist and at TP2 legacy; the exported HF model's logits equal
  Megatron's on the true vocabulary (max abs diff <= 1e-5), greedy generate() follows Megatron's own
  forward loop (except where its top-2 gap < 1e-4), and the from-hf checkpoint that Megatron-LM
  loads back gives bit-identical logits.
In-process: HF -> Megatron -> HF is bit-identical (torch_dist and legacy, TE and local names, LNS,
biases, tied embeddings, rope scaling); stock Llama exports load as LlamaForCausalLM; layouts; and
every refusal (not a checkpoint, missing / truncated shards, unsupported models, existing output)
leaves nothing behind.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from harness.testing import run_python
from mixln_megatron.convert import ConversionError, UnsupportedModelError  # noqa: E402
from mixln_megatron.convert import convert_from_hf as from_hf  # noqa: E402
from mixln_megatron.convert import convert_to_hf as to_hf  # noqa: E402
from mixln_megatron.convert.inspect import open_checkpoint  # noqa: E402
from mixln_megatron.convert.mapping import (  # noqa: E402
    deinterleave_rope_rows, merge_qkv, merge_tp_shards, split_qkv, split_tp_shard)
from mixln_megatron.convert.shape import (  # noqa: E402
    ModelShape, padded_vocab_size, shape_from_hf_config, shape_from_megatron_args)
from mixln_megatron.convert.inspect import mixln_record  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)


# --------------------------------------------------------------------------------- helpers
def randomize_(model):
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim == 1 else 0.05) + (1.0 if p.ndim == 1 else 0))
    return model


def make_mixln_folder(path, dtype=torch.bfloat16, post_ln_layers=2, scheme="mixln", **over):
    from mixln_megatron.hf import MixLNLlamaConfig, MixLNLlamaForCausalLM, save_hf_folder

    cfg = MixLNLlamaConfig(post_ln_layers=post_ln_layers, mixln_scheme=scheme, **{**TINY, **over})
    model = randomize_(MixLNLlamaForCausalLM(cfg)).to(dtype)
    save_hf_folder(model, str(path))
    return model


def make_llama_folder(path, dtype=torch.float32, **over):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = randomize_(LlamaForCausalLM(LlamaConfig(**{**TINY, **over}))).to(dtype)
    model.save_pretrained(str(path))
    return model


def tensors(folder):
    out = {}
    for f in sorted(glob.glob(os.path.join(str(folder), "*.safetensors"))):
        out.update(load_file(f))
    return out


def assert_same_tensors(a, b):
    ta, tb = tensors(a), tensors(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert torch.equal(ta[name], tb[name]), name


def no_leftovers(path):
    parent, base = os.path.dirname(str(path)), os.path.basename(str(path))
    return [e for e in os.listdir(parent) if e.startswith(f".{base}.tmp-") or e.startswith(f".{base}.old-")]


# --------------------------------------------------------------------------------- parity (torchrun)
@pytest.mark.mp
@pytest.mark.parametrize("fmt,tp,pp", [
    # 2-rank twins in the default suite: torch_dist at PP2 here, TP2 in legacy-tp2 and in the LNS
    # parity below; the 4-rank TP2 x PP2 job is marked slow (make test-all)
    ("torch_dist", 1, 2),
    pytest.param("torch_dist", 2, 2, marks=pytest.mark.slow),
    ("torch", 2, 1),
], ids=["torch_dist-pp2", "torch_dist-tp2pp2", "legacy-tp2"])
@pytest.mark.compat
def test_megatron_hf_parity(tmp_path, fmt, tp, pp):
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_parity", os.path.join(REPO, "benchmarks", "hf_parity.py"))
    hf_parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_parity)
    hf_parity.run_worker(str(tmp_path), tp, pp, fmt)
    res = hf_parity.compare(str(tmp_path))
    assert res["max_abs_logit_diff"] <= 1e-5, res
    assert res["generate_match"], res
    assert res["roundtrip_max_abs_diff"] == 0.0  # Megatron-LM loaded the from-hf checkpoint
    summary = res["summary"]
    assert summary["to_hf"]["format"] == fmt
    assert summary["to_hf"]["post_ln_layers"] == 2 and summary["to_hf"]["scheme"] == "mixln"
    assert summary["to_hf"]["vocab_size"] == 250 and summary["to_hf"]["padded_vocab_size"] == 256
    cfg = json.load(open(tmp_path / "hf" / "config.json"))
    assert cfg["model_type"] == "mixln_llama" and cfg["auto_map"] and cfg["post_ln_layers"] == 2
    assert cfg["num_key_value_heads"] == 2 and cfg["tie_word_embeddings"] is False
    assert (tmp_path / "hf" / "modeling_mixln_llama.py").exists()
    assert (tmp_path / "hf" / "generation_config.json").exists()
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()


@pytest.mark.mp
@pytest.mark.parametrize("scheme,post_ln_layers", [
    ("mixln+lns", "2"),
    pytest.param("lns", "0", marks=pytest.mark.slow),
])
def test_megatron_hf_parity_layernorm_scaling(tmp_path, scheme, post_ln_layers):
    """LayerNorm Scaling (the second scheme) exports with the same logits."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_parity", os.path.join(REPO, "benchmarks", "hf_parity.py"))
    hf_parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_parity)
    hf_parity.run_worker(str(tmp_path), 2, 1, "torch_dist",
                         extra_args=["--mixln-post-ln-layers", post_ln_layers, "--mixln-scheme", scheme])
    res = hf_parity.compare(str(tmp_path))
    assert res["max_abs_logit_diff"] <= 1e-5, res
    assert res["generate_match"], res
    assert res["summary"]["to_hf"]["scheme"] == scheme
    cfg = json.load(open(tmp_path / "hf" / "config.json"))
    assert cfg["mixln_scheme"] == scheme and cfg["post_ln_layers"] == int(post_ln_layers)


@pytest.mark.mp
@pytest.mark.parametrize("extra,rope", [
    (["--rotary-seq-len-interpolation-factor", "4"], {"rope_type": "linear", "factor": 4.0}),
], ids=["linear-interpolation"])
def test_megatron_hf_parity_of_rope_scaling(tmp_path, extra, rope):
    """The RoPE settings the export reads from the saved args are the ones the trained model used
    (mixln-megatron pretrain passes them to GPTModel: 7e-5 off when it did not). The llama3 factor
    moves only frequencies too low to matter within this model's 32 positions: the provider test
    in test_pretrain.py checks that it reaches the model's RoPE."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_parity", os.path.join(REPO, "benchmarks", "hf_parity.py"))
    hf_parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_parity)
    hf_parity.run_worker(str(tmp_path), 1, 1, "torch_dist", extra_args=extra)
    res = hf_parity.compare(str(tmp_path))
    assert res["max_abs_logit_diff"] <= 1e-5, res
    assert res["generate_match"], res
    got = json.load(open(tmp_path / "hf" / "config.json"))["rope_parameters"]
    assert {k: got[k] for k in rope} == rope, got


# --------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("fmt,tp,pp,impl", [
    ("torch_dist", 2, 2, "transformer_engine"),
    ("torch", 2, 2, "transformer_engine"),
    ("torch", 1, 1, "local"),
])
def test_hf_megatron_hf_bit_identical(tmp_path, fmt, tp, pp, impl):
    src, ckpt, back = tmp_path / "src", tmp_path / "ckpt", tmp_path / "back"
    make_mixln_folder(src)
    s = from_hf(str(src), str(ckpt), tp=tp, pp=pp, ckpt_format=fmt, transformer_impl=impl, progress=False)
    assert s["padded_vocab_size"] == 128 * tp and s["iteration"] == "release"
    assert open(ckpt / "latest_checkpointed_iteration.txt").read() == "release"
    reader = open_checkpoint(str(ckpt))
    assert reader.format == fmt
    args = reader.args
    assert (args.num_layers, args.hidden_size, args.num_query_groups, args.padded_vocab_size) == (4, 64, 2, 128 * tp)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (tp, pp)
    assert args.mixln_post_ln_layers == 2 and args.spec[0] == "mixln_megatron.spec"
    assert mixln_record(reader, 4)[0]["post_ln_layers"] == 2
    if fmt == "torch_dist":  # a Mix-LN model's norms are under the keys a stock model lacks
        assert reader.norm_layout == "mixln" and reader.has("decoder.layers.mixln_norm_a.weight")
    to_hf(str(ckpt), str(back), progress=False)
    assert_same_tensors(src, back)
    a, b = json.load(open(src / "config.json")), json.load(open(back / "config.json"))
    for key in ("model_type", "post_ln_layers", "mixln_scheme", "vocab_size", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "auto_map", "architectures"):
        assert a.get(key) == b.get(key), key


def test_roundtrip_lns_biases_tied_rope_scaling(tmp_path):
    src, ckpt, back = tmp_path / "src", tmp_path / "ckpt", tmp_path / "back"
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 5e5}
    with pytest.raises(UnsupportedModelError, match="original_max_position_embeddings"):
        make_mixln_folder(src, post_ln_layers=1, scheme="mixln+lns", tie_word_embeddings=True,
                          attention_bias=True, mlp_bias=True, rope_parameters=rope)
        from_hf(str(src), str(ckpt), progress=False)
    assert not ckpt.exists() and not no_leftovers(ckpt)
    shutil.rmtree(src)
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    make_mixln_folder(src, dtype=torch.float32, post_ln_layers=1, scheme="mixln+lns", tie_word_embeddings=True,
                      attention_bias=True, mlp_bias=True, rope_parameters=rope)
    from_hf(str(src), str(ckpt), tp=2, progress=False)
    args = open_checkpoint(str(ckpt)).args
    assert args.add_bias_linear and not args.untie_embeddings_and_output_weights
    assert args.rotary_seq_len_interpolation_factor == 2.0 and args.rotary_base == 5e5
    assert args.mixln_scheme == "mixln+lns" and args.mixln_post_ln_layers == 1
    to_hf(str(ckpt), str(back), progress=False)
    assert_same_tensors(src, back)
    cfg = json.load(open(back / "config.json"))
    assert cfg["rope_parameters"]["rope_type"] == "linear" and cfg["rope_scaling"]["factor"] == 2.0
    assert cfg["attention_bias"] and cfg["mlp_bias"] and cfg["tie_word_embeddings"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(back), trust_remote_code=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(src), trust_remote_code=True)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_stock_llama_is_pre_ln_and_exports_as_llama(tmp_path):
    src, ckpt, back = tmp_path / "src", tmp_path / "ckpt", tmp_path / "back"
    model = make_llama_folder(src, tie_word_embeddings=True)
    s = from_hf(str(src), str(ckpt), tp=2, pp=2, progress=False)
    assert s["post_ln_layers"] == 0 and s["scheme"] == "mixln"
    reader = open_checkpoint(str(ckpt))
    assert reader.settings_record is None and reader.args.spec is None  # loads into stock Megatron-LM
    assert reader.content_metadata["mixln"]["post_ln_layers"] == 0
    to_hf(str(ckpt), str(back), progress=False)
    assert_same_tensors(src, back)
    assert not (back / "modeling_mixln_llama.py").exists()
    cfg = json.load(open(back / "config.json"))
    assert cfg["model_type"] == "llama" and "auto_map" not in cfg
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(back))  # no remote code
    assert type(loaded) is transformers.LlamaForCausalLM
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_stock_llama_as_mixln_only_when_asked(tmp_path, capsys):
    src, ckpt, back = tmp_path / "src", tmp_path / "ckpt", tmp_path / "back"
    make_llama_folder(src)
    s = from_hf(str(src), str(ckpt), post_ln_layers=1, ckpt_format="torch", progress=False)
    assert s["post_ln_layers"] == 1 and "WARNING" in capsys.readouterr().out
    to_hf(str(ckpt), str(back), progress=False)
    a, b = tensors(src), tensors(back)
    assert torch.equal(b["model.layers.0.post_feedforward_layernorm.weight"], a["model.layers.0.input_layernorm.weight"])
    assert torch.equal(b["model.layers.0.post_attention_layernorm.weight"], a["model.layers.0.post_attention_layernorm.weight"])
    assert "model.layers.0.input_layernorm.weight" not in b and "model.layers.1.input_layernorm.weight" in b
    assert json.load(open(back / "config.json"))["post_ln_layers"] == 1
    # a Mix-LN folder keeps its own settings
    with pytest.raises(ConversionError, match="would change the network"):
        from_hf(str(back), str(tmp_path / "other"), post_ln_layers=0, progress=False)
    assert not (tmp_path / "other").exists()


def test_dtype_option_and_shards(tmp_path):
    src, ckpt, back = tmp_path / "src", tmp_path / "ckpt", tmp_path / "back"
    make_mixln_folder(src, dtype=torch.float32)
    from_hf(str(src), str(ckpt), dtype="bfloat16", progress=False)
    assert open_checkpoint(str(ckpt)).dtype == torch.bfloat16
    to_hf(str(ckpt), str(back), dtype="float32", max_shard_size="40KB", progress=False)
    index = json.load(open(back / "model.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files == sorted(f for f in os.listdir(back) if f.endswith(".safetensors"))
    a, b = tensors(src), tensors(back)
    assert all(b[k].dtype == torch.float32 and torch.equal(b[k], a[k].bfloat16().float()) for k in a)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in b.values())


# --------------------------------------------------------------------------------- layouts
def test_qkv_and_glu_layouts():
    shape = ModelShape(num_layers=1, hidden_size=8, ffn_hidden_size=6, num_attention_heads=4, num_query_groups=2,
                         kv_channels=2, vocab_size=10, max_position_embeddings=8)
    rows = torch.arange(shape.qkv_rows)
    q, k, v = split_qkv(rows, shape)
    # group g: [q heads 2g, 2g+1 | k_g | v_g], 2 rows per head
    assert q.tolist() == [0, 1, 2, 3, 8, 9, 10, 11] and k.tolist() == [4, 5, 12, 13] and v.tolist() == [6, 7, 14, 15]
    assert torch.equal(merge_qkv(q, k, v, shape), rows)
    fc1 = torch.arange(12)
    shards = [split_tp_shard("fc1.weight", fc1, 2, r) for r in range(2)]
    assert shards[0].tolist() == [0, 1, 2, 6, 7, 8] and torch.equal(merge_tp_shards("fc1.weight", shards), fc1)
    for role in ("qkv.weight", "proj.weight", "fc2.weight"):
        t = torch.randn(shape.megatron_layer_shapes()[role])
        assert torch.equal(merge_tp_shards(role, [split_tp_shard(role, t, 2, r) for r in range(2)]), t)
    # every role of a layer becomes the HF tensors hf_role_tensors names, with their shapes
    from mixln_megatron.convert.mapping import hf_layer_tensors, hf_role_tensors, layer_roles

    assert sorted(layer_roles(shape)) == sorted(shape.megatron_layer_shapes())  # the same roles, biases or not
    for role, megatron_shape in shape.megatron_layer_shapes().items():
        hf = hf_layer_tensors(role, torch.randn(megatron_shape), shape)
        assert [tuple(t.shape) for t in hf] == [s for _, s in hf_role_tensors(shape, role, False)], role
    assert padded_vocab_size(32000, 128, 4) == 32256 and padded_vocab_size(250, 128, 2) == 256


def test_interleaved_rope_rows_match_megatron(monkeypatch):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    s, heads, d = 7, 3, 8
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(s, 1, heads, d, generator=g), torch.randn(s, 1, heads, d, generator=g)
    rope = RotaryEmbedding(kv_channels=d, rotary_percent=1.0, rotary_interleaved=True, use_cpu_initialization=True)
    emb = rope.get_emb(s)
    qm, km = (_apply_rotary_pos_emb_bshd(t, emb, rotary_interleaved=True) for t in (q, k))
    want = torch.einsum("ibhd,jbhd->hij", qm, km)
    # the same projections with their rows permuted as the export does, then HF's rotate-half RoPE
    perm = deinterleave_rope_rows(torch.arange(heads * d), heads, d).view(heads, d) % d
    qh = torch.stack([q[:, 0, h, perm[h]] for h in range(heads)], 0)  # [heads, s, d]
    kh = torch.stack([k[:, 0, h, perm[h]] for h in range(heads)], 0)
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), rope.inv_freq.cpu())
    cat = torch.cat([freqs, freqs], -1)
    qr, kr = apply_rotary_pos_emb(qh[None], kh[None], cat.cos()[None], cat.sin()[None])
    got = torch.einsum("hid,hjd->hij", qr[0], kr[0])
    assert (got - want).abs().max() < 1e-5


def test_rope_scaling_maps_to_hf(monkeypatch, tmp_path):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    d = 64
    meg = RotaryEmbedding(kv_channels=d, rotary_percent=1.0, rotary_base=500000, rope_scaling=True,
                          rope_scaling_factor=8.0, use_cpu_initialization=True)
    args = argparse.Namespace(num_layers=1, hidden_size=256, num_attention_heads=4, num_query_groups=4,
                              group_query_attention=False, kv_channels=d, ffn_hidden_size=512,
                              max_position_embeddings=16384, normalization="RMSNorm", swiglu=True,
                              position_embedding_type="rope", rotary_base=500000, use_rope_scaling=True,
                              rope_scaling_factor=8.0, add_bias_linear=False, untie_embeddings_and_output_weights=True)
    from mixln_megatron.convert.to_hf import hf_config_dict

    folder = tmp_path / "llama3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config_dict(shape_from_megatron_args(args, 100), 0, "mixln",
                                                                   None, "float32", {})))
    cfg = LlamaConfig.from_pretrained(str(folder))
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    assert torch.allclose(hf_inv.float(), meg.inv_freq.float(), rtol=1e-6, atol=0)


# --------------------------------------------------------------------------------- refusals
def test_refusals_leave_nothing_behind(tmp_path):
    out = tmp_path / "out"
    empty = tmp_path / "empty"
    empty.mkdir()
    for bad, match in ((tmp_path / "nope", "does not exist"), (empty, "not a Megatron-LM checkpoint")):
        with pytest.raises(ConversionError, match=match):
            to_hf(str(bad), str(out), progress=False)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "latest_checkpointed_iteration.txt").write_text("5")
    with pytest.raises(ConversionError, match="iter_0000005"):
        to_hf(str(junk), str(out), progress=False)
    with pytest.raises(ConversionError, match="config.json"):
        from_hf(str(empty), str(out), progress=False)
    assert not out.exists() and not no_leftovers(out)
    src, ckpt = tmp_path / "src", tmp_path / "ckpt"
    make_mixln_folder(src)
    from_hf(str(src), str(ckpt), progress=False)
    # a failure after the output was started: the temporary directory and new parents disappear
    import mixln_megatron.convert.to_hf as to_hf_module

    nested = tmp_path / "new" / "deeper" / "out"
    original = to_hf_module.StreamingSafetensorsWriter.write
    calls = []

    def failing(self, name, tensor):
        calls.append(name)
        if len(calls) > 5:
            raise OSError("disk full (simulated)")
        return original(self, name, tensor)

    to_hf_module.StreamingSafetensorsWriter.write = failing
    try:
        with pytest.raises(OSError, match="disk full"):
            to_hf(str(ckpt), str(nested), progress=False)
    finally:
        to_hf_module.StreamingSafetensorsWriter.write = original
    assert not (tmp_path / "new").exists()

    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ConversionError, match="not empty.*--overwrite"):
        to_hf(str(ckpt), str(out), progress=False)
    with pytest.raises(ConversionError, match="not empty"):
        from_hf(str(src), str(out), progress=False)
    assert os.listdir(out) == ["keep.txt"] and not no_leftovers(out)
    # --overwrite replaces only a previous export (tests/test_output_safety.py covers the rest)
    with pytest.raises(ConversionError, match="not one: it holds keep.txt"):
        to_hf(str(ckpt), str(out), overwrite=True, progress=False)
    assert os.listdir(out) == ["keep.txt"] and not no_leftovers(out)


def test_missing_and_truncated_shards(tmp_path):
    src = tmp_path / "src"
    make_mixln_folder(src)
    out = tmp_path / "out"
    # torch_dist
    dist = tmp_path / "dist"
    from_hf(str(src), str(dist), progress=False)
    shard = dist / "release" / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match="truncated"):
        to_hf(str(dist), str(out), progress=False)
    shard.unlink()
    with pytest.raises(ConversionError, match="missing"):
        to_hf(str(dist), str(out), progress=False)
    # legacy
    legacy = tmp_path / "legacy"
    from_hf(str(src), str(legacy), tp=2, pp=2, ckpt_format="torch", progress=False)
    f = legacy / "release" / "mp_rank_01_001" / "model_optim_rng.pt"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ConversionError, match="unreadable|truncated"):
        to_hf(str(legacy), str(out), progress=False)
    shutil.rmtree(legacy / "release" / "mp_rank_01_001")
    with pytest.raises(ConversionError, match="mp_rank_01_001.*missing"):
        to_hf(str(legacy), str(out), progress=False)
    # HF side
    st = src / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-100])
    with pytest.raises(ConversionError, match="truncated"):
        from_hf(str(src), str(out), progress=False)
    assert not out.exists() and not no_leftovers(out)


def _legacy_with_args(tmp_path, **changes):
    src, ckpt = tmp_path / "src", tmp_path / "ckpt"
    if not src.exists():
        make_mixln_folder(src)
    shutil.rmtree(ckpt, ignore_errors=True)
    from_hf(str(src), str(ckpt), ckpt_format="torch", progress=False)
    f = ckpt / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    for k, v in changes.items():
        setattr(state["args"], k, v)
    torch.save(state, f)
    return ckpt


@pytest.mark.parametrize("changes,match", [
    (dict(num_experts=8), "MoE"),
    (dict(multi_latent_attention=True), "multi-latent attention"),
    (dict(normalization="LayerNorm"), "RMSNorm"),
    (dict(add_bias_linear=False, add_qkv_bias=True), "qkv-only bias"),
    (dict(rotary_percent=0.5), "partial rotary"),
    (dict(position_embedding_type="learned_absolute"), "RoPE"),
    (dict(swiglu=False), "SwiGLU"),
])
def test_unsupported_models_are_named(tmp_path, changes, match):
    ckpt = _legacy_with_args(tmp_path, **changes)
    out = tmp_path / "out"
    with pytest.raises(UnsupportedModelError, match=match):
        to_hf(str(ckpt), str(out), progress=False)
    assert not out.exists() and not no_leftovers(out)


def test_layernorm_1p_and_interleaved_rope_export(tmp_path):
    src = tmp_path / "src"
    make_mixln_folder(src, dtype=torch.float32)
    ckpt = _legacy_with_args(tmp_path, layernorm_zero_centered_gamma=True, rotary_interleaved=True)
    out = tmp_path / "out"
    to_hf(str(ckpt), str(out), progress=False)
    a, b = tensors(src), tensors(out)
    for name in ("model.layers.0.post_feedforward_layernorm.weight", "model.layers.3.input_layernorm.weight",
                 "model.norm.weight"):
        assert torch.equal(b[name], a[name] + 1), name
    q = a["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(b["model.layers.1.self_attn.q_proj.weight"], deinterleave_rope_rows(q, 4, 16))
    assert torch.equal(b["model.layers.1.self_attn.v_proj.weight"], a["model.layers.1.self_attn.v_proj.weight"])


def test_config_fields_match_the_hf_model_code(tmp_path):
    from mixln_megatron.convert.to_hf import hf_config_dict
    from mixln_megatron.hf import export_config_fields

    shape = shape_from_hf_config({**TINY, "model_type": "llama"})
    for post, scheme in ((0, "mixln"), (2, "mixln"), (0, "lns"), (1, "mixln+lns")):
        cfg = hf_config_dict(shape, post, scheme, None, "bfloat16", {})
        want = export_config_fields(post, scheme, None)
        assert {k: cfg.get(k) for k in want} == want
        assert "auto_map" not in cfg if (post, scheme) == (0, "mixln") else cfg["auto_map"]
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(shape, 0, "mixln", None, "float32", {})))
    loaded = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert type(loaded) is transformers.LlamaConfig and loaded.num_key_value_heads == 2 and loaded.head_dim == 16


def test_pytorch_bin_folders_and_extra_tensors(tmp_path, capsys):
    src, ckpt, back = tmp_path / "src", tmp_path / "ckpt", tmp_path / "back"
    model = make_llama_folder(src)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    state["extra.weight"] = torch.ones(3)
    os.remove(src / "model.safetensors")
    torch.save(state, src / "pytorch_model.bin")
    from_hf(str(src), str(ckpt), progress=False)
    assert "extra.weight" in capsys.readouterr().out
    to_hf(str(ckpt), str(back), progress=False)
    b = tensors(back)
    assert all(torch.equal(b[k], state[k]) for k in b)


def test_moe_keys_and_foreign_hf_models(tmp_path):
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    ckpt = tmp_path / "moe"
    (ckpt / "iter_0000001").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    common = [{"args": argparse.Namespace(num_layers=1), "iteration": 1}]  # what megatron-core stores
    state = {"embedding.word_embeddings.weight": torch.zeros(8, 4),
             "decoder.layers.mlp.experts.linear_fc1.weight": torch.zeros(1, 8, 4), "common_state/shard_0_1": common}
    # the common state as one object, as megatron-core writes it (the reader reads it before any refusal)
    dcp_save(state, storage_writer=FileSystemWriter(str(ckpt / "iter_0000001")), no_dist=True,
             planner=DefaultSavePlanner(flatten_state_dict=False))
    (ckpt / "iter_0000001" / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    # to-hf carries MoE layers now (tests/test_convert_moe.py); GPT <-> hybrid conversion still refuses them
    from mixln_megatron.convert import convert_gpt_to_hybrid

    with pytest.raises(UnsupportedModelError, match="MoE"):
        convert_gpt_to_hybrid(str(ckpt), str(tmp_path / "out"))
    hf = tmp_path / "mistral"
    make_llama_folder(hf)
    cfg = json.load(open(hf / "config.json"))
    cfg["model_type"] = "mistral"
    json.dump(cfg, open(hf / "config.json", "w"))
    with pytest.raises(UnsupportedModelError, match="mistral"):
        from_hf(str(hf), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def test_settings_and_vocab_come_from_the_checkpoint(tmp_path):
    src, ckpt, out = tmp_path / "src", tmp_path / "ckpt", tmp_path / "out"
    make_mixln_folder(src)
    from_hf(str(src), str(ckpt), ckpt_format="torch", progress=False)
    f = ckpt / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    state["args"].vocab_size = None
    state["args"].mixln_post_ln_layers = None
    torch.save(state, f)
    with pytest.raises(ConversionError, match="--vocab-size"):
        to_hf(str(ckpt), str(out), progress=False)
    s = to_hf(str(ckpt), str(out), vocab_size=97, progress=False)
    assert s["post_ln_layers"] == 2 and "settings record" in s["settings_source"]
    assert_same_tensors(src, out)
    # a record that contradicts how the layers are stored is refused
    state["model"]["decoder.layers.0.mixln_settings"]["post_ln_layers"] = 1
    torch.save(state, f)
    with pytest.raises(ConversionError, match="layer 2 is stored as a Post-LN layer"):
        to_hf(str(ckpt), str(tmp_path / "out2"), vocab_size=97, progress=False)


def test_legacy_virtual_pipeline_order(tmp_path):
    """model0 / model1 chunks per stage: global layers go chunk by chunk across the stages."""
    src, ckpt, ref = tmp_path / "src", tmp_path / "ckpt", tmp_path / "ref"
    make_mixln_folder(src)
    from_hf(str(src), str(ckpt), ckpt_format="torch", progress=False)
    f = ckpt / "release" / "mp_rank_00" / "model_optim_rng.pt"
    whole = torch.load(f, weights_only=False)
    # PP2 x VPP2 with one layer per chunk: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3.
    placement = {0: [(0, 0), (2, 1)], 1: [(1, 0), (3, 1)]}
    shutil.rmtree(ckpt / "release" / "mp_rank_00")
    for stage, layers in placement.items():
        state = {k: v for k, v in whole.items() if k != "model"}
        for layer, chunk in layers:
            model = {}
            for name, value in whole["model"].items():
                prefix = f"decoder.layers.{layer}."
                if name.startswith(prefix):
                    model["decoder.layers.0." + name[len(prefix):]] = value
                elif not name.startswith("decoder.layers.") and (
                        (stage == 0 and chunk == 0 and name.startswith("embedding"))
                        or (stage == 1 and chunk == 1 and not name.startswith("embedding"))):
                    model[name] = value
            state[f"model{chunk}"] = model
        os.makedirs(ckpt / "release" / f"mp_rank_00_{stage:03d}")
        torch.save(state, ckpt / "release" / f"mp_rank_00_{stage:03d}" / "model_optim_rng.pt")
    to_hf(str(ckpt), str(ref), progress=False)
    assert_same_tensors(src, ref)


def test_streaming_safetensors_writer(tmp_path):
    from mixln_megatron.convert.to_hf import StreamingSafetensorsWriter

    plan = [("a", (5, 3), torch.float32), ("b", (4,), torch.bfloat16), ("c", (7, 2), torch.float16)]
    w = StreamingSafetensorsWriter(str(tmp_path), plan, max_shard_bytes=64)
    a, b, c = torch.randn(5, 3), torch.randn(4).bfloat16(), torch.randn(7, 2).half()
    w.write("a", a[:2])
    w.write("a", a[2:])
    with pytest.raises(RuntimeError, match="expected b"):
        w.write("c", c)
    w.write("b", b)
    w.write("c", c)
    w.close()
    got = tensors(tmp_path)
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b) and torch.equal(got["c"], c)
    assert len(w.files) == 2


def test_cli(tmp_path, capsys):
    from mixln_megatron.convert.cli import main

    src, ckpt, back = tmp_path / "src", tmp_path / "ckpt", tmp_path / "back"
    make_mixln_folder(src)
    assert main(["from-hf", "--load", str(src), "--save", str(ckpt), "--tp", "2", "--pp", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "release" in out and "--mixln-post-ln-layers 2" in out
    assert main(["to-hf", "--load", str(ckpt), "--save", str(back), "--no-progress"]) == 0
    assert "trust_remote_code=True" in capsys.readouterr().out
    assert_same_tensors(src, back)
    assert main(["to-hf", "--load", str(ckpt), "--save", str(back), "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["to-hf", "--load", str(ckpt)])  # --save is required


# --------------------------------------------------------------------------------- slow
PRETRAIN_TINY = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "96", "--num-attention-heads", "4",
                 "--group-query-attention", "--num-query-groups", "2", "--seq-length", "32",
                 "--max-position-embeddings", "64", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
                 "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--norm-epsilon",
                 "1e-5", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3", "--mock-data",
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "97", "--num-workers", "0", "--eval-iters", "0",
                 "--eval-interval", "1000", "--log-interval", "1", "--use-cpu-initialization"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_from_hf_checkpoint_continues_training_with_pretrain(tmp_path, fmt):
    src, ckpt, cont = tmp_path / "src", tmp_path / "ckpt", tmp_path / "cont"
    make_mixln_folder(src, dtype=torch.float32)
    from_hf(str(src), str(ckpt), ckpt_format=fmt, transformer_impl="local", progress=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    base = [sys.executable, "-m", "mixln_megatron.training.pretrain", "--cpu", *PRETRAIN_TINY, "--load", str(ckpt),
            "--ckpt-format", fmt]
    ok = run_python(base + ["--mixln-post-ln-layers", "2", "--train-iters", "2", "--save", str(cont),
                                "--save-interval", "2"], capture_output=True, text=True, env=env, timeout=600)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "loading release" in ok.stdout + ok.stderr
    assert open(cont / "latest_checkpointed_iteration.txt").read().strip() == "2"
    bad = run_python(base + ["--mixln-post-ln-layers", "1", "--train-iters", "1"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert bad.returncode != 0 and "Mix-LN settings differ" in bad.stdout + bad.stderr


# Measured on the converter before the readers moved onto torch.distributed.checkpoint (commit
# 3397bf7: hand-written zip-chunk reads, row pieces); the one-way data path must write the same bytes.
EXPORT_SHA256 = "2372fa8bdbe2574aa5537c3f9d3d54561642cfd3913d0f8741f92dd65e0b17a2"


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_export_bytes_are_unchanged(tmp_path, ckpt_format):
    """A fixed (seeded) Mix-LN model through from-hf (TP2 x PP2) and to-hf gives byte-identical safetensors."""
    import hashlib

    make_mixln_folder(tmp_path / "src", dtype=torch.bfloat16, post_ln_layers=2)
    from_hf(str(tmp_path / "src"), str(tmp_path / "ckpt"), tp=2, pp=2, ckpt_format=ckpt_format, progress=False)
    to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), progress=False)
    files = sorted(glob.glob(str(tmp_path / "hf" / "*.safetensors")))
    assert [os.path.basename(f) for f in files] == ["model-00001-of-00001.safetensors"]
    assert hashlib.sha256(open(files[0], "rb").read()).hexdigest() == EXPORT_SHA256
