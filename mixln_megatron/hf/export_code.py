"""Helpers that make an exported Hugging Face folder self-contained.

A Mix-LN / LNS model is saved with `model_type = "mixln_llama"`, an `auto_map` pointing at the two code
files copied next to config.json, and loads with
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` on a machine without mixln_megatron.
A model whose layers are all "pre" (P = 0, no layer_kinds or all of them "pre") with scheme "mixln" is exactly
LLaMA and is exported as a stock `LlamaForCausalLM` (model_type "llama", no auto_map, no code files).

Per-layer kinds (issue 29): a placement is written as `layer_kinds` (+ `deepnorm_alpha` / `deepnorm_beta`) only
when it is not Mix-LN's own "first P layers post, the rest pre" layout, so those configs stay as they were.
`placement_export_fields(placement)` turns mixln_megatron's Placement into the keyword arguments of
`is_stock_llama`, `export_config_fields` and `config_for_export`.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Dict, List, Optional

CODE_FILES = ("configuration_mixln_llama.py", "modeling_mixln_llama.py")

# AutoModel (the base model) is what the Transformers backend of vLLM and SGLang
# (`--model-impl transformers`) instantiates; the causal-LM head is theirs there.
AUTO_MAP = {
    "AutoConfig": "configuration_mixln_llama.MixLNLlamaConfig",
    "AutoModel": "modeling_mixln_llama.MixLNLlamaModel",
    "AutoModelForCausalLM": "modeling_mixln_llama.MixLNLlamaForCausalLM",
}
MIXLN_ARCHITECTURES = ["MixLNLlamaForCausalLM"]
LLAMA_ARCHITECTURES = ["LlamaForCausalLM"]

# Keys of a config dict that describe the class rather than the network; never forwarded as kwargs.
_CLASS_KEYS = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")


def _first_p(layer_kinds) -> bool:
    """Mix-LN's own layout: some "post" layers, then only "pre" layers."""
    kinds = list(layer_kinds)
    p = 0
    while p < len(kinds) and kinds[p] == "post":
        p += 1
    return all(k == "pre" for k in kinds[p:])


def is_stock_llama(post_ln_layers: int, mixln_scheme: str, layer_kinds=None) -> bool:
    """True when the network is exactly LLaMA (every layer "pre", no scaling): export as LlamaForCausalLM.

    Pass `layer_kinds` whenever the placement has them: a layout of "sandwich" layers has P = 0 too.
    """
    return (int(post_ln_layers) == 0 and mixln_scheme == "mixln"
            and (layer_kinds is None or all(k == "pre" for k in layer_kinds)))


def placement_export_fields(placement) -> Dict[str, Any]:
    """The Mix-LN keyword arguments of a mixln_megatron Placement (model/placement.py), for
    `is_stock_llama(**f)`, `export_config_fields(**f)` and `config_for_export(**f, **llama_kwargs)`.

    layer_kinds is given only when the placement is not Mix-LN's first-P layout (`Placement.is_first_p`), so
    first-P exports keep their config.json; deepnorm_alpha / deepnorm_beta are the placement's (None without
    a deepnorm layer).
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
                         deepnorm_alpha: Optional[float] = None, deepnorm_beta: Optional[float] = None
                         ) -> Dict[str, Any]:
    """The config.json keys that select the architecture, for writers that build the JSON dict themselves.

    Stock:  {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    Mix-LN: {"model_type": "mixln_llama", "architectures": ["MixLNLlamaForCausalLM"], "auto_map": {...},
             "post_ln_layers": P, "mixln_scheme": scheme, "mixln_alpha": alpha}
    plus, for a layout other than Mix-LN's first P (layer_kinds given and not "post"* "pre"*):
             "layer_kinds": [...], and "deepnorm_alpha" / "deepnorm_beta" when a layer is deepnorm.
    All fields are validated as MixLNLlamaConfig does (MixLNConfigValueError, a ValueError).
    """
    from .configuration_mixln_llama import _check_mixln_fields

    num_layers = None if layer_kinds is None or isinstance(layer_kinds, str) else len(layer_kinds)
    _check_mixln_fields(post_ln_layers, mixln_scheme, num_layers, layer_kinds, deepnorm_alpha, deepnorm_beta)
    if layer_kinds is not None and _first_p(layer_kinds):
        layer_kinds = None  # P alone says it (validated: P counts the post layers); deepnorm fields are None
    if is_stock_llama(post_ln_layers, mixln_scheme, layer_kinds):
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
    return fields


def config_for_export(post_ln_layers: int, mixln_scheme: str, mixln_alpha: Optional[str] = None, layer_kinds=None,
                      deepnorm_alpha: Optional[float] = None, deepnorm_beta: Optional[float] = None, **llama_kwargs):
    """The config to save: a `LlamaConfig` when stock, else a `MixLNLlamaConfig` with auto_map and architectures.

    `llama_kwargs` are LlamaConfig arguments (hidden_size, num_hidden_layers, rope_theta / rope_parameters,
    tie_word_embeddings, ...); a `LlamaConfig.to_dict()` may be passed as is: its class-describing keys
    (model_type, architectures, auto_map, transformers_version, _name_or_path) are dropped. The Mix-LN fields
    (post_ln_layers ... deepnorm_beta) are the arguments, as `placement_export_fields(placement)` gives them.
    """
    from transformers import LlamaConfig

    from .configuration_mixln_llama import MixLNLlamaConfig

    kwargs = {k: v for k, v in llama_kwargs.items() if k not in _CLASS_KEYS}
    fields = export_config_fields(post_ln_layers, mixln_scheme, mixln_alpha, layer_kinds, deepnorm_alpha,
                                  deepnorm_beta)
    cls = LlamaConfig if fields["model_type"] == "llama" else MixLNLlamaConfig
    config = cls(**kwargs, **{k: v for k, v in fields.items() if k not in _CLASS_KEYS})
    for key in ("architectures", "auto_map"):
        if key in fields:
            setattr(config, key, fields[key])
    return config


def mark_for_remote_code(config) -> None:
    """Set `auto_map` and `architectures` on an existing MixLNLlamaConfig (in place)."""
    if getattr(config, "model_type", None) != "mixln_llama":
        raise ValueError(f"expected a MixLNLlamaConfig (model_type 'mixln_llama'), got model_type {config.model_type!r}")
    config.auto_map = dict(AUTO_MAP)
    config.architectures = list(MIXLN_ARCHITECTURES)


def write_model_code(out_dir: str | os.PathLike) -> List[str]:
    """Copy the configuration and modeling files into the HF folder `out_dir`; return the written paths.

    The files import only `torch`/`transformers` (and each other, relatively), so the folder loads with
    trust_remote_code=True where mixln_megatron is not installed.
    """
    os.makedirs(out_dir, exist_ok=True)
    here = os.path.dirname(os.path.abspath(__file__))
    written = []
    for name in CODE_FILES:
        dst = os.path.join(os.fspath(out_dir), name)
        shutil.copyfile(os.path.join(here, name), dst)
        written.append(dst)
    return written


def save_hf_folder(model, out_dir: str | os.PathLike, **save_kwargs) -> None:
    """`model.save_pretrained(out_dir)` plus, for a Mix-LN model, auto_map and the code files.

    Works for a `LlamaForCausalLM` (stock export: nothing extra) and a `MixLNLlamaForCausalLM`.
    """
    config = model.config
    if getattr(config, "model_type", None) == "mixln_llama":
        mark_for_remote_code(config)
        model.save_pretrained(out_dir, **save_kwargs)
        write_model_code(out_dir)
    else:
        model.save_pretrained(out_dir, **save_kwargs)


__all__ = [
    "AUTO_MAP",
    "CODE_FILES",
    "config_for_export",
    "export_config_fields",
    "is_stock_llama",
    "mark_for_remote_code",
    "placement_export_fields",
    "save_hf_folder",
    "write_model_code",
]
