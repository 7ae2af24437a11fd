"""Hugging Face folder -> Megatron-LM checkpoint that Megatron-LM (and `mixln-megatron pretrain`)
loads to continue training or fine-tune.

Input: a Mix-LN / LNS folder (model_type mixln_llama, e.g. from `convert to-hf`; with `layer_kinds`,
any layout of pre, post, deepnorm and sandwich layers, model.layout) or a stock Llama
folder (model_type llama). A stock folder becomes a Pre-LN model (P = 0) unless the user asks
for Mix-LN explicitly (--post-ln-layers / --mixln-alpha): then layers 1..P become Post-LN layers
with N1 := post_attention_layernorm and N2 := input_layernorm of the Llama weights (a different
network; meant as an initialisation for Mix-LN fine-tuning, and announced as such).
MoE folders: Mix-LN MoE (mixln_moe, e.g. from `convert to-hf`), stock Mixtral and Qwen2-MoE (the
hub's per-expert names; Qwen2-MoE's / mixln_moe's qkv_bias as --add-qkv-bias), written as
torch_dist only, with per-layer keys when dense and MoE layers mix (as megatron saves them) and the
MoE args (--num-experts, --moe-layer-freq, --moe-router-dtype fp32 for a mixln_moe router_dtype
"float32", ...) recorded; the written fc1s are plain [gate; up] and no top-k scaling factor is set.

Output (written into a temporary directory renamed to --save at the end):
  latest_checkpointed_iteration.txt   "release"
  release/                            Megatron-LM's name for a converted (not trained) checkpoint:
                                      loaded as iteration 0, without optimizer / RNG state
                                      (there is none), so training continues with a fresh
                                      optimizer and its first save is iter_<N>.
  torch_dist (default): release/{.metadata, __0_0.distcp, metadata.json} with the common state
      (args, iteration 0, content metadata with the Mix-LN record) inside, and the Mix-LN
      settings record `decoder.layers.mixln_settings` unless the model is stock (format 2 with the
      layout for a layout other than Mix-LN's first P); sandwich layers' output norms under
      decoder.layers.mixln_norm_c / _d, stacked over the sandwich layers (model.layer).
      torch_dist is layout-free: Megatron reshards it to any TP / PP / VPP at load time. --tp
      only decides the vocabulary padding (make_vocab_size_divisible_by x TP, which the loading
      run must reproduce) and, like --pp, is recorded in the args.
  torch (legacy, --ckpt-format torch): release/mp_rank_TT[_PPP]/model_optim_rng.pt, one file per
      TP x PP rank; the loading run must use exactly this --tp / --pp (Megatron checks both), and
      the module names follow --transformer-impl (TE fused-norm names or local names).

The args carried (argparse.Namespace, as Megatron-LM saves them): the model shape and flavour
(RMSNorm, SwiGLU, RoPE base / scaling, biases, tied embeddings, GQA), vocab_size /
padded_vocab_size / make_vocab_size_divisible_by, the tokenizer (HuggingFaceTokenizer on the HF
folder when it holds tokenizer files), params dtype, TP / PP, the --spec of the Mix-LN layer when
the model is not stock, and the integer P as mixln_post_ln_layers (alpha is only informational),
or for another layout mixln_layout and DeepNorm's mixln_deepnorm_alpha / _beta (text, as the
--mixln-* flags take them). A layer_kinds without deepnorm_beta gets DeepNet's default beta (it
only shapes an initialisation, never these weights).
Reading: hf_folder, hf_roles; writing: megatron_writers (one chunk or one rank file in memory).

The folder is untrusted input (issue 27): hf_folder confines every read to it and validates the
index and every safetensors header, shape.shape_from_hf_config checks each config field's type and
range, and the config is checked against the files (the layers the weight names show, then every
tensor's shape in the headers, hf_roles.HFRoleSource.check) before any plan is built, so a
config.json claiming 10**9 layers is one line at bounded memory, never a 10**9-layer plan.
"""

from __future__ import annotations

import math
import os
import time
from typing import Optional, Tuple

import torch

from ..errors import ConversionError
from .staging import prepare_output, staged_output_dir
from . import mapping as M
from .hf_folder import HFCheckpoint
from .hf_roles import HFRoleSource
from .locate import TRACKER
from .megatron_writers import write_legacy, write_torch_dist
from .shape import ModelShape, check_tp_divisibility, padded_vocab_size, shape_from_hf_config
from .written_args import launch_flags, megatron_args_namespace, placement_flags

RELEASE = "release"
MIXLN_MODEL_TYPES = ("mixln_llama", "mixln_moe")  # folders that carry their Mix-LN settings (else stock)
CONTENT_METADATA_BASE = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


# --------------------------------------------------------------------------- checks
def check_layers_against_files(hf: HFCheckpoint, shape: ModelShape) -> None:
    """The decoder layers the weight names show (model.layers.<i>.) must be exactly 0..L-1 of the
    config's num_hidden_layers: one ConversionError otherwise, before anything is planned."""
    found = hf.layer_indices()  # sorted, distinct: 0..L-1 exactly when it has L entries ending at L-1
    if found and len(found) == shape.num_layers and found[0] == 0 and found[-1] == shape.num_layers - 1:
        return
    config = os.path.join(hf.path, "config.json")
    if not found:
        raise ConversionError(f"{config} says num_hidden_layers {shape.num_layers}, but the weights of {hf.path} "
                              "hold no decoder layer (no model.layers.<i>. tensor)")
    gaps = []  # the first few missing indices, found without materialising any range (memory bounded by the names)
    for before, after in zip([-1] + found, found):
        gaps.extend(range(before + 1, min(after, before + 1 + 5 - len(gaps))))
        if len(gaps) >= 5:
            break
    detail = f"layers 0..{found[-1]}" + (f" without {gaps[:5]}" if gaps else "")
    raise ConversionError(f"{config} says num_hidden_layers {shape.num_layers}, but the weights of {hf.path} hold "
                          f"{len(found)} decoder layers ({detail}); the config does not match the files")


def _layout_fields(config: dict, num_layers: int, source: str = "config.json"):
    """(layer kinds or None, deepnorm_alpha, deepnorm_beta) of a mixln_llama config.json, checked as
    untrusted input: layer_kinds a list of one known kind per layer (num_hidden_layers entries, itself
    bounded by shape.BOUNDS), deepnorm_alpha / deepnorm_beta finite numbers > 0 or null."""
    from ..model.layout import KINDS

    kinds = config.get("layer_kinds")
    bad = f"invalid Mix-LN fields in {source}"
    if kinds is not None:
        if not isinstance(kinds, list):
            raise ConversionError(f"{bad}: layer_kinds must be a list with one of {', '.join(KINDS)} per layer, got "
                                  f"{_shown(kinds)}")
        if len(kinds) != num_layers:
            raise ConversionError(f"{bad}: layer_kinds has {len(kinds)} entries but num_hidden_layers is {num_layers}: "
                                  "one kind per layer")
        wrong = next(((i, k) for i, k in enumerate(kinds) if not isinstance(k, str) or k not in KINDS), None)
        if wrong is not None:
            raise ConversionError(f"{bad}: layer_kinds[{wrong[0]}] is {_shown(wrong[1])}, not one of {', '.join(KINDS)}")
        kinds = tuple(kinds)
    constants = []
    for name in ("deepnorm_alpha", "deepnorm_beta"):
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ConversionError(f"{bad}: {name} must be a finite number > 0 or null, got {_shown(value)}")
        constants.append(None if value is None else float(value))
    return (kinds, *constants)


def _shown(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _mixln_fields(config: dict, source: str = "config.json"):
    """(post_ln_layers, scheme, alpha) of a mixln_llama config.json, type-checked."""
    p = config.get("post_ln_layers", 0)
    if p is None:
        p = 0
    if not isinstance(p, int) or isinstance(p, bool) or p < 0:
        raise ConversionError(f"invalid Mix-LN fields in {source}: post_ln_layers must be a non-negative "
                              f"integer, got {p!r:.60}")
    scheme = config.get("mixln_scheme", "mixln")
    if scheme is None:
        scheme = "mixln"
    if not isinstance(scheme, str):
        raise ConversionError(f"invalid Mix-LN fields in {source}: mixln_scheme must be a string, got {scheme!r:.60}")
    alpha = config.get("mixln_alpha")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))):
        raise ConversionError(f"invalid Mix-LN fields in {source}: mixln_alpha must be a number or null, got "
                              f"{alpha!r:.60}")
    return p, scheme, alpha


# --------------------------------------------------------------------------- settings
def folder_placement(config: dict, num_layers: int, source: str = "config.json"):
    """The model.placement.Placement of a mixln_llama config.json: Mix-LN's first P layers from
    post_ln_layers, or every layer's kind from layer_kinds (DeepNorm's alpha from the folder, its
    beta too when recorded, else DeepNet's default: beta only shapes the initialisation)."""
    from ..model.layout import DEEPNORM, layout_text
    from ..model.placement import MixLNConfigError, MixLNSettings, Placement, resolve_placement

    post_ln, scheme, alpha = _mixln_fields(config, source)
    kinds, dn_alpha, dn_beta = _layout_fields(config, num_layers, source)
    try:
        if kinds is None:
            if dn_alpha is not None or dn_beta is not None:
                raise MixLNConfigError("deepnorm_alpha / deepnorm_beta are set but there is no layer_kinds")
            return Placement(num_layers, post_ln, scheme, alpha)
        if DEEPNORM in kinds and dn_alpha is None:
            raise MixLNConfigError("layer_kinds has deepnorm layers but deepnorm_alpha is null")
        if DEEPNORM not in kinds and (dn_alpha is not None or dn_beta is not None):
            raise MixLNConfigError("deepnorm_alpha / deepnorm_beta are set but no layer is deepnorm")
        deepnorm = {"deepnorm_alpha": dn_alpha, **({"deepnorm_beta": dn_beta} if dn_beta is not None else {})} \
            if DEEPNORM in kinds else {}
        placement = resolve_placement(num_layers, MixLNSettings(layout=layout_text(kinds), scheme=scheme,
                                                                **deepnorm))
        if placement.post_ln_layers != post_ln:
            raise MixLNConfigError(f"post_ln_layers is {post_ln} but layer_kinds has {placement.post_ln_layers} "
                                   "post / deepnorm layers: post_ln_layers must count them")
        return placement
    except MixLNConfigError as e:
        raise ConversionError(f"invalid Mix-LN fields in {source}: {e}") from None


def resolve_settings(config: dict, num_layers: int, post_ln_layers=None, alpha=None, scheme=None,
                     source: str = "config.json") -> Tuple[dict, str, bool]:
    """(placement record, description, whether a stock folder is turned into Mix-LN)."""
    from ..model.placement import MixLNConfigError, MixLNSettings, Placement, resolve_placement

    explicit = post_ln_layers is not None or alpha is not None or scheme is not None
    try:
        asked = resolve_placement(num_layers, MixLNSettings(alpha=alpha, post_ln_layers=post_ln_layers,
                                                            scheme=scheme)) if (
            post_ln_layers is not None or alpha is not None) else None
    except MixLNConfigError as e:
        raise ConversionError(str(e)) from None
    if config.get("model_type") in MIXLN_MODEL_TYPES:
        folder = folder_placement(config, num_layers, source)
        shown = (f"P={folder.post_ln_layers}" if folder.is_first_p else f"layout={folder.layout}")
        if explicit:
            want_kinds = asked.kinds if asked is not None else folder.kinds
            want_scheme = scheme or folder.scheme
            if (want_kinds, want_scheme) != (folder.kinds, folder.scheme):
                want = (f"P={asked.post_ln_layers}" if asked is not None else shown)
                raise ConversionError(
                    f"the folder is a Mix-LN model with scheme={folder.scheme} {shown}; the "
                    f"settings given (scheme={want_scheme} {want}) would change the network. Drop them."
                )
        return folder.record(), f"config.json (scheme={folder.scheme}, {shown})", False
    # stock Llama
    if not explicit:
        return Placement(num_layers, 0, "mixln").record(), "stock Llama folder: Pre-LN, P = 0", False
    try:
        p = asked.post_ln_layers if asked is not None else 0
        placement = Placement(num_layers, p, scheme or "mixln", asked.alpha if asked is not None else None)
    except MixLNConfigError as e:
        raise ConversionError(str(e)) from None
    changed = placement.post_ln_layers > 0 or placement.scheme != "mixln"
    return placement.record(), (f"stock Llama folder converted as scheme={placement.scheme} "
                                f"P={placement.post_ln_layers} (asked explicitly)"), changed


# --------------------------------------------------------------------------- conversion
def convert_from_hf(
    load: str,
    save: str,
    *,
    tp: int = 1,
    pp: int = 1,
    ckpt_format: str = "torch_dist",
    dtype: str = "auto",
    transformer_impl: str = "transformer_engine",
    make_vocab_size_divisible_by: int = 128,
    post_ln_layers: Optional[int] = None,
    alpha=None,
    scheme: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Convert the HF folder `load` into a Megatron-LM checkpoint directory `save` (see module doc)."""
    t0 = time.time()
    from ..safe_output import MEGATRON_FOLDER

    prepare_output(load, save, MEGATRON_FOLDER, overwrite)  # before any work: never lose the input or a foreign folder
    if ckpt_format not in ("torch_dist", "torch"):
        raise ConversionError(f"--ckpt-format must be torch_dist or torch, got {ckpt_format!r}")
    if transformer_impl not in ("transformer_engine", "local"):
        raise ConversionError(f"--transformer-impl must be transformer_engine or local, got {transformer_impl!r}")
    if tp < 1 or pp < 1:
        raise ConversionError("--tp and --pp must be >= 1")
    hf = HFCheckpoint(load)  # config.json, index and every header: confined to the folder, validated
    shape = shape_from_hf_config(hf.config, os.path.join(hf.path, "config.json"))
    check_layers_against_files(hf, shape)  # before anything is planned: the config must match the files
    check_tp_divisibility(shape, tp)
    if shape.moe is not None and ckpt_format != "torch_dist":
        raise ConversionError("MoE models are written as torch_dist checkpoints only (megatron reshards their experts "
                              "across expert-parallel sizes at load); drop --ckpt-format torch")
    if shape.moe is not None and shape.moe.expert_ffn % tp:
        raise ConversionError(f"--tp {tp} does not divide the experts' FFN size {shape.moe.expert_ffn}")
    if ckpt_format == "torch" and shape.num_layers % pp:
        raise ConversionError(
            f"--pp {pp} does not divide num_layers {shape.num_layers}; legacy files need equal stages "
            "(torch_dist has no such constraint)"
        )
    if pp > shape.num_layers:
        raise ConversionError(f"--pp {pp} exceeds num_layers {shape.num_layers}")
    record, settings_source, changed = resolve_settings(hf.config, shape.num_layers, post_ln_layers, alpha, scheme,
                                                       os.path.join(hf.path, "config.json"))
    post_ln = int(record["post_ln_layers"])
    kinds = _record_kinds(record, shape.num_layers)
    stock = not M.uses_mixln_layout(record)
    if changed:
        print(f"[mixln-megatron convert] WARNING: {settings_source}: the Post-LN layers reuse the Llama norm "
              "weights (N1 := post_attention_layernorm, N2 := input_layernorm); this is a different network, "
              "meant as an initialisation for Mix-LN training.", flush=True)
    if dtype in (None, "auto"):
        out_dtype = hf.dtype(M.HF_EMBEDDING)
    elif dtype in DTYPES:
        out_dtype = DTYPES[dtype]
    else:
        raise ConversionError(f"--dtype must be auto, bfloat16, float16 or float32, got {dtype!r}")
    model_type = hf.config.get("model_type")
    src = HFRoleSource(hf, shape, kinds, model_type not in MIXLN_MODEL_TYPES, out_dtype,
                       "mixtral" if model_type == "mixtral" else "qwen2_moe")
    src.check()
    padded = padded_vocab_size(shape.vocab_size, make_vocab_size_divisible_by, tp)
    if tokenizer_model is None and hf.tokenizer_files():
        tokenizer_model = hf.path
    ns = megatron_args_namespace(
        shape, tp=tp, pp=pp, ckpt_format=ckpt_format, params_dtype=out_dtype, padded_vocab=padded,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, placement_record=record,
        transformer_impl=transformer_impl, tokenizer_type="HuggingFaceTokenizer" if tokenizer_model else None,
        tokenizer_model=tokenizer_model, source=hf.path,
    )
    common = {"args": ns, "checkpoint_version": 3.0, "iteration": 0, "num_floating_point_operations_so_far": 0,
              "content_metadata": {**CONTENT_METADATA_BASE, "mixln": dict(record)}}
    total = _total_bytes(shape, padded, out_dtype, ckpt_format, pp, kinds)
    with staged_output_dir(save, overwrite, MEGATRON_FOLDER) as tmp:
        release = os.path.join(tmp, RELEASE)
        os.makedirs(release)
        from .to_hf import _progress

        bar = _progress(progress, total, f"from-hf {os.path.basename(os.path.abspath(save))}")
        try:
            if ckpt_format == "torch_dist":
                write_torch_dist(release, src, shape, padded, record, common, stock, bar)
            else:
                write_legacy(release, src, shape, padded, record, common, stock, tp, pp, transformer_impl, bar)
        finally:
            bar.close()
        with open(os.path.join(tmp, TRACKER), "w") as f:
            f.write(RELEASE)
    return {
        "format": ckpt_format, "save": os.path.abspath(save), "iteration": RELEASE, "tp": tp, "pp": pp,
        "post_ln_layers": post_ln, "scheme": record["scheme"], "layout": record.get("layout"),
        "deepnorm_alpha": record.get("deepnorm_alpha"), "deepnorm_beta": record.get("deepnorm_beta"),
        "settings_source": settings_source,
        "vocab_size": shape.vocab_size, "padded_vocab_size": padded, "dtype": str(out_dtype).replace("torch.", ""),
        "transformer_impl": transformer_impl, "launch_flags": launch_flags(ns), "mixln_flags": placement_flags(ns),
        "seconds": round(time.time() - t0, 2),
    }


def _record_kinds(record: dict, num_layers: int):
    """Every layer's kind of a placement record (model.placement.Placement.record(): format 1 is
    Mix-LN's first P layers post, format 2 names its layout)."""
    from ..model.layout import first_p_kinds, parse_layout

    if record.get("layout") is not None:
        return parse_layout(record["layout"], num_layers, "the placement record")
    return first_p_kinds(num_layers, int(record["post_ln_layers"]))


def _total_bytes(shape: ModelShape, padded: int, dtype, ckpt_format: str, pp: int, kinds=()) -> int:
    n = padded * shape.hidden_size * (1 if shape.tie_embeddings else 2) + shape.hidden_size
    n += 2 * shape.hidden_size * sum(k == "sandwich" for k in kinds)  # the sandwich layers' output norms
    if shape.tie_embeddings and ckpt_format == "torch" and pp > 1:
        n += padded * shape.hidden_size
    moe_layers = shape.moe.moe_layers if shape.moe is not None else (False,) * shape.num_layers
    for role, shp in shape.megatron_layer_shapes().items():
        k = 1
        for s in shp:
            k *= s
        if role in M.DENSE_MLP_ROLES:
            n += k * sum(not m for m in moe_layers)
        elif role in M.MOE_ROLE_NAMES:
            n += k * sum(moe_layers)
        else:
            n += k * shape.num_layers
    return n * dtype.itemsize
