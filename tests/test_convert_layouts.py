"""Conversion of per-layer layouts: pre, post, deepnorm and sandwich layers anywhere.

A tiny Megatron GPTModel of each layout (local backend, GQA, fp32) is saved as torch_dist with
Megatron-LM's args, then:
  - `convert to-hf` writes layer_kinds (and DeepNorm's alpha) into config.json, every norm under its
    HF name (sandwich: Gemma 2's four), and the exported model's logits equal Megatron's;
  - `convert from-hf` writes it back: the format-2 record, mixln_norm_c / _d stacked over the
    sandwich layers, --mixln-layout in the args; the checkpoint loads into the Megatron model of the
    layout with every tensor bit-identical, and exports again to the same HF tensors;
  - a legacy (per-rank torch) file of the same model exports to the same HF tensors, and from-hf
    writes legacy files whose layers carry their kind's module names;
  - `convert inspect` prints the layout; an all-sandwich model is mixln_llama, never stock Llama;
  - gpt-to-hybrid / hybrid-to-gpt carry every layout (sandwich's output norms stacked over the
    sandwich layers in GPT, per `*` / `-` layer in hybrid): the hybrid checkpoint exports to the
    same HF tensors and converts back bit for bit;
  - a bad layer_kinds / deepnorm_alpha in an HF config.json is one ConversionError line;
  - (mp) the torch_dist checkpoint resharded to TP2 and to PP2 exports to the same HF tensors.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mixln_megatron.convert import ConversionError  # noqa: E402
from mixln_megatron.convert import convert_from_hf as from_hf  # noqa: E402
from mixln_megatron.convert import convert_to_hf as to_hf  # noqa: E402
from harness import testing as mu  # noqa: E402

from test_convert import assert_same_tensors, tensors  # noqa: E402

pytestmark = pytest.mark.usefixtures("mcore_single")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "layout_convert_worker.py")
L = 4
LAYOUTS = {  # name: (layout, scheme, untie)
    "mixed": ("deepnorm:1,sandwich:2,post:3,pre:4", None, True),
    "every2": ("post:every2,pre:*", None, False),
    "sandwich": ("sandwich:*", None, True),
    "lns": ("pre:1,sandwich:2-4", "lns", True),
}
KINDS = {
    "mixed": ["deepnorm", "sandwich", "post", "pre"],
    "every2": ["pre", "post", "pre", "post"],
    "sandwich": ["sandwich"] * 4,
    "lns": ["pre", "sandwich", "sandwich", "sandwich"],
}


# --------------------------------------------------------------------------------- helpers
def megatron_args(layout, scheme, untie, tp=1, pp=1):
    """What Megatron-LM saves in a checkpoint of this tiny model (the fields conversion reads)."""
    return argparse.Namespace(
        num_layers=L, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, group_query_attention=True,
        num_query_groups=2, kv_channels=16, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
        position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0,
        untie_embeddings_and_output_weights=untie, vocab_size=mu.VOCAB, padded_vocab_size=mu.VOCAB,
        make_vocab_size_divisible_by=128, max_position_embeddings=mu.SEQ, seq_length=mu.SEQ, norm_epsilon=1e-5,
        layernorm_epsilon=1e-5, tokenizer_model=None, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, mixln_layout=layout, mixln_scheme=scheme, mixln_post_ln_layers=None,
        mixln_alpha=None, ckpt_format="torch_dist",
    )


def build(name, seed=None):
    """The tiny GPTModel of LAYOUTS[name] (local backend), its weights drawn with `seed`."""
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec

    layout, scheme, untie = LAYOUTS[name]
    cfg = mu.tiny_config(num_layers=L, query_groups=2)
    spec = get_mixln_decoder_block_spec(cfg, backend="local", settings=MixLNSettings(layout=layout, scheme=scheme))
    model = mu.build_gpt(cfg, spec, untie=untie)
    if seed is not None:
        mu.randomize([model], seed=seed)
        with torch.no_grad():  # larger linears than megatron's init, so that every weight shows in the logits
            for pname, p in model.named_parameters():
                if "norm" not in pname:
                    p.mul_(5.0)
    return model


def save_torch_dist(model, name, root):
    """The model as Megatron-LM saves it: <root>/iter_0000001 (args and the content metadata in the
    common state) and latest_checkpointed_iteration.txt."""
    from megatron.core import dist_checkpointing

    ckpt = root / "iter_0000001"
    ckpt.mkdir(parents=True)
    metadata = {}
    state = {"model": model.sharded_state_dict(metadata=metadata), "args": megatron_args(*LAYOUTS[name]),
             "iteration": 1, "checkpoint_version": 3.0}
    dist_checkpointing.save(state, str(ckpt), content_metadata=metadata)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    return root


def load_torch_dist(model, path):
    """dist_checkpointing load as Megatron-LM does (content metadata handed to sharded_state_dict)."""
    from megatron.core import dist_checkpointing

    path = str(path)
    if os.path.exists(os.path.join(path, "latest_checkpointed_iteration.txt")):
        text = open(os.path.join(path, "latest_checkpointed_iteration.txt")).read().strip()
        path = os.path.join(path, "release" if text == "release" else f"iter_{int(text):07d}")
    metadata = dist_checkpointing.load_content_metadata(path)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=metadata)}, path)
    model.load_state_dict(loaded["model"])
    return model


def megatron_logits(model):
    ids, _, pos, mask = mu.batch()
    model.eval()
    with torch.no_grad():
        return ids, model(ids, pos, mask)


def one_line_error(fn, *args, error=ConversionError, match=None, **kwargs):
    with pytest.raises(error, match=match) as err:
        fn(*args, **kwargs)
    assert "\n" not in str(err.value), str(err.value)
    return str(err.value)


# --------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{name: (Megatron model, its torch_dist save dir, its HF export, the to-hf summary)}."""
    root = tmp_path_factory.mktemp("layouts")
    out = {}
    for i, name in enumerate(LAYOUTS):
        model = build(name, seed=10 + i)
        ckpt = save_torch_dist(model, name, root / f"{name}_ckpt")
        hf = root / f"{name}_hf"
        summary = to_hf(str(ckpt), str(hf), progress=False)
        out[name] = (model, ckpt, hf, summary)
    return out


# --------------------------------------------------------------------------------- to-hf
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_export_carries_the_layout_and_equals_megatron(exported, name):
    from transformers import AutoModelForCausalLM

    model, _, hf, summary = exported[name]
    layout, scheme, untie = LAYOUTS[name]
    cfg = json.load(open(hf / "config.json"))
    assert cfg["model_type"] == "mixln_llama" and cfg["architectures"] == ["MixLNLlamaForCausalLM"], cfg
    assert cfg["layer_kinds"] == KINDS[name] and cfg["post_ln_layers"] == sum(
        k in ("post", "deepnorm") for k in KINDS[name])
    assert cfg["mixln_scheme"] == (scheme or "mixln") and cfg["tie_word_embeddings"] is (not untie)
    if "deepnorm" in KINDS[name]:
        assert cfg["deepnorm_alpha"] == pytest.approx((2 * L) ** 0.25, rel=1e-15)
        assert cfg["deepnorm_beta"] == pytest.approx((8 * L) ** -0.25, rel=1e-15)
    else:
        assert "deepnorm_alpha" not in cfg
    assert (hf / "modeling_mixln_llama.py").exists()
    assert summary["architecture"] == "MixLNLlamaForCausalLM" and summary["layout"] is not None
    # every norm under its kind's HF name
    names = set(tensors(hf))
    for i, kind in enumerate(KINDS[name]):
        norms = {n.split(".")[3] for n in names if n.startswith(f"model.layers.{i}.") and "layernorm" in n}
        assert norms == {
            "pre": {"input_layernorm", "post_attention_layernorm"},
            "post": {"post_attention_layernorm", "post_feedforward_layernorm"},
            "deepnorm": {"post_attention_layernorm", "post_feedforward_layernorm"},
            "sandwich": {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm"},
        }[kind], (i, kind)
    ids, want = megatron_logits(model)
    hf_model = AutoModelForCausalLM.from_pretrained(str(hf), trust_remote_code=True, dtype=torch.float32).eval()
    assert type(hf_model).__name__ == "MixLNLlamaForCausalLM"
    with torch.no_grad():
        got = hf_model(ids).logits
    assert want.abs().max() > 1.0  # the comparison is not of near-zero logits
    assert (got - want).abs().max().item() <= 1e-5


def test_sandwich_norm_rows_are_the_sandwich_layers(exported):
    """HF's sandwich output norms come from their layer's row of mixln_norm_c / _d (its rank among
    the sandwich layers), not from the layer index."""
    model, _, hf, _ = exported["lns"]
    hf_tensors = tensors(hf)
    layers = list(model.decoder.layers)
    for i in (1, 2, 3):
        layer = layers[i]
        assert layer.kind == "sandwich"
        assert torch.equal(hf_tensors[f"model.layers.{i}.post_attention_layernorm.weight"],
                           layer.attn_output_layernorm.weight)
        assert torch.equal(hf_tensors[f"model.layers.{i}.post_feedforward_layernorm.weight"],
                           layer.mlp_output_layernorm.weight)
        assert torch.equal(hf_tensors[f"model.layers.{i}.pre_feedforward_layernorm.weight"],
                           layer.pre_mlp_layernorm.weight)


def test_all_sandwich_is_never_stock_llama(exported):
    from mixln_megatron.convert.to_hf import hf_config_dict
    from mixln_megatron.convert.shape import ModelShape

    assert json.load(open(exported["sandwich"][2] / "config.json"))["model_type"] == "mixln_llama"
    shape = ModelShape(num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2, num_query_groups=1,
                       kv_channels=4, vocab_size=10, max_position_embeddings=8)
    assert hf_config_dict(shape, 0, "mixln", None, "float32", {}, ["sandwich"] * 2)["model_type"] == "mixln_llama"
    assert hf_config_dict(shape, 0, "mixln", None, "float32", {}, ["pre"] * 2)["model_type"] == "llama"


def test_inspect_shows_the_layout(exported, capsys):
    from mixln_megatron.convert.cli import main

    _, ckpt, _, _ = exported["mixed"]
    assert main(["inspect", "--load", str(ckpt), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layout"] == "deepnorm:1,sandwich:2,post:3,pre:4" and info["post_ln_blocks"] == [1, 3]
    assert info["deepnorm_alpha"] == pytest.approx((2 * L) ** 0.25) and info["post_ln_layers"] == 2
    assert main(["inspect", "--load", str(exported["every2"][1])]) == 0
    text = capsys.readouterr().out
    assert "layout: pre:1,post:2,pre:3,post:4" in text and "post_ln_blocks: [2, 4]" in text


def test_to_hf_cli_line_names_the_layout(exported, tmp_path, capsys):
    from mixln_megatron.convert.cli import main

    assert main(["to-hf", "--load", str(exported["mixed"][1]), "--save", str(tmp_path / "hf"), "--no-progress"]) == 0
    assert "layout=deepnorm:1,sandwich:2,post:3,pre:4" in capsys.readouterr().out


def test_legacy_file_of_the_model_exports_the_same(exported, tmp_path):
    """A legacy (per-rank torch) file as Megatron-LM saves it (module names, the record on layer 0)
    exports to the torch_dist export's tensors; a layer stored as another kind is refused."""
    for name in ("mixed", "lns"):
        model, _, hf, _ = exported[name]
        root = tmp_path / name
        (root / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
        (root / "latest_checkpointed_iteration.txt").write_text("1")
        state = {"args": megatron_args(*LAYOUTS[name]), "iteration": 1, "checkpoint_version": 3.0,
                 "model": model.state_dict_for_save_checkpoint()}
        torch.save(state, root / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")
        to_hf(str(root), str(tmp_path / f"{name}_hf"), progress=False)
        assert_same_tensors(hf, tmp_path / f"{name}_hf")
    # layer 1 (pre) stored with the output norms of a sandwich layer: the settings say otherwise
    sd = state["model"]
    for suffix in ("attn_output_layernorm.weight", "mlp_output_layernorm.weight"):
        sd[f"decoder.layers.0.{suffix}"] = sd[f"decoder.layers.1.{suffix}"]
    torch.save(state, root / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")
    one_line_error(to_hf, str(root), str(tmp_path / "bad"), progress=False,
                   match=r"layer 1 is stored as a sandwich layer but the Mix-LN settings \(layout pre:1,sandwich:2-4\) "
                         "make it pre")


# --------------------------------------------------------------------------------- from-hf
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_from_hf_loads_back_bit_identical(exported, tmp_path, name):
    from mixln_megatron.convert.inspect import open_checkpoint

    model, _, hf, _ = exported[name]
    layout, scheme, _ = LAYOUTS[name]
    ckpt = tmp_path / "ckpt"
    summary = from_hf(str(hf), str(ckpt), transformer_impl="local", progress=False)
    assert summary["layout"] == ",".join(f"{k}:{i}" for i, k in enumerate(KINDS[name], 1)) or summary["layout"]
    assert "--mixln-layout" in summary["mixln_flags"] and "--mixln-post-ln-layers" not in summary["launch_flags"]
    reader = open_checkpoint(str(ckpt))
    args = reader.args
    assert args.mixln_post_ln_layers is None and args.mixln_layout == summary["layout"]
    assert args.spec == ["mixln_megatron.spec", "mixln_local_layer_spec"]
    record = reader.settings_record
    assert record["format"] == 2 and record["layout"] == summary["layout"]
    sandwiches = KINDS[name].count("sandwich")
    for key in ("decoder.layers.mixln_norm_c.weight", "decoder.layers.mixln_norm_d.weight"):
        assert (reader.global_shape(key) if sandwiches else reader.has(key)) == ((sandwiches, 64) if sandwiches
                                                                                 else False)
    if "deepnorm" in KINDS[name]:
        assert float(args.mixln_deepnorm_alpha) == record["deepnorm_alpha"] == pytest.approx((2 * L) ** 0.25)
        assert isinstance(args.mixln_deepnorm_alpha, str) and isinstance(args.mixln_deepnorm_beta, str)
        assert "--mixln-deepnorm-alpha" in summary["mixln_flags"]
    # the settings a resume reads from these args agree with the record (one reading, cross-checked)
    from mixln_megatron.model.settings import MixLNSettings

    again = MixLNSettings.from_checkpoint(args, record=record, metadata=reader.content_metadata["mixln"])
    assert again.layout == summary["layout"]
    # Megatron loads it into the model of the layout (settings record checked): every tensor bit-identical
    fresh = load_torch_dist(build(name, seed=99), ckpt)
    for (pname, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        if torch.is_tensor(a) and a.is_floating_point():
            assert torch.equal(a, b), pname
    # and it exports to the same HF tensors
    to_hf(str(ckpt), str(tmp_path / "back"), progress=False)
    assert_same_tensors(hf, tmp_path / "back")


def test_from_hf_legacy_files_name_each_kind_s_modules(exported, tmp_path):
    from mixln_megatron.convert.inspect import open_checkpoint

    hf = exported["mixed"][2]
    for impl in ("local", "transformer_engine"):
        ckpt = tmp_path / impl
        from_hf(str(hf), str(ckpt), ckpt_format="torch", tp=2, pp=2, transformer_impl=impl, progress=False)
        stage0 = torch.load(ckpt / "release" / "mp_rank_01_000" / "model_optim_rng.pt", weights_only=False)["model"]
        layer1, layer2 = ({k.split(".", 3)[3] for k in stage0 if k.startswith(f"decoder.layers.{i}.")} for i in (0, 1))
        assert {"post_attention_layernorm.weight", "post_mlp_layernorm.weight"} <= layer1  # deepnorm
        pre_norms = ({"input_layernorm.weight", "pre_mlp_layernorm.weight"} if impl == "local" else
                     {"self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"})
        assert pre_norms | {"attn_output_layernorm.weight", "mlp_output_layernorm.weight"} <= layer2  # sandwich
        assert stage0["decoder.layers.0.mixln_settings"]["layout"] == "deepnorm:1,sandwich:2,post:3,pre:4"
        assert open_checkpoint(str(ckpt)).args.mixln_layout == "deepnorm:1,sandwich:2,post:3,pre:4"
        to_hf(str(ckpt), str(tmp_path / f"{impl}_back"), progress=False)
        assert_same_tensors(hf, tmp_path / f"{impl}_back")


def test_from_hf_cli_prints_the_layout_flags(exported, tmp_path, capsys):
    from mixln_megatron.convert.cli import main

    assert main(["from-hf", "--load", str(exported["mixed"][2]), "--save", str(tmp_path / "c"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "--mixln-layout deepnorm:1,sandwich:2,post:3,pre:4 --mixln-deepnorm-alpha" in out
    assert "--spec mixln_megatron.spec mixln_layer_spec" in out


def _edited(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.load(open(dst / "config.json"))
    for key, value in changes.items():
        if value is KeyError:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes,match", [
    (dict(layer_kinds="sandwich:*"), "layer_kinds must be None or a list"),
    (dict(layer_kinds={"0": "pre"}), "layer_kinds must be None or a list"),
    (dict(layer_kinds=["deepnorm", "sandwich", "post"]), "layer_kinds has 3 entries but num_hidden_layers = 4"),
    (dict(layer_kinds=["deepnorm"] * 10**5), "layer_kinds has 100000 entries"),
    (dict(layer_kinds=["deepnorm", "sandwich", "peri", "pre"]), r"layer_kinds\[2\] = 'peri' is not one of"),
    (dict(layer_kinds=["deepnorm", None, "post", "pre"]), r"layer_kinds\[1\] = None is not one of"),
    (dict(deepnorm_alpha=float("nan")), "deepnorm_alpha must be a finite number > 0"),
    (dict(deepnorm_alpha=-1.0), "deepnorm_alpha must be a finite number > 0"),
    (dict(deepnorm_alpha="2.0"), "deepnorm_alpha must be a finite number > 0"),
    (dict(deepnorm_alpha=True), "deepnorm_alpha must be a finite number > 0"),
    (dict(deepnorm_beta=0), "deepnorm_beta must be a finite number > 0"),
    (dict(deepnorm_alpha=None), "deepnorm layers but deepnorm_alpha is None"),
    (dict(post_ln_layers=1), "post_ln_layers = 1 but layer_kinds has 2"),
    (dict(layer_kinds=["pre", "sandwich", "pre", "pre"], post_ln_layers=0), "no layer is deepnorm"),
    (dict(layer_kinds=KeyError), "deepnorm_alpha is set but no layer is deepnorm"),
    (dict(mixln_scheme="lns"), "scheme 'lns'"),
])
def test_bad_layout_fields_of_an_hf_folder_are_one_line(exported, tmp_path, changes, match):
    folder = _edited(exported["mixed"][2], tmp_path / "hf", **changes)
    one_line_error(from_hf, str(folder), str(tmp_path / "out"), progress=False, match=match)
    assert not (tmp_path / "out").exists()


def test_bad_layer_kinds_through_the_cli(exported, tmp_path, capsys):
    from mixln_megatron.convert.cli import main

    folder = _edited(exported["mixed"][2], tmp_path / "hf", layer_kinds=["pre", 7, "post", "pre"])
    assert main(["from-hf", "--load", str(folder), "--save", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "layer_kinds[1] = 7 is not one of" in err, err


def test_a_folder_without_deepnorm_beta_gets_deepnet_s(exported, tmp_path):
    from mixln_megatron.convert.inspect import open_checkpoint

    folder = _edited(exported["mixed"][2], tmp_path / "hf", deepnorm_beta=None, deepnorm_alpha=2.5)
    s = from_hf(str(folder), str(tmp_path / "out"), progress=False)
    assert s["deepnorm_alpha"] == 2.5 and s["deepnorm_beta"] == pytest.approx((8 * L) ** -0.25)
    assert open_checkpoint(str(tmp_path / "out")).args.mixln_deepnorm_alpha == "2.5"


def test_explicit_settings_that_change_a_layout_folder_are_refused(exported, tmp_path):
    one_line_error(from_hf, str(exported["mixed"][2]), str(tmp_path / "out"), post_ln_layers=2, progress=False,
                   match="layout=deepnorm:1,sandwich:2,post:3,pre:4.*would change the network")
    s = from_hf(str(exported["lns"][2]), str(tmp_path / "same"), scheme="lns", progress=False)
    assert s["layout"] == "pre:1,sandwich:2-4" and s["scheme"] == "lns"


# --------------------------------------------------------------------------------- GPT <-> hybrid
@pytest.mark.parametrize("name", ["every2", "mixed", "sandwich", "lns"])
def test_gpt_hybrid_carries_every_layout(exported, tmp_path, name):
    from mixln_megatron.convert.gpt_hybrid import convert_gpt_to_hybrid, convert_hybrid_to_gpt
    from mixln_megatron.convert.inspect import open_checkpoint
    from mixln_megatron.model.layout import layout_text

    model, ckpt, hf, _ = exported[name]
    layout = layout_text(KINDS[name])
    s = convert_gpt_to_hybrid(str(ckpt), str(tmp_path / "hybrid"))
    assert s["layout"] == layout and s["hybrid_pattern"] == "*-" * L
    hybrid = open_checkpoint(str(tmp_path / "hybrid"))
    for block, kind in enumerate(KINDS[name]):
        # a post / deepnorm block keeps N1 in its `*` layer and N2 in its `-` layer, a pre / sandwich
        # block the other way round; a sandwich block's N_b in its `*` layer, N_d in its `-` layer
        post, sandwich = kind in ("post", "deepnorm"), kind == "sandwich"
        a, b, c, d = (f"decoder.layers.{2 * block + j}.mixln_norm_{n}.weight"
                      for j, n in ((0, "a"), (1, "b"), (0, "c"), (1, "d")))
        assert (hybrid.has(a), hybrid.has(b), hybrid.has(c), hybrid.has(d)) == (
            not post, not post, sandwich, sandwich), (block, kind)
    # the hybrid checkpoint exports as the GPT model it is, and converts back to the same tensors
    to_hf(str(tmp_path / "hybrid"), str(tmp_path / "hybrid_hf"), progress=False)
    assert_same_tensors(hf, tmp_path / "hybrid_hf")
    back = convert_hybrid_to_gpt(str(tmp_path / "hybrid"), str(tmp_path / "gpt"))
    assert back["layout"] == layout
    fresh = load_torch_dist(build(name, seed=99), tmp_path / "gpt")
    for (pname, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        if torch.is_tensor(a) and a.is_floating_point():
            assert torch.equal(a, b), pname


def test_hybrid_sandwich_norms_that_disagree_with_the_settings_are_one_line(exported, tmp_path, monkeypatch):
    """A hybrid checkpoint whose sandwich norms sit in other blocks than its settings record says
    (block 2's, read with settings that make block 4 the sandwich one): to-hf and hybrid-to-gpt
    refuse in one line, and write nothing."""
    from mixln_megatron.convert import gpt_hybrid, inspect
    from mixln_megatron.convert.gpt_hybrid import convert_gpt_to_hybrid, convert_hybrid_to_gpt
    from mixln_megatron.model.placement import resolve_placement
    from mixln_megatron.model.settings import MixLNSettings

    convert_gpt_to_hybrid(str(exported["mixed"][1]), str(tmp_path / "hybrid"))
    real = inspect.mixln_placement

    def moved(reader, num_layers):  # the record as saved, the kinds of another layout
        record, source, placement = real(reader, num_layers)
        other = resolve_placement(num_layers, MixLNSettings(layout="deepnorm:1,pre:2,post:3,sandwich:4",
                                                            deepnorm_alpha=placement.deepnorm_alpha,
                                                            deepnorm_beta=placement.deepnorm_beta))
        return record, source, other

    monkeypatch.setattr(inspect, "mixln_placement", moved)
    monkeypatch.setattr(gpt_hybrid, "mixln_placement", moved)
    line = one_line_error(to_hf, str(tmp_path / "hybrid"), str(tmp_path / "hf"), progress=False)
    assert "sandwich" in line and "block 2" in line, line
    line = one_line_error(convert_hybrid_to_gpt, str(tmp_path / "hybrid"), str(tmp_path / "gpt"))
    assert "sandwich" in line, line
    assert sorted(os.listdir(tmp_path)) == ["hybrid"]


def test_hybrid_model_loads_the_converted_layout(exported, tmp_path):
    """The gpt-to-hybrid output of a `post:every2` model loads into the HybridModel of that layout
    (its settings check passes) and gives the GPT model's logits."""
    from mixln_megatron import compat

    if not compat.HYBRID_MODEL:
        pytest.skip("this megatron-core has no HybridModel")
    from mixln_megatron.convert.gpt_hybrid import convert_gpt_to_hybrid
    from mixln_megatron.model.specs import get_mixln_hybrid_stack_spec

    model, ckpt, _, _ = exported["every2"]
    convert_gpt_to_hybrid(str(ckpt), str(tmp_path / "hybrid"))
    cfg = mu.tiny_config(num_layers=2 * L, query_groups=2)
    spec = get_mixln_hybrid_stack_spec(cfg, backend="local", layout=LAYOUTS["every2"][0])
    hybrid = load_torch_dist(mu.build_hybrid(cfg, spec, "*-" * L, untie=LAYOUTS["every2"][2]), tmp_path / "hybrid")
    ids, want = megatron_logits(model)
    _, got = megatron_logits(hybrid)
    assert torch.equal(got, want)


# --------------------------------------------------------------------------------- resharded (torchrun)
@pytest.mark.mp
def test_resharded_checkpoints_export_the_same(exported, tmp_path):
    """The `mixed` checkpoint loaded and saved again at TP2 and at PP2 (2 ranks): sandwich rows from
    two TP shards / two stages; each exports to the TP1 export's tensors."""
    _, ckpt, hf, _ = exported["mixed"]
    (tmp_path / "args.json").write_text(json.dumps(vars(megatron_args(*LAYOUTS["mixed"]))))
    mu.torchrun(WORKER, 2, "--load", str(ckpt / "iter_0000001"), "--out", str(tmp_path), "--layout",
                LAYOUTS["mixed"][0], "--args", str(tmp_path / "args.json"), timeout=900)
    for layout in ("tp2", "pp2"):
        to_hf(str(tmp_path / layout), str(tmp_path / f"{layout}_hf"), progress=False)
        assert_same_tensors(hf, tmp_path / f"{layout}_hf")


# --------------------------------------------------------------------------------- analysis loader
@pytest.mark.parametrize("name", ["mixed", "lns"])
def test_the_analysis_loader_builds_the_checkpoint_s_layout(exported, name):
    """`mixln-megatron analyze --load` reads a layout checkpoint into the same network."""
    from mixln_megatron.analysis.loading import load_megatron_checkpoint

    model, ckpt, _, _ = exported[name]
    lm = load_megatron_checkpoint(str(ckpt))
    assert [layer.kind for layer in lm.layers] == KINDS[name]
    ids, want = megatron_logits(model)
    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        got = lm.token_losses(ids, labels)
        ref = torch.nn.functional.cross_entropy(want.float().reshape(-1, want.shape[-1]), labels.reshape(-1),
                                                reduction="none").reshape(labels.shape)
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
