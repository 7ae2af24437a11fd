"""The Megatron-Bridge bridge of `MixLNLlamaForCausalLM` (HF folders with model_type "mixln_llama").

Built on Bridge's Llama bridge (megatron.bridge.models.llama.LlamaBridge in 0.6.2: provider,
RoPE scaling, the embedding / attention / MLP / final-norm mappings) with two additions:
  - the provider is a MixLNModelProvider carrying the layout of the HF config (P, scheme, alpha);
  - the Post-LN layers' norms, which a Llama layer does not have:
        Megatron (both backends)                        HF (the Mix-LN model code)
        decoder.layers.<i>.post_attention_layernorm.*   model.layers.<i>.post_attention_layernorm.*  (N1)
        decoder.layers.<i>.post_mlp_layernorm.*         model.layers.<i>.post_feedforward_layernorm.* (N2)
    Pre-LN layers keep Llama's names (TE: linear_qkv / linear_fc1 .layer_norm_weight; local:
    input_layernorm / pre_mlp_layernorm), so every layout (any P, lns, mixln+lns) is one registry:
    a layer only has the parameters of its kind and each name maps to one HF tensor.
LNS scales norm outputs, never stored weights, so its tensors map like the plain scheme's.
"""

from __future__ import annotations

from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.conversion.param_mapping import AutoMapping
from megatron.bridge.models.llama.llama_bridge import LlamaBridge
from megatron.core.models.gpt.gpt_model import GPTModel

from ..hf.configuration_mixln_llama import MIXLN_SCHEMES
from ..hf.export_code import MIXLN_ARCHITECTURES, export_config_fields
from .provider import MixLNModelProvider

MIXLN_ARCHITECTURE = MIXLN_ARCHITECTURES[0]  # "MixLNLlamaForCausalLM", the auto_map class name
MIXLN_MODEL_TYPE = "mixln_llama"

# Megatron name (inside decoder.layers.<i>.) -> HF name (inside model.layers.<i>.) of the Post-LN norms.
POST_LN_NORMS = {
    "post_attention_layernorm": "post_attention_layernorm",  # N1, after the attention residual add
    "post_mlp_layernorm": "post_feedforward_layernorm",  # N2, after the MLP residual add
}

# The parallel type of this package's own module classes, for AutoMapping: the Post-LN qkv / fc1
# linear of the TE backend (mixln_megatron.model.backends) and the local backend's norm.
MODULE_TYPES = {"MixLNPostLNColumnParallelLinear": "column", "MixLNNorm": "replicated"}


def post_ln_mappings(with_bias: bool = False) -> list:
    """AutoMappings of the Post-LN norms (weights; biases too for LayerNorm)."""
    names = ("weight", "bias") if with_bias else ("weight",)
    return [
        AutoMapping(megatron_param=f"decoder.layers.*.{meg}.{n}", hf_param=f"model.layers.*.{hf}.{n}")
        for meg, hf in POST_LN_NORMS.items()
        for n in names
    ]


def _register_module_types() -> None:
    for name, kind in MODULE_TYPES.items():
        AutoMapping.register_module_type(name, kind)


def _layout_of(hf_config) -> dict:
    """P, scheme and alpha of an HF config, checked the way the HF model code checks them."""
    post_ln = getattr(hf_config, "post_ln_layers", 0)
    scheme = getattr(hf_config, "mixln_scheme", "mixln")
    alpha = getattr(hf_config, "mixln_alpha", None)
    if isinstance(post_ln, bool) or not isinstance(post_ln, int) or not 0 <= post_ln <= hf_config.num_hidden_layers:
        raise ValueError(f"post_ln_layers must be an integer in [0, num_hidden_layers], got {post_ln!r}")
    if scheme not in MIXLN_SCHEMES:
        raise ValueError(f"mixln_scheme must be one of {', '.join(MIXLN_SCHEMES)}; got {scheme!r}")
    kinds = getattr(hf_config, "layer_kinds", None)
    if kinds is not None and list(kinds) != ["post"] * post_ln + ["pre"] * (hf_config.num_hidden_layers - post_ln):
        # Bridge's mappings here cover Mix-LN's first-P layout (two norms per layer); a per-layer
        # layout (deepnorm, sandwich, interleaved Post-LN) converts with `mixln-megatron convert`.
        raise ValueError(
            f"this HF config has a per-layer layout (layer_kinds {kinds!r:.120}) that the Megatron-Bridge path "
            "does not map; convert it with `mixln-megatron convert from-hf` instead")
    return {"post_ln_layers": post_ln, "mixln_scheme": scheme, "mixln_alpha": alpha}


@MegatronModelBridge.register_bridge(
    source=MIXLN_ARCHITECTURE, target=GPTModel, provider=MixLNModelProvider, model_type=MIXLN_MODEL_TYPE
)
class MixLNLlamaBridge(LlamaBridge):
    """Megatron-Bridge bridge for Mix-LN / LNS LLaMA (MixLNLlamaForCausalLM <-> GPTModel).

    Used through AutoBridge (the class is found by config.auto_map["AutoModelForCausalLM"]):
        >>> import mixln_megatron.bridge
        >>> bridge = AutoBridge.from_hf_pretrained(folder, trust_remote_code=True)
        >>> provider = bridge.to_megatron_provider()   # MixLNModelProvider
    """

    def provider_bridge(self, hf_pretrained) -> MixLNModelProvider:
        provider = super().provider_bridge(hf_pretrained)  # Llama's, built as a MixLNModelProvider
        for name, value in _layout_of(hf_pretrained.config).items():
            setattr(provider, name, value)
        return provider

    @classmethod
    def megatron_to_hf_config(cls, provider) -> dict:
        hf_config = super().megatron_to_hf_config(provider)
        hf_config.update(export_config_fields(
            int(getattr(provider, "post_ln_layers", 0)),
            getattr(provider, "mixln_scheme", "mixln"),
            getattr(provider, "mixln_alpha", None),
        ))
        return hf_config

    def mapping_registry(self) -> MegatronMappingRegistry:
        llama = super().mapping_registry()
        return MegatronMappingRegistry(*llama.mappings, *post_ln_mappings())


_register_module_types()
