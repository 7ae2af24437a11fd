"""The shape of a Llama-style model, read from Megatron-LM args or an HF config.json: dense, MoE and
the forward pass's scalars (muP, GLU offset), with one set of validators.

ModelShape is what both directions agree on; reading it refuses what Llama (or Megatron) cannot
express, with one message naming every problem, before anything is written. Both sources are
untrusted input: every field is checked for its type and range (BOUNDS: far above any real model)
at the reader, one ConversionError each. Megatron-LM's args are read through `_arg`: a field left
None is one Megatron-LM computes and reads as its default; a None boolean flag reads False, as
Megatron-LM and model.support use it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, Optional, Tuple

from ..errors import ConversionError, UnsupportedModelError
from ..model import hybrid_pattern, moe_fields, support
from . import hf_config_fields

# ------------------------------------------------------------------------------- forward scalars
# Megatron-LM's muP arguments (TransformerConfig fields), in the order the HF record keeps them.
MUP_ARGS = ("use_mup", "mup_base_hidden_size", "mup_width_mult", "mup_embedding_mult", "mup_output_mult",
            "mup_base_head_dim", "mup_attn_scale_power")
# TransformerConfig's defaults of the muP fields (every supported release).
MUP_DEFAULTS = {"use_mup": False, "mup_base_hidden_size": None, "mup_width_mult": 1.0, "mup_embedding_mult": 1.0,
                "mup_output_mult": 1.0, "mup_base_head_dim": None, "mup_attn_scale_power": 1.0}


@dataclasses.dataclass(frozen=True)
class ForwardScalars:
    attention_scale: Optional[float] = None
    embedding_multiplier: float = 1.0
    logits_multiplier: float = 1.0
    glu_linear_offset: float = 0.0

    @property
    def is_default(self) -> bool:
        return self == ForwardScalars()

    def hf_fields(self) -> dict:
        """The non-default ones, under their HF config names (a default one is not written)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v != getattr(ForwardScalars, k)}


def mup_record(get: Callable[[str, object], object]) -> Optional[dict]:
    """The muP flags as saved (raw, before __post_init__), or None without --use-mup."""
    if not get("use_mup", False):
        return None
    return {name: get(name, MUP_DEFAULTS[name]) for name in MUP_ARGS}


def forward_scalars(get: Callable[[str, object], object], hidden_size: int, kv_channels: int) -> ForwardScalars:
    """What megatron-core's TransformerConfig.__post_init__ makes of the saved flags (`get(name,
    default)` reads one; None counts as absent). Its muP attention power 1.0 is 1/d_head, not 1/sqrt."""
    offset = float(get("glu_linear_offset", 0.0))
    if not get("use_mup", False):
        return ForwardScalars(glu_linear_offset=offset)
    base = get("mup_base_hidden_size", None) or hidden_size
    width = hidden_size / base
    head = get("mup_base_head_dim", None)
    scale = (1.0 if head is None else head ** 0.5) / (kv_channels ** get("mup_attn_scale_power", 1.0))
    output = float(get("mup_output_mult", 1.0))
    if output == 1.0 and width != 1.0:
        output = 1.0 / width
    return ForwardScalars(attention_scale=float(scale), embedding_multiplier=float(get("mup_embedding_mult", 1.0)),
                          logits_multiplier=output, glu_linear_offset=offset)


def mup_flags_for(scalars: ForwardScalars, hidden_size: int, kv_channels: int, record: Optional[dict] = None) -> dict:
    """Megatron-LM muP arguments whose forward_scalars are `scalars` exactly (for from-hf): the record
    an export wrote, else width 1 with the softmax scale s as sqrt(s * s) / kv_channels ** 0 (exact in
    IEEE arithmetic); {} when the scalars need no muP."""
    if record is not None:
        return {name: record.get(name, MUP_DEFAULTS[name]) for name in MUP_ARGS}
    mup = (scalars.attention_scale, scalars.embedding_multiplier, scalars.logits_multiplier)
    if mup == (None, 1.0, 1.0):
        return {}
    scale = kv_channels ** -0.5 if scalars.attention_scale is None else scalars.attention_scale
    return dict(MUP_DEFAULTS, use_mup=True, mup_base_hidden_size=hidden_size,
                mup_embedding_mult=scalars.embedding_multiplier, mup_output_mult=scalars.logits_multiplier,
                mup_base_head_dim=scale * scale, mup_attn_scale_power=0.0)


def config_problem(config) -> Optional[str]:
    """One line naming the forward scalars a built TransformerConfig (a Bridge provider, after its
    __post_init__) has, for code that cannot carry them; None when it has none."""
    found = []
    if getattr(config, "use_mup", False):
        found.append("muP (use_mup=True: softmax scale, embedding and output multipliers)")
    elif getattr(config, "softmax_scale", None) is not None:
        found.append(f"softmax_scale={config.softmax_scale!r}")
    if getattr(config, "glu_linear_offset", 0.0):
        found.append(f"glu_linear_offset={config.glu_linear_offset!r}")
    if not found:
        return None
    return (f"{' and '.join(found)}: the Megatron-Bridge path does not carry them; export with "
            "`mixln-megatron convert to-hf`, which does")


def args_getter(args) -> Callable[[str, object], object]:
    """`get(name, default)` over saved args: a None or missing value reads as the default."""
    def get(name, default):
        value = getattr(args, name, None)
        return default if value is None else value
    return get


# ------------------------------------------------------------------------------- MoE
EXPERTS_BOUND = 1 << 14  # far above any real model (DeepSeek-V3: 256 routed experts)


@dataclasses.dataclass(frozen=True)
class MoEShape:
    num_experts: int
    topk: int
    expert_ffn: int  # each routed expert's FFN width I (fc1 holds [gate; up]: 2I rows)
    moe_layers: Tuple[bool, ...]  # per layer (0-based): MoE (True) or dense
    shared_ffn: Optional[int] = None  # the shared expert's FFN width S; None: no shared expert
    shared_gate: bool = False  # the shared expert's output times sigmoid(h @ gate^T)
    norm_topk_prob: bool = True  # renormalise the k chosen weights (Megatron's default routing)
    # Carried or folded beyond the default routing (one table: model.moe_fields):
    topk_scaling: float = 1.0  # --moe-router-topk-scaling-factor: folded into each routed expert's fc2
    router_fp32: bool = False  # --moe-router-dtype fp32: the router's logits and softmax in fp32
    expert_glu_interleave: Optional[int] = None  # --moe-mlp-glu-interleave-size: fc1 rows in gate/up blocks
    shared_glu_interleave: Optional[int] = None  # moe_shared_expert_glu_interleave_size: the shared fc1's

    @property
    def dense_layers(self) -> Tuple[int, ...]:
        return tuple(i for i, moe in enumerate(self.moe_layers) if not moe)


def _int(where: str, name: str, value, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= hi:
        raise ConversionError(f"{where}: {name} must be a positive integer (at most {hi}), got {_shown(value)}")
    return value


def layers_of_freq(freq, num_layers: int, where: str, name: str = "moe_layer_freq") -> Tuple[bool, ...]:
    """Megatron's --moe-layer-freq: an integer N (layer i is MoE when i % N == 0) or one 0/1 per layer."""
    if isinstance(freq, int) and not isinstance(freq, bool):
        if freq < 1:
            raise ConversionError(f"{where}: {name} must be >= 1 or a list of 0/1, got {_shown(freq)}")
        return tuple(i % freq == 0 for i in range(num_layers))
    if isinstance(freq, (list, tuple)):
        if len(freq) != num_layers:
            raise ConversionError(f"{where}: {name} has {len(freq)} entries but the model has {num_layers} layers")
        if any(isinstance(v, bool) or v not in (0, 1) for v in freq):
            raise ConversionError(f"{where}: {name} must hold only 0 and 1, got {_shown(freq)}")
        return tuple(bool(v) for v in freq)
    raise ConversionError(f"{where}: {name} must be an integer or a list of 0/1, got {_shown(freq)}")


def _positive_float(where: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConversionError(f"{where}: {name} must be a finite number > 0, got {_shown(value)}")
    return float(value)


def _interleave(where: str, name: str, value, ffn: Optional[int]) -> Optional[int]:
    """A GLU interleave block size: whole blocks of gate and up rows must fit the FFN width."""
    if value is None:
        return None
    value = _int(where, name, value, 1 << 20)
    if ffn is not None and ffn % value:
        raise ConversionError(f"{where}: {name} {value} does not divide the FFN width {ffn}")
    return value


def moe_shape_of_args(args, num_layers: int, add_bias_linear: bool, where: str) -> Optional[MoEShape]:
    """The MoEShape of saved Megatron-LM args (None for a dense model), every field checked; one
    UnsupportedModelError naming each flag a conversion cannot carry (model.moe_fields.TABLE)."""
    experts = moe_fields.num_experts(args)
    if experts is None or experts == 0:
        return None
    experts = _int(where, "num_experts", experts, EXPERTS_BOUND)
    problems = moe_fields.conversion_problems(args)  # one sentence per setting an export cannot carry
    if add_bias_linear:
        problems.append("biases on the MoE layers' linears [--disable-bias-linear]: the HF MoE experts have none")
    if problems:
        raise UnsupportedModelError("this checkpoint's MoE layers cannot be converted: " + "; ".join(problems))
    get = moe_fields.getter(args)
    topk = _int(where, "moe_router_topk", getattr(args, "moe_router_topk", None) or 2, experts)
    ffn = getattr(args, "moe_ffn_hidden_size", None)
    ffn = getattr(args, "ffn_hidden_size", None) if ffn is None else ffn
    ffn = _int(where, "moe_ffn_hidden_size", ffn, 1 << 20)
    freq = getattr(args, "moe_layer_freq", None)
    layers = layers_of_freq(1 if freq is None else freq, num_layers, where)
    shared = getattr(args, "moe_shared_expert_intermediate_size", None)
    shared = None if shared is None else _int(where, "moe_shared_expert_intermediate_size", shared, 1 << 20)
    gate = bool(getattr(args, "moe_shared_expert_gate", False))
    if gate and shared is None:
        raise ConversionError(f"{where}: moe_shared_expert_gate is set without a shared expert")
    return MoEShape(
        num_experts=experts, topk=topk, expert_ffn=ffn, moe_layers=layers, shared_ffn=shared, shared_gate=gate,
        norm_topk_prob=moe_fields.norm_topk_prob(get),
        topk_scaling=_positive_float(where, "moe_router_topk_scaling_factor", moe_fields.topk_scaling(get)),
        router_fp32=moe_fields.router_fp32(get),
        expert_glu_interleave=_interleave(where, "moe_mlp_glu_interleave_size", moe_fields.expert_glu_interleave(get),
                                          ffn),
        shared_glu_interleave=_interleave(where, "moe_shared_expert_glu_interleave_size",
                                          moe_fields.shared_glu_interleave(get), shared))


def _cfg(config: dict, where: str, name: str, default=None, hi: int = 1 << 20):
    value = config.get(name)
    if value is None:
        if default is None:
            raise ConversionError(f"{where}: {name} must be a positive integer, got nothing")
        return default
    return _int(where, name, value, hi)


def moe_shape_of_hf_config(config: dict, model_type: str, num_layers: int, where: str):
    """(MoEShape, [what Megatron cannot express]) of a mixln_moe / mixtral / qwen2_moe config.json,
    every field checked as untrusted input (one ConversionError naming it)."""
    problems = []
    if model_type == "mixtral":
        experts = _cfg(config, where, "num_local_experts", None, EXPERTS_BOUND)
        moe = MoEShape(num_experts=experts, topk=_cfg(config, where, "num_experts_per_tok", None, experts),
                       expert_ffn=_cfg(config, where, "intermediate_size"), moe_layers=(True,) * num_layers)
        return moe, problems + _megatron_routing_problems(moe, "num_experts_per_tok")
    experts = _cfg(config, where, "num_experts", None, EXPERTS_BOUND)
    topk = _cfg(config, where, "num_experts_per_tok", None, experts)
    expert_ffn = _cfg(config, where, "moe_intermediate_size")
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers
                                          for i in dense) or len(set(dense)) != len(dense):
        raise ConversionError(f"{where}: mlp_only_layers must be distinct layer indices in 0..{num_layers - 1}, got "
                              f"{_shown(dense)}")
    step = 1
    if model_type == "qwen2_moe":  # always a gated shared expert; renormalisation off by default
        step = _cfg(config, where, "decoder_sparse_step", 1, num_layers)
        shared = _cfg(config, where, "shared_expert_intermediate_size")
        gate, norm_topk = True, _cfg_bool(config, where, "norm_topk_prob", False)
    else:
        shared = config.get("shared_expert_intermediate_size")
        shared = None if shared is None else _int(where, "shared_expert_intermediate_size", shared, 1 << 20)
        gate = _cfg_bool(config, where, "shared_expert_gate", False)
        norm_topk = _cfg_bool(config, where, "norm_topk_prob", True)
        if gate and shared is None:
            raise ConversionError(f"{where}: shared_expert_gate is true without a shared expert")
    router_fp32 = False
    if model_type == "mixln_moe":
        router_fp32 = moe_fields.MEGATRON_ROUTER_DTYPE.get(_router_dtype(config, where)) == "fp32"
        problems += _mixln_moe_bias_problems(config, where)
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    if not any(layers):
        problems.append("no MoE layer (every layer is in mlp_only_layers or off decoder_sparse_step)")
    moe = MoEShape(num_experts=experts, topk=topk, expert_ffn=expert_ffn, moe_layers=layers, shared_ffn=shared,
                   shared_gate=gate, norm_topk_prob=norm_topk, router_fp32=router_fp32)
    return moe, problems + _megatron_routing_problems(moe, "norm_topk_prob")


def _router_dtype(config: dict, where: str) -> Optional[str]:
    """mixln_moe's router_dtype: null (the model's dtype) or a name of moe_fields.MEGATRON_ROUTER_DTYPE."""
    value = config.get("router_dtype")
    if value is not None and (not isinstance(value, str) or value not in moe_fields.MEGATRON_ROUTER_DTYPE):
        names = " or ".join(f'"{name}"' for name in moe_fields.MEGATRON_ROUTER_DTYPE)
        raise ConversionError(f"{where}: router_dtype must be null or {names}, got {_shown(value)}")
    return value


def _mixln_moe_bias_problems(config: dict, where: str) -> list:
    """Megatron puts a linear bias on every linear, the experts' included, or on none (its
    add_bias_linear); the Mix-LN MoE model's experts have none, so no bias converts."""
    return [f"{name} true: Megatron's --add-bias-linear would put biases on the experts too, which this model's "
            f"experts lack; convert a model with {name} false"
            for name in ("attention_bias", "mlp_bias") if _cfg_bool(config, where, name, False)]


def _megatron_routing_problems(moe: MoEShape, field: str) -> list:
    """Routing an HF model has that megatron refuses to build: top-1 renormalised (weight always 1)."""
    if moe.topk == 1 and moe.norm_topk_prob:
        return [f"top-1 routing with the weight renormalised to 1 ({field}): megatron builds top-1 softmax routing "
                "only with --moe-router-pre-softmax, a different weight; no Megatron model computes it"]
    return []


def moe_role_shapes(moe: MoEShape, hidden: int) -> dict:
    """Global shape of each MoE role of one MoE layer (the experts' as a whole [E, ...] tensor)."""
    e, i = moe.num_experts, moe.expert_ffn
    shapes = {"router.weight": (e, hidden), "experts.fc1.weight": (e, 2 * i, hidden),
              "experts.fc2.weight": (e, hidden, i)}
    if moe.shared_ffn is not None:
        shapes.update({"shared.fc1.weight": (2 * moe.shared_ffn, hidden),
                       "shared.fc2.weight": (hidden, moe.shared_ffn)})
    if moe.shared_gate:
        shapes["shared.gate.weight"] = (1, hidden)
    return shapes


# ------------------------------------------------------------------------------- dense shape
# Upper bounds of what a checkpoint or config.json may say (Llama 3.1 405B: 126 layers, hidden 16384).
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


def _finite_value(where: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConversionError(f"{where}: {name} must be a finite number, got {_shown(value)}")
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
    """A boolean field: absent -> `default` (Megatron-LM's own); None -> False; a bool (or 0 / 1)."""
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
    """forward_scalars' `get` over `read(name)` (saved args, an HF muP record), each value checked;
    None reads as the default."""
    def get(name, default):
        value = read(name)
        if value is None:
            return default
        if name == "use_mup":
            return _bool_value(where, name, value)
        if name == "mup_base_hidden_size":
            return _int_value(where, name, value, BOUNDS["hidden"])
        if name in ("glu_linear_offset", "mup_attn_scale_power"):
            return _finite_value(where, name, value)
        return _float_value(where, name, value)
    return get


args_hybrid_pattern = hybrid_pattern.pattern_of_args  # Megatron-LM's saved args -> the pattern, if any


def _checked_pattern(args) -> Optional[str]:
    pattern = args_hybrid_pattern(args)
    if pattern is not None and not isinstance(pattern, str):
        raise ConversionError(f"{ARGS}: hybrid_layer_pattern must be a string, got {_shown(pattern)}")
    return pattern


def args_num_blocks(args) -> int:
    """Transformer blocks L (model.hybrid_pattern.blocks_of_args), the saved values checked first."""
    pattern = _checked_pattern(args)
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
    add_bias = _flag(args, "add_bias_linear", default=True) and not _flag(args, "disable_bias_linear")
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
    moe: Optional[MoEShape] = None  # the MoE layers, experts and routing (MoEShape); None: dense
    # muP's softmax scale and multipliers and the GLU offset (ForwardScalars): LLaMA's by default
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
    # MoE is carried (moe_shape_of_args refuses the routing it cannot), so it has no row there
    problems = list(support.problems(args, support.CONVERT))
    pattern = _checked_pattern(args)
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
    add_bias = _flag(args, "add_bias_linear", default=True) and not _flag(args, "disable_bias_linear")
    if _flag(args, "add_qkv_bias") and not add_bias and not moe_fields.num_experts(args):  # MoE: Qwen2-MoE / mixln_moe qkv_bias
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


def shape_from_megatron_args(args, vocab_size: int) -> ModelShape:
    """The model shape recorded in a Megatron-LM checkpoint's args (after the support check)."""
    check_megatron_args_supported(args)
    a = args_shape(args)
    return _model_shape(a, vocab_size, moe_shape_of_args(args, a.num_layers, a.add_bias_linear, ARGS))


def read_checkpoint_shape(args, vocab_size: Optional[int] = None):
    """The one reading of a checkpoint's args (convert.inspect): (ArgsShape, ModelShape, layer shapes);
    without `vocab_size` (the true vocabulary, for an export) (ArgsShape, None, None), any GPT."""
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
HF_MOE_MODEL_TYPES = ("mixln_moe", "mixtral", "qwen2_moe")  # moe_shape_of_hf_config


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
    """The model shape of an HF config.json dict, every field checked (one ConversionError naming
    `source` and the field); with `megatron`, what Megatron cannot express refused (one
    UnsupportedModelError naming every problem)."""
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
    """(ForwardScalars, muP record or None) of a Mix-LN config.json, checked; a megatron_mup record
    must give the same scalars by megatron's rule (forward_scalars), or the folder is refused."""
    def number(name, default, positive=True):
        value = config.get(name)
        if value is None:
            return default
        return _float_value(where, name, value) if positive else _finite_value(where, name, value)

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
