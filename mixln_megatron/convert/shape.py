"""The shape of a Llama-style model, read from Megatron-LM args or an HF config.json.

ModelShape is what both directions agree on: it decides every tensor's shape and the forward
pass. Reading it is also where we refuse what Llama (or Megatron) cannot express, with one message
naming every problem, before anything is written. Megatron pads the vocabulary to a multiple of
make_vocab_size_divisible_by x TP; export trims to the true vocabulary, import pads with zero rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

from ..model import hybrid_pattern, support
from ..errors import ConversionError, UnsupportedModelError
from .mapping import HF_EMBEDDING, HF_FINAL_NORM, HF_OUTPUT, hf_layer_prefix, hf_norm_names


def _arg_set(args, *names, default=None):
    """The first of `names` that args has and that is not None."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            return value
    return default


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


args_hybrid_pattern = hybrid_pattern.pattern_of_args  # Megatron-LM's saved args -> the pattern, if any


def args_num_blocks(args) -> int:
    """Transformer blocks L: GPT's num_layers; a Mix-LN hybrid pattern's `*-` pairs (its
    num_layers is the pattern length 2L). A pattern that is not Mix-LN's keeps num_layers (the
    support check refuses it, check_megatron_args_supported)."""
    pattern = args_hybrid_pattern(args)
    if pattern and hybrid_pattern.pattern_problem(pattern) is None:
        return hybrid_pattern.check_pattern(pattern)
    return int(args.num_layers)


def args_shape(args) -> ArgsShape:
    """The ArgsShape of saved Megatron-LM args (argparse.Namespace or a stand-in with attributes)."""
    if args is None:
        raise ConversionError("the checkpoint carries no Megatron args (saved without them?): the model shape "
                              "cannot be read")
    hidden = int(args.hidden_size)
    heads = int(args.num_attention_heads)
    groups = int(_arg_set(args, "num_query_groups", default=heads)) if _arg_set(
        args, "group_query_attention", default=False) else heads
    add_bias = bool(_arg_set(args, "add_bias_linear", default=True))
    if _arg_set(args, "disable_bias_linear", default=None) is True:
        add_bias = False
    padded = _arg_set(args, "padded_vocab_size")
    return ArgsShape(
        num_layers=args_num_blocks(args),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=int(_arg_set(args, "kv_channels", default=hidden // heads)),
        ffn_hidden_size=int(_arg_set(args, "ffn_hidden_size", default=4 * hidden)),
        padded_vocab_size=int(padded) if padded is not None else None,
        max_position_embeddings=int(_arg_set(args, "max_position_embeddings", "seq_length", default=2048)),
        norm_epsilon=float(_arg_set(args, "layernorm_epsilon", "norm_epsilon", default=1e-5)),
        normalization=str(_arg_set(args, "normalization", default="LayerNorm")),
        zero_centered_gamma=bool(_arg_set(args, "layernorm_zero_centered_gamma", default=False)
                                 or _arg_set(args, "apply_layernorm_1p", default=False)),
        swiglu=bool(_arg_set(args, "swiglu", default=False)),
        add_bias_linear=add_bias,
        add_qkv_bias=bool(_arg_set(args, "add_qkv_bias", default=False)),
        qk_layernorm=bool(_arg_set(args, "qk_layernorm", default=False)),
        untie_embeddings=bool(_arg_set(args, "untie_embeddings_and_output_weights", default=False)),
        position_embedding_type=str(_arg_set(args, "position_embedding_type", default="learned_absolute")),
        rotary_base=float(_arg_set(args, "rotary_base", default=10000)),
        rotary_percent=float(_arg_set(args, "rotary_percent", default=1.0)),
        rotary_interleaved=bool(_arg_set(args, "rotary_interleaved", default=False)),
        rotary_seq_len_interpolation_factor=_arg_set(args, "rotary_seq_len_interpolation_factor"),
        use_rope_scaling=bool(_arg_set(args, "use_rope_scaling", default=False)),
        rope_scaling_factor=float(_arg_set(args, "rope_scaling_factor", default=8.0)),
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
        return shapes

    def roles(self) -> List[str]:
        """Per-layer roles in the order they are converted (and written to HF)."""
        order = ["qkv.weight", "qkv.bias", "proj.weight", "proj.bias", "fc1.weight", "fc1.bias",
                 "fc2.weight", "fc2.bias", "norm_b", "norm_a"]
        present = self.megatron_layer_shapes()
        return [r for r in order if r in present]

    def hf_role_tensors(self, role: str, is_post_ln: bool) -> List[Tuple[str, Tuple[int, ...]]]:
        """HF (layer-local name, shape) pairs a role turns into, in write order."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.kv_channels
        nq, nkv = self.num_attention_heads * d, self.num_query_groups * d
        if role in ("norm_a", "norm_b"):
            return [(hf_norm_names(is_post_ln)[role], (h,))]
        kind = role.split(".")[1]
        tail = (h,) if kind == "weight" else ()
        if role.startswith("qkv."):
            return [(f"self_attn.q_proj.{kind}", (nq, *tail)), (f"self_attn.k_proj.{kind}", (nkv, *tail)),
                    (f"self_attn.v_proj.{kind}", (nkv, *tail))]
        if role == "proj.weight":
            return [("self_attn.o_proj.weight", (h, nq))]
        if role == "proj.bias":
            return [("self_attn.o_proj.bias", (h,))]
        if role.startswith("fc1."):
            return [(f"mlp.gate_proj.{kind}", (f, *tail)), (f"mlp.up_proj.{kind}", (f, *tail))]
        if role == "fc2.weight":
            return [("mlp.down_proj.weight", (h, f))]
        if role == "fc2.bias":
            return [("mlp.down_proj.bias", (h,))]
        raise KeyError(role)

    def hf_plan(self, post_ln_layers: int) -> List[Tuple[str, Tuple[int, ...]]]:
        """Every HF tensor (name, shape) of the model, in the order the export writes them."""
        plan = [(HF_EMBEDDING, (self.vocab_size, self.hidden_size))]
        for i in range(self.num_layers):
            for role in self.roles():
                for name, shape in self.hf_role_tensors(role, i < post_ln_layers):
                    plan.append((hf_layer_prefix(i) + name, shape))
        plan.append((HF_FINAL_NORM, (self.hidden_size,)))
        if not self.tie_embeddings:
            plan.append((HF_OUTPUT, (self.vocab_size, self.hidden_size)))
        return plan


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Megatron's padding rule: a multiple of make_vocab_size_divisible_by x TP."""
    multiple = max(1, int(make_vocab_size_divisible_by)) * max(1, int(tp))
    return int(math.ceil(vocab_size / multiple) * multiple)


# ------------------------------------------------------------------- Megatron args -> shape
def _arg(args, *names, default=None):
    for name in names:
        if hasattr(args, name):
            return getattr(args, name)
    return default


def check_megatron_args_supported(args) -> None:
    """Raise UnsupportedModelError naming every feature of `args` that Llama cannot express."""
    problems = support.problems(args, support.CONVERT)  # the features in mixln_megatron.model.support.TABLE
    pattern = args_hybrid_pattern(args)
    if pattern and hybrid_pattern.pattern_problem(pattern):  # HybridModel: only Mix-LN's `*-` pairs
        problems.append(hybrid_pattern.pattern_problem(pattern) + " [hybrid_layer_pattern]")
    normalization = _arg(args, "normalization", default="LayerNorm")
    if normalization != "RMSNorm":
        problems.append(f"normalization {normalization!r}: Llama uses RMSNorm [--normalization RMSNorm]")
    if not _arg(args, "swiglu", default=False):
        problems.append("a non-gated MLP: Llama uses SwiGLU [--swiglu]")
    pos = _arg(args, "position_embedding_type", default="learned_absolute")
    if pos != "rope":
        problems.append(f"position_embedding_type {pos!r}: Llama uses RoPE [--position-embedding-type rope]")
    rotary_percent = float(_arg(args, "rotary_percent", default=1.0) or 1.0)
    if rotary_percent != 1.0:
        problems.append(f"partial rotary embeddings (rotary_percent={rotary_percent}): Llama rotates every dimension")
    rope_type = _arg(args, "rope_type", default=None)
    if rope_type not in (None, "rope"):
        problems.append(f"rope_type {rope_type!r}")
    add_bias = bool(_arg(args, "add_bias_linear", default=True))
    if _arg(args, "disable_bias_linear", default=None) is True:
        add_bias = False
    if _arg(args, "add_qkv_bias", default=False) and not add_bias:
        problems.append(
            "a bias on the QKV projection only (--add-qkv-bias without biases on the other linears): "
            "Llama's attention_bias also puts a bias on o_proj (qkv-only bias)"
        )
    if _arg(args, "use_rope_scaling", default=False) and _arg(args, "rotary_seq_len_interpolation_factor"):
        problems.append("both --use-rope-scaling and --rotary-seq-len-interpolation-factor")
    if problems:
        raise UnsupportedModelError(
            "this checkpoint's model cannot be converted to Hugging Face Llama: " + "; ".join(problems)
        )


def shape_from_megatron_args(args, vocab_size: int) -> ModelShape:
    """The model shape recorded in a Megatron-LM checkpoint's args (after the support check)."""
    check_megatron_args_supported(args)
    a = args_shape(args)
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


# ----------------------------------------------------------------------------- HF <-> shape
def v4_rope_keys(shape: ModelShape) -> dict:
    """rope_theta / rope_scaling as transformers 4.x reads them (5.x reads rope_parameters)."""
    out = {"rope_theta": shape.rotary_base}
    if shape.rope_scaling is not None:
        scaling = dict(shape.rope_scaling)
        scaling.setdefault("type", scaling.get("rope_type"))
        out["rope_scaling"] = scaling
    else:
        out["rope_scaling"] = None
    return out


HF_MODEL_TYPES = ("llama", "mixln_llama")


def shape_from_hf_config(config: dict) -> ModelShape:
    """The model shape of an HF config.json dict; raises UnsupportedModelError naming what is not Llama."""
    problems = []
    model_type = config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported: from-hf reads Llama ('llama') and Mix-LN Llama "
            "('mixln_llama') folders"
        )
    if config.get("quantization_config"):
        problems.append("a quantized checkpoint (quantization_config): convert the full-precision weights")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act {act!r}: Megatron's --swiglu is SiLU-gated")
    attention_bias = bool(config.get("attention_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        problems.append(
            f"attention_bias={attention_bias} with mlp_bias={mlp_bias}: Megatron's add_bias_linear puts "
            "biases on all linears or none"
        )
    theta, scaling = _hf_rope(config)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")) if scaling else "default"
    rope_scaling = None
    if rope_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(scaling["factor"])}
    elif rope_type == "llama3":
        want = llama3_rope_scaling(float(scaling["factor"]))
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if float(scaling.get(key, want[key])) != float(want[key]):
                problems.append(
                    f"llama3 rope scaling with {key}={scaling.get(key)}: Megatron's --use-rope-scaling fixes "
                    f"it to {want[key]}"
                )
        rope_scaling = want
    elif rope_type != "default":
        problems.append(f"rope type {rope_type!r}: Megatron supports default, linear and llama3 RoPE")
    if config.get("sliding_window"):
        problems.append("sliding-window attention")
    if problems:
        raise UnsupportedModelError("this Hugging Face model cannot be converted to Megatron: " + "; ".join(problems))
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    return ModelShape(
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(config["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=int(config.get("num_key_value_heads") or heads),
        kv_channels=int(config.get("head_dim") or hidden // heads),
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        rotary_base=float(theta),
        rope_scaling=rope_scaling,
        add_bias_linear=attention_bias,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def _hf_rope(config: dict):
    """(rope_theta, scaling dict or None) from a v5 (rope_parameters) or v4 (rope_theta/rope_scaling) config."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params:
        if "rope_theta" in params or "rope_type" in params:
            theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
            if scaling.get("rope_type", "default") == "default":
                scaling = None
            return theta, scaling
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return config.get("rope_theta", 10000.0), scaling or None


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
