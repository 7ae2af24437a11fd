"""Tensor names on both sides of a conversion: Megatron-LM (megatron-core GPT) and HF (Mix-LN) LLaMA.

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
    norm_b       mlp.linear_fc1.layer_norm_weight                          Pre-LN: post_attention_layernorm (MLP norm)
                                                                           Post-LN: post_attention_layernorm (N1)
                                                                           Sandwich: pre_feedforward_layernorm (N_c)
    norm_c       mixln_norm_c.weight (sandwich N_b, stacked [S, ...])      Sandwich: post_attention_layernorm
    norm_d       mixln_norm_d.weight (sandwich N_d, stacked [S, ...])      Sandwich: post_feedforward_layernorm

MoE layers (convert.moe_shape) replace fc1 / fc2 by these roles (torch_dist: the layer's own key,
`decoder.layers.<i>.`, when dense and MoE layers mix; stacked [L, ...] when every layer is MoE):

    role                 torch_dist (layer-local)                   HF (model.layers.<i>.): mixln_moe / qwen2_moe | mixtral
    router.weight        mlp.router.weight [E, H]                   mlp.gate.weight | block_sparse_moe.gate.weight
    experts.<e>.fc1.weight  mlp.experts.experts.linear_fc1.weight[e]   mlp.experts.<e>.{gate,up}_proj.weight | ...w1 / w3
    experts.<e>.fc2.weight  mlp.experts.experts.linear_fc2.weight[e]   mlp.experts.<e>.down_proj.weight | ...w2
    shared.fc1.weight    mlp.shared_experts.linear_fc1.weight       mlp.shared_expert.{gate,up}_proj.weight
    shared.fc2.weight    mlp.shared_experts.linear_fc2.weight       mlp.shared_expert.down_proj.weight
    shared.gate.weight   mlp.shared_experts.gate_weight [1, H]      mlp.shared_expert_gate.weight

One role per expert, so a conversion holds one expert's tensors at a time, not a layer's.

Per-layer kinds (model.layout: pre, post, deepnorm, sandwich): deepnorm layers have the norms and
keys of post layers, sandwich layers those of pre layers (norm_a = N_a, norm_b = N_c) plus norm_c /
norm_d, which only sandwich layers have: their torch_dist keys are stacked over the S sandwich layers
of the model (a layer's row: its 0-based rank among them, model.layer).

A model with P > 0 or an LNS scheme stores the two norms of every layer under Mix-LN keys instead
(mixln_megatron.model.layer), so that a stock model cannot load it; checkpoints saved before that
change use the stock keys. Readers accept both layouts. Legacy per-rank files name modules
instead (TE fused names, local names, Post-LN names): LEGACY_LAYER_NAMES.

Shapes live in convert.shape, tensor layouts (QKV groups, [gate; up], TP shards) in
convert.layouts, the args a written checkpoint carries in convert.written_args. The roles of a
model and the HF tensors each becomes (`layer_roles`, `hf_role_tensors`, `map_roles`) are here:
an export reads the checkpoint's facts (convert.facts), maps the roles once, then writes.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from ..model import checkpoint_keys as keys
from ..model import hf_norm_names, layout
from . import moe_shape

# ---------------------------------------------------------------------------------------- keys
# The GPTModel torch_dist keys, as the conversion names them (the values are model.checkpoint_keys').
TD_EMBEDDING = keys.EMBEDDING
TD_OUTPUT = keys.OUTPUT
TD_FINAL_NORM = keys.GPT_FINAL_NORM + "weight"
TD_LAYER_PREFIX = keys.LAYERS
TD_SETTINGS_RECORD = keys.GPT_RECORD_KEY

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
# MoE layers' roles (convert.moe_shape); an expert's role is experts.<e>.fc1.weight / experts.<e>.fc2.weight,
# read as row e of the layer's experts tensor [E, ...].
MOE_ROLE_NAMES: Dict[str, str] = {
    "router.weight": "mlp.router.weight",
    "experts.fc1.weight": "mlp.experts.experts.linear_fc1.weight",
    "experts.fc2.weight": "mlp.experts.experts.linear_fc2.weight",
    "shared.fc1.weight": "mlp.shared_experts.linear_fc1.weight",
    "shared.fc2.weight": "mlp.shared_experts.linear_fc2.weight",
    "shared.gate.weight": "mlp.shared_experts.gate_weight",
}
DENSE_MLP_ROLES = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
EXPERT_ROLES = ("experts.fc1.weight", "experts.fc2.weight")


expert_role, split_expert_role = moe_shape.expert_role, moe_shape.split_expert_role  # the one spelling


# Mix-LN models (P > 0 or LNS) store the norms here instead (mixln_megatron.model.layer.PRE_LN_KEYS_MAP).
MIXLN_NORM_NAMES: Dict[str, str] = {"norm_a": keys.MIXLN_NORM_A + "weight", "norm_b": keys.MIXLN_NORM_B + "weight"}


# A sandwich layer's output norms, stacked over the sandwich layers only (model.checkpoint_keys).
SANDWICH_NORM_NAMES: Dict[str, str] = {"norm_c": keys.MIXLN_NORM_C + "weight", "norm_d": keys.MIXLN_NORM_D + "weight"}
SANDWICH_ROLES = tuple(SANDWICH_NORM_NAMES)
NORM_ROLES = ("norm_a", "norm_b") + SANDWICH_ROLES


# {Mix-LN layout?: {role: layer-local torch_dist name}}: a stock (False) or Mix-LN (True) checkpoint.
TD_LAYER_NAMES: Dict[bool, Dict[str, str]] = {
    False: {**LAYER_ROLE_NAMES, **MOE_ROLE_NAMES},
    True: {**LAYER_ROLE_NAMES, **MOE_ROLE_NAMES, **MIXLN_NORM_NAMES, **SANDWICH_NORM_NAMES}}


def td_layer_name(role: str, mixln_layout: bool) -> str:
    """The layer-local torch_dist name of a role in a stock (False) or Mix-LN (True) checkpoint
    (an expert's role: its layer's experts tensor)."""
    expert = split_expert_role(role)
    return TD_LAYER_NAMES[bool(mixln_layout)][expert[1] if expert else role]


def uses_mixln_layout(placement_record: dict) -> bool:
    """Whether a model with these settings stores its norms under the Mix-LN keys: every model but
    the stock one (P = 0, scheme mixln, every layer pre). A format-2 record (a layout other than
    Mix-LN's first P, model.placement) always has a layer of another kind."""
    return not (int(placement_record.get("post_ln_layers", 0)) == 0
                and placement_record.get("scheme", "mixln") == "mixln"
                and placement_record.get("layout") is None)


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
    "attn_output_layernorm.weight": "norm_c",  # sandwich N_b
    "mlp_output_layernorm.weight": "norm_d",  # sandwich N_d
}
LEGACY_SANDWICH_NAMES = ("attn_output_layernorm.weight", "mlp_output_layernorm.weight")
LEGACY_POST_LN_NAMES = ("post_attention_layernorm.weight", "post_mlp_layernorm.weight")
LEGACY_IGNORED_SUFFIXES = ("_extra_state", keys.RECORD)

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
# A sandwich layer's output norms (both backends); its pre-norms are named as a Pre-LN layer's.
LEGACY_WRITE_SANDWICH_NAMES = {"norm_c": "attn_output_layernorm.weight", "norm_d": "mlp_output_layernorm.weight"}


def legacy_write_names(transformer_impl: str, kind: str) -> Dict[str, str]:
    """Megatron module names (legacy files) of a layer's norm roles, for a layer of `kind` (model.layout)."""
    names = dict(LEGACY_WRITE_NAMES[(transformer_impl, kind in layout.POST_LN_KINDS)])
    if kind == layout.SANDWICH:
        names.update(LEGACY_WRITE_SANDWICH_NAMES)
    return names

HF_EMBEDDING = "model.embed_tokens.weight"
HF_FINAL_NORM = "model.norm.weight"
HF_OUTPUT = "lm_head.weight"


def hf_layer_prefix(index: int) -> str:
    return f"model.layers.{index}."


# HF names (within a layer) of each kind's norm roles: the weights of model.hf_norm_names' modules.
HF_NORM_NAMES: Dict[str, Dict[str, str]] = {
    kind: {role: f"{module}.weight" for role, module in modules.items()}
    for kind, modules in hf_norm_names.HF_NORM_MODULES.items()
}


def _kind(kind) -> str:
    """A layer kind (model.layout); True / False stand for post / pre (Mix-LN's two kinds)."""
    if isinstance(kind, bool):
        return layout.POST if kind else layout.PRE
    return kind


def hf_norm_names(kind) -> Dict[str, str]:
    """HF names (within a layer) of the norm roles of a layer of `kind` (pre, post, deepnorm, sandwich;
    True / False: Post-LN / Pre-LN)."""
    return HF_NORM_NAMES[_kind(kind)]


# ---------------------------------------------------------------------------------------- roles
# Per-layer roles in the order they are converted (and written to HF); the biases only with add_bias_linear
# (qkv.bias alone with a qkv-only bias: ModelShape.add_qkv_bias).
LAYER_ROLES = ("qkv.weight", "qkv.bias", "proj.weight", "proj.bias", "fc1.weight", "fc1.bias",
               "fc2.weight", "fc2.bias", "norm_b", "norm_a")


# HF names (within a layer) of the MoE roles, by the naming of the exported class: mixln_moe and
# qwen2_moe share transformers' per-expert hub names (it fuses them on load), mixtral has its own.
MOE_STYLES = ("qwen2_moe", "mixtral")
HF_MOE_NAMES: Dict[str, Dict[str, str]] = {
    "qwen2_moe": {"router": "mlp.gate.weight", "gate": "mlp.experts.{e}.gate_proj.weight",
                  "up": "mlp.experts.{e}.up_proj.weight", "down": "mlp.experts.{e}.down_proj.weight"},
    "mixtral": {"router": "block_sparse_moe.gate.weight", "gate": "block_sparse_moe.experts.{e}.w1.weight",
                "up": "block_sparse_moe.experts.{e}.w3.weight", "down": "block_sparse_moe.experts.{e}.w2.weight"},
}
HF_SHARED_NAMES = {"gate": "mlp.shared_expert.gate_proj.weight", "up": "mlp.shared_expert.up_proj.weight",
                   "down": "mlp.shared_expert.down_proj.weight", "shared_gate": "mlp.shared_expert_gate.weight"}


def is_moe_layer(shape, layer: Optional[int]) -> bool:
    return layer is not None and shape.moe is not None and shape.moe.moe_layers[layer]


def layer_roles(shape, kind=None, layer: Optional[int] = None) -> List[str]:
    """The per-layer roles of a model of this shape (convert.shape.ModelShape), in conversion order;
    a sandwich layer (`kind`) also has norm_c / norm_d; an MoE layer (`layer` of an MoE shape) has
    the router, the shared expert's roles, then one fc1 / fc2 pair per expert instead of fc1 / fc2."""
    qkv_only = getattr(shape, "add_qkv_bias", False)  # --add-qkv-bias alone: the QKV bias, no other

    def kept(role):
        return shape.add_bias_linear or not role.endswith(".bias") or (qkv_only and role == "qkv.bias")

    roles = [r for r in LAYER_ROLES if kept(r)]
    if is_moe_layer(shape, layer):
        moe = shape.moe
        roles = [r for r in roles if r not in DENSE_MLP_ROLES]
        mlp = ["router.weight"]
        if moe.shared_ffn is not None:
            mlp += ["shared.fc1.weight", "shared.fc2.weight"] + (["shared.gate.weight"] if moe.shared_gate else [])
        at = roles.index("norm_b")
        roles = roles[:at] + mlp + roles[at:]
    norms = list(SANDWICH_ROLES) if kind == layout.SANDWICH else []
    experts = [expert_role(e, w) for e in range(shape.moe.num_experts) for w in ("fc1", "fc2")] \
        if is_moe_layer(shape, layer) else []
    return roles + norms + experts


def hf_role_tensors(shape, role: str, kind, moe_style: str = "qwen2_moe") -> List[Tuple[str, Tuple[int, ...]]]:
    """HF (layer-local name, shape) pairs a role of a layer of `kind` turns into, in write order
    (`kind`: pre, post, deepnorm, sandwich; True / False: Post-LN / Pre-LN; `moe_style`: the MoE
    names of the exported class, MOE_STYLES)."""
    h, f, d = shape.hidden_size, shape.ffn_hidden_size, shape.kv_channels
    nq, nkv = shape.num_attention_heads * d, shape.num_query_groups * d
    if role in NORM_ROLES:
        return [(hf_norm_names(kind)[role], (h,))]
    if role in MOE_ROLE_NAMES or split_expert_role(role):
        return _hf_moe_tensors(shape, role, moe_style)
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


def _hf_moe_tensors(shape, role: str, style: str) -> List[Tuple[str, Tuple[int, ...]]]:
    h, moe = shape.hidden_size, shape.moe
    names = HF_MOE_NAMES[style]
    if role == "router.weight":
        return [(names["router"], (moe.num_experts, h))]
    expert = split_expert_role(role)
    if expert is not None:
        e, whole = expert
        i = moe.expert_ffn
        if whole == "experts.fc1.weight":
            return [(names["gate"].format(e=e), (i, h)), (names["up"].format(e=e), (i, h))]
        return [(names["down"].format(e=e), (h, i))]
    s = moe.shared_ffn
    if role == "shared.fc1.weight":
        return [(HF_SHARED_NAMES["gate"], (s, h)), (HF_SHARED_NAMES["up"], (s, h))]
    if role == "shared.fc2.weight":
        return [(HF_SHARED_NAMES["down"], (h, s))]
    if role == "shared.gate.weight":
        return [(HF_SHARED_NAMES["shared_gate"], (1, h))]
    raise KeyError(role)


@dataclasses.dataclass(frozen=True)
class RoleMap:
    """Where every Megatron tensor of a model goes in its HF export, worked out once (map_roles).

    `layers[i]`: ((role, ((HF name, shape), ...)), ...) of layer i in conversion order (a sandwich
    layer's ends with norm_c / norm_d); `kinds[i]` its kind; `plan`: every HF tensor (name, shape) in
    the order the export writes them (embedding, layers, final norm, output layer unless tied)."""

    roles: Tuple[str, ...]  # the roles every layer has
    kinds: Tuple[str, ...]
    layers: Tuple[Tuple[Tuple[str, Tuple[Tuple[str, Tuple[int, ...]], ...]], ...], ...]
    embedding: Tuple[str, Tuple[int, ...]]
    final_norm: Tuple[str, Tuple[int, ...]]
    output: Optional[Tuple[str, Tuple[int, ...]]]
    plan: Tuple[Tuple[str, Tuple[int, ...]], ...]


def map_roles(shape, kinds, moe_style: str = "qwen2_moe") -> RoleMap:
    """The RoleMap of a model of this shape whose layer i is of kind `kinds[i]` (model.layout; an
    integer P stands for Mix-LN's layout: the first P layers post, the rest pre); MoE layers' HF
    names in `moe_style` (MOE_STYLES)."""
    if isinstance(kinds, int):
        kinds = layout.first_p_kinds(shape.num_layers, kinds)
    kinds = tuple(kinds)
    if len(kinds) != shape.num_layers:
        raise ValueError(f"{len(kinds)} layer kinds for {shape.num_layers} layers")
    roles = tuple(layer_roles(shape))
    layers = tuple(
        tuple((role, tuple((hf_layer_prefix(i) + name, shp)
                           for name, shp in hf_role_tensors(shape, role, kind, moe_style)))
              for role in layer_roles(shape, kind, i))
        for i, kind in enumerate(kinds))
    vocab = (shape.vocab_size, shape.hidden_size)
    embedding, final_norm = (HF_EMBEDDING, vocab), (HF_FINAL_NORM, (shape.hidden_size,))
    output = None if shape.tie_embeddings else (HF_OUTPUT, vocab)
    plan = (embedding, *(t for layer in layers for _, tensors in layer for t in tensors), final_norm)
    return RoleMap(roles, kinds, layers, embedding, final_norm, output, plan + ((output,) if output else ()))

