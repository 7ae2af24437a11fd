"""Hugging Face model code for Mix-LN / LayerNorm-Scaling LLaMA, and the helpers that export it.

  configuration_mixln_llama  MixLNLlamaConfig (model_type "mixln_llama")
  modeling_mixln_llama       MixLNLlamaForCausalLM, MixLNLlamaModel, the pre / post / deepnorm / sandwich layers
  export_code                is_stock_llama, placement_export_fields, config_for_export, write_model_code,
                             save_hf_folder

The two model files are self-contained (transformers only) because they are copied into exported folders.
Names are imported lazily, so `import mixln_megatron.hf` does not import torch or transformers.
"""

import importlib

_EXPORTS = {
    "LAYER_KINDS": "configuration_mixln_llama",
    "MIXLN_SCHEMES": "configuration_mixln_llama",
    "MixLNConfigValueError": "configuration_mixln_llama",
    "MixLNLlamaConfig": "configuration_mixln_llama",
    "MixLNLlamaForCausalLM": "modeling_mixln_llama",
    "MixLNLlamaModel": "modeling_mixln_llama",
    "MixLNLlamaPreTrainedModel": "modeling_mixln_llama",
    "MixLNLlamaPreLNDecoderLayer": "modeling_mixln_llama",
    "MixLNLlamaPostLNDecoderLayer": "modeling_mixln_llama",
    "MixLNLlamaDeepNormDecoderLayer": "modeling_mixln_llama",
    "MixLNLlamaSandwichDecoderLayer": "modeling_mixln_llama",
    "mixln_decoder_layer": "modeling_mixln_llama",
    "AUTO_MAP": "export_code",
    "CODE_FILES": "export_code",
    "config_for_export": "export_code",
    "export_config_fields": "export_code",
    "is_stock_llama": "export_code",
    "placement_export_fields": "export_code",
    "mark_for_remote_code": "export_code",
    "save_hf_folder": "export_code",
    "write_model_code": "export_code",
}


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def register_auto_classes() -> None:
    """Register MixLNLlamaConfig / MixLNLlamaForCausalLM with AutoConfig / AutoModelForCausalLM in this process.

    Lets `AutoModelForCausalLM.from_pretrained(dir)` load a mixln_llama folder without trust_remote_code
    where mixln_megatron is installed. Safe to call more than once.
    """
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from .configuration_mixln_llama import MixLNLlamaConfig
    from .modeling_mixln_llama import MixLNLlamaForCausalLM, MixLNLlamaModel

    AutoConfig.register(MixLNLlamaConfig.model_type, MixLNLlamaConfig, exist_ok=True)
    AutoModel.register(MixLNLlamaConfig, MixLNLlamaModel, exist_ok=True)
    AutoModelForCausalLM.register(MixLNLlamaConfig, MixLNLlamaForCausalLM, exist_ok=True)


__all__ = sorted(_EXPORTS) + ["register_auto_classes"]
