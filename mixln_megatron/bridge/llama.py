"""The Megatron-Bridge bridge of `MixLNLlamaForCausalLM` (HF folders with model_type "mixln_llama").

Built on Bridge's Llama bridge (megatron.bridge.models.llama.LlamaBridge in 0.6.2: provider,
RoPE scaling, the embedding / attention / MLP / final-norm mappings) with two additions: the
provider is a MixLNModelProvider carrying the HF config's layout, and the norms a Llama layer does
not have are mapped (POST_LN_NORMS, SANDWICH_OUTPUT_NORMS; HF names are convert.mapping's).
A layer only has the parameters of its kind and each name maps to one HF tensor, so every first-P
layout is one registry. The one name whose HF name depends on the kind is the MLP pre-norm
(post_attention_layernorm in a Pre-LN layer, pre_feedforward_layernorm in a sandwich layer, whose
post_attention_layernorm is Gemma 2's norm after attention): with sandwich layers it is mapped
layer by layer. LNS scales norm outputs, never stored weights, so its tensors map like the plain
scheme's.
"""

from __future__ import annotations

from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.conversion.param_mapping import AutoMapping
from megatron.bridge.models.llama.llama_bridge import LlamaBridge
from megatron.core.models.gpt.gpt_model import GPTModel

from ..convert.mapping import NORM_A, NORM_B, NORM_C, NORM_D, hf_norm_module
from ..convert.shape import config_problem
from ..errors import MixLNError
from ..hf.configuration_mixln_llama import FORWARD_SCALAR_DEFAULTS as FORWARD_FIELDS  # refused by this path
from ..hf.configuration_mixln_llama import mixln_fields
from ..hf.export_code import MIXLN_ARCHITECTURES, export_config_fields
from ..model import support
from ..model.placement import resolve_placement
from ..model.layout import KINDS, POST, POST_LN_KINDS, SANDWICH, first_p_kinds, layout_text, leading_post_count
from .conversion_tasks import build_tasks
from .provider import MixLNModelProvider, mixln_settings

MIXLN_ARCHITECTURE = MIXLN_ARCHITECTURES[0]  # "MixLNLlamaForCausalLM", the auto_map class name
MIXLN_MODEL_TYPE = "mixln_llama"

# Megatron name (inside decoder.layers.<i>.) -> HF name (inside model.layers.<i>.) of the Post-LN
# norms; the HF names are convert.mapping's (a deepnorm layer's are the same).
POST_LN_NORMS = {
    "post_attention_layernorm": hf_norm_module(POST, NORM_B),  # N1, after the attention residual add
    "post_mlp_layernorm": hf_norm_module(POST, NORM_A),  # N2, after the MLP residual add
}

# A sandwich layer's output norms: Megatron name -> HF name (model.layout; Gemma 2's names).
SANDWICH_OUTPUT_NORMS = {
    "attn_output_layernorm": hf_norm_module(SANDWICH, NORM_C),  # N_b, on the attention output
    "mlp_output_layernorm": hf_norm_module(SANDWICH, NORM_D),  # N_d, on the MLP output
}
# The MLP pre-norm of a Pre-LN-kind layer (TE: fused into fc1; local) and its HF name by kind:
# post_attention_layernorm in a pre layer, pre_feedforward_layernorm in a sandwich layer.
MLP_PRE_NORM_HF = {kind: hf_norm_module(kind, NORM_B) for kind in KINDS if kind not in POST_LN_KINDS}
MLP_PRE_NORMS = ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")

# The parallel type of this package's own module classes, for AutoMapping: the Post-LN qkv / fc1
# linear of the TE backend (mixln_megatron.model.backends) and the local backend's norm.
MODULE_TYPES = {"MixLNPostLNColumnParallelLinear": "column", "MixLNNorm": "replicated"}


class MixLNBridgeError(MixLNError, ValueError):
    """A provider (or folder) whose settings a Mix-LN bridge's HF config or mappings cannot carry
    exactly; the message names the setting and what to do."""


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


def _kinds_of(hf_config) -> list:
    """Every layer's kind of an HF config (layer_kinds, or Mix-LN's first P)."""
    kinds = getattr(hf_config, "layer_kinds", None)
    if kinds is not None:
        return list(kinds)
    return list(first_p_kinds(hf_config.num_hidden_layers, getattr(hf_config, "post_ln_layers", 0)))


def _layout_of(hf_config) -> dict:
    """The provider fields of an HF config (P, scheme, alpha; a per-layer layout and DeepNorm's
    constants), checked the way the HF model code checks them."""
    read = mixln_fields(lambda name, default: getattr(hf_config, name, default), hf_config.num_hidden_layers)
    kinds = read["layer_kinds"]
    fields = {"post_ln_layers": read["post_ln_layers"], "mixln_scheme": read["mixln_scheme"],
              "mixln_alpha": read["mixln_alpha"], "mixln_layout": None, "mixln_deepnorm_alpha": None,
              "mixln_deepnorm_beta": None}
    if kinds is not None and leading_post_count(kinds) is None:  # a first-P layer_kinds says no more than P
        fields.update(mixln_layout=layout_text(kinds), mixln_deepnorm_alpha=read["deepnorm_alpha"],
                      mixln_deepnorm_beta=read["deepnorm_beta"])
    return fields


def layout_mappings(kinds) -> tuple:
    """(Llama mappings to drop, mappings to add) for a layout with sandwich layers: the MLP
    pre-norm layer by layer, and the sandwich output norms."""
    if "sandwich" not in kinds:
        return (), []
    dropped = tuple(f"decoder.layers.*.{name}" for name in MLP_PRE_NORMS)
    per_layer = [AutoMapping(megatron_param=f"decoder.layers.{i}.{name}",
                             hf_param=f"model.layers.{i}.{MLP_PRE_NORM_HF[kind]}.weight")
                 for i, kind in enumerate(kinds) if kind in MLP_PRE_NORM_HF for name in MLP_PRE_NORMS]
    outputs = [AutoMapping(megatron_param=f"decoder.layers.*.{meg}.weight", hf_param=f"model.layers.*.{hf}.weight")
               for meg, hf in SANDWICH_OUTPUT_NORMS.items()]
    return dropped, per_layer + outputs


@MegatronModelBridge.register_bridge(
    source=MIXLN_ARCHITECTURE, target=GPTModel, provider=MixLNModelProvider, model_type=MIXLN_MODEL_TYPE
)
class MixLNLlamaBridge(LlamaBridge):
    """Megatron-Bridge bridge for Mix-LN / LNS LLaMA (MixLNLlamaForCausalLM <-> GPTModel), used through
    AutoBridge (found by config.auto_map["AutoModelForCausalLM"]). It maps no bias (Bridge's Llama mappings
    are weights only): see check_provider_biases."""

    # What check_provider_biases says and raises (the MoE bridge has its own).
    NO_BIAS = "the Mix-LN Llama bridge maps no bias (on q, k, v, o_proj or the MLP)"
    QKV_BIAS_FIELD = None  # the HF config field of a q/k/v-only bias; None: the config has none
    BRIDGE_ERROR = MixLNBridgeError

    @classmethod
    def check_provider_biases(cls, provider) -> None:
        """Refuse, in one line naming the megatron flag, a provider with biases this bridge's HF
        model cannot carry: add_bias_linear (biases on qkv, proj, fc1, fc2: none is mapped), and
        add_qkv_bias unless the HF config has a q/k/v-only bias field (QKV_BIAS_FIELD). Bridge's
        generic config mapping would write add_qkv_bias as LLaMA's attention_bias, a bias on
        o_proj too, so the HF model would be another one."""
        if getattr(provider, "add_bias_linear", False):
            raise cls.BRIDGE_ERROR(
                f"add_bias_linear (megatron's default, off with --disable-bias-linear): {cls.NO_BIAS}; use a "
                "model without them" + (" (add_qkv_bias / --add-qkv-bias for a bias on q, k, v only)"
                                        if cls.QKV_BIAS_FIELD else ""))
        if getattr(provider, "add_qkv_bias", False) and not cls.QKV_BIAS_FIELD:
            raise cls.BRIDGE_ERROR(
                "add_qkv_bias (--add-qkv-bias): a bias on q, k and v only, which the Mix-LN Llama model cannot "
                "hold (LLaMA's attention_bias puts one on o_proj too); use a model without --add-qkv-bias")

    @classmethod
    def check_forward_scalars(cls, config) -> None:
        """Refuse, in one line, muP / a softmax scale / a GLU offset (convert.shape's forward scalars) and
        the export's other refusals: the Bridge's config mapping would drop them, and the HF model
        would be another one."""
        problem = config_problem(config)
        if problem:
            raise cls.BRIDGE_ERROR(problem)
        # and every other setting the export cannot carry (model.config_fields' refused rows), as
        # `convert to-hf` refuses them: Bridge's generic config mapping would drop them silently
        support.check(config, support.CONVERT, error=cls.BRIDGE_ERROR)

    def provider_bridge(self, hf_pretrained) -> MixLNModelProvider:
        forward = {k: getattr(hf_pretrained.config, k, None) for k in FORWARD_FIELDS}
        if any(forward[k] not in (None, default) for k, default in FORWARD_FIELDS.items()):
            shown = ", ".join(f"{k}={v!r}" for k, v in forward.items() if v not in (None, FORWARD_FIELDS[k]))
            raise self.BRIDGE_ERROR(f"{shown}: the Megatron-Bridge path does not carry them; import with "
                                    "`mixln-megatron convert from-hf`, which does")
        provider = super().provider_bridge(hf_pretrained)  # Llama's, built as a MixLNModelProvider
        for name, value in _layout_of(hf_pretrained.config).items():
            setattr(provider, name, value)
        return provider

    @classmethod
    def megatron_to_hf_config(cls, provider) -> dict:
        cls.check_provider_biases(provider)
        cls.check_forward_scalars(provider)
        hf_config = super().megatron_to_hf_config(provider)
        # Bridge writes add_qkv_bias / add_bias_linear as LLaMA's attention_bias / mlp_bias; neither
        # is carried (a q/k/v-only bias is the MoE config's qkv_bias)
        hf_config.update(attention_bias=False, mlp_bias=False)
        layout = {}
        if getattr(provider, "mixln_layout", None) is not None:
            placement = resolve_placement(int(provider.num_layers), mixln_settings(provider))
            layout = dict(layer_kinds=list(placement.kinds), deepnorm_alpha=placement.deepnorm_alpha,
                          deepnorm_beta=placement.deepnorm_beta)
        hf_config.update(export_config_fields(
            int(getattr(provider, "post_ln_layers", 0)),
            getattr(provider, "mixln_scheme", "mixln"),
            getattr(provider, "mixln_alpha", None),
            **layout,
        ))
        return hf_config

    def mapping_registry(self) -> MegatronMappingRegistry:
        llama = super().mapping_registry()
        # self.hf_config: set by Bridge before it asks for the registry (None: a first-P layout)
        dropped, added = layout_mappings(_kinds_of(self.hf_config) if self.hf_config is not None else [])
        kept = [m for m in llama.mappings if getattr(m, "megatron_param", None) not in dropped]
        return MegatronMappingRegistry(*kept, *post_ln_mappings(), *added)

    def stream_weights_megatron_to_hf(self, megatron_model, *args, **kwargs):
        """Bridge's export (export_hf_weights, save_hf_pretrained), after check_provider_biases on
        the model's config: a bias no mapping carries is refused naming its flag."""
        from megatron.bridge.models.conversion.utils import unwrap_model
        from megatron.core.utils import get_model_config

        models = unwrap_model(megatron_model if isinstance(megatron_model, list) else [megatron_model])
        self.check_provider_biases(get_model_config(models[0]))
        self.check_forward_scalars(get_model_config(models[0]))
        return super().stream_weights_megatron_to_hf(megatron_model, *args, **kwargs)

    # Bridge's task builders, corrected (conversion_tasks): tied embeddings keep the sandwich output
    # norms, and a parameter no task writes is refused instead of left at its initial value.
    def build_conversion_tasks(self, hf_pretrained, megatron_model, *args, **kwargs):
        return build_tasks(self, super().build_conversion_tasks, hf_pretrained, megatron_model, *args, **kwargs)

    def build_export_fp8_tasks(self, hf_pretrained, megatron_model, *args, **kwargs):
        return build_tasks(self, super().build_export_fp8_tasks, hf_pretrained, megatron_model, *args, **kwargs)


_register_module_types()
