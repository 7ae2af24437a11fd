"""Helpers that make an exported Hugging Face folder self-contained (docs/conversion.md, "Exported classes").

A Mix-LN / LNS model is saved with model_type "mixln_llama" (MoE: "mixln_moe") and an `auto_map` pointing at
the code files copied next to config.json, so it loads with trust_remote_code=True where mixln_megatron is not
installed. A model that is exactly a stock class's network (every layer "pre", scheme "mixln", LLaMA's forward
scalars; for MoE, Mixtral or Qwen2-MoE) is exported as that class, without auto_map or code files.
config.json keeps earlier exports' keys: `layer_kinds` (and the DeepNorm constants) only for a layout other
than Mix-LN's first P, the forward scalars (the `forward` argument: muP, GLU offset) only when set.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Dict, List, Optional

CODE_FILES = ("configuration_mixln_llama.py", "modeling_mixln_llama.py")
MOE_CODE_FILES = CODE_FILES + ("configuration_mixln_moe.py", "modeling_mixln_moe.py")

# AutoModel (the base model) is what the Transformers backend of vLLM and SGLang
# (`--model-impl transformers`) instantiates; the causal-LM head is theirs there.
AUTO_MAP = {
    "AutoConfig": "configuration_mixln_llama.MixLNLlamaConfig",
    "AutoModel": "modeling_mixln_llama.MixLNLlamaModel",
    "AutoModelForCausalLM": "modeling_mixln_llama.MixLNLlamaForCausalLM",
}
MIXLN_ARCHITECTURES = ["MixLNLlamaForCausalLM"]
LLAMA_ARCHITECTURES = ["LlamaForCausalLM"]
MOE_AUTO_MAP = {
    "AutoConfig": "configuration_mixln_moe.MixLNMoeConfig",
    "AutoModel": "modeling_mixln_moe.MixLNMoeModel",
    "AutoModelForCausalLM": "modeling_mixln_moe.MixLNMoeForCausalLM",
}
MOE_ARCHITECTURES = ["MixLNMoeForCausalLM"]
# The stock MoE classes an all-"pre" model may be exported as, and their architectures.
STOCK_MOE_ARCHITECTURES = {"mixtral": ["MixtralForCausalLM"], "qwen2_moe": ["Qwen2MoeForCausalLM"]}
# What remote code each model_type needs: its auto_map, architectures and code files.
_REMOTE_CODE = {
    "mixln_llama": (AUTO_MAP, MIXLN_ARCHITECTURES, CODE_FILES),
    "mixln_moe": (MOE_AUTO_MAP, MOE_ARCHITECTURES, MOE_CODE_FILES),
}
# LlamaConfig arguments that the stock MoE configs do not have (their value is checked, then dropped).
_LLAMA_ONLY_KEYS = ("attention_bias", "mlp_bias", "pretraining_tp")

# Keys of a config dict that describe the class rather than the network; never forwarded as kwargs.
_CLASS_KEYS = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")


def _first_p(layer_kinds) -> bool:
    """Mix-LN's own layout: some "post" layers, then only "pre" layers."""
    kinds = list(layer_kinds)
    p = 0
    while p < len(kinds) and kinds[p] == "post":
        p += 1
    return all(k == "pre" for k in kinds[p:])


def forward_export_fields(forward: Optional[dict]) -> Dict[str, Any]:
    """The forward scalars of `forward` that differ from LLaMA's (validated as MixLNLlamaConfig does), for
    config.json; {} for LLaMA's network."""
    from .configuration_mixln_llama import OPTIONAL_FIELDS, check_forward_scalars  # optional: transformers

    unknown = sorted(set(forward or {}) - set(OPTIONAL_FIELDS))
    if unknown:
        raise ValueError(f"unknown forward scalar {unknown[0]!r}; one of {', '.join(OPTIONAL_FIELDS)}")
    checked = check_forward_scalars(**(forward or {}))
    return {k: v for k, v in checked.items() if v != OPTIONAL_FIELDS[k]}


def is_stock_llama(post_ln_layers: int, mixln_scheme: str, layer_kinds=None, forward: Optional[dict] = None) -> bool:
    """True when the network is exactly LLaMA (every layer "pre", no scaling, LLaMA's forward scalars): export
    as LlamaForCausalLM.

    Pass `layer_kinds` whenever the placement has them: a layout of "sandwich" layers has P = 0 too; and
    `forward` whenever the model has forward scalars (muP, GLU offset).
    """
    return (int(post_ln_layers) == 0 and mixln_scheme == "mixln"
            and (layer_kinds is None or all(k == "pre" for k in layer_kinds))
            and not forward_export_fields(forward))


def placement_export_fields(placement) -> Dict[str, Any]:
    """The Mix-LN keyword arguments of a mixln_megatron Placement (model/placement.py), for
    `is_stock_llama(**f)`, `export_config_fields(**f)` and `config_for_export(**f, **llama_kwargs)`;
    layer_kinds only when the placement is not Mix-LN's first P, so first-P exports keep their config.json.
    """
    return {
        "post_ln_layers": int(placement.post_ln_layers),
        "mixln_scheme": placement.scheme,
        "mixln_alpha": placement.alpha,
        "layer_kinds": None if placement.is_first_p else list(placement.kinds),
        "deepnorm_alpha": None if placement.deepnorm_alpha is None else float(placement.deepnorm_alpha),
        "deepnorm_beta": None if placement.deepnorm_beta is None else float(placement.deepnorm_beta),
    }


def export_config_fields(post_ln_layers: int, mixln_scheme: str, mixln_alpha: Optional[str] = None, layer_kinds=None,
                         deepnorm_alpha: Optional[float] = None, deepnorm_beta: Optional[float] = None,
                         forward: Optional[dict] = None) -> Dict[str, Any]:
    """The config.json keys that select the architecture (the class keys, and for Mix-LN its fields: see the
    module docstring), for writers that build the JSON dict themselves. All fields are validated as
    MixLNLlamaConfig does (MixLNConfigValueError, a ValueError).
    """
    from .configuration_mixln_llama import _check_mixln_fields  # optional: transformers

    num_layers = None if layer_kinds is None or isinstance(layer_kinds, str) else len(layer_kinds)
    _check_mixln_fields(post_ln_layers, mixln_scheme, num_layers, layer_kinds, deepnorm_alpha, deepnorm_beta)
    if layer_kinds is not None and _first_p(layer_kinds):
        layer_kinds = None  # P alone says it (validated: P counts the post layers); deepnorm fields are None
    scalars = forward_export_fields(forward)
    if is_stock_llama(post_ln_layers, mixln_scheme, layer_kinds, scalars):
        return {"model_type": "llama", "architectures": list(LLAMA_ARCHITECTURES)}
    fields = {
        "model_type": "mixln_llama",
        "architectures": list(MIXLN_ARCHITECTURES),
        "auto_map": dict(AUTO_MAP),
        "post_ln_layers": post_ln_layers,
        "mixln_scheme": mixln_scheme,
        "mixln_alpha": mixln_alpha,
    }
    if layer_kinds is not None:
        fields["layer_kinds"] = list(layer_kinds)
        if deepnorm_alpha is not None:
            fields["deepnorm_alpha"] = float(deepnorm_alpha)
            fields["deepnorm_beta"] = None if deepnorm_beta is None else float(deepnorm_beta)
    fields.update(scalars)
    return fields


def config_for_export(post_ln_layers: int, mixln_scheme: str, mixln_alpha: Optional[str] = None, layer_kinds=None,
                      deepnorm_alpha: Optional[float] = None, deepnorm_beta: Optional[float] = None,
                      forward: Optional[dict] = None, **llama_kwargs):
    """The config to save: a `LlamaConfig` when stock, else a `MixLNLlamaConfig` with auto_map and architectures.

    `llama_kwargs` are LlamaConfig arguments (hidden_size, num_hidden_layers, rope_theta / rope_parameters,
    tie_word_embeddings, ...); a `LlamaConfig.to_dict()` may be passed as is: its class-describing keys
    (model_type, architectures, auto_map, transformers_version, _name_or_path) are dropped. The Mix-LN fields
    (post_ln_layers ... deepnorm_beta) are the arguments, as `placement_export_fields(placement)` gives them.
    """
    from transformers import LlamaConfig  # optional

    from .configuration_mixln_llama import MixLNLlamaConfig  # optional: transformers

    kwargs = {k: v for k, v in llama_kwargs.items() if k not in _CLASS_KEYS}
    fields = export_config_fields(post_ln_layers, mixln_scheme, mixln_alpha, layer_kinds, deepnorm_alpha,
                                  deepnorm_beta, forward)
    cls = LlamaConfig if fields["model_type"] == "llama" else MixLNLlamaConfig
    return _with_class_keys(cls(**kwargs, **{k: v for k, v in fields.items() if k not in _CLASS_KEYS}), fields)


def _with_class_keys(config, fields: Dict[str, Any]):
    """`config` with the architectures and auto_map of `fields` (those it has) set on it."""
    for key in ("architectures", "auto_map"):
        if key in fields:
            setattr(config, key, fields[key])
    return config


def _dtype_name(dtype) -> Optional[str]:
    """"float32", "bfloat16", ... of a torch dtype or its name (None stays None)."""
    return None if dtype is None else str(dtype).replace("torch.", "")


def stock_moe_model_type(post_ln_layers: int, mixln_scheme: str, layer_kinds=None, *,
                         shared_expert_intermediate_size: Optional[int] = None, shared_expert_gate: bool = False,
                         mlp_only_layers=None, norm_topk_prob: bool = True, attention_bias: bool = False,
                         qkv_bias: bool = False, mlp_bias: bool = False, router_dtype: Optional[str] = None,
                         dtype=None, forward: Optional[dict] = None, **_other_fields) -> Optional[str]:
    """"mixtral" or "qwen2_moe" when that stock class is exactly the MoE network, else None ("mixln_moe").

    Only an all-"pre" "mixln" model (`is_stock_llama`) qualifies, without LLaMA's attention / MLP biases:
      Mixtral    no shared expert, no dense layer, renormalised top-k (norm_topk_prob), no qkv bias;
      Qwen2-MoE  a shared expert WITH its gate (Qwen2-MoE always gates it); dense layers, either routing and
                 a qkv-only bias (Megatron's --add-qkv-bias: Qwen2-MoE's qkv_bias) are fine.
    Both compute the router logits in the model's dtype: with router_dtype "float32" (--moe-router-dtype fp32)
    they are exact only for an export `dtype` of float32 (a bf16 router picks other experts on near ties).
    Every other field of `moe_export_config_fields` may be passed too (ignored), so one dict serves both.
    """
    if not is_stock_llama(post_ln_layers, mixln_scheme, layer_kinds, forward) or attention_bias or mlp_bias:
        return None
    if router_dtype is not None and _dtype_name(dtype) != router_dtype:
        return None
    shared = shared_expert_intermediate_size is not None
    if not shared and not mlp_only_layers and norm_topk_prob and not qkv_bias:
        return "mixtral"
    if shared and shared_expert_gate:
        return "qwen2_moe"
    return None


def moe_export_config_fields(post_ln_layers: int, mixln_scheme: str, mixln_alpha: Optional[str] = None,
                             layer_kinds=None, deepnorm_alpha: Optional[float] = None,
                             deepnorm_beta: Optional[float] = None, *, num_experts: int, num_experts_per_tok: int,
                             moe_intermediate_size: int, norm_topk_prob: bool = True,
                             shared_expert_intermediate_size: Optional[int] = None, shared_expert_gate: bool = False,
                             mlp_only_layers=None, attention_bias: bool = False, qkv_bias: bool = False,
                             mlp_bias: bool = False, num_hidden_layers: Optional[int] = None,
                             router_dtype: Optional[str] = None, dtype=None,
                             forward: Optional[dict] = None) -> Dict[str, Any]:
    """The config.json keys of an MoE export: class keys, Mix-LN fields and MoE fields, spelled for the class
    `stock_moe_model_type` picks (Mixtral, Qwen2-MoE, or "mixln_moe" with "qkv_bias" / "router_dtype" only when
    set). attention_bias / mlp_bias are LLaMA's (they only decide the class; they are LlamaConfig arguments of
    `moe_config_for_export`); `dtype` is the export's (it decides whether a stock class routes exactly).
    Validated as MixLNMoeConfig does (MixLNConfigValueError, a ValueError, one line); mlp_only_layers are checked
    against num_hidden_layers (or the length of layer_kinds) when known.
    """
    from .configuration_mixln_moe import check_moe_fields  # optional: transformers

    if layer_kinds is not None and not isinstance(layer_kinds, str) and num_hidden_layers is None:
        num_hidden_layers = len(layer_kinds)
    dense_fields = export_config_fields(post_ln_layers, mixln_scheme, mixln_alpha, layer_kinds, deepnorm_alpha,
                                        deepnorm_beta, forward)
    if dense_fields.get("glu_linear_offset", 0.0) != 0.0:
        raise ValueError(f"glu_linear_offset = {dense_fields['glu_linear_offset']!r} is not supported by the MoE "
                         "model (its experts have no GLU offset)")
    mlp_only_layers = check_moe_fields(num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
                                       shared_expert_intermediate_size, shared_expert_gate, mlp_only_layers,
                                       num_hidden_layers, qkv_bias, router_dtype)
    stock = stock_moe_model_type(post_ln_layers, mixln_scheme, layer_kinds,
                                 shared_expert_intermediate_size=shared_expert_intermediate_size,
                                 shared_expert_gate=shared_expert_gate, mlp_only_layers=mlp_only_layers,
                                 norm_topk_prob=norm_topk_prob, attention_bias=attention_bias, qkv_bias=qkv_bias,
                                 mlp_bias=mlp_bias, router_dtype=router_dtype, dtype=dtype, forward=forward)
    if stock == "mixtral":
        return {"model_type": "mixtral", "architectures": list(STOCK_MOE_ARCHITECTURES["mixtral"]),
                "num_local_experts": num_experts, "num_experts_per_tok": num_experts_per_tok,
                "intermediate_size": moe_intermediate_size, "router_jitter_noise": 0.0}
    if stock == "qwen2_moe":
        return {"model_type": "qwen2_moe", "architectures": list(STOCK_MOE_ARCHITECTURES["qwen2_moe"]),
                "num_experts": num_experts, "num_experts_per_tok": num_experts_per_tok,
                "moe_intermediate_size": moe_intermediate_size,
                "shared_expert_intermediate_size": shared_expert_intermediate_size,
                "mlp_only_layers": mlp_only_layers, "decoder_sparse_step": 1, "norm_topk_prob": norm_topk_prob,
                "qkv_bias": bool(qkv_bias), "use_sliding_window": False}
    fields = {k: v for k, v in dense_fields.items() if k not in _CLASS_KEYS}
    if qkv_bias:
        fields["qkv_bias"] = True
    if router_dtype is not None:
        fields["router_dtype"] = router_dtype
    return {
        "model_type": "mixln_moe",
        "architectures": list(MOE_ARCHITECTURES),
        "auto_map": dict(MOE_AUTO_MAP),
        **fields,
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "moe_intermediate_size": moe_intermediate_size,
        "norm_topk_prob": norm_topk_prob,
        "shared_expert_intermediate_size": shared_expert_intermediate_size,
        "shared_expert_gate": shared_expert_gate,
        "mlp_only_layers": mlp_only_layers,
    }


def moe_config_for_export(post_ln_layers: int, mixln_scheme: str, mixln_alpha: Optional[str] = None,
                          layer_kinds=None, deepnorm_alpha: Optional[float] = None,
                          deepnorm_beta: Optional[float] = None, *, num_experts: int, num_experts_per_tok: int,
                          moe_intermediate_size: int, norm_topk_prob: bool = True,
                          shared_expert_intermediate_size: Optional[int] = None, shared_expert_gate: bool = False,
                          mlp_only_layers=None, qkv_bias: bool = False, router_dtype: Optional[str] = None,
                          forward: Optional[dict] = None, **llama_kwargs):
    """The MoE config to save: a `MixtralConfig`, `Qwen2MoeConfig` or `MixLNMoeConfig` (with auto_map), as
    `moe_export_config_fields` chooses. `llama_kwargs` are LlamaConfig arguments as for `config_for_export`
    (the dense layers' intermediate_size among them); LLaMA-only ones (attention_bias, mlp_bias, pretraining_tp)
    are not passed to a stock class, which can only be chosen when they are off.
    """
    kwargs = {k: v for k, v in llama_kwargs.items() if k not in _CLASS_KEYS}
    fields = moe_export_config_fields(
        post_ln_layers, mixln_scheme, mixln_alpha, layer_kinds, deepnorm_alpha, deepnorm_beta,
        num_experts=num_experts, num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=moe_intermediate_size,
        norm_topk_prob=norm_topk_prob, shared_expert_intermediate_size=shared_expert_intermediate_size,
        shared_expert_gate=shared_expert_gate, mlp_only_layers=mlp_only_layers,
        attention_bias=bool(kwargs.get("attention_bias", False)), qkv_bias=qkv_bias,
        mlp_bias=bool(kwargs.get("mlp_bias", False)), num_hidden_layers=kwargs.get("num_hidden_layers"),
        router_dtype=router_dtype, dtype=kwargs.get("dtype", kwargs.get("torch_dtype")), forward=forward)
    model_type = fields["model_type"]
    if model_type == "mixln_moe":
        from .configuration_mixln_moe import MixLNMoeConfig as cls  # optional: transformers
    else:
        from transformers import CONFIG_MAPPING  # optional

        cls = CONFIG_MAPPING[model_type]
        kwargs = {k: v for k, v in kwargs.items() if k not in _LLAMA_ONLY_KEYS}
    kwargs.update({k: v for k, v in fields.items() if k not in _CLASS_KEYS})
    return _with_class_keys(cls(**kwargs), fields)


def mark_for_remote_code(config) -> None:
    """Set `auto_map` and `architectures` on an existing MixLNLlamaConfig or MixLNMoeConfig (in place)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _REMOTE_CODE:
        raise ValueError(f"expected a MixLNLlamaConfig or MixLNMoeConfig (model_type 'mixln_llama' or 'mixln_moe'), "
                         f"got model_type {model_type!r}")
    auto_map, architectures, _ = _REMOTE_CODE[model_type]
    config.auto_map = dict(auto_map)
    config.architectures = list(architectures)


def write_model_code(out_dir: str | os.PathLike, model_type: str = "mixln_llama") -> List[str]:
    """Copy the configuration and modeling files of `model_type` ("mixln_llama": two files, "mixln_moe": those
    and the two MoE files) into the HF folder `out_dir`; return the written paths.

    The files import only `torch`/`transformers` (and each other, relatively), so the folder loads with
    trust_remote_code=True where mixln_megatron is not installed.
    """
    if model_type not in _REMOTE_CODE:
        raise ValueError(f"no model code for model_type {model_type!r}; one of {', '.join(_REMOTE_CODE)}")
    os.makedirs(out_dir, exist_ok=True)
    here = os.path.dirname(os.path.abspath(__file__))
    written = []
    for name in _REMOTE_CODE[model_type][2]:
        dst = os.path.join(os.fspath(out_dir), name)
        shutil.copyfile(os.path.join(here, name), dst)
        written.append(dst)
    return written


def save_hf_folder(model, out_dir: str | os.PathLike, **save_kwargs) -> None:
    """`model.save_pretrained(out_dir)` plus, for a Mix-LN model, auto_map and the code files.

    Works for the stock exports (`LlamaForCausalLM`, `MixtralForCausalLM`, `Qwen2MoeForCausalLM`: nothing extra),
    a `MixLNLlamaForCausalLM` (two code files) and a `MixLNMoeForCausalLM` (four).
    """
    model_type = getattr(model.config, "model_type", None)
    if model_type in _REMOTE_CODE:
        mark_for_remote_code(model.config)
    model.save_pretrained(out_dir, **save_kwargs)
    if model_type in _REMOTE_CODE:
        write_model_code(out_dir, model_type)


__all__ = [
    "AUTO_MAP",
    "CODE_FILES",
    "MOE_AUTO_MAP",
    "MOE_CODE_FILES",
    "config_for_export",
    "export_config_fields",
    "forward_export_fields",
    "is_stock_llama",
    "mark_for_remote_code",
    "moe_config_for_export",
    "moe_export_config_fields",
    "placement_export_fields",
    "stock_moe_model_type",
    "save_hf_folder",
    "write_model_code",
]
