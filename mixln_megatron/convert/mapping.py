"""The role table: every tensor's name on both sides of a conversion, and its rows in both directions.

Per-layer tensors are handled under a "role" that is the same for every Megatron flavour:

    role         torch_dist key (decoder.layers.<...>, stacked [L, ...])   HF (model.layers.<i>.<...>)
    qkv.weight   self_attention.linear_qkv.weight (query groups)           self_attn.{q,k,v}_proj.weight
    proj.weight  self_attention.linear_proj.weight                         self_attn.o_proj.weight
    fc1.weight   mlp.linear_fc1.weight  ([gate; up])                       mlp.{gate,up}_proj.weight
    fc2.weight   mlp.linear_fc2.weight                                     mlp.down_proj.weight
    (and the .bias of each, with add_bias_linear)
    norm_a       self_attention.linear_qkv.layer_norm_weight               HF_NORM_MODULES, by layer kind
    norm_b       mlp.linear_fc1.layer_norm_weight
    norm_c       mixln_norm_c.weight (sandwich N_b, stacked [S, ...])
    norm_d       mixln_norm_d.weight (sandwich N_d, stacked [S, ...])

MoE layers replace fc1 / fc2 by the router, the shared expert and one role per routed expert
(experts.<e>.fc1.weight: row e of the layer's [E, ...] tensor, so one expert is held at a time).
A model with P > 0 or an LNS scheme stores norm_a / norm_b under the Mix-LN keys (model.layer);
readers accept both layouts. Legacy per-rank files name modules instead.

One table, both directions: `map_roles` gives every HF tensor of a model and the role it comes
from; to-hf turns each role into its HF tensors (`hf_layer_tensors`), from-hf reads the same map
backwards (HFRoleSource), in row ranges that never straddle what HF keeps apart.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import ConversionError
from ..model import checkpoint as keys
from ..model import layout, qkv_layout

# ---------------------------------------------------------------------------------------- Megatron
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
# One routed expert's role: experts.<e>.fc1.weight / experts.<e>.fc2.weight. The readers match it
# themselves (a pattern, not a call back into this table while they read).
EXPERT_ROLE = re.compile(r"experts\.([0-9]+)\.(fc[12])\.weight")


def expert_role(expert: int, which: str) -> str:
    """The role of one routed expert's fc1 / fc2 (`which`: "fc1" or "fc2")."""
    return f"experts.{expert}.{which}.weight"


def split_expert_role(role: str):
    """(expert index, its layer's whole-tensor role "experts.fcN.weight") of an expert's role, or None."""
    m = EXPERT_ROLE.fullmatch(role)
    return None if m is None else (int(m.group(1)), f"experts.{m.group(2)}.weight")


# Mix-LN models (P > 0 or LNS) store the norms here instead (model.layer); a sandwich layer's output
# norms are stacked over the sandwich layers only (model.checkpoint).
MIXLN_NORM_NAMES: Dict[str, str] = {"norm_a": keys.MIXLN_NORM_A + "weight", "norm_b": keys.MIXLN_NORM_B + "weight"}
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
    the stock one (P = 0, scheme mixln, no layout)."""
    return not (int(placement_record.get("post_ln_layers", 0)) == 0
                and placement_record.get("scheme", "mixln") == "mixln"
                and placement_record.get("layout") is None)


# Linear modules whose (empty) `_extra_state` megatron-core saves per layer in torch_dist.
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")

# Legacy (per-rank torch) files name a layer's norm modules: a Pre-LN kind's by backend, a Post-LN
# kind's alike for both, a sandwich layer's output norms beside its Pre-LN ones.
LEGACY_NORM_NAMES = {
    "transformer_engine": {"norm_a": LAYER_ROLE_NAMES["norm_a"], "norm_b": LAYER_ROLE_NAMES["norm_b"]},
    "local": {"norm_a": "input_layernorm.weight", "norm_b": "pre_mlp_layernorm.weight"},
    "post": {"norm_a": "post_mlp_layernorm.weight", "norm_b": "post_attention_layernorm.weight"},
    "sandwich": {"norm_c": "attn_output_layernorm.weight", "norm_d": "mlp_output_layernorm.weight"},
}
# Legacy layer-local name -> role, every backend and kind: the inverse of the names above.
LEGACY_LAYER_NAMES: Dict[str, str] = {name: role for names in (LAYER_ROLE_NAMES, *LEGACY_NORM_NAMES.values())
                                      for role, name in names.items()}
LEGACY_SANDWICH_NAMES = tuple(LEGACY_NORM_NAMES["sandwich"].values())
LEGACY_POST_LN_NAMES = tuple(LEGACY_NORM_NAMES["post"].values())
LEGACY_IGNORED_SUFFIXES = ("_extra_state", keys.RECORD)


def legacy_write_names(transformer_impl: str, kind: str) -> Dict[str, str]:
    """Megatron module names (legacy files) of a layer's norm roles, for a layer of `kind` (model.layout)."""
    names = dict(LEGACY_NORM_NAMES["post" if kind in layout.POST_LN_KINDS else transformer_impl])
    if kind == layout.SANDWICH:
        names.update(LEGACY_NORM_NAMES["sandwich"])
    return names


# ---------------------------------------------------------------------------------------- HF
HF_EMBEDDING = "model.embed_tokens.weight"
HF_FINAL_NORM = "model.norm.weight"
HF_OUTPUT = "lm_head.weight"


def hf_layer_prefix(index: int) -> str:
    return f"model.layers.{index}."


# The HF modules of a dense layer's linear roles, in Megatron's row order ([q; k; v] grouped, [gate; up]).
HF_LINEAR_MODULES = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "proj": ("self_attn.o_proj",),
                     "fc1": ("mlp.gate_proj", "mlp.up_proj"), "fc2": ("mlp.down_proj",)}

# The HF module of each norm of a Mix-LN layer, by layer kind and norm role (mixln_megatron.hf; the
# sandwich names are Gemma 2's). What each role is:
#     role    Pre-LN kinds (pre, sandwich)         Post-LN kinds (post, deepnorm)
#     norm_a  the attention pre-norm               N2, after the MLP residual add
#     norm_b  the MLP pre-norm                     N1, after the attention residual add
#     norm_c  sandwich: N_b, on the attention output
#     norm_d  sandwich: N_d, on the MLP output
NORM_A, NORM_B, NORM_C, NORM_D = "norm_a", "norm_b", "norm_c", "norm_d"
_PRE_LN = {NORM_A: "input_layernorm", NORM_B: "post_attention_layernorm"}
_POST_LN = {NORM_A: "post_feedforward_layernorm", NORM_B: "post_attention_layernorm"}
HF_NORM_MODULES: Dict[str, Dict[str, str]] = {
    layout.PRE: _PRE_LN,
    layout.POST: _POST_LN,
    layout.DEEPNORM: _POST_LN,  # DeepNorm scales the residual, its norms are Post-LN's
    layout.SANDWICH: {NORM_A: "input_layernorm", NORM_B: "pre_feedforward_layernorm",
                      NORM_C: "post_attention_layernorm", NORM_D: "post_feedforward_layernorm"},
}


def hf_norm_module(kind: str, role: str) -> str:
    """The HF module name (inside model.layers.<i>.) of the `role` norm of a layer of `kind`."""
    return HF_NORM_MODULES[kind][role]


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


# ---------------------------------------------------------------------------------------- roles
# Per-layer roles in the order they are converted (and written to HF); the biases only with add_bias_linear
# (qkv.bias alone with a qkv-only bias: ModelShape.add_qkv_bias).
LAYER_ROLES = ("qkv.weight", "qkv.bias", "proj.weight", "proj.bias", "fc1.weight", "fc1.bias",
               "fc2.weight", "fc2.bias", "norm_b", "norm_a")


def is_moe_layer(shape, layer: Optional[int]) -> bool:
    return layer is not None and shape.moe is not None and shape.moe.moe_layers[layer]


def layer_roles(shape, kind=None, layer: Optional[int] = None) -> List[str]:
    """The per-layer roles of a model of this shape, in conversion order (a sandwich layer's and an
    MoE layer's included)."""
    qkv_only = getattr(shape, "add_qkv_bias", False)  # --add-qkv-bias alone: the QKV bias, no other

    def kept(role):
        return shape.add_bias_linear or not role.endswith(".bias") or (qkv_only and role == "qkv.bias")

    roles = [r for r in LAYER_ROLES if kept(r)]
    experts = []
    if is_moe_layer(shape, layer):
        moe = shape.moe
        roles = [r for r in roles if r not in DENSE_MLP_ROLES]
        mlp = ["router.weight"]
        if moe.shared_ffn is not None:
            mlp += ["shared.fc1.weight", "shared.fc2.weight"] + (["shared.gate.weight"] if moe.shared_gate else [])
        at = roles.index("norm_b")
        roles = roles[:at] + mlp + roles[at:]
        experts = [expert_role(e, w) for e in range(moe.num_experts) for w in ("fc1", "fc2")]
    norms = list(SANDWICH_ROLES) if kind == layout.SANDWICH else []
    return roles + norms + experts


def hf_role_tensors(shape, role: str, kind, moe_style: str = "qwen2_moe") -> List[Tuple[str, Tuple[int, ...]]]:
    """HF (layer-local name, shape) pairs a role of a layer of `kind` turns into, in Megatron's row
    order (`kind`: pre, post, deepnorm, sandwich; True / False: Post-LN / Pre-LN; `moe_style`: the MoE
    names of the exported class)."""
    h, f, d = shape.hidden_size, shape.ffn_hidden_size, shape.kv_channels
    nq, nkv = shape.num_attention_heads * d, shape.num_query_groups * d
    if role in NORM_ROLES:
        if isinstance(kind, bool):  # True / False: Mix-LN's two kinds, post / pre
            kind = layout.POST if kind else layout.PRE
        return [(hf_norm_module(kind, role) + ".weight", (h,))]
    if role in MOE_ROLE_NAMES or split_expert_role(role):
        return _hf_moe_tensors(shape, role, moe_style)
    linear, param = role.split(".")
    rows = {"qkv": (nq, nkv, nkv), "proj": (h,), "fc1": (f, f), "fc2": (h,)}[linear]
    columns = {"qkv": h, "proj": nq, "fc1": h, "fc2": f}[linear]
    tail = (columns,) if param == "weight" else ()
    return [(f"{module}.{param}", (n, *tail)) for module, n in zip(HF_LINEAR_MODULES[linear], rows)]


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
    """Where every Megatron tensor of a model goes in its HF export, worked out once (map_roles);
    `plan`: every HF tensor (name, shape) in the order the export writes them."""

    roles: Tuple[str, ...]  # the roles every layer has
    kinds: Tuple[str, ...]
    layers: Tuple[Tuple[Tuple[str, Tuple[Tuple[str, Tuple[int, ...]], ...]], ...], ...]
    embedding: Tuple[str, Tuple[int, ...]]
    final_norm: Tuple[str, Tuple[int, ...]]
    output: Optional[Tuple[str, Tuple[int, ...]]]
    plan: Tuple[Tuple[str, Tuple[int, ...]], ...]


def map_roles(shape, kinds, moe_style: str = "qwen2_moe", hf_kinds=None) -> RoleMap:
    """The RoleMap of a model whose layer i is of kind `kinds[i]` (an integer P: Mix-LN's first P
    post); the HF norm names of `hf_kinds` when they are not the layers' own (a stock folder)."""
    if isinstance(kinds, int):
        kinds = layout.first_p_kinds(shape.num_layers, kinds)
    kinds = tuple(kinds)
    if len(kinds) != shape.num_layers:
        raise ValueError(f"{len(kinds)} layer kinds for {shape.num_layers} layers")
    names_of = tuple(kinds if hf_kinds is None else hf_kinds)
    layers = tuple(
        tuple((role, tuple((hf_layer_prefix(i) + name, shp)
                           for name, shp in hf_role_tensors(shape, role, names_of[i], moe_style)))
              for role in layer_roles(shape, kind, i))
        for i, kind in enumerate(kinds))
    vocab = (shape.vocab_size, shape.hidden_size)
    embedding, final_norm = (HF_EMBEDDING, vocab), (HF_FINAL_NORM, (shape.hidden_size,))
    output = None if shape.tie_embeddings else (HF_OUTPUT, vocab)
    plan = (embedding, *(t for layer in layers for _, tensors in layer for t in tensors), final_norm)
    return RoleMap(tuple(layer_roles(shape)), kinds, layers, embedding, final_norm, output,
                   plan + ((output,) if output else ()))


# ---------------------------------------------------------------------------------------- rows: Megatron -> HF
# The weights' dtypes a conversion writes (--dtype; auto: the input's).
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def split_qkv(qkv, shape):
    """Megatron's grouped QKV rows -> (q, k, v) in HF head order (weight [rows, h] or bias [rows])."""
    ng = shape.num_query_groups
    qpg = shape.num_attention_heads // ng  # the shape's fields only: an export's writing never calls back into it
    return qkv_layout.split(qkv, ng, qpg, shape.kv_channels)


def merge_qkv(q, k, v, shape, groups: Optional[int] = None):
    """HF q, k, v (the rows of `groups` query groups, default all) -> Megatron's QKV rows grouped per query group."""
    return qkv_layout.merge(q, k, v, shape.num_query_groups if groups is None else groups, shape.q_per_group,
                            shape.kv_channels)


def deinterleave_rope_rows(t, num_heads: int, head_dim: int):
    """Rows of q or k for Megatron's interleaved RoPE -> HF's rotate-half order, per head: row 2j to j,
    2j+1 to j + d/2 in both q and k (a shared permutation of the head dimension cancels in the scores)."""
    rest = tuple(t.shape[1:])
    return t.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(num_heads * head_dim, *rest)


def split_glu_rows(tensor, interleave_size: Optional[int] = None):
    """An fc1's rows (weight [2I, H] or bias [2I]) -> (gate, up), each [I, ...]: plain [gate; up], or
    with `interleave_size` s blocks [gate s rows; up s rows] repeated (TE grouped GEMM's layout)."""
    if interleave_size is None:
        gate, up = tensor.chunk(2, dim=0)
        return gate, up
    rows, rest = tensor.shape[0], tuple(tensor.shape[1:])
    if interleave_size < 1 or rows % (2 * interleave_size):
        raise ConversionError(f"an fc1 of {rows} rows cannot hold GLU blocks of {interleave_size} gate + "
                              f"{interleave_size} up rows (the saved GLU interleave size does not fit the tensor)")
    blocks = tensor.reshape(rows // (2 * interleave_size), 2, interleave_size, *rest)
    return blocks[:, 0].reshape(rows // 2, *rest), blocks[:, 1].reshape(rows // 2, *rest)


def hf_layer_tensors(role: str, tensor: torch.Tensor, shape) -> List[torch.Tensor]:
    """One layer's Megatron tensor of `role` (global layout) -> its HF tensors, in hf_role_tensors order.
    MoE fc1s saved with a GLU interleave (--moe-mlp-glu-interleave-size / the shared expert's) are
    split by blocks; a top-k scaling factor is folded into each routed expert's fc2."""
    if role.startswith("qkv."):
        q, k, v = split_qkv(tensor, shape)
        if shape.rotary_interleaved:  # Megatron's interleaved RoPE -> HF's rotate-half rows
            d = shape.kv_channels
            q, k = (deinterleave_rope_rows(t, t.shape[0] // d, d) for t in (q, k))
        return [q, k, v]
    moe = shape.moe
    if role.startswith("fc1.") or role.endswith(".fc1.weight"):  # dense, each expert's and the shared expert's
        interleave = None
        if moe is not None and role.endswith(".fc1.weight"):
            interleave = moe.shared_glu_interleave if role.startswith("shared.") else moe.expert_glu_interleave
        return list(split_glu_rows(tensor, interleave))  # [gate; up] or [gate s; up s]*
    if role.endswith(".fc2.weight") and EXPERT_ROLE.fullmatch(role) and moe.topk_scaling != 1:
        # Megatron multiplies the k routing weights by the factor; each routed expert's output is
        # linear in its fc2 (no bias), so the factor goes into fc2 (in fp32, cast once on writing)
        return [tensor.float() * moe.topk_scaling]
    if role in NORM_ROLES and shape.layernorm_1p:
        return [tensor.float() + 1]  # Megatron stores gamma - 1 (--apply-layernorm-1p)
    return [tensor]


# ---------------------------------------------------------------------------------------- rows: HF -> Megatron
def _ranges(start: int, stop: int, step: int):
    """[start, stop) cut into consecutive ranges of at most `step`."""
    return [(i, min(stop, i + step)) for i in range(start, stop, step)]


def megatron_row_chunks(role: str, shape, row_bytes: int, piece_bytes: int):
    """Row ranges [a, b) that split one layer's Megatron `role` tensor into chunks of <= piece_bytes,
    never straddling what HF keeps apart (QKV: whole query groups; fc1: inside the gate or up half)."""
    per = max(1, piece_bytes // max(1, row_bytes))
    if role.startswith("qkv."):
        group = qkv_layout.group_rows(shape.q_per_group, shape.kv_channels)
        return _ranges(0, shape.qkv_rows, max(1, per // group) * group)
    if role.startswith("fc1."):
        f = shape.ffn_hidden_size
        return _ranges(0, f, per) + _ranges(f, 2 * f, per)
    return _ranges(0, shape.megatron_layer_shapes()[role][0], per)


class HFRoleSource:
    """Megatron role tensors (global layout) computed on demand from an HF folder's tensors, by the
    role map read backwards: both writers ask for rows of a role, and only the HF rows they come
    from are read, so import memory stays bounded by one piece, whatever the model size."""

    def __init__(self, hf, shape, kinds, stock_source: bool, dtype, moe_style: str = "qwen2_moe"):
        """`kinds`: every layer's kind, or an integer P; `stock_source`: a stock Llama folder, whose
        norms have their Pre-LN names whatever the layer becomes."""
        self.roles = map_roles(shape, kinds, moe_style, (layout.PRE,) * shape.num_layers if stock_source else None)
        self.hf, self.shape, self.kinds, self.dtype = hf, shape, self.roles.kinds, dtype
        self._parts = [dict(layer) for layer in self.roles.layers]
        # a sandwich layer's row of the norms stacked over the sandwich layers (mixln_norm_c / _d)
        self.sandwich_rows = layout.sandwich_rows(self.kinds)

    def layer_roles(self, layer: int):
        return list(self._parts[layer])

    def is_moe_layer(self, layer: int) -> bool:
        return is_moe_layer(self.shape, layer)

    def parts(self, layer: int, role: str):
        """The HF (name, shape) pairs a role of layer `layer` comes from, in Megatron's row order."""
        return self._parts[layer][role]

    def hf_tensor(self, name, start=None, stop=None):
        """HF tensor `name` (rows start:stop if given) in the output dtype."""
        return self.hf.get(name, start, stop).to(self.dtype)

    def role(self, layer: int, role: str) -> torch.Tensor:
        """The whole tensor of `role` in layer `layer` (Megatron's global layout)."""
        if role.startswith("qkv."):
            return self.role_rows(layer, role, 0, self.shape.qkv_rows)
        return torch.cat([self.hf_tensor(name) for name, _ in self.parts(layer, role)], dim=0)

    def role_rows(self, layer: int, role: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of that tensor, reading only the HF rows they come from (ranges as
        megatron_row_chunks makes them)."""
        parts = self.parts(layer, role)
        if role.startswith("qkv."):
            d, qpg = self.shape.kv_channels, self.shape.q_per_group
            group = qkv_layout.group_rows(qpg, d)
            if start % group or stop % group:
                raise ValueError(f"QKV rows {start}:{stop} are not whole query groups")
            g0, g1 = start // group, stop // group
            q_rows, kv_rows = qkv_layout.separate_rows(g0, g1, qpg, d)
            (q, _), (k, _), (v, _) = parts
            return merge_qkv(self.hf_tensor(q, q_rows.start, q_rows.stop), self.hf_tensor(k, kv_rows.start, kv_rows.stop),
                             self.hf_tensor(v, kv_rows.start, kv_rows.stop), self.shape, g1 - g0)
        offset = 0  # otherwise Megatron's rows are the parts' rows one after another
        for name, shp in parts:
            if start < offset + shp[0]:
                if stop > offset + shp[0]:
                    raise ValueError(f"{role} rows {start}:{stop} straddle {name} and the tensor after it")
                return self.hf_tensor(name, start - offset, stop - offset)
            offset += shp[0]
        raise ValueError(f"{role} rows {start}:{stop} lie past its {offset} rows")

    def vocab_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the padded vocabulary: real rows from HF, zeros past the true vocab."""
        v = self.shape.vocab_size
        out = torch.zeros(stop - start, self.shape.hidden_size, dtype=self.dtype)
        if start < v:
            out[: min(stop, v) - start] = self.hf_tensor(name, start, min(stop, v))
        return out

    def check(self) -> None:
        """Every tensor of the role map is in the folder with the shape config.json implies (one
        ConversionError naming up to nine problems); tensors it does not use are named in a warning."""
        r = self.roles
        expected = dict([r.embedding, r.final_norm] + ([r.output] if r.output else [])
                        + [t for layer in r.layers for _, tensors in layer for t in tensors])
        ignored = [n for n in self.hf.weight_map if n not in expected and not n.endswith("rotary_emb.inv_freq")
                   and not (n == HF_OUTPUT and self.shape.tie_embeddings)]
        if ignored:
            print(f"[mixln-megatron convert] WARNING: {len(ignored)} tensor(s) of {self.hf.path} have no place in "
                  f"the Megatron model and are not converted: {', '.join(sorted(ignored)[:6])}"
                  + (" ..." if len(ignored) > 6 else ""), flush=True)
        problems = []
        for name, want in expected.items():
            if not self.hf.has(name):
                problems.append(f"missing {name}")
            elif tuple(self.hf.shape(name)) != tuple(want):
                problems.append(f"{name} has shape {tuple(self.hf.shape(name))}, config.json implies {tuple(want)}")
            if len(problems) > 8:
                break
        if problems:
            raise ConversionError(f"{self.hf.path} does not match its config.json: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------- legacy TP shards
# Legacy tensor-parallel layout of each role: ("cat", dim), "glu" ([gate_r; up_r] per rank: torch_dist
# stores the layout-independent [gate_all; up_all]) or "replicated" (every rank holds the full tensor).
LEGACY_TP_LAYOUT: Dict[str, object] = {
    "qkv.weight": ("cat", 0), "qkv.bias": ("cat", 0), "proj.weight": ("cat", 1), "proj.bias": "replicated",
    "fc1.weight": "glu", "fc1.bias": "glu", "fc2.weight": ("cat", 1), "fc2.bias": "replicated",
    "norm_a": "replicated", "norm_b": "replicated", "norm_c": "replicated", "norm_d": "replicated",
}


def merge_tp_shards(role: str, shards: Sequence):
    """Legacy TP shards of one role (rank order) -> the global tensor (QKV: TP splits whole query
    groups, so the concatenated shards have torch_dist's layout)."""
    how = LEGACY_TP_LAYOUT[role]
    if how == "replicated" or len(shards) == 1:
        return shards[0]
    if how == "glu":  # [gate_r; up_r] per rank -> [gate_all; up_all]
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([g for g, _ in halves] + [u for _, u in halves], dim=0)
    return torch.cat(list(shards), dim=how[1])


def split_tp_shard(role: str, tensor, tp: int, rank: int):
    """The global tensor of a role -> legacy TP rank `rank`'s shard (a contiguous copy)."""
    how = LEGACY_TP_LAYOUT[role]
    if how == "replicated" or tp == 1:
        return tensor.contiguous()
    if how == "glu":  # [gate_all; up_all] -> rank's [gate_r; up_r]
        ffn = tensor.shape[0] // 2
        part = ffn // tp
        return torch.cat([tensor[rank * part:(rank + 1) * part],
                          tensor[ffn + rank * part:ffn + (rank + 1) * part]], dim=0).contiguous()
    size = tensor.shape[how[1]] // tp
    return tensor.narrow(how[1], rank * size, size).contiguous()
