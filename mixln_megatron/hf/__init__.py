"""Hugging Face model code for Mix-LN / LayerNorm-Scaling LLaMA, and the helpers that export it.

  configuration_mixln_llama  MixLNLlamaConfig (model_type "mixln_llama")
  modeling_mixln_llama       MixLNLlamaForCausalLM, MixLNLlamaModel, the pre / post / deepnorm / sandwich layers
  configuration_mixln_moe    MixLNMoeConfig (model_type "mixln_moe"): the same plus mixture-of-experts fields
  modeling_mixln_moe         MixLNMoeForCausalLM, MixLNMoeModel, MixLNMoeSparseMoeBlock, the four kinds with MoE
  export_code                is_stock_llama, placement_export_fields, config_for_export, write_model_code,
                             save_hf_folder; for MoE models stock_moe_model_type, moe_export_config_fields,
                             moe_config_for_export

The model files are self-contained (transformers only, and each other) because they are copied into exported
folders.
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
    "MixLNMoeConfig": "configuration_mixln_moe",
    "MixLNMoeForCausalLM": "modeling_mixln_moe",
    "MixLNMoeModel": "modeling_mixln_moe",
    "MixLNMoePreTrainedModel": "modeling_mixln_moe",
    "MixLNMoeSparseMoeBlock": "modeling_mixln_moe",
    "MixLNMoePreLNDecoderLayer": "modeling_mixln_moe",
    "MixLNMoePostLNDecoderLayer": "modeling_mixln_moe",
    "MixLNMoeDeepNormDecoderLayer": "modeling_mixln_moe",
    "MixLNMoeSandwichDecoderLayer": "modeling_mixln_moe",
    "mixln_moe_decoder_layer": "modeling_mixln_moe",
    "AUTO_MAP": "export_code",
    "CODE_FILES": "export_code",
    "MOE_AUTO_MAP": "export_code",
    "MOE_CODE_FILES": "export_code",
    "moe_config_for_export": "export_code",
    "moe_export_config_fields": "export_code",
    "stock_moe_model_type": "export_code",
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
    """Register the Mix-LN configs / models (MixLNLlamaConfig, MixLNMoeConfig) with AutoConfig / AutoModel /
    AutoModelForCausalLM in this process.

    Lets `AutoModelForCausalLM.from_pretrained(dir)` load a mixln_llama or mixln_moe folder without
    trust_remote_code where mixln_megatron is installed. Safe to call more than once. The MoE classes need
    transformers >= 5; with an older one only the dense classes are registered.
    """
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from .configuration_mixln_llama import MixLNLlamaConfig
    from .modeling_mixln_llama import MixLNLlamaForCausalLM, MixLNLlamaModel

    pairs = [(MixLNLlamaConfig, MixLNLlamaModel, MixLNLlamaForCausalLM)]
    try:
        from .configuration_mixln_moe import MixLNMoeConfig
        from .modeling_mixln_moe import MixLNMoeForCausalLM, MixLNMoeModel
    except ImportError:  # transformers < 5: no fused experts, no MoE model
        pass
    else:
        pairs.append((MixLNMoeConfig, MixLNMoeModel, MixLNMoeForCausalLM))
    for config_class, base_model, causal_lm in pairs:
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModel.register(config_class, base_model, exist_ok=True)
        AutoModelForCausalLM.register(config_class, causal_lm, exist_ok=True)


__all__ = sorted(_EXPORTS) + ["register_auto_classes"]
