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
    norm_b       mlp.linear_fc1.layer_norm_weight                          post_attention_layernorm
                                                                           (Pre-LN MLP norm / Post-LN N1)

A model with P > 0 or an LNS scheme stores the two norms of every layer under Mix-LN keys instead
(mixln_megatron.model.layer), so that a stock model cannot load it; checkpoints saved before that
change use the stock keys. Readers accept both layouts. Legacy per-rank files name modules
instead (TE fused names, local names, Post-LN names): LEGACY_LAYER_NAMES.

Shapes live in convert.shape, tensor layouts (QKV groups, [gate; up], TP shards) in
convert.layouts, the args a written checkpoint carries in convert.written_args.
"""

from __future__ import annotations

from typing import Dict

from ..model import checkpoint_keys as keys

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
# Mix-LN models (P > 0 or LNS) store the norms here instead (mixln_megatron.model.layer.PRE_LN_KEYS_MAP).
MIXLN_NORM_NAMES: Dict[str, str] = {"norm_a": keys.MIXLN_NORM_A + "weight", "norm_b": keys.MIXLN_NORM_B + "weight"}


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
