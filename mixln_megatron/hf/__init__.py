"""Hugging Face model code for Mix-LN / LayerNorm-Scaling LLaMA (dense: *_mixln_llama, MoE: *_mixln_moe),
and the helpers that export it (export_code).

The model files are self-contained (transformers only, and each other) because they are copied into exported
folders. Names are imported lazily, so `import mixln_megatron.hf` does not import torch or transformers.
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
    """Register the Mix-LN configs / models with the Auto classes in this process, so that mixln_llama and
    mixln_moe folders load without trust_remote_code where mixln_megatron is installed. Safe to call more than
    once; with transformers < 5 only the dense classes are registered (the MoE model needs 5)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # optional

    from .configuration_mixln_llama import MixLNLlamaConfig  # optional: transformers
    from .modeling_mixln_llama import MixLNLlamaForCausalLM, MixLNLlamaModel  # optional: transformers

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
