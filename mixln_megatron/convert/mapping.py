"""Name and layout maps between Megatron-LM (megatron-core GPT) and Hugging Face (Mix-LN) LLaMA.

Per-layer tensors are handled under a "role" that is the same for every Megatron flavour:

    role         torch_dist key (decoder.layers.<...>, stacked [L, ...])   HF (model.layers.<i>.<...>)
    qkv.weight   self_attention.linear_qkv.weight                          self_attn.{q,k,v}_proj.weight
    qkv.bias     self_attention.linear_qkv.bias                            self_attn.{q,k,v}_proj.bias
    proj.weight  self_attention.linear_proj.weight                         self_attn.o_proj.weight
    proj.bias    self_attention.linear_proj.bias                           self_attn.o_proj.bias
    fc1.weight   mlp.linear_fc1.weight  ([gate; up])                       mlp.{gate,up}_proj.weight
    fc1.bias     mlp.linear_fc1.bias                                       mlp.{gate,up}_proj.bias
    fc2.weight   mlp.linear_fc2.weight                                     mlp.down_proj.weight
    fc2.bias     mlp.linear_fc2.bias                                       mlp.down_proj.bias
    norm_a       self_attention.linear_qkv.layer_norm_weight               Pre-LN: input_layernorm
                                                                           Post-LN: post_feedforward_layernorm (N2)
    norm_b       mlp.linear_fc1.layer_norm_weight                          post_attention_layernorm
                                                                           (Pre-LN MLP norm / Post-LN N1)

A model with P > 0 or an LNS scheme stores the two norms of every layer under Mix-LN keys instead
(mixln_megatron.model.layer): norm_a -> mixln_norm_a.weight, norm_b -> mixln_norm_b.weight (Post-LN:
N1 -> norm_b, N2 -> norm_a), so that a stock model cannot load it; checkpoints saved before that
change use the stock keys for every model. Readers accept both layouts (td_norm_keys).
Legacy per-rank files use the module names instead: LEGACY_LAYER_NAMES below covers the
TransformerEngine names (fused layer_norm_weight), the local names (input_layernorm,
pre_mlp_layernorm) and the Post-LN names (post_attention_layernorm, post_mlp_layernorm).

Layouts:
  * QKV rows are grouped per query group: for group g, [the q heads of g; k_g; v_g], each head
    kv_channels rows. Tensor parallelism splits whole groups, so concatenating the TP shards of a
    legacy checkpoint gives the same grouped layout as torch_dist.
  * fc1 (SwiGLU) is [gate; up]. torch_dist stores the layout-independent [gate_all; up_all]; each
    legacy TP rank holds [gate_r; up_r] of its own slice.
  * The vocabulary is padded by Megatron to a multiple of make_vocab_size_divisible_by x TP;
    export trims to the true vocabulary, import pads with zero rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

from ..model import support
from . import UnsupportedModelError

# ---------------------------------------------------------------------------------------- keys
TD_EMBEDDING = "embedding.word_embeddings.weight"
TD_OUTPUT = "output_layer.weight"
TD_FINAL_NORM = "decoder.final_layernorm.weight"
TD_LAYER_PREFIX = "decoder.layers."
TD_SETTINGS_RECORD = "decoder.layers.mixln_settings"

LAYER_ROLE_NAMES: Dict[str, str] = {
    "qkv.weight": "self_attention.linear_qkv.weight",
    "qkv.bias": "self_attention.linear_qkv.bias",
    "proj.weight": "self_attention.linear_proj.weight",
    "proj.bias": "self_attention.linear_proj.bias",
    "fc1.weight": "mlp.linear_fc1.weight",
    "fc1.bias": "mlp.linear_fc1.bias",
    "fc2.weight": "mlp.linear_fc2.weight",
    "fc2.bias": "mlp.linear_fc2.bias",
    "norm_a": "self_attention.linear_qkv.layer_norm_weight",
    "norm_b": "mlp.linear_fc1.layer_norm_weight",
}
# Mix-LN models (P > 0 or LNS) store the norms here instead (mixln_megatron.model.layer.PRE_LN_KEYS_MAP).
MIXLN_NORM_NAMES: Dict[str, str] = {"norm_a": "mixln_norm_a.weight", "norm_b": "mixln_norm_b.weight"}


def td_layer_name(role: str, mixln_layout: bool) -> str:
    """The layer-local torch_dist name of a role in a stock (False) or Mix-LN (True) checkpoint."""
    if mixln_layout and role in MIXLN_NORM_NAMES:
        return MIXLN_NORM_NAMES[role]
    return LAYER_ROLE_NAMES[role]


def uses_mixln_layout(placement_record: dict) -> bool:
    """Whether a model with these settings stores its norms under the Mix-LN keys."""
    return not (int(placement_record.get("post_ln_layers", 0)) == 0
                and placement_record.get("scheme", "mixln") == "mixln")


# Linear modules whose (empty) `_extra_state` megatron-core saves per layer in torch_dist.
EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)

# Legacy (per-rank torch) layer-local names -> role. TE and local specs, Pre-LN and Post-LN layers.
LEGACY_LAYER_NAMES: Dict[str, str] = {
    "self_attention.linear_qkv.weight": "qkv.weight",
    "self_attention.linear_qkv.bias": "qkv.bias",
    "self_attention.linear_proj.weight": "proj.weight",
    "self_attention.linear_proj.bias": "proj.bias",
    "mlp.linear_fc1.weight": "fc1.weight",
    "mlp.linear_fc1.bias": "fc1.bias",
    "mlp.linear_fc2.weight": "fc2.weight",
    "mlp.linear_fc2.bias": "fc2.bias",
    "self_attention.linear_qkv.layer_norm_weight": "norm_a",  # TE, Pre-LN
    "input_layernorm.weight": "norm_a",  # local, Pre-LN
    "post_mlp_layernorm.weight": "norm_a",  # Post-LN N2
    "mlp.linear_fc1.layer_norm_weight": "norm_b",  # TE, Pre-LN
    "pre_mlp_layernorm.weight": "norm_b",  # local, Pre-LN
    "post_attention_layernorm.weight": "norm_b",  # Post-LN N1
}
LEGACY_POST_LN_NAMES = ("post_attention_layernorm.weight", "post_mlp_layernorm.weight")
LEGACY_IGNORED_SUFFIXES = ("_extra_state", "mixln_settings")

# Legacy tensor-parallel layout of each role: ("cat", dim), "glu" ([gate_r; up_r] per rank) or
# "replicated" (every rank holds the full tensor).
LEGACY_TP_LAYOUT: Dict[str, object] = {
    "qkv.weight": ("cat", 0),
    "qkv.bias": ("cat", 0),
    "proj.weight": ("cat", 1),
    "proj.bias": "replicated",
    "fc1.weight": "glu",
    "fc1.bias": "glu",
    "fc2.weight": ("cat", 1),
    "fc2.bias": "replicated",
    "norm_a": "replicated",
    "norm_b": "replicated",
}

# Megatron module names (legacy files) of each role, for writing: TE vs local, Pre-LN vs Post-LN.
LEGACY_WRITE_NAMES = {
    ("transformer_engine", False): {
        "norm_a": "self_attention.linear_qkv.layer_norm_weight",
        "norm_b": "mlp.linear_fc1.layer_norm_weight",
    },
    ("local", False): {"norm_a": "input_layernorm.weight", "norm_b": "pre_mlp_layernorm.weight"},
    ("transformer_engine", True): {
        "norm_a": "post_mlp_layernorm.weight",
        "norm_b": "post_attention_layernorm.weight",
    },
    ("local", True): {"norm_a": "post_mlp_layernorm.weight", "norm_b": "post_attention_layernorm.weight"},
}

HF_EMBEDDING = "model.embed_tokens.weight"
HF_FINAL_NORM = "model.norm.weight"
HF_OUTPUT = "lm_head.weight"


def hf_layer_prefix(index: int) -> str:
    return f"model.layers.{index}."


def hf_norm_names(is_post_ln: bool) -> Dict[str, str]:
    """HF names (within a layer) of norm_a / norm_b for a Pre-LN or Post-LN layer."""
    if is_post_ln:
        return {"norm_a": "post_feedforward_layernorm.weight", "norm_b": "post_attention_layernorm.weight"}
    return {"norm_a": "input_layernorm.weight", "norm_b": "post_attention_layernorm.weight"}


# ---------------------------------------------------------------------------------------- shape
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
    from .inspect import args_shape

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
def hf_config_kwargs(shape: ModelShape) -> dict:
    """LlamaConfig keyword arguments of the model (the Mix-LN fields are added by the caller)."""
    kwargs = dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.ffn_hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_query_groups,
        head_dim=shape.kv_channels,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=shape.norm_epsilon,
        rope_theta=shape.rotary_base,
        attention_bias=shape.add_bias_linear,
        mlp_bias=shape.add_bias_linear,
        tie_word_embeddings=shape.tie_embeddings,
        hidden_act="silu",
        attention_dropout=0.0,
    )
    if shape.rope_scaling is not None:
        kwargs["rope_scaling"] = dict(shape.rope_scaling)
    return kwargs


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


# ------------------------------------------------------------------------------------ layouts
def split_qkv(qkv, shape: ModelShape):
    """Megatron's grouped QKV rows -> (q, k, v) in HF head order (weight [rows, h] or bias [rows])."""
    d, ng, qpg = shape.kv_channels, shape.num_query_groups, shape.q_per_group
    rest = tuple(qkv.shape[1:])
    grouped = qkv.reshape(ng, qpg + 2, d, *rest)
    q = grouped[:, :qpg].reshape(ng * qpg * d, *rest)
    k = grouped[:, qpg].reshape(ng * d, *rest)
    v = grouped[:, qpg + 1].reshape(ng * d, *rest)
    return q, k, v


def merge_qkv(q, k, v, shape: ModelShape):
    """HF q, k, v -> Megatron's QKV rows grouped per query group."""
    import torch

    d, ng, qpg = shape.kv_channels, shape.num_query_groups, shape.q_per_group
    rest = tuple(q.shape[1:])
    return torch.cat(
        [q.reshape(ng, qpg, d, *rest), k.reshape(ng, 1, d, *rest), v.reshape(ng, 1, d, *rest)], dim=1
    ).reshape(ng * (qpg + 2) * d, *rest)


def deinterleave_rope_rows(t, num_heads: int, head_dim: int):
    """Rows of q or k for Megatron's interleaved RoPE -> HF's rotate-half order, per head.

    Interleaved RoPE rotates the pairs (2j, 2j+1) with frequency j, rotate-half the pairs
    (j, j + d/2); moving row 2j to j and 2j+1 to j + d/2 in both q and k maps one onto the other
    (the attention scores are sums over the head dimension, so a shared permutation cancels).
    """
    rest = tuple(t.shape[1:])
    return t.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(num_heads * head_dim, *rest)


def split_glu(fc1, ffn_hidden_size: int):
    """[gate; up] -> (gate, up)."""
    return fc1[:ffn_hidden_size], fc1[ffn_hidden_size:]


def merge_glu_ranks(shards: Sequence):
    """Legacy TP shards [gate_r; up_r] -> the global [gate_all; up_all]."""
    import torch

    gates, ups = [], []
    for shard in shards:
        half = shard.shape[0] // 2
        gates.append(shard[:half])
        ups.append(shard[half:])
    return torch.cat(gates + ups, dim=0)


def split_glu_rank(fc1, tp: int, rank: int):
    """The global [gate_all; up_all] -> legacy TP rank `rank`'s [gate_r; up_r]."""
    import torch

    ffn = fc1.shape[0] // 2
    part = ffn // tp
    gate = fc1[rank * part:(rank + 1) * part]
    up = fc1[ffn + rank * part:ffn + (rank + 1) * part]
    return torch.cat([gate, up], dim=0)


def merge_tp_shards(role: str, shards: Sequence):
    """Legacy TP shards of one role (rank order) -> the global tensor."""
    import torch

    layout = LEGACY_TP_LAYOUT[role]
    if layout == "replicated" or len(shards) == 1:
        return shards[0]
    if layout == "glu":
        return merge_glu_ranks(shards)
    return torch.cat(list(shards), dim=layout[1])


def split_tp_shard(role: str, tensor, tp: int, rank: int):
    """The global tensor of a role -> legacy TP rank `rank`'s shard (a contiguous copy)."""
    layout = LEGACY_TP_LAYOUT[role]
    if layout == "replicated" or tp == 1:
        return tensor.contiguous()
    if layout == "glu":
        return split_glu_rank(tensor, tp, rank).contiguous()
    dim = layout[1]
    size = tensor.shape[dim] // tp
    return tensor.narrow(dim, rank * size, size).contiguous()


def hf_row_pieces(role: str, index: int, shape: ModelShape, row_bytes: int, piece_bytes: int):
    """Row ranges of a layer's Megatron `role` tensor that make up its `index`-th HF tensor, in order.

    Each range is at most `piece_bytes` (but at least one row, or one head for q / k / v), so an
    export can read, convert and write any tensor in bounded pieces: q is gathered group by group
    from the grouped QKV rows, k and v take one head per group, gate / up are the two halves of
    fc1, everything else is split into plain row blocks.
    """
    per = max(1, piece_bytes // max(1, row_bytes))
    d = shape.kv_channels

    def split(a, b, step):
        return [(i, min(b, i + step)) for i in range(a, b, step)]

    if role.startswith("qkv."):
        group = (shape.q_per_group + 2) * d
        out = []
        for g in range(shape.num_query_groups):
            base = g * group
            if index == 0:
                out += split(base, base + shape.q_per_group * d, max(d, per // d * d))
            else:
                start = base + (shape.q_per_group + index - 1) * d
                out.append((start, start + d))
        return out
    if role.startswith("fc1."):
        f = shape.ffn_hidden_size
        return split(index * f, (index + 1) * f, per)
    rows = shape.megatron_layer_shapes()[role][0]
    return split(0, rows, per)


def megatron_row_chunks(role: str, shape: ModelShape, row_bytes: int, piece_bytes: int):
    """Row ranges [a, b) that split one layer's Megatron `role` tensor into chunks of <= piece_bytes.

    Chunks never straddle what HF keeps apart: QKV chunks are whole query groups (so each is built
    from row slices of q, k and v), fc1 chunks lie inside the gate or the up half.
    """
    per = max(1, piece_bytes // max(1, row_bytes))

    def split(a, b, step):
        return [(i, min(b, i + step)) for i in range(a, b, step)]

    if role.startswith("qkv."):
        group = (shape.q_per_group + 2) * shape.kv_channels
        return split(0, shape.qkv_rows, max(1, per // group) * group)
    if role.startswith("fc1."):
        f = shape.ffn_hidden_size
        return split(0, f, per) + split(f, 2 * f, per)
    return split(0, shape.megatron_layer_shapes()[role][0], per)


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


# ----------------------------------------------------------------- Megatron args for writing
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
    """The args a converted checkpoint carries (what Megatron-LM's loader and --use-checkpoint-args read).

    Only model-defining arguments are set (plus what Megatron-LM's load_checkpoint compares);
    everything about training (batch sizes, lr, data) is left to the run that loads it.
    """
    import torch

    stock = placement_record.get("post_ln_layers", 0) == 0 and placement_record.get("scheme", "mixln") == "mixln"
    spec = None
    if not stock:
        spec = ["mixln_megatron.spec",
                "mixln_layer_spec" if transformer_impl == "transformer_engine" else "mixln_local_layer_spec"]
    scaling = shape.rope_scaling or {}
    ns = argparse.Namespace(
        # shape
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        group_query_attention=shape.num_query_groups != shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels,
        max_position_embeddings=shape.max_position_embeddings,
        seq_length=shape.max_position_embeddings,
        encoder_seq_length=shape.max_position_embeddings,
        # Llama flavour
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_epsilon,
        norm_epsilon=shape.norm_epsilon,
        layernorm_zero_centered_gamma=False,
        apply_layernorm_1p=False,
        swiglu=True,
        squared_relu=False,
        add_bias_linear=shape.add_bias_linear,
        add_qkv_bias=shape.add_bias_linear,
        position_embedding_type="rope",
        add_position_embedding=True,
        use_rotary_position_embeddings=False,
        rotary_base=shape.rotary_base,
        rotary_percent=1.0,
        rotary_interleaved=False,
        rotary_seq_len_interpolation_factor=(
            scaling.get("factor") if scaling.get("rope_type") == "linear" else None),
        use_rope_scaling=scaling.get("rope_type") == "llama3",
        rope_scaling_factor=float(scaling.get("factor", 8.0)) if scaling.get("rope_type") == "llama3" else 8.0,
        untie_embeddings_and_output_weights=not shape.tie_embeddings,
        apply_query_key_layer_scaling=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        num_experts=None,
        moe_layer_freq=1,
        mtp_num_layers=None,
        multi_latent_attention=False,
        spec=spec,
        transformer_impl=transformer_impl,
        # vocabulary / tokenizer
        vocab_size=shape.vocab_size,
        padded_vocab_size=padded_vocab,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        tokenizer_type=tokenizer_type,
        tokenizer_model=tokenizer_model,
        vocab_file=None,
        merge_file=None,
        # precision
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # checkpoint / parallel layout it was written for
        ckpt_format=ckpt_format,
        use_dist_ckpt=ckpt_format == "torch_dist",
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=1,
        context_parallel_size=1,
        world_size=tp * pp,
        data_parallel_size=1,
        data_parallel_random_init=False,
        # no optimizer / RNG state in a converted checkpoint
        no_save_optim=True,
        no_save_rng=True,
        iteration=0,
        consumed_train_samples=0,
        skipped_train_samples=0,
        consumed_valid_samples=0,
        # Mix-LN: the integer P is authoritative (alpha only informational)
        mixln_post_ln_layers=int(placement_record.get("post_ln_layers", 0)),
        mixln_alpha=None,
        mixln_scheme=placement_record.get("scheme", "mixln"),
        mixln_converted_from=source,
    )
    return ns


def launch_flags(ns: argparse.Namespace) -> List[str]:
    """The Megatron-LM flags that rebuild the model a converted checkpoint's args describe.

    Every shape flag, including those Megatron-LM's --use-checkpoint-args does not copy (the norm
    epsilon, rope scaling), and the Mix-LN placement: what the launch hint after from-hf prints.
    """
    flags = ["--num-layers", ns.num_layers, "--hidden-size", ns.hidden_size, "--ffn-hidden-size", ns.ffn_hidden_size,
             "--num-attention-heads", ns.num_attention_heads, "--kv-channels", ns.kv_channels]
    if ns.group_query_attention:
        flags += ["--group-query-attention", "--num-query-groups", ns.num_query_groups]
    flags += ["--max-position-embeddings", ns.max_position_embeddings, "--normalization", ns.normalization,
              "--norm-epsilon", repr(float(ns.layernorm_epsilon)), "--swiglu",
              "--position-embedding-type", "rope", "--rotary-base", f"{ns.rotary_base:g}"]
    if not ns.add_bias_linear:
        flags.append("--disable-bias-linear")
    if ns.rotary_seq_len_interpolation_factor:
        flags += ["--rotary-seq-len-interpolation-factor", f"{ns.rotary_seq_len_interpolation_factor:g}"]
    if ns.use_rope_scaling:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", f"{ns.rope_scaling_factor:g}"]
    if ns.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    flags += ["--make-vocab-size-divisible-by", ns.make_vocab_size_divisible_by,
              "--mixln-post-ln-layers", ns.mixln_post_ln_layers]
    if ns.mixln_scheme != "mixln":
        flags += ["--mixln-scheme", ns.mixln_scheme]
    if ns.ckpt_format == "torch":
        flags += ["--ckpt-format", "torch", "--tensor-model-parallel-size", ns.tensor_model_parallel_size,
                  "--pipeline-model-parallel-size", ns.pipeline_model_parallel_size]
    return [str(f) for f in flags]
