"""Helpers that make an exported Hugging Face folder self-contained.

A Mix-LN / LNS model is saved with `model_type = "mixln_llama"`, an `auto_map` pointing at the two code
files copied next to config.json, and loads with
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` on a machine without mixln_megatron.
A model with P = 0 and scheme "mixln" is exactly LLaMA and is exported as a stock `LlamaForCausalLM`
(model_type "llama", no auto_map, no code files).
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


def is_stock_llama(post_ln_layers: int, mixln_scheme: str) -> bool:
    """True when the network is exactly LLaMA (no Post-LN layers, no scaling): export as LlamaForCausalLM."""
    return int(post_ln_layers) == 0 and mixln_scheme == "mixln"


def export_config_fields(post_ln_layers: int, mixln_scheme: str, mixln_alpha: Optional[str] = None) -> Dict[str, Any]:
    """The config.json keys that select the architecture, for writers that build the JSON dict themselves.

    Stock:  {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    Mix-LN: {"model_type": "mixln_llama", "architectures": ["MixLNLlamaForCausalLM"], "auto_map": {...},
             "post_ln_layers": P, "mixln_scheme": scheme, "mixln_alpha": alpha}
    """
    from .configuration_mixln_llama import _check_mixln_fields

    _check_mixln_fields(post_ln_layers, mixln_scheme, None)
    if is_stock_llama(post_ln_layers, mixln_scheme):
        return {"model_type": "llama", "architectures": list(LLAMA_ARCHITECTURES)}
    return {
        "model_type": "mixln_llama",
        "architectures": list(MIXLN_ARCHITECTURES),
        "auto_map": dict(AUTO_MAP),
        "post_ln_layers": post_ln_layers,
        "mixln_scheme": mixln_scheme,
        "mixln_alpha": mixln_alpha,
    }


def config_for_export(post_ln_layers: int, mixln_scheme: str, mixln_alpha: Optional[str] = None, **llama_kwargs):
    """The config to save: a `LlamaConfig` when stock, else a `MixLNLlamaConfig` with auto_map and architectures.

    `llama_kwargs` are LlamaConfig arguments (hidden_size, num_hidden_layers, rope_theta / rope_parameters,
    tie_word_embeddings, ...); a `LlamaConfig.to_dict()` may be passed as is: its class-describing keys
    (model_type, architectures, auto_map, transformers_version, _name_or_path) are dropped.
    """
    from transformers import LlamaConfig

    from .configuration_mixln_llama import MixLNLlamaConfig

    kwargs = {k: v for k, v in llama_kwargs.items() if k not in _CLASS_KEYS}
    fields = export_config_fields(post_ln_layers, mixln_scheme, mixln_alpha)
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
    "save_hf_folder",
    "write_model_code",
]
