"""Hugging Face folder -> Megatron-LM checkpoint that Megatron-LM (and `mixln-megatron pretrain`)
loads to continue training or fine-tune (what it accepts and writes: docs/conversion.md).

A stock folder becomes Pre-LN (P = 0) unless Mix-LN is asked for explicitly: then layers 1..P are
Post-LN with N1 := post_attention_layernorm and N2 := input_layernorm (a different network, an
initialisation for Mix-LN fine-tuning, announced as such). Output: iteration `release` (loaded as
iteration 0, no optimizer / RNG state), torch_dist (layout-free; --tp only sets the vocabulary
padding) or legacy per-rank files for exactly --tp x --pp, with args carrying the model-defining
fields and the integer P (or the layout); MoE as torch_dist only, fc1 plain [gate; up].

One way through: hf_folder reads the folder, mapping.HFRoleSource gives each role's rows (the role
map to-hf uses, read backwards), the writers here write them one chunk (torch_dist) or one rank's
state dict (legacy) at a time. The folder is untrusted input: its config is checked against the
files (layers, then every tensor's shape: HFRoleSource.check) before any plan is built, so a
config.json claiming 10**9 layers is one line at bounded memory.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections import OrderedDict
from typing import List, Optional, Tuple

import torch

from ..errors import ConversionError
from ..model.layout import DEEPNORM, first_p_kinds, layout_text, parse_layout
from ..model.placement import MixLNConfigError, MixLNSettings, Placement, resolve_placement
from ..progress import bar as progress_bar
from ..safe_output import MEGATRON_FOLDER, prepare_output, staged_dir
from . import mapping as M
from .dcp_files import LazyTorchDistWriter
from .hf_folder import HFCheckpoint
from .mapping import DTYPES, HFRoleSource, megatron_row_chunks, split_tp_shard
from .megatron_reader import TRACKER
from .shape import ModelShape, check_tp_divisibility, mup_flags_for, padded_vocab_size, shape_from_hf_config

RELEASE = "release"
MIXLN_MODEL_TYPES = ("mixln_llama", "mixln_moe")  # folders that carry their Mix-LN settings (else stock)
CONTENT_METADATA_BASE = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
PIECE_BYTES = 8 << 20  # largest piece converted / written at once


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


# --------------------------------------------------------------------------- settings
def folder_placement(config: dict, num_layers: int, source: str = "config.json"):
    """The model.placement.Placement of a mixln_llama / mixln_moe config.json, its Mix-LN fields read
    as the HF config class reads them (hf.configuration_mixln_llama.mixln_fields); a missing DeepNorm
    beta is DeepNet's default (it only shapes the initialisation)."""
    from ..hf.configuration_mixln_llama import MixLNConfigValueError, mixln_fields  # optional: imports transformers

    try:
        fields = mixln_fields(config.get, num_layers)
        post_ln, scheme, kinds = fields["post_ln_layers"], fields["mixln_scheme"], fields["layer_kinds"]
        if kinds is None:
            return Placement(num_layers, post_ln, scheme, fields["mixln_alpha"])
        deepnorm = {} if DEEPNORM not in kinds else {"deepnorm_alpha": fields["deepnorm_alpha"], **(
            {"deepnorm_beta": fields["deepnorm_beta"]} if fields["deepnorm_beta"] is not None else {})}
        return resolve_placement(num_layers, MixLNSettings(layout=layout_text(kinds), scheme=scheme, **deepnorm))
    except (MixLNConfigValueError, MixLNConfigError) as e:
        raise ConversionError(f"invalid Mix-LN fields in {source}: {e}") from None


def resolve_settings(config: dict, num_layers: int, post_ln_layers=None, alpha=None, scheme=None,
                     source: str = "config.json") -> Tuple[dict, str, bool]:
    """(placement record, description, whether a stock folder is turned into Mix-LN)."""
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
    prepare_output([load], save, MEGATRON_FOLDER, overwrite, ConversionError)  # before any work: never lose the input or a foreign folder
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
    with staged_dir(save, MEGATRON_FOLDER, overwrite, ConversionError) as tmp:
        release = os.path.join(tmp, RELEASE)
        os.makedirs(release)
        bar = progress_bar(total, f"from-hf {os.path.basename(os.path.abspath(save))}", enabled=progress)
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
        k = math.prod(shp)
        if role in M.DENSE_MLP_ROLES:
            n += k * sum(not m for m in moe_layers)
        elif role in M.MOE_ROLE_NAMES:
            n += k * sum(moe_layers)
        else:
            n += k * shape.num_layers
    return n * dtype.itemsize


# --------------------------------------------------------------------------- writers
def write_torch_dist(out_dir: str, src: HFRoleSource, shape: ModelShape, padded_vocab: int, record: dict,
                     common: dict, stock: bool, bar) -> None:
    """A megatron-core torch_dist checkpoint in `out_dir`, one chunk in memory at a time."""
    dtype = src.dtype
    plan = LazyTorchDistWriter()

    def tensor(key, global_shape, offsets, sizes, produce):
        plan.tensor(key, global_shape, offsets, sizes, dtype, produce)

    h, L = shape.hidden_size, shape.num_layers
    block = max(1, PIECE_BYTES // (h * dtype.itemsize))

    def vocab(key, hf_name):
        for start in range(0, padded_vocab, block):
            stop = min(padded_vocab, start + block)
            tensor(key, (padded_vocab, h), (start, 0), (stop - start, h),
                   lambda a=start, b=stop: src.vocab_rows(hf_name, a, b))

    vocab(M.TD_EMBEDDING, M.HF_EMBEDDING)
    layer_shapes = shape.megatron_layer_shapes()
    sandwiches = len(src.sandwich_rows)
    # megatron keeps one key per layer (no layer axis) when dense and MoE layers mix
    per_layer = shape.moe is not None and not all(shape.moe.moe_layers)
    lead = (lambda layer: ((), ())) if per_layer else (lambda layer: ((L,), (layer,)))
    for layer in range(L):
        prefix = f"{M.TD_LAYER_PREFIX}{layer}." if per_layer else M.TD_LAYER_PREFIX
        lead_shape, lead_offset = lead(layer)
        ones = (1,) * len(lead_shape)
        for role in src.layer_roles(layer):
            if role in M.SANDWICH_NORM_NAMES and per_layer:  # the layer's own [hidden]
                tensor(prefix + M.SANDWICH_NORM_NAMES[role], (h,), (0,), (h,),
                       lambda l=layer, r=role: src.role_rows(l, r, 0, h))
                continue
            if role in M.SANDWICH_NORM_NAMES:  # stacked over the S sandwich layers only (model.layer)
                tensor(M.TD_LAYER_PREFIX + M.SANDWICH_NORM_NAMES[role], (sandwiches, h), (src.sandwich_rows[layer], 0),
                       (1, h), lambda l=layer, r=role: src.role_rows(l, r, 0, h).unsqueeze(0))
                continue
            if src.is_moe_layer(layer) and (role in M.MOE_ROLE_NAMES or M.split_expert_role(role)):
                _moe_role(tensor, src, shape, layer, role, prefix + M.td_layer_name(role, not stock),
                          lead_shape, lead_offset, dtype)
                continue
            shp = layer_shapes[role]
            row_bytes = dtype.itemsize * (shp[1] if len(shp) > 1 else 1)
            # Chunks of <= PIECE_BYTES: megatron-core reshards them at load like any other layout.
            for a, b in megatron_row_chunks(role, shape, row_bytes, PIECE_BYTES):
                tensor(prefix + M.td_layer_name(role, not stock), (*lead_shape, *shp),
                       lead_offset + (a,) + (0,) * (len(shp) - 1), (*ones, b - a, *shp[1:]),
                       lambda l=layer, r=role, a=a, b=b, o=ones, s=shp: src.role_rows(l, r, a, b).reshape(
                           *o, b - a, *s[1:]))
        for name in _extra_state_objects(src, shape, layer, L, per_layer):
            plan.object(name, None)
    tensor(M.TD_FINAL_NORM, (h,), (0,), (h,), lambda: src.hf_tensor(M.HF_FINAL_NORM))
    plan.object("decoder.final_layernorm._extra_state/shard_0_1", None)
    if not shape.tie_embeddings:
        vocab(M.TD_OUTPUT, M.HF_OUTPUT)
    if not stock:  # global layer 1's record (per-layer keys: its own)
        plan.object(f"{M.TD_LAYER_PREFIX}0.{M.TD_SETTINGS_RECORD[len(M.TD_LAYER_PREFIX):]}/shard_0_1" if per_layer
                    else f"{M.TD_SETTINGS_RECORD}/shard_0_1", record)
    plan.object("common_state/shard_0_1", common)

    def on_write(data):
        if isinstance(data, torch.Tensor):
            bar.update(data.numel() * data.element_size())

    plan.save(out_dir, on_write)
    # The same common state as common.pt too: megatron-core 0.19 reads the object above, 0.17 /
    # 0.18 only common.pt; with both, every supported release loads the output.
    torch.save(common, os.path.join(out_dir, "common.pt"))


def _moe_role(tensor, src: HFRoleSource, shape: ModelShape, layer: int, role: str, key: str, lead_shape, lead_offset,
              dtype) -> None:
    """One MoE role's chunks: the router / shared expert as one tensor, an expert as its row e of the
    layer's [E, rows, columns] tensor; an fc1's chunks lie inside its gate or up half."""
    parts = src.parts(layer, role)
    rows, cols = sum(p[1][0] for p in parts), parts[0][1][1]
    expert = M.split_expert_role(role)
    e_shape, e_offset = ((shape.moe.num_experts,), (expert[0],)) if expert else ((), ())
    ones = (1,) * (len(lead_shape) + len(e_shape))
    per = max(1, PIECE_BYTES // max(1, cols * dtype.itemsize))
    start = 0
    for _, (part_rows, _) in parts:
        for a in range(start, start + part_rows, per):
            b = min(start + part_rows, a + per)
            tensor(key, (*lead_shape, *e_shape, rows, cols), lead_offset + e_offset + (a, 0), (*ones, b - a, cols),
                   lambda a=a, b=b: src.role_rows(layer, role, a, b).reshape(*ones, b - a, cols))
        start += part_rows


def _extra_state_objects(src: HFRoleSource, shape: ModelShape, layer: int, L: int, per_layer: bool):
    """The (empty) `_extra_state` objects megatron-core saves for a layer's linears, under its shard names."""
    prefix = f"{M.TD_LAYER_PREFIX}{layer}." if per_layer else M.TD_LAYER_PREFIX
    one = "shard_0_1" if per_layer else f"shard_{layer}_{L}"
    modules = list(M.EXTRA_STATE_MODULES[:2])
    if not src.is_moe_layer(layer):
        return [f"{prefix}{m}._extra_state/{one}" for m in M.EXTRA_STATE_MODULES]
    if shape.moe.shared_ffn is not None:
        modules += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
    names = [f"{prefix}{m}._extra_state/{one}" for m in modules]
    e_count = shape.moe.num_experts
    for fc in ("linear_fc1", "linear_fc2"):
        for e in range(e_count):
            shard = f"shard_{e}_{e_count}" if per_layer else f"shard_{layer}.{e}_{L}.{e_count}"
            names.append(f"{prefix}mlp.experts.experts.{fc}._extra_state/{shard}")
    return names


def write_legacy(out_dir: str, src: HFRoleSource, shape: ModelShape, padded_vocab: int, record: dict, common: dict,
                 stock: bool, tp: int, pp: int, transformer_impl: str, bar) -> None:
    """release/mp_rank_TT[_PPP]/model_optim_rng.pt files (one rank's state dict in memory at a time)."""
    L = shape.num_layers
    per_stage = L // pp
    for p in range(pp):
        layers = range(p * per_stage, (p + 1) * per_stage)
        for t in range(tp):
            model = OrderedDict()
            rows = padded_vocab // tp
            if p == 0:
                model[M.TD_EMBEDDING] = src.vocab_rows(M.HF_EMBEDDING, t * rows, (t + 1) * rows)
            for local, layer in enumerate(layers):
                names = M.legacy_write_names(transformer_impl, src.kinds[layer])
                prefix = f"decoder.layers.{local}."
                for role in src.layer_roles(layer):
                    full = src.role(layer, role)
                    name = names[role] if role in names else M.LAYER_ROLE_NAMES[role]
                    model[prefix + name] = split_tp_shard(role, full, tp, t)
                    del full
                for module in M.EXTRA_STATE_MODULES:
                    model[f"{prefix}{module}._extra_state"] = None
                if layer == 0 and not stock:
                    model[prefix + "mixln_settings"] = dict(record)
            if p == pp - 1:
                model[M.TD_FINAL_NORM] = src.hf_tensor(M.HF_FINAL_NORM)
                if not shape.tie_embeddings:
                    model[M.TD_OUTPUT] = src.vocab_rows(M.HF_OUTPUT, t * rows, (t + 1) * rows)
                elif pp > 1:
                    # Tied weights: the last stage keeps its own copy of the embedding for the output.
                    model[M.TD_OUTPUT] = src.vocab_rows(M.HF_EMBEDDING, t * rows, (t + 1) * rows)
                model["output_layer._extra_state"] = None
            state = {"args": common["args"], "checkpoint_version": 3.0, "iteration": 0, "model": model,
                     "num_floating_point_operations_so_far": 0}
            name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
            os.makedirs(os.path.join(out_dir, name))
            torch.save(state, os.path.join(out_dir, name, "model_optim_rng.pt"))
            bar.update(sum(v.numel() * v.element_size() for v in model.values() if torch.is_tensor(v)))
            del model, state


# --------------------------------------------------------------------------- the args a written checkpoint carries
# ModelShape's fields carry Megatron-LM's argument names.
SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "max_position_embeddings")
# What every Llama is in Megatron-LM's terms (RMSNorm, SwiGLU, full RoPE, dense, no dropout).
LLAMA_FIXED_ARGS = dict(
    normalization="RMSNorm", layernorm_zero_centered_gamma=False, apply_layernorm_1p=False, swiglu=True,
    squared_relu=False, position_embedding_type="rope", add_position_embedding=True,
    use_rotary_position_embeddings=False, rotary_percent=1.0, rotary_interleaved=False,
    apply_query_key_layer_scaling=False, attention_dropout=0.0, hidden_dropout=0.0, num_experts=None,
    moe_layer_freq=1, mtp_num_layers=None, multi_latent_attention=False, vocab_file=None, merge_file=None,
)
# A converted checkpoint starts training afresh: no optimizer / RNG state, no data consumed, one
# model replica, and P (not alpha) recorded.
FRESH_START_ARGS = dict(
    virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1, context_parallel_size=1,
    data_parallel_size=1, data_parallel_random_init=False, no_save_optim=True, no_save_rng=True, iteration=0,
    consumed_train_samples=0, skipped_train_samples=0, consumed_valid_samples=0, mixln_alpha=None,
)

def megatron_args_namespace(
    shape: ModelShape,
    *,
    tp: int,
    pp: int,
    ckpt_format: str,
    params_dtype,
    padded_vocab: int,
    make_vocab_size_divisible_by: int,
    placement_record: dict,
    transformer_impl: str,
    tokenizer_type: Optional[str],
    tokenizer_model: Optional[str],
    source: str,
) -> argparse.Namespace:
    """The args a converted checkpoint carries: the model-defining ones (plus what Megatron-LM's
    load_checkpoint compares); training's (batch sizes, lr, data) are left to the run that loads it."""
    stock = not M.uses_mixln_layout(placement_record)
    spec = None
    if not stock:
        spec = ["mixln_megatron.spec",
                "mixln_layer_spec" if transformer_impl == "transformer_engine" else "mixln_local_layer_spec"]
    scaling = shape.rope_scaling or {}
    return argparse.Namespace(
        **moe_args(shape),
        **forward_args(shape),
        **{name: getattr(shape, name) for name in SHAPE_ARGS},
        **{k: v for k, v in LLAMA_FIXED_ARGS.items() if shape.moe is None or k not in ("num_experts", "moe_layer_freq")},
        **FRESH_START_ARGS,
        group_query_attention=shape.num_query_groups != shape.num_attention_heads,
        seq_length=shape.max_position_embeddings,
        encoder_seq_length=shape.max_position_embeddings,
        layernorm_epsilon=shape.norm_epsilon,
        norm_epsilon=shape.norm_epsilon,
        add_bias_linear=shape.add_bias_linear,
        add_qkv_bias=shape.add_bias_linear or shape.add_qkv_bias,
        rotary_base=shape.rotary_base,
        rotary_seq_len_interpolation_factor=(
            scaling.get("factor") if scaling.get("rope_type") == "linear" else None),
        use_rope_scaling=scaling.get("rope_type") == "llama3",
        rope_scaling_factor=float(scaling.get("factor", 8.0)) if scaling.get("rope_type") == "llama3" else 8.0,
        untie_embeddings_and_output_weights=not shape.tie_embeddings,
        spec=spec,
        transformer_impl=transformer_impl,
        # vocabulary / tokenizer
        vocab_size=shape.vocab_size,
        padded_vocab_size=padded_vocab,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        tokenizer_type=tokenizer_type,
        tokenizer_model=tokenizer_model,
        # precision
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # checkpoint / parallel layout it was written for
        ckpt_format=ckpt_format,
        use_dist_ckpt=ckpt_format == "torch_dist",
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        world_size=tp * pp,
        # Mix-LN: the integer P (alpha only informational), or the layout (placement_args)
        **placement_args(placement_record),
        mixln_scheme=placement_record.get("scheme", "mixln"),
        mixln_converted_from=source,
    )


def moe_args(shape: ModelShape) -> dict:
    """Megatron-LM's MoE args of an MoE shape: routing as the HF model routes; no top-k scaling factor
    (an export folded it into fc2) and plain [gate; up] fc1 rows."""
    moe = shape.moe
    if moe is None:
        return {}
    return dict(num_experts=moe.num_experts, moe_router_topk=moe.topk, moe_ffn_hidden_size=moe.expert_ffn,
                moe_layer_freq=[int(m) for m in moe.moe_layers],
                moe_shared_expert_intermediate_size=moe.shared_ffn, moe_shared_expert_gate=moe.shared_gate,
                moe_router_pre_softmax=not moe.norm_topk_prob, moe_router_score_function="softmax",
                moe_router_dtype="fp32" if moe.router_fp32 else None,
                moe_router_topk_scaling_factor=None, moe_router_enable_expert_bias=False,
                moe_expert_capacity_factor=None, moe_mlp_glu_interleave_size=None,
                moe_shared_expert_glu_interleave_size=None)


def forward_args(shape: ModelShape) -> dict:
    """Megatron-LM's args for the shape's forward scalars: --glu-linear-offset (with the fused SwiGLU
    off: it has no offset) and the muP flags (convert.shape.mup_flags_for)."""
    out = {}
    if shape.forward.glu_linear_offset != 0.0:
        out.update(glu_linear_offset=shape.forward.glu_linear_offset, bias_swiglu_fusion=False)
    out.update(mup_flags_for(shape.forward, shape.hidden_size, shape.kv_channels, shape.mup))
    return out


def forward_flags(ns: argparse.Namespace) -> List[str]:
    """The flags of forward_args (none for LLaMA's forward)."""
    flags = []
    if getattr(ns, "glu_linear_offset", 0.0):
        flags += ["--glu-linear-offset", repr(float(ns.glu_linear_offset)), "--no-bias-swiglu-fusion"]
    if getattr(ns, "use_mup", False):
        flags.append("--use-mup")
        for name in ("mup_base_hidden_size", "mup_width_mult", "mup_embedding_mult", "mup_output_mult",
                     "mup_base_head_dim", "mup_attn_scale_power"):
            if getattr(ns, name, None) is not None:
                flags += ["--" + name.replace("_", "-"), repr(getattr(ns, name))]
    return flags


def moe_flags(ns: argparse.Namespace) -> List[str]:
    """The MoE flags of converted args (none for a dense model)."""
    if not getattr(ns, "num_experts", None):
        return []
    flags = ["--num-experts", ns.num_experts, "--moe-router-topk", ns.moe_router_topk,
             "--moe-ffn-hidden-size", ns.moe_ffn_hidden_size,
             "--moe-layer-freq", "[" + ",".join(str(v) for v in ns.moe_layer_freq) + "]"]
    if ns.moe_shared_expert_intermediate_size is not None:
        flags += ["--moe-shared-expert-intermediate-size", ns.moe_shared_expert_intermediate_size]
    if ns.moe_shared_expert_gate:
        flags.append("--moe-shared-expert-gate")
    if ns.moe_router_pre_softmax:
        flags.append("--moe-router-pre-softmax")
    if getattr(ns, "moe_router_dtype", None):
        flags += ["--moe-router-dtype", ns.moe_router_dtype]
    return [str(f) for f in flags]


def placement_args(placement_record: dict) -> dict:
    """mixln_post_ln_layers, or mixln_layout with mixln_deepnorm_alpha / _beta (text: repr of the
    float, exact), of a placement record (model.placement.Placement.record())."""
    layout = placement_record.get("layout")
    if layout is None:
        return {"mixln_post_ln_layers": int(placement_record.get("post_ln_layers", 0)), "mixln_layout": None,
                "mixln_deepnorm_alpha": None, "mixln_deepnorm_beta": None}
    text = {k: None if placement_record.get(k) is None else repr(float(placement_record[k]))
            for k in ("deepnorm_alpha", "deepnorm_beta")}
    return {"mixln_post_ln_layers": None, "mixln_layout": layout, "mixln_deepnorm_alpha": text["deepnorm_alpha"],
            "mixln_deepnorm_beta": text["deepnorm_beta"]}


def placement_flags(ns: argparse.Namespace) -> List[str]:
    """The --mixln-* placement flags of converted args: --mixln-post-ln-layers P, or --mixln-layout
    (with DeepNorm's constants when it has deepnorm layers); --mixln-scheme unless mixln."""
    if getattr(ns, "mixln_layout", None):
        flags = ["--mixln-layout", ns.mixln_layout]
        for name in ("deepnorm_alpha", "deepnorm_beta"):
            if getattr(ns, f"mixln_{name}", None) is not None:
                flags += [f"--mixln-{name.replace('_', '-')}", getattr(ns, f"mixln_{name}")]
    else:
        flags = ["--mixln-post-ln-layers", ns.mixln_post_ln_layers]
    if ns.mixln_scheme != "mixln":
        flags += ["--mixln-scheme", ns.mixln_scheme]
    return [str(f) for f in flags]


def launch_flags(ns: argparse.Namespace) -> List[str]:
    """The Megatron-LM flags that rebuild the model a converted checkpoint's args describe, those
    --use-checkpoint-args does not copy (norm epsilon, rope scaling) included: from-hf's launch hint."""
    flags = ["--num-layers", ns.num_layers, "--hidden-size", ns.hidden_size, "--ffn-hidden-size", ns.ffn_hidden_size,
             "--num-attention-heads", ns.num_attention_heads, "--kv-channels", ns.kv_channels]
    if ns.group_query_attention:
        flags += ["--group-query-attention", "--num-query-groups", ns.num_query_groups]
    flags += ["--max-position-embeddings", ns.max_position_embeddings, "--normalization", ns.normalization,
              "--norm-epsilon", repr(float(ns.layernorm_epsilon)), "--swiglu",
              "--position-embedding-type", "rope", "--rotary-base", f"{ns.rotary_base:g}"]
    if not ns.add_bias_linear:
        flags.append("--disable-bias-linear")
        if getattr(ns, "add_qkv_bias", False):
            flags.append("--add-qkv-bias")
    if ns.rotary_seq_len_interpolation_factor:
        flags += ["--rotary-seq-len-interpolation-factor", f"{ns.rotary_seq_len_interpolation_factor:g}"]
    if ns.use_rope_scaling:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", f"{ns.rope_scaling_factor:g}"]
    if ns.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    flags += ["--make-vocab-size-divisible-by", ns.make_vocab_size_divisible_by, *placement_flags(ns), *moe_flags(ns),
              *forward_flags(ns)]
    if ns.ckpt_format == "torch":
        flags += ["--ckpt-format", "torch", "--tensor-model-parallel-size", ns.tensor_model_parallel_size,
                  "--pipeline-model-parallel-size", ns.pipeline_model_parallel_size]
    return [str(f) for f in flags]
