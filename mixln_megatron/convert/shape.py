"""The shape of a Llama-style model, read from Megatron-LM args or an HF config.json.

ModelShape is what both directions agree on: it decides every tensor's shape and the forward
pass. Reading it is also where we refuse what Llama (or Megatron) cannot express, with one message
naming every problem, before anything is written. Megatron pads the vocabulary to a multiple of
make_vocab_size_divisible_by x TP; export trims to the true vocabulary, import pads with zero rows.

Both sources are untrusted input (issue 27): every field read is checked for its type and range
here, at the reader, one ConversionError each (`config.json: hidden_size must be an integer in
[1, 131072], got 'abc'`). Integers must be JSON / Python integers (not booleans, strings, null or
floats such as 1e9); the bounds (BOUNDS) lie far above any real model and far below what a
conversion plan or a model build could afford from a tiny crafted file. Megatron-LM's args are read
through one reader, `_arg`, whatever the field: a field Megatron-LM leaves None is one it computes
(kv_channels, ffn_hidden_size, num_query_groups, padded_vocab_size, ...) and reads as its default;
a boolean flag that is None reads False, as Megatron-LM itself uses it (by truthiness) and as
model.support's rows count None as "off" -- so `add_bias_linear=None` is no bias in the shape and
in the support check alike.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Tuple

from ..model import hybrid_pattern, support
from ..errors import ConversionError, UnsupportedModelError
from .forward_scalars import ForwardScalars, forward_scalars, mup_record
from . import hf_config_fields
from .moe_shape import MoEShape, moe_role_shapes, moe_shape_of_args

# Upper bounds of what a checkpoint or config.json may say. Real models for comparison: Llama 3.1
# 405B has 126 layers, hidden 16384, 128 heads (8 KV), FFN 53248, vocabulary 128256; the largest
# public vocabularies are ~256k, the deepest trained transformers (DeepNet) 1000 layers.
BOUNDS = {
    "layers": 4096,
    "hidden": 131072,  # 2 x 65536
    "heads": 16384,
    "head_dim": 65536,
    "ffn": 1 << 20,
    "vocab": 1 << 24,
    "padded_vocab": 1 << 25,
    "positions": 1 << 30,
}
_MISSING = object()


def _shown(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _int_value(where: str, name: str, value, hi: int, lo: int = 1) -> int:
    """`value` if it is an integer (not a bool, str, None or float) in [lo, hi]; one ConversionError otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        kind = "a positive integer" if lo == 1 else f"an integer >= {lo}"
        raise ConversionError(f"{where}: {name} must be {kind} (at most {hi}, far above any real model), "
                              f"got {_shown(value)}")
    return value


def _float_value(where: str, name: str, value, hi: Optional[float] = None, lo_inclusive: bool = False) -> float:
    """A finite positive number (an int or float, not a bool or str), below `hi` when given."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= 0 if lo_inclusive else value > 0) and (hi is None or value <= hi)
    if not ok:
        rng = f"in {'[' if lo_inclusive else '('}0, {hi}]" if hi is not None else "positive and finite"
        raise ConversionError(f"{where}: {name} must be a number {rng}, got {_shown(value)}")
    return float(value)


def _bool_value(where: str, name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConversionError(f"{where}: {name} must be true or false, got {_shown(value)}")


def _str_value(where: str, name: str, value) -> str:
    if not isinstance(value, str):
        raise ConversionError(f"{where}: {name} must be a string, got {_shown(value)}")
    return value


# ------------------------------------------------------------------- Megatron args: one reader
ARGS = "the checkpoint's Megatron args"


def _arg(args, *names, default=None):
    """The one reader of Megatron-LM's saved args: the first of `names` that args has with a value
    other than None, else `default` (Megatron-LM leaves None what it computes)."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            return value
    return default


def _flag(args, *names, default: bool = False) -> bool:
    """A boolean field: absent -> `default` (Megatron-LM's own default); None -> False (Megatron-LM
    uses these fields by truthiness, and model.support counts None as off); a bool (or 0 / 1);
    anything else is refused."""
    for name in names:
        if hasattr(args, name):
            value = getattr(args, name)
            return False if value is None else _bool_value(ARGS, name, value)
    return default


def _int_arg(args, name: str, hi: int, default=_MISSING, *more) -> int:
    value = _arg(args, name, *more, default=default)
    if value is _MISSING:
        raise ConversionError(f"{ARGS}: {name} is missing: the model shape cannot be read")
    return _int_value(ARGS, name, value, hi)


def _float_arg(args, name: str, default, *more, hi=None, lo_inclusive=False) -> float:
    return _float_value(ARGS, name, _arg(args, name, *more, default=default), hi, lo_inclusive)


def _str_arg(args, name: str, default: str) -> str:
    return _str_value(ARGS, name, _arg(args, name, default=default))


@dataclasses.dataclass(frozen=True)
class ArgsShape:
    """The model a Megatron-LM checkpoint's args describe (any GPT, not only Llama)."""

    num_layers: int  # transformer blocks (a Mix-LN HybridModel's `*-` pairs)
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    padded_vocab_size: Optional[int]
    max_position_embeddings: int
    norm_epsilon: float
    normalization: str
    zero_centered_gamma: bool
    swiglu: bool
    add_bias_linear: bool
    add_qkv_bias: bool
    qk_layernorm: bool
    untie_embeddings: bool
    position_embedding_type: str
    rotary_base: float
    rotary_percent: float
    rotary_interleaved: bool
    rotary_seq_len_interpolation_factor: Optional[float]
    use_rope_scaling: bool
    rope_scaling_factor: float
    forward: ForwardScalars = ForwardScalars()  # muP's and the GLU offset's, as megatron uses them
    mup: Optional[dict] = None  # the muP flags as saved (None without --use-mup)


def _checked_getter(read, where: str = ARGS):
    """forward_scalars' `get` over `read(name)` (saved args, an HF muP record), each value checked
    (one ConversionError naming it): use_mup a flag, mup_base_hidden_size a positive integer, the
    offset and the attention power finite numbers, the other muP values positive numbers; None
    reads as the default."""
    def get(name, default):
        value = read(name)
        if value is None:
            return default
        if name == "use_mup":
            return _bool_value(where, name, value)
        if name == "mup_base_hidden_size":
            return _int_value(where, name, value, BOUNDS["hidden"])
        if name in ("glu_linear_offset", "mup_attn_scale_power"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConversionError(f"{where}: {name} must be a finite number, got {_shown(value)}")
            return float(value)
        return _float_value(where, name, value)
    return get


args_hybrid_pattern = hybrid_pattern.pattern_of_args  # Megatron-LM's saved args -> the pattern, if any


def args_num_blocks(args) -> int:
    """Transformer blocks L (model.hybrid_pattern.blocks_of_args, the one reading): GPT's
    num_layers; a Mix-LN hybrid pattern's `*-` pairs (its num_layers is the pattern length 2L).
    The saved values are checked first; a pattern that is not Mix-LN's is refused with the reason."""
    pattern = args_hybrid_pattern(args)
    if pattern is not None and not isinstance(pattern, str):
        raise ConversionError(f"{ARGS}: hybrid_layer_pattern must be a string, got {_shown(pattern)}")
    if not pattern:
        _int_arg(args, "num_layers", BOUNDS["layers"])
    try:
        blocks = hybrid_pattern.blocks_of_args(args)
    except support.MixLNUnsupportedError as error:
        raise UnsupportedModelError(f"{ARGS}: {error}") from None
    return _int_value(ARGS, "the hybrid pattern's blocks" if pattern else "num_layers", blocks, BOUNDS["layers"])


def args_shape(args) -> ArgsShape:
    """The ArgsShape of saved Megatron-LM args (argparse.Namespace or a stand-in with attributes),
    every field checked for its type and range (one ConversionError naming the field)."""
    if args is None:
        raise ConversionError("the checkpoint carries no Megatron args (saved without them?): the model shape "
                              "cannot be read")
    hidden = _int_arg(args, "hidden_size", BOUNDS["hidden"])
    heads = _int_arg(args, "num_attention_heads", min(BOUNDS["heads"], hidden))
    groups = _int_arg(args, "num_query_groups", heads, heads) if _flag(args, "group_query_attention") else heads
    if heads % groups:
        raise ConversionError(f"{ARGS}: num_attention_heads {heads} is not a multiple of num_query_groups {groups}")
    if _arg(args, "kv_channels") is None and hidden % heads:
        raise ConversionError(f"{ARGS}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                              "(and kv_channels is not given)")
    add_bias = _flag(args, "add_bias_linear", default=True)
    if _flag(args, "disable_bias_linear"):
        add_bias = False
    padded = _arg(args, "padded_vocab_size")
    factor = _arg(args, "rotary_seq_len_interpolation_factor")
    kv_channels = _int_arg(args, "kv_channels", BOUNDS["head_dim"], hidden // heads)
    get = _checked_getter(lambda name: getattr(args, name, None))
    return ArgsShape(
        num_layers=args_num_blocks(args),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=kv_channels,
        ffn_hidden_size=_int_arg(args, "ffn_hidden_size", BOUNDS["ffn"], 4 * hidden),
        padded_vocab_size=None if padded is None else _int_value(ARGS, "padded_vocab_size", padded,
                                                                  BOUNDS["padded_vocab"]),
        max_position_embeddings=_int_arg(args, "max_position_embeddings", BOUNDS["positions"], 2048, "seq_length"),
        norm_epsilon=_float_arg(args, "layernorm_epsilon", 1e-5, "norm_epsilon", hi=1.0),
        normalization=_str_arg(args, "normalization", "LayerNorm"),
        zero_centered_gamma=_flag(args, "layernorm_zero_centered_gamma") or _flag(args, "apply_layernorm_1p"),
        swiglu=_flag(args, "swiglu"),
        add_bias_linear=add_bias,
        add_qkv_bias=_flag(args, "add_qkv_bias"),
        qk_layernorm=_flag(args, "qk_layernorm"),
        untie_embeddings=_flag(args, "untie_embeddings_and_output_weights"),
        position_embedding_type=_str_arg(args, "position_embedding_type", "learned_absolute"),
        rotary_base=_float_arg(args, "rotary_base", 10000),
        rotary_percent=_float_arg(args, "rotary_percent", 1.0, hi=1.0),
        rotary_interleaved=_flag(args, "rotary_interleaved"),
        rotary_seq_len_interpolation_factor=None if factor is None else _float_value(
            ARGS, "rotary_seq_len_interpolation_factor", factor),
        use_rope_scaling=_flag(args, "use_rope_scaling"),
        rope_scaling_factor=_float_arg(args, "rope_scaling_factor", 8.0),
        forward=forward_scalars(get, hidden, kv_channels),
        mup=mup_record(get),
    )


@dataclasses.dataclass
class ModelShape:
    """Everything that decides tensor shapes and the forward pass of a Llama-style GPT."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int  # the true vocabulary (HF side); Megatron pads it
    max_position_embeddings: int
    norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    rope_scaling: Optional[dict] = None  # HF style: linear {"rope_type", "factor"} or llama3
    add_bias_linear: bool = False
    tie_embeddings: bool = False
    layernorm_1p: bool = False  # Megatron stores gamma - 1 (--apply-layernorm-1p)
    rotary_interleaved: bool = False  # Megatron's interleaved RoPE (export permutes q/k rows)
    # a bias on q, k, v only (--add-qkv-bias without add_bias_linear; HF: Qwen2's qkv_bias); MoE models only
    add_qkv_bias: bool = False
    moe: Optional[MoEShape] = None  # the MoE layers, experts and routing (convert.moe_shape); None: dense
    # muP's softmax scale and multipliers and the GLU offset (convert.forward_scalars): LLaMA's by default
    forward: ForwardScalars = ForwardScalars()
    mup: Optional[dict] = None  # Megatron's muP flags, recorded for the way back (informational in HF)

    def forward_fields(self) -> dict:
        """The HF config fields of the forward scalars that are not LLaMA's (+ the muP record)."""
        fields = self.forward.hf_fields()
        if self.mup is not None:
            fields["megatron_mup"] = dict(self.mup)
        return fields

    def __post_init__(self):
        if self.num_attention_heads % self.num_query_groups:
            raise UnsupportedModelError(
                f"num_attention_heads = {self.num_attention_heads} is not a multiple of "
                f"num_query_groups = {self.num_query_groups}"
            )

    @property
    def q_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def qkv_rows(self) -> int:
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.kv_channels

    def megatron_layer_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Global (unstacked) shape of every per-layer role present in this model."""
        h, f = self.hidden_size, self.ffn_hidden_size
        shapes = {
            "qkv.weight": (self.qkv_rows, h),
            "proj.weight": (h, self.num_attention_heads * self.kv_channels),
            "fc1.weight": (2 * f, h),
            "fc2.weight": (h, f),
            "norm_a": (h,),
            "norm_b": (h,),
        }
        if self.add_bias_linear:
            shapes.update({"qkv.bias": (self.qkv_rows,), "proj.bias": (h,), "fc1.bias": (2 * f,), "fc2.bias": (h,)})
        elif self.add_qkv_bias:
            shapes["qkv.bias"] = (self.qkv_rows,)
        if self.moe is not None:  # fc1 / fc2 only in the dense layers, these only in the MoE layers
            shapes.update(moe_role_shapes(self.moe, h))
        return shapes


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Megatron's padding rule: a multiple of make_vocab_size_divisible_by x TP."""
    multiple = max(1, int(make_vocab_size_divisible_by)) * max(1, int(tp))
    return int(math.ceil(vocab_size / multiple) * multiple)


# ------------------------------------------------------------------- Megatron args -> shape
def check_megatron_args_supported(args) -> None:
    """Raise UnsupportedModelError naming every feature of `args` that Llama cannot express (fields
    read through the same readers as args_shape: one answer per field)."""
    # MoE is carried (convert.moe_shape refuses the routing it cannot), so it has no row there
    problems = list(support.problems(args, support.CONVERT))
    pattern = args_hybrid_pattern(args)
    if pattern is not None and not isinstance(pattern, str):
        raise ConversionError(f"{ARGS}: hybrid_layer_pattern must be a string, got {_shown(pattern)}")
    if pattern and hybrid_pattern.pattern_problem(pattern, moe=False):  # HybridModel: only `*-` pairs, no `E`
        problems.append(hybrid_pattern.pattern_problem(pattern, moe=False) + " [hybrid_layer_pattern]")
    normalization = _str_arg(args, "normalization", "LayerNorm")
    if normalization != "RMSNorm":
        problems.append(f"normalization {normalization!r}: Llama uses RMSNorm [--normalization RMSNorm]")
    if not _flag(args, "swiglu"):
        problems.append("a non-gated MLP: Llama uses SwiGLU [--swiglu]")
    pos = _str_arg(args, "position_embedding_type", "learned_absolute")
    if pos != "rope":
        problems.append(f"position_embedding_type {pos!r}: Llama uses RoPE [--position-embedding-type rope]")
    rotary_percent = _float_arg(args, "rotary_percent", 1.0, hi=1.0)
    if rotary_percent != 1.0:
        problems.append(f"partial rotary embeddings (rotary_percent={rotary_percent}): Llama rotates every dimension")
    rope_type = _arg(args, "rope_type")
    if rope_type not in (None, "rope"):
        problems.append(f"rope_type {_shown(rope_type)}")
    add_bias = _flag(args, "add_bias_linear", default=True)
    if _flag(args, "disable_bias_linear"):
        add_bias = False
    if _flag(args, "add_qkv_bias") and not add_bias and not _is_moe(args):  # MoE: Qwen2-MoE / mixln_moe qkv_bias
        problems.append(
            "a bias on the QKV projection only (--add-qkv-bias without biases on the other linears): "
            "Llama's attention_bias also puts a bias on o_proj (qkv-only bias)"
        )
    if pattern and _flag(args, "use_rope_scaling"):
        problems.append("Llama 3 RoPE scaling (--use-rope-scaling) in a HybridModel, which takes none: the "
                        "model trained without it [use_rope_scaling=True]")
    if _flag(args, "use_rope_scaling") and _arg(args, "rotary_seq_len_interpolation_factor"):
        problems.append("both --use-rope-scaling and --rotary-seq-len-interpolation-factor")
    if problems:
        raise UnsupportedModelError(
            "this checkpoint's model cannot be converted to Hugging Face Llama: " + "; ".join(problems)
        )


def _is_moe(args) -> bool:
    """Whether saved args describe an MoE model (convert.moe_shape reads the rest)."""
    from ..model import moe_fields

    return bool(moe_fields.num_experts(args))


def shape_from_megatron_args(args, vocab_size: int) -> ModelShape:
    """The model shape recorded in a Megatron-LM checkpoint's args (after the support check)."""
    check_megatron_args_supported(args)
    a = args_shape(args)
    return _model_shape(a, vocab_size, moe_shape_of_args(args, a.num_layers, a.add_bias_linear, ARGS))


def read_checkpoint_shape(args, vocab_size: Optional[int] = None):
    """The one reading of a checkpoint's args (convert.inspect): (ArgsShape, ModelShape, layer shapes).

    Without `vocab_size`: (ArgsShape, None, None), any GPT. With the true vocabulary (an export to
    Llama): the args' fields checked first, then what Llama cannot express (one
    UnsupportedModelError), then the ModelShape and its per-layer role shapes."""
    a = args_shape(args)
    if vocab_size is None:
        return a, None, None
    check_megatron_args_supported(args)
    model = _model_shape(a, vocab_size, moe_shape_of_args(args, a.num_layers, a.add_bias_linear, ARGS))
    return a, model, model.megatron_layer_shapes()


def _model_shape(a: ArgsShape, vocab_size: int, moe: Optional[MoEShape] = None) -> ModelShape:
    rope_scaling = None
    if a.rotary_seq_len_interpolation_factor:
        rope_scaling = {"rope_type": "linear", "factor": float(a.rotary_seq_len_interpolation_factor)}
    if a.use_rope_scaling:
        rope_scaling = llama3_rope_scaling(a.rope_scaling_factor)
    return ModelShape(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        ffn_hidden_size=a.ffn_hidden_size,
        num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups,
        kv_channels=a.kv_channels,
        vocab_size=int(vocab_size),
        max_position_embeddings=a.max_position_embeddings,
        norm_epsilon=a.norm_epsilon,
        rotary_base=a.rotary_base,
        rope_scaling=rope_scaling,
        add_bias_linear=a.add_bias_linear,
        tie_embeddings=not a.untie_embeddings,
        layernorm_1p=a.zero_centered_gamma,
        rotary_interleaved=a.rotary_interleaved,
        add_qkv_bias=a.add_qkv_bias and not a.add_bias_linear and moe is not None,
        moe=moe,
        forward=a.forward,
        mup=a.mup,
    )


def llama3_rope_scaling(factor: float) -> dict:
    """Megatron's --use-rope-scaling (Llama 3.x): fixed low/high frequency factors 1 / 4, 8192."""
    return {
        "rope_type": "llama3",
        "factor": float(factor),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


# ----------------------------------------------------------------------------- HF config.json -> shape
HF_MODEL_TYPES = ("llama", "mixln_llama")
HF_MOE_MODEL_TYPES = ("mixln_moe", "mixtral", "qwen2_moe")  # convert.moe_shape.moe_shape_of_hf_config


def _cfg_int(config: dict, where: str, name: str, hi: int, default=_MISSING, lo: int = 1) -> int:
    value = config.get(name, _MISSING)
    if value is None or value is _MISSING:
        if default is _MISSING:
            raise ConversionError(f"{where}: {name} must be a positive integer, got "
                                  f"{'nothing (the field is missing)' if value is _MISSING else 'null'}")
        return default
    return _int_value(where, name, value, hi, lo)


def _cfg_bool(config: dict, where: str, name: str, default: bool = False) -> bool:
    value = config.get(name)
    return default if value is None else _bool_value(where, name, value)


def hf_config_shape(config: dict, source: str = "config.json", megatron: bool = True) -> ModelShape:
    """The model shape of an HF config.json dict, every field checked for its type and range (one
    ConversionError naming `source` and the field). With `megatron`, also refuse (one
    UnsupportedModelError naming every problem) what Megatron's Llama model cannot express."""
    where = source
    if not isinstance(config, dict):
        raise ConversionError(f"{where} must hold a JSON object, got {_shown(config)}")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in HF_MODEL_TYPES + HF_MOE_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {_shown(model_type)} is not supported: from-hf reads Llama ('llama'), Mix-LN Llama "
            "('mixln_llama'), Mix-LN MoE ('mixln_moe'), Mixtral ('mixtral') and Qwen2-MoE ('qwen2_moe') folders"
        )
    hidden = _cfg_int(config, where, "hidden_size", BOUNDS["hidden"])
    layers = _cfg_int(config, where, "num_hidden_layers", BOUNDS["layers"])
    heads = _cfg_int(config, where, "num_attention_heads", min(BOUNDS["heads"], hidden))
    groups = _cfg_int(config, where, "num_key_value_heads", heads, heads)
    if heads % groups:
        raise ConversionError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}")
    if config.get("head_dim") is None and hidden % heads:
        raise ConversionError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                              "(and head_dim is not given)")
    head_dim = _cfg_int(config, where, "head_dim", BOUNDS["head_dim"], hidden // heads)
    ffn = _cfg_int(config, where, "intermediate_size", BOUNDS["ffn"])
    vocab = _cfg_int(config, where, "vocab_size", BOUNDS["vocab"])
    positions = _cfg_int(config, where, "max_position_embeddings", BOUNDS["positions"], 2048)
    eps = config.get("rms_norm_eps")
    eps = 1e-6 if eps is None else _float_value(where, "rms_norm_eps", eps, hi=1.0)
    attention_bias = _cfg_bool(config, where, "attention_bias")
    _cfg_bool(config, where, "mlp_bias")  # type-checked here; its rule is hf_config_fields'
    tie = _cfg_bool(config, where, "tie_word_embeddings")
    if config.get("hidden_act") is not None:
        _str_value(where, "hidden_act", config["hidden_act"])
    theta, scaling = _hf_rope(config, where)
    rope_type = "default"
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        rope_type = _str_value(where, "rope_scaling.rope_type", rope_type)
    problems, rope_scaling = [], None
    if rope_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _float_value(where, "rope factor", scaling.get("factor"))}
    elif rope_type == "llama3":
        want = llama3_rope_scaling(_float_value(where, "rope factor", scaling.get("factor")))
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            got = scaling.get(key, want[key])
            if _float_value(where, f"rope {key}", got) != float(want[key]):
                problems.append(
                    f"llama3 rope scaling with {key}={got}: Megatron's --use-rope-scaling fixes it to {want[key]}"
                )
        rope_scaling = want
    elif rope_type != "default":
        problems.append(f"rope type {rope_type!r}: Megatron supports default, linear and llama3 RoPE")
    problems += hf_config_fields.problems(config, model_type)  # the one-field rules (activation, biases, window, ...)
    forward, mup = ForwardScalars(), None
    if model_type in ("mixln_llama", "mixln_moe"):  # the Mix-LN classes' forward scalars (muP, GLU offset)
        forward, mup = _hf_forward_scalars(config, where, hidden, head_dim)
    moe, qkv_bias = None, False
    if model_type in ("qwen2_moe", "mixln_moe"):  # q, k, v biases without o_proj's (Qwen2-MoE's default: true)
        qkv_bias = _cfg_bool(config, where, "qkv_bias", model_type == "qwen2_moe") and not attention_bias
    if model_type in HF_MOE_MODEL_TYPES:
        from .moe_shape import moe_shape_of_hf_config

        moe, moe_problems = moe_shape_of_hf_config(config, model_type, layers, where)
        problems += moe_problems
        if model_type == "mixtral":  # Mixtral has no dense layers: its intermediate_size is the experts'
            ffn = moe.expert_ffn
    if problems and megatron:
        raise UnsupportedModelError("this Hugging Face model cannot be converted to Megatron: " + "; ".join(problems))
    return ModelShape(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        vocab_size=vocab,
        max_position_embeddings=positions,
        norm_epsilon=eps,
        rotary_base=theta,
        rope_scaling=rope_scaling,
        add_bias_linear=attention_bias,
        tie_embeddings=tie,
        add_qkv_bias=qkv_bias,
        moe=moe,
        forward=forward,
        mup=mup,
    )


def _hf_forward_scalars(config: dict, where: str, hidden: int, head_dim: int):
    """(ForwardScalars, muP record or None) of a Mix-LN config.json, checked: attention_scale null or
    > 0, the multipliers > 0, the offset finite; a megatron_mup record must give the same softmax
    scale and multipliers by megatron's rule (forward_scalars), or the folder is refused."""
    def number(name, default, positive=True):
        value = config.get(name)
        if value is None:
            return default
        if positive:
            return _float_value(where, name, value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConversionError(f"{where}: {name} must be a finite number, got {_shown(value)}")
        return float(value)

    forward = ForwardScalars(attention_scale=number("attention_scale", None),
                             embedding_multiplier=number("embedding_multiplier", 1.0),
                             logits_multiplier=number("logits_multiplier", 1.0),
                             glu_linear_offset=number("glu_linear_offset", 0.0, positive=False))
    record = config.get("megatron_mup")
    if record is None:
        return forward, None
    if not isinstance(record, dict):
        raise ConversionError(f"{where}: megatron_mup must be an object or null, got {_shown(record)}")
    get = _checked_getter(record.get, f"{where}: megatron_mup")
    mup = mup_record(get)
    implied = dataclasses.replace(forward_scalars(get, hidden, head_dim), glu_linear_offset=forward.glu_linear_offset)
    if implied != forward:
        raise ConversionError(f"{where}: megatron_mup gives attention_scale {implied.attention_scale}, "
                              f"embedding_multiplier {implied.embedding_multiplier} and logits_multiplier "
                              f"{implied.logits_multiplier}, but the config says {forward.attention_scale}, "
                              f"{forward.embedding_multiplier} and {forward.logits_multiplier}: the fields disagree")
    return forward, mup


def shape_from_hf_config(config: dict, source: str = "config.json") -> ModelShape:
    """The model shape of an HF config.json dict; ConversionError for a field of the wrong type or
    range, UnsupportedModelError naming what Megatron's Llama cannot express."""
    return hf_config_shape(config, source, megatron=True)


def _hf_rope(config: dict, where: str = "config.json"):
    """(rope_theta, scaling dict or None) from a v5 (rope_parameters) or v4 (rope_theta/rope_scaling)
    config, checked: theta a positive number, scaling an object or null."""
    params = config.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConversionError(f"{where}: rope_parameters must be an object or null, got {_shown(params)}")
    theta, scaling = config.get("rope_theta"), None
    if params and ("rope_theta" in params or "rope_type" in params):
        theta = params.get("rope_theta", theta)
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            scaling = None
    else:
        scaling = config.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise ConversionError(f"{where}: rope_scaling must be an object or null, got {_shown(scaling)}")
        if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
    theta = 10000.0 if theta is None else _float_value(where, "rope_theta", theta)
    return theta, scaling or None


def check_tp_divisibility(shape: ModelShape, tp: int) -> None:
    """Megatron's own requirements for tensor parallelism, checked before anything is written."""
    problems = []
    if shape.num_attention_heads % tp:
        problems.append(f"num_attention_heads {shape.num_attention_heads}")
    if shape.num_query_groups % tp:
        problems.append(f"num_query_groups (num_key_value_heads) {shape.num_query_groups}")
    if shape.ffn_hidden_size % tp:
        problems.append(f"ffn_hidden_size {shape.ffn_hidden_size}")
    if problems:
        raise UnsupportedModelError(f"--tp {tp} does not divide " + ", ".join(problems))
