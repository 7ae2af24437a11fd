"""What a Megatron-LM checkpoint says about its model: args, shape, norm epsilon, Mix-LN record.

The one place that reads them, for conversion (to_hf) and analysis (analysis.models) alike:

    info = inspect_checkpoint("runs/ckpt")         # CheckpointInfo
    info.shape.norm_epsilon, info.record["post_ln_layers"], info.reader.read_layer(...)
    info.model_kind, info.hybrid_pattern    # GPTModel, or a HybridModel read as its GPT blocks

Megatron 0.19 stores the norm epsilon as `layernorm_epsilon` (the TransformerConfig field behind
--norm-epsilon); older tools wrote `norm_epsilon`. Both are read, the config field first.

The Mix-LN settings have up to four sources, which must agree (a disagreement is an error naming
both): the sharded settings record the layers saved, the `mixln` entry of Megatron-LM's content
metadata, the saved --mixln-* args, and the tensor layout (norms under the Mix-LN keys mean a
Mix-LN model; under the stock keys either a stock model or a checkpoint saved before the Mix-LN
keys existed). None of them: a stock Pre-LN checkpoint (P = 0).

What a checkpoint holds is untrusted input: the readers check it (convert.saved_values) before
anything uses it. Objects of allowed classes can still have the wrong shape (a list where the
record should be, a string iteration, args whose num_layers is text); each such file is one
ConversionError naming the file, never an AttributeError or TypeError from deep inside.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..errors import ConversionError, UnsupportedModelError
from . import hybrid_keys
from .shape import ArgsShape, ModelShape, args_hybrid_pattern, args_shape, read_checkpoint_shape  # noqa: F401

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
    """(record dict, where it came from, the model.placement.Placement: every layer's kind and
    DeepNorm's constants) of an open checkpoint reader; see mixln_record."""
    from ..model.placement import MixLNConfigError, Placement, deepnorm_defaults, resolve_placement
    from ..model.settings import MixLNSettings, saved_settings

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
@dataclasses.dataclass
class CheckpointInfo:
    reader: object  # TorchDistCheckpoint or LegacyCheckpoint: reads the tensors
    path: str
    format: str
    iteration: object
    args: object
    shape: ArgsShape
    record: dict  # Placement.record() of the checkpoint's Mix-LN settings
    record_source: str
    placement: object = None  # model.placement.Placement of the record: every layer's kind (a field, read once)
    model_kind: str = hybrid_keys.GPT  # or hybrid_keys.HYBRID (a HybridModel checkpoint)
    hybrid_pattern: Optional[str] = None  # the args' --hybrid-layer-pattern, else the one the keys hold
    model_shape: Optional[ModelShape] = None  # the Llama shape, when read for an export (true vocabulary given)
    layer_shapes: Optional[dict] = None  # model_shape.megatron_layer_shapes(), read with it

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


def inspect_checkpoint(load: str, iteration=None, moe: bool = False) -> CheckpointInfo:
    """Open the checkpoint in `load` (a --save directory or one iteration in it) and read its model
    (`moe`: MoE layers are read, not refused)."""
    from .megatron_reader import open_checkpoint

    return inspect_reader(open_checkpoint(load, iteration), moe=moe)


def inspect_reader(reader, vocab_size: Optional[int] = None, moe: bool = False) -> CheckpointInfo:
    """What an open checkpoint reader says about its model: the model kind, the shape (read once,
    convert.shape.read_checkpoint_shape: with `vocab_size`, the true vocabulary of an export, also
    the Llama ModelShape), then the Mix-LN record. MoE layers are refused unless `moe`."""
    reader.refuse_unconvertible(moe=moe)
    reader._require_args()
    kind = _model_kind(reader)
    if kind == hybrid_keys.HYBRID:  # before anything counts its layers as blocks
        problem = hybrid_keys.pattern_problem(args_hybrid_pattern(reader.args), reader.hybrid_pattern)
        if problem:
            raise UnsupportedModelError(f"{reader.path} is not a Mix-LN model: {problem}")
    shape, model_shape, layer_shapes = read_checkpoint_shape(reader.args, vocab_size)
    record, source, placement = mixln_placement(reader, shape.num_layers)
    pattern = args_hybrid_pattern(reader.args) or getattr(reader, "hybrid_pattern", None)
    return CheckpointInfo(reader=reader, path=reader.path, format=reader.format, iteration=reader.iteration,
                          args=reader.args, shape=shape, record=record, record_source=source, placement=placement,
                          model_kind=kind,
                          hybrid_pattern=pattern if kind == hybrid_keys.HYBRID else None,
                          model_shape=model_shape, layer_shapes=layer_shapes)


def describe_checkpoint(load: str, iteration=None) -> dict:
    """What `mixln-megatron convert inspect` prints: format, model kind, blocks, Mix-LN settings, shape."""
    info = inspect_checkpoint(load, iteration, moe=True)
    s = info.shape
    hybrid = info.model_kind == hybrid_keys.HYBRID
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
    from ..model import moe_fields
    from .moe_shape import moe_shape_of_args

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
    kind = getattr(reader, "model_kind", hybrid_keys.GPT)
    args_pattern = args_hybrid_pattern(reader.args)
    if args_pattern and reader.format != "torch_dist":
        raise UnsupportedModelError(
            f"{reader.path} is a legacy ({reader.format}) HybridModel checkpoint; only torch_dist HybridModel "
            "checkpoints are read (save with --ckpt-format torch_dist)")
    if reader.args is not None and bool(args_pattern) != (kind == hybrid_keys.HYBRID):
        raise ConversionError(
            f"{reader.path}: its args " + (f"have hybrid_layer_pattern {args_pattern!r}" if args_pattern else
                                           "have no hybrid_layer_pattern")
            + f", but its tensors are laid out as a {'HybridModel' if kind == hybrid_keys.HYBRID else 'GPTModel'}'s"
            ": the checkpoint was edited or converted incompletely")
    return kind


def apply_resume_args(args, checkpoint_args, argv) -> dict:
    """Set on `args` the RESUME_ARGS a resumed checkpoint records, except flags given in `argv`.

    Megatron-LM's --use-checkpoint-args copies most shape flags but not these, so a resume of a
    from-hf checkpoint of a Llama with rms_norm_eps 1e-6 would otherwise train with 1e-5.
    Returns {name: value} of what was changed.
    """
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
