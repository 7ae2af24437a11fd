"""The Megatron-Bridge bridge of `MixLNMoeForCausalLM` (HF folders with model_type "mixln_moe").

The Mix-LN Llama bridge (bridge.llama: provider, layout, every norm of every kind, which an MoE
layer names as a dense one does) plus the MoE MLP (moe_mappings), in the hub's per-expert names the
folders hold on disk (transformers fuses them on load, Bridge reads the files), the q/k/v-only bias,
and the routing in the provider (moe_provider_fields / hf_moe_fields); any other routing
(model.moe_fields.TABLE, the Bridge column) and LLaMA's attention_bias / mlp_bias are refused in one
line. How the experts run (dispatcher, grouped GEMM) is megatron's default; on GPUs set the
provider's moe_token_dispatcher_type / moe_grouped_gemm as for any Megatron MoE model.
"""

from __future__ import annotations

from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping, QKVMapping
from megatron.core.models.gpt.gpt_model import GPTModel

from ..hf.export_code import export_config_fields, moe_export_config_fields
from ..model import moe_fields
from .llama import MixLNBridgeError, MixLNLlamaBridge
from .provider import MixLNModelProvider

MOE_ARCHITECTURE = "MixLNMoeForCausalLM"
MOE_MODEL_TYPE = "mixln_moe"

_MEG, _HF = "decoder.layers.*.mlp.", "model.layers.*.mlp."


def moe_mappings() -> list:
    """The MoE MLP's mappings (every MoE layer; a dense layer has none of these parameters)."""
    experts = []
    for fc1, fc2 in (("experts.local_experts.*.linear_fc1.weight", "experts.local_experts.*.linear_fc2.weight"),
                     ("experts.linear_fc1.weight*", "experts.linear_fc2.weight*")):  # sequential, TE grouped
        experts += [GatedMLPMapping(megatron_param=_MEG + fc1, gate=_HF + "experts.*.gate_proj.weight",
                                    up=_HF + "experts.*.up_proj.weight"),
                    AutoMapping(megatron_param=_MEG + fc2, hf_param=_HF + "experts.*.down_proj.weight")]
    return [
        AutoMapping(megatron_param=_MEG + "router.weight", hf_param=_HF + "gate.weight"),
        *experts,
        GatedMLPMapping(megatron_param=_MEG + "shared_experts.linear_fc1.weight",
                        gate=_HF + "shared_expert.gate_proj.weight", up=_HF + "shared_expert.up_proj.weight"),
        AutoMapping(megatron_param=_MEG + "shared_experts.linear_fc2.weight", hf_param=_HF + "shared_expert.down_proj.weight"),
        AutoMapping(megatron_param=_MEG + "shared_experts.gate_weight", hf_param=_HF + "shared_expert_gate.weight"),
    ]


def qkv_bias_mapping() -> QKVMapping:
    """The q/k/v-only bias (HF qkv_bias, megatron add_qkv_bias): megatron's one interleaved linear_qkv
    bias <-> HF's q_proj / k_proj / v_proj biases, interleaved as the weight's rows are."""
    return QKVMapping(megatron_param="decoder.layers.*.self_attention.linear_qkv.bias",
                      q="model.layers.*.self_attn.q_proj.bias", k="model.layers.*.self_attn.k_proj.bias",
                      v="model.layers.*.self_attn.v_proj.bias")


class MoEBridgeError(MixLNBridgeError):
    """A provider (or folder) whose MoE routing or biases the Mix-LN MoE HF config cannot describe; the
    message names the setting."""


def check_provider_routing(provider) -> None:
    """Refuse, in one line naming each setting, a provider whose routing differs from what
    hf_moe_fields writes (model.moe_fields.TABLE: refused rows, and carried ones the Bridge
    export does not write), rather than export a config that describes another routing."""
    problems = moe_fields.bridge_problems(provider)
    if problems:
        raise MoEBridgeError("this provider's MoE routing cannot be exported by the Mix-LN MoE bridge: "
                             + "; ".join(problems) + "; use megatron's default routing or export with "
                             "`mixln-megatron convert to-hf` from a Megatron-LM checkpoint")


def moe_provider_fields(hf_config) -> dict:
    """The provider's MoE fields of a (validated) MixLNMoeConfig, and its biases: q/k/v's only
    (qkv_bias), LLaMA's attention_bias / mlp_bias refused (this bridge maps no o_proj or MLP bias)."""
    dense = set(hf_config.mlp_only_layers or ())
    biases = [name for name in ("attention_bias", "mlp_bias") if getattr(hf_config, name, False)]
    if biases:
        raise MoEBridgeError(f"{' and '.join(biases)} true: the Mix-LN MoE bridge carries a bias on q, k and v only "
                             "(qkv_bias), none on o_proj or the MLPs; convert a model without them")
    router_dtype = getattr(hf_config, "router_dtype", None)
    if router_dtype is not None and router_dtype not in moe_fields.MEGATRON_ROUTER_DTYPE:  # the config class refuses it first
        raise MoEBridgeError(f"router_dtype {router_dtype!r:.20}: the Mix-LN MoE bridge carries null or "
                             f"{', '.join(map(repr, moe_fields.MEGATRON_ROUTER_DTYPE))}; export the model with one of them")
    return dict(
        num_moe_experts=int(hf_config.num_experts), moe_router_topk=int(hf_config.num_experts_per_tok),
        moe_ffn_hidden_size=int(hf_config.moe_intermediate_size),
        moe_layer_freq=[0 if i in dense else 1 for i in range(hf_config.num_hidden_layers)],
        moe_shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size,
        moe_shared_expert_gate=bool(hf_config.shared_expert_gate),
        moe_router_pre_softmax=not hf_config.norm_topk_prob,  # softmax, top-k, no renormalisation
        moe_router_score_function="softmax", moe_router_topk_scaling_factor=None,
        moe_router_dtype=moe_fields.MEGATRON_ROUTER_DTYPE.get(router_dtype),  # None: the model's dtype
        add_qkv_bias=bool(getattr(hf_config, "qkv_bias", False)), add_bias_linear=False,
        moe_aux_loss_coeff=0.0,  # training-only; an inference-equal model (set it to train with it)
    )


def hf_moe_fields(provider) -> dict:
    """moe_export_config_fields' MoE keyword arguments of a provider (the inverse of moe_provider_fields);
    a routing they would not describe is refused (check_provider_routing), and biases they would not
    (add_bias_linear) by MixLNMoeBridge.check_provider_biases, which megatron_to_hf_config runs first."""
    check_provider_routing(provider)
    router_dtype = moe_fields.HF_ROUTER_DTYPE.get(getattr(provider, "moe_router_dtype", None))
    freq = provider.moe_layer_freq
    pattern = [bool(v) for v in freq] if isinstance(freq, (list, tuple)) else \
        [i % int(freq) == 0 for i in range(int(provider.num_layers))]
    return dict(num_experts=int(provider.num_moe_experts), num_experts_per_tok=int(provider.moe_router_topk),
                moe_intermediate_size=int(provider.moe_ffn_hidden_size),
                norm_topk_prob=not provider.moe_router_pre_softmax,
                shared_expert_intermediate_size=provider.moe_shared_expert_intermediate_size,
                shared_expert_gate=bool(provider.moe_shared_expert_gate),
                mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
                num_hidden_layers=int(provider.num_layers), router_dtype=router_dtype,
                qkv_bias=bool(getattr(provider, "add_qkv_bias", False)))


@MegatronModelBridge.register_bridge(
    source=MOE_ARCHITECTURE, target=GPTModel, provider=MixLNModelProvider, model_type=MOE_MODEL_TYPE
)
class MixLNMoeBridge(MixLNLlamaBridge):
    """Megatron-Bridge bridge for Mix-LN MoE models (MixLNMoeForCausalLM <-> GPTModel with MoE layers)."""

    # check_provider_biases (the dense bridge's): add_qkv_bias is carried as qkv_bias
    NO_BIAS = "the Mix-LN MoE model has no bias on o_proj, the MLPs or the experts"
    QKV_BIAS_FIELD = "qkv_bias"
    BRIDGE_ERROR = MoEBridgeError

    def provider_bridge(self, hf_pretrained) -> MixLNModelProvider:
        provider = super().provider_bridge(hf_pretrained)  # Llama's fields and the Mix-LN layout
        for name, value in moe_provider_fields(hf_pretrained.config).items():
            setattr(provider, name, value)
        return provider

    @classmethod
    def megatron_to_hf_config(cls, provider) -> dict:
        # Llama's and the Mix-LN fields, biases checked (no attention_bias / mlp_bias: add_qkv_bias is qkv_bias)
        hf_config = super().megatron_to_hf_config(provider)
        dense_keys = export_config_fields(int(getattr(provider, "post_ln_layers", 0)),
                                          getattr(provider, "mixln_scheme", "mixln"))
        for key in ("model_type", "architectures", "auto_map"):  # the dense class keys give way to the MoE ones
            if key in dense_keys:
                hf_config.pop(key, None)
        layout = {k: hf_config.get(k) for k in ("layer_kinds", "deepnorm_alpha", "deepnorm_beta")}
        hf_config.update(moe_export_config_fields(
            int(getattr(provider, "post_ln_layers", 0)), getattr(provider, "mixln_scheme", "mixln"),
            getattr(provider, "mixln_alpha", None), **layout, **hf_moe_fields(provider)))
        return hf_config

    def mapping_registry(self) -> MegatronMappingRegistry:
        return MegatronMappingRegistry(*super().mapping_registry().mappings, *moe_mappings(), qkv_bias_mapping())
