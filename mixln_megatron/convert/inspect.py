"""What a Megatron-LM checkpoint says about its model, read once into one record: CheckpointInfo,
for conversion (to_hf, gpt_hybrid, `convert inspect`) and analysis alike.

    info = inspect_checkpoint("runs/ckpt")         # args, shape, Mix-LN record, model kind
    facts = read_checkpoint_facts("runs/ckpt", vocab_size=None, tokenizer=None)   # for an export

An export walks one way: open the checkpoint (open_checkpoint), read its facts here (the shape
through convert.shape once; the reader checks its tensors against them), map the roles, write;
nothing after this module goes back to it. The Mix-LN settings have up to four sources (the
sharded record, the content metadata, the saved --mixln-* args, the norm keys), which must agree
(model.settings.saved_settings); none of them: a stock Pre-LN checkpoint (P = 0).
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Mapping, Optional, Tuple

from ..errors import ConversionError, UnsupportedModelError
from ..model import moe_fields
from ..model.placement import MixLNConfigError, Placement, deepnorm_defaults, resolve_placement
from ..model.settings import MixLNSettings, saved_settings
from .megatron_reader import GPT, HYBRID, LegacyCheckpoint, detect_format, pattern_problem, resolve_checkpoint_dir
from .shape import ArgsShape, ModelShape, args_hybrid_pattern, args_shape, moe_shape_of_args, read_checkpoint_shape
from .torch_dist_reader import TorchDistCheckpoint

# Tokenizer files an export copies with --tokenizer-model; the first four mark a folder as a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "spiece.model",
                   "chat_template.jinja", "chat_template.json")

NO_RECORD = "no Mix-LN record (a stock Pre-LN checkpoint: P = 0)"


# Shape settings Megatron-LM's own --use-checkpoint-args (load_args_from_checkpoint, 0.19) does
# not copy from the checkpoint, with the flag that sets each: a resume must get them elsewhere.
RESUME_ARGS = (
    ("layernorm_epsilon", "--norm-epsilon"),
    ("layernorm_zero_centered_gamma", "--apply-layernorm-1p"),
    ("use_rope_scaling", "--use-rope-scaling"),
    ("rope_scaling_factor", "--rope-scaling-factor"),
    ("rotary_seq_len_interpolation_factor", "--rotary-seq-len-interpolation-factor"),
)


def resume_args(checkpoint_args) -> dict:
    """{arg name: value} of the RESUME_ARGS the checkpoint's args record (None values left out)."""
    shape = args_shape(checkpoint_args)
    values = {
        "layernorm_epsilon": shape.norm_epsilon,
        "layernorm_zero_centered_gamma": shape.zero_centered_gamma,
        "use_rope_scaling": shape.use_rope_scaling,
        "rope_scaling_factor": shape.rope_scaling_factor,
        "rotary_seq_len_interpolation_factor": shape.rotary_seq_len_interpolation_factor,
    }
    return {k: v for k, v in values.items() if v is not None}


# ------------------------------------------------------------------------------- Mix-LN record
def mixln_record(reader, num_layers: int):
    """(record dict, where it came from) of an open checkpoint reader; disagreeing sources are an
    error (model.settings.saved_settings: the same cross-check a resume makes)."""
    record, source, _ = mixln_placement(reader, num_layers)
    return record, source


def mixln_placement(reader, num_layers: int):
    """(record dict, where it came from, its model.placement.Placement) of an open checkpoint reader."""
    meta = reader.content_metadata.get("mixln") if isinstance(reader.content_metadata, dict) else None
    try:
        found = saved_settings(num_layers, record=reader.settings_record, metadata=meta, args=reader.args)
    except MixLNConfigError as e:
        raise ConversionError(str(e)) from None
    found = found or {"scheme": None, "post_ln_layers": None, "alpha": None, "source": None, "layout": None}
    try:
        if found.get("layout") is not None:  # a layout other than Mix-LN's first P (format-2 record, --mixln-layout)
            # DeepNorm's constants as saved; a source without them (saved args) means DeepNet's defaults
            alpha, beta = (found.get(k) for k in ("deepnorm_alpha", "deepnorm_beta"))
            defaults = deepnorm_defaults(num_layers)
            deepnorm = {} if "deepnorm" not in found["layout"] else {
                "deepnorm_alpha": defaults[0] if alpha is None else alpha,
                "deepnorm_beta": defaults[1] if beta is None else beta}
            placement = resolve_placement(num_layers, MixLNSettings(
                layout=found["layout"], scheme=found["scheme"] or "mixln", **deepnorm))
        else:
            placement = Placement(num_layers, found["post_ln_layers"] or 0, found["scheme"] or "mixln", found["alpha"])
    except MixLNConfigError as e:
        raise ConversionError(f"the checkpoint's Mix-LN settings are invalid: {e}") from None
    if reader.norm_layout == "mixln" and placement.is_stock:
        raise ConversionError(
            f"{reader.path} stores its norms under the Mix-LN keys (decoder.layers.mixln_norm_*) but "
            + (f"{found['source']} says P = 0 with scheme mixln" if found["source"] else "has no Mix-LN settings record")
            + ": the checkpoint is damaged or was edited")
    return placement.record(), (f"from {found['source']}" if found["source"] else NO_RECORD), placement


# ------------------------------------------------------------------------------- one call
@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint says about its model, read and checked once; read for an export
    (read_checkpoint_facts), also the Llama shape, the true vocabulary and the special token ids."""

    reader: object  # TorchDistCheckpoint or LegacyCheckpoint: reads the tensors
    path: str
    format: str
    iteration: object
    args: object
    shape: ArgsShape
    record: dict  # Placement.record() of the checkpoint's Mix-LN settings
    record_source: str
    placement: object = None  # model.placement.Placement of the record: every layer's kind (a field, read once)
    model_kind: str = GPT  # or HYBRID (a HybridModel checkpoint, exported as the GPT model its blocks are)
    hybrid_pattern: Optional[str] = None  # the args' --hybrid-layer-pattern, else the one the keys hold
    model_shape: Optional[ModelShape] = None  # the Llama shape, when read for an export (true vocabulary given)
    layer_shapes: Optional[dict] = None  # model_shape.megatron_layer_shapes(), read with it
    vocab_size: Optional[int] = None  # an export's true vocabulary, and where it came from
    vocab_source: Optional[str] = None
    token_ids: Mapping[str, Optional[int]] = types.MappingProxyType({})  # bos / eos / pad of the tokenizer

    @property
    def num_blocks(self) -> int:
        """Transformer blocks L (a hybrid checkpoint: its `*-` pairs; P counts blocks in both kinds)."""
        return self.shape.num_layers

    @property
    def post_ln_layers(self) -> int:
        return int(self.record["post_ln_layers"])

    @property
    def scheme(self) -> str:
        return self.record["scheme"]


def open_checkpoint(load: str, iteration: Optional[int] = None):
    """The reader (TorchDistCheckpoint or LegacyCheckpoint) of a Megatron-LM checkpoint."""
    path, label = resolve_checkpoint_dir(load, iteration)
    fmt = detect_format(path)
    if fmt is None:
        raise ConversionError(
            f"not a Megatron-LM checkpoint: {path} holds neither torch_dist files (.metadata, "
            "metadata.json) nor legacy mp_rank_*/model_optim_rng.pt files"
        )
    reader = TorchDistCheckpoint(path) if fmt == "torch_dist" else LegacyCheckpoint(path)
    reader.label = label
    return reader


def inspect_checkpoint(load: str, iteration=None, moe: bool = False) -> CheckpointInfo:
    """Open the checkpoint in `load` (a --save directory or one iteration in it) and read its model
    (`moe`: MoE layers are read, not refused)."""
    reader = open_checkpoint(load, iteration)
    reader.refuse_unconvertible(moe=moe)
    reader._require_args()
    return _read(reader)


def _read(reader, vocab_size: Optional[int] = None, **export) -> CheckpointInfo:
    """The model kind, the shape (read once, convert.shape.read_checkpoint_shape: with `vocab_size`,
    the true vocabulary of an export, also the Llama ModelShape), then the Mix-LN record."""
    kind = _model_kind(reader)
    if kind == HYBRID:  # before anything counts its layers as blocks
        problem = pattern_problem(args_hybrid_pattern(reader.args), reader.hybrid_pattern)
        if problem:
            raise UnsupportedModelError(f"{reader.path} is not a Mix-LN model: {problem}")
    shape, model_shape, layer_shapes = read_checkpoint_shape(reader.args, vocab_size)
    record, source, placement = mixln_placement(reader, shape.num_layers)
    pattern = args_hybrid_pattern(reader.args) or getattr(reader, "hybrid_pattern", None)
    return CheckpointInfo(reader=reader, path=reader.path, format=reader.format, iteration=reader.iteration,
                          args=reader.args, shape=shape, record=record, record_source=source, placement=placement,
                          model_kind=kind, hybrid_pattern=pattern if kind == HYBRID else None,
                          model_shape=model_shape, layer_shapes=layer_shapes, vocab_size=vocab_size, **export)


def read_checkpoint_facts(load: str, iteration=None, *, vocab_size: Optional[int] = None,
                          tokenizer: Optional[str] = None) -> CheckpointInfo:
    """Open the checkpoint in `load` and read what an export needs (MoE layers carried), its tensors
    checked against it (ConversionError / UnsupportedModelError naming the first problem)."""
    reader = open_checkpoint(load, iteration)
    reader.refuse_unconvertible(moe=True)  # before the vocabulary: MLA / MTP are refused as such
    reader._require_args()
    true_vocab, vocab_source = resolve_true_vocab(reader, vocab_size, tokenizer)
    info = _read(reader, true_vocab, vocab_source=vocab_source, token_ids=_token_ids(reader, tokenizer))
    shape = info.model_shape
    if shape.moe is not None and reader.format != "torch_dist":
        raise UnsupportedModelError(f"{reader.path}: MoE models are converted from torch_dist checkpoints only, this is a "
                                    f"legacy ({reader.format}) one; save with --ckpt-format torch_dist")
    if true_vocab > reader.padded_vocab_size:
        raise ConversionError(
            f"true vocabulary {true_vocab} ({vocab_source}) exceeds the checkpoint's embedding rows "
            f"{reader.padded_vocab_size}"
        )
    reader.check_shapes(shape, info.layer_shapes)
    reader.check_layer_kinds(info.placement.kinds)
    if not shape.tie_embeddings and not reader.has_output_layer:
        raise ConversionError("the args say the output layer is untied, but the checkpoint has no output_layer.weight")
    return info


def resolve_true_vocab(reader, vocab_size: Optional[int], tokenizer_dir: Optional[str]) -> Tuple[int, str]:
    """The true (unpadded) vocabulary size and where it came from."""
    if vocab_size is not None:
        return int(vocab_size), "--vocab-size"
    args_vocab = getattr(reader.args, "vocab_size", None)
    if args_vocab:
        return int(args_vocab), "the checkpoint's args (vocab_size)"
    for source, path in (("--tokenizer-model", tokenizer_dir), ("the checkpoint's args (tokenizer_model)",
                                                           getattr(reader.args, "tokenizer_model", None))):
        if path and os.path.isdir(str(path)):
            return len(load_tokenizer(str(path))), f"the tokenizer in {path} ({source})"
    raise ConversionError(
        "cannot tell the true vocabulary size: the checkpoint's args record none and no local tokenizer "
        f"is known; pass --vocab-size N or --tokenizer-model DIR (the padded size is {reader.padded_vocab_size})"
    )


def _token_ids(reader, tokenizer: Optional[str]) -> Mapping[str, Optional[int]]:
    """Special token ids only come from a tokenizer (--tokenizer-model, else a local folder the args
    record); without one they stay unset (not Llama's 1 / 2)."""
    tok = None
    if tokenizer:
        tok = load_tokenizer(tokenizer)
    else:
        recorded = getattr(reader.args, "tokenizer_model", None)
        if recorded and os.path.isdir(str(recorded)) and any(
                os.path.isfile(os.path.join(str(recorded), n)) for n in TOKENIZER_FILES[:4]):
            try:
                tok = load_tokenizer(str(recorded))  # only for the special token ids
            except ConversionError:
                tok = None
    return types.MappingProxyType({k: getattr(tok, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})


def load_tokenizer(path: str):
    from transformers import AutoTokenizer  # optional

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any tokenizer loading problem is a user input problem
        raise ConversionError(f"cannot load a tokenizer from {path}: {e}") from None


def describe_checkpoint(load: str, iteration=None) -> dict:
    """What `mixln-megatron convert inspect` prints: format, model kind, blocks, Mix-LN settings, shape."""
    info = inspect_checkpoint(load, iteration, moe=True)
    s = info.shape
    hybrid = info.model_kind == HYBRID
    out = {
        "checkpoint": info.path, "format": info.format, "iteration": info.iteration,
        "model": "HybridModel" if hybrid else "GPTModel",
    }
    if hybrid:
        out["hybrid_pattern"] = info.hybrid_pattern
        out["hybrid_layers"] = len(info.reader.hybrid_pattern)
        out["blocks"] = "'*-' pairs: hybrid layers 2k-1 / 2k are transformer block k"
    placement = info.placement
    out.update({
        "transformer_blocks": s.num_layers, "scheme": info.scheme, "post_ln_layers": info.post_ln_layers,
        "post_ln_blocks": placement.post_ln_layer_numbers, "alpha": info.record.get("alpha"),
        "layout": placement.layout,
    })
    if placement.deepnorm_alpha is not None:
        out.update({"deepnorm_alpha": placement.deepnorm_alpha, "deepnorm_beta": placement.deepnorm_beta})
    out.update({
        "settings_source": info.record_source, "norm_keys": getattr(info.reader, "norm_layout", None),
        "hidden_size": s.hidden_size, "ffn_hidden_size": s.ffn_hidden_size,
        "num_attention_heads": s.num_attention_heads, "num_query_groups": s.num_query_groups,
        "padded_vocab_size": info.reader.padded_vocab_size, "dtype": str(info.reader.dtype).replace("torch.", ""),
        "norm_epsilon": s.norm_epsilon, "normalization": s.normalization,
    })
    out.update(_describe_moe(info))
    return out


def _describe_moe(info) -> dict:
    """The MoE part of `inspect`: experts, top-k, expert / shared widths, which layers are dense,
    and whether to-hf carries the routing (else the one-line reason)."""
    if not getattr(info.reader, "moe", False):
        return {}
    try:
        moe = moe_shape_of_args(info.args, info.shape.num_layers, False, "the checkpoint's Megatron args")
        problem = None
    except (UnsupportedModelError, ConversionError) as e:
        moe, problem = None, str(e)
    if moe is None:
        return {"moe": True, "moe_convertible": problem or "no num_experts in the args"}
    out = {"num_experts": moe.num_experts, "moe_router_topk": moe.topk, "moe_ffn_hidden_size": moe.expert_ffn,
           "moe_layers": [i + 1 for i, m in enumerate(moe.moe_layers) if m],
           "dense_layers": [i + 1 for i in moe.dense_layers],
           "shared_expert_intermediate_size": moe.shared_ffn, "shared_expert_gate": moe.shared_gate,
           "norm_topk_prob": moe.norm_topk_prob}
    # what the export rewrites or routes differently from megatron's default (model.moe_fields), when set
    extra = {"moe_router_load_balancing_type": "sinkhorn (its evaluation routing)"
             if moe_fields.balancing(moe_fields.getter(info.args)) == "sinkhorn" else None,
             "topk_scaling": moe.topk_scaling if moe.topk_scaling != 1 else None,
             "router_fp32": True if moe.router_fp32 else None,
             "expert_glu_interleave": moe.expert_glu_interleave, "shared_glu_interleave": moe.shared_glu_interleave}
    out.update({key: value for key, value in extra.items() if value is not None})
    if info.shape.add_bias_linear:
        out["moe_convertible"] = "biases on the MoE layers' linears: not carried by to-hf"
    return out


def _model_kind(reader) -> str:
    """GPT or HYBRID, from the tensor layout; the args' hybrid pattern (when there are args) must agree."""
    kind = getattr(reader, "model_kind", GPT)
    args_pattern = args_hybrid_pattern(reader.args)
    if args_pattern and reader.format != "torch_dist":
        raise UnsupportedModelError(
            f"{reader.path} is a legacy ({reader.format}) HybridModel checkpoint; only torch_dist HybridModel "
            "checkpoints are read (save with --ckpt-format torch_dist)")
    if reader.args is not None and bool(args_pattern) != (kind == HYBRID):
        raise ConversionError(
            f"{reader.path}: its args " + (f"have hybrid_layer_pattern {args_pattern!r}" if args_pattern else
                                           "have no hybrid_layer_pattern")
            + f", but its tensors are laid out as a {'HybridModel' if kind == HYBRID else 'GPTModel'}'s"
            ": the checkpoint was edited or converted incompletely")
    return kind


def apply_resume_args(args, checkpoint_args, argv) -> dict:
    """Set on `args` the RESUME_ARGS a resumed checkpoint records, except flags given in `argv`
    (--use-checkpoint-args does not copy them); returns {name: value} of what was changed."""
    if checkpoint_args is None:
        return {}
    given = {flag for flag in argv if isinstance(flag, str) and flag.startswith("--")}
    given |= {flag.split("=", 1)[0] for flag in given}
    flags = dict(RESUME_ARGS)
    changed = {}
    for name, value in resume_args(checkpoint_args).items():
        if flags[name] in given or getattr(args, name, None) == value:
            continue
        setattr(args, name, value)
        changed[name] = value
    return changed
