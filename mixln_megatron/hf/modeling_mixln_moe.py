"""Mix-LN / LayerNorm-Scaling mixture-of-experts LLaMA for Hugging Face transformers (>= 5).

The Mix-LN LLaMA of modeling_mixln_llama.py with the MLP of every layer not in `config.mlp_only_layers` replaced
by a mixture of experts; each layer kind puts its norms around the MoE block exactly as around a dense MLP
(a Post-LN layer: y = N(h + MoE(h))). The MoE block (MixLNMoeSparseMoeBlock), for the tokens h:

    p = softmax(h @ gate^T) over the E experts;  S = the k largest;  w_e = p_e / sum_{S} p  (norm_topk_prob)
                                                                     or  w_e = p_e          (otherwise)
    MoE(h) = sum_{e in S} w_e * down_e(silu(gate_e(h)) * up_e(h))
             [ + shared(h) ]                               with a shared expert
             [ * sigmoid(h @ shared_expert_gate^T) on it ] with its gate

Router, experts (fused `gate_up_proj` [E, 2I, H], gate rows first, and `down_proj` [E, H, I]) and shared expert are
transformers' Qwen2-MoE modules; with `config.router_dtype` "float32" the router computes its logits from the fp32
weight and input (MixLNMoeFp32Router), as Megatron's --moe-router-dtype fp32 does. `config.qkv_bias` gives q, k and v
(not o) a bias. On disk the experts are per expert under the hub's names
(`mlp.experts.<e>.gate_proj/up_proj/down_proj.weight`): importing this file registers transformers' own Qwen2-MoE
checkpoint conversion for model_type "mixln_moe", so from_pretrained fuses them and save_pretrained splits them.

This file is copied next to config.json in exported checkpoints (remote code), with the configuration files and
modeling_mixln_llama.py, which it imports relatively; it imports nothing else but `torch` / `transformers`.
"""

import torch
from torch import nn

from .configuration_mixln_moe import MixLNMoeConfig
from .modeling_mixln_llama import (
    MixLNLlamaDeepNormDecoderLayer,
    MixLNLlamaForCausalLM,
    MixLNLlamaModel,
    MixLNLlamaPostLNDecoderLayer,
    MixLNLlamaPreLNDecoderLayer,
    MixLNLlamaPreTrainedModel,
    MixLNLlamaSandwichDecoderLayer,
)

try:  # the fused experts and the checkpoint conversion that splits / merges them came with transformers 5
    from transformers import initialization as hf_init
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts, Qwen2MoeMLP, Qwen2MoeTopKRouter
except ImportError as exc:  # pragma: no cover - depends on the installed transformers
    import transformers

    raise ImportError(
        f"the Mix-LN MoE model needs transformers >= 5 (fused Qwen2-MoE experts); installed: "
        f"{transformers.__version__} ({exc})"
    ) from exc


def _register_expert_conversion() -> None:
    """On load, per-expert files -> fused params; on save, the reverse: Qwen2-MoE's names are the contract's."""
    mapping = get_checkpoint_conversion_mapping("qwen2_moe")
    if not mapping:
        raise ImportError("the installed transformers has no 'qwen2_moe' checkpoint conversion: the Mix-LN MoE "
                          "model needs transformers >= 5")
    register_checkpoint_conversion_mapping(MixLNMoeConfig.model_type, mapping, overwrite=True)


_register_expert_conversion()


class MixLNMoeFp32Router(Qwen2MoeTopKRouter):
    """Qwen2-MoE's top-k router with the logits from the fp32 weight and input: in bf16 near-tied logits round
    together and the top-k picks other experts than the fp32 router the model was trained with. Softmax and
    top-k are fp32 (as in the parent); the weights go back to the input's dtype."""

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        hidden_states = hidden_states.reshape(-1, self.hidden_dim).float()
        router_logits = nn.functional.linear(hidden_states, self.weight.float())
        probs = torch.softmax(router_logits, dim=-1)
        top_value, top_index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        return router_logits, top_value.to(dtype), top_index


def _router(config: MixLNMoeConfig) -> nn.Module:
    """The router of `config.router_dtype`: the model's dtype (Qwen2-MoE's router) or fp32."""
    if getattr(config, "router_dtype", None) == "float32":
        return MixLNMoeFp32Router(config)
    return Qwen2MoeTopKRouter(config)  # softmax, top-k, renormalised iff config.norm_topk_prob


class MixLNMoeSparseMoeBlock(nn.Module):
    """Top-k routed SwiGLU experts plus an optional (optionally gated) shared expert; see the module docstring."""

    def __init__(self, config: MixLNMoeConfig):
        super().__init__()
        self.gate = _router(config)
        self.experts = Qwen2MoeExperts(config)
        if config.shared_expert_intermediate_size is not None:
            self.shared_expert = Qwen2MoeMLP(config, intermediate_size=config.shared_expert_intermediate_size)
            if config.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        _, weights, experts = self.gate(tokens)
        out = self.experts(tokens, experts, weights)
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(tokens)
            if hasattr(self, "shared_expert_gate"):
                shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
            out = out + shared
        return out.reshape(shape)


def _add_qkv_bias(attention: nn.Module) -> None:
    """Give LLaMA's q, k, v projections a bias (o_proj keeps none): Qwen2's qkv_bias."""
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attention, name)
        if old.bias is None:
            setattr(attention, name, nn.Linear(old.in_features, old.out_features, bias=True,
                                               device=old.weight.device, dtype=old.weight.dtype))


class _MoeMLP:
    """Mixin for the Mix-LN layer kinds: the MoE block in place of LLaMA's MLP on MoE layers."""

    def __init__(self, config: MixLNMoeConfig, layer_idx: int):
        # The kind's own init runs unchanged (it builds LLaMA's dense MLP, dropped here on MoE layers; from_pretrained
        # builds on the meta device, so that costs no memory there).
        super().__init__(config, layer_idx)
        if config.is_moe_layer(layer_idx):
            self.mlp = MixLNMoeSparseMoeBlock(config)
        if getattr(config, "qkv_bias", False):
            _add_qkv_bias(self.self_attn)


class MixLNMoePreLNDecoderLayer(_MoeMLP, MixLNLlamaPreLNDecoderLayer):
    """The "pre" kind (LLaMA, optional LNS scale) with the MoE block on MoE layers."""


class MixLNMoePostLNDecoderLayer(_MoeMLP, MixLNLlamaPostLNDecoderLayer):
    """The "post" kind with the MoE block on MoE layers."""


class MixLNMoeDeepNormDecoderLayer(_MoeMLP, MixLNLlamaDeepNormDecoderLayer):
    """The "deepnorm" kind with the MoE block on MoE layers."""


class MixLNMoeSandwichDecoderLayer(_MoeMLP, MixLNLlamaSandwichDecoderLayer):
    """The "sandwich" kind with the MoE block on MoE layers."""


MOE_DECODER_LAYER_CLASSES = {
    "pre": MixLNMoePreLNDecoderLayer,
    "post": MixLNMoePostLNDecoderLayer,
    "deepnorm": MixLNMoeDeepNormDecoderLayer,
    "sandwich": MixLNMoeSandwichDecoderLayer,
}


def mixln_moe_decoder_layer(config: MixLNMoeConfig, layer_idx: int) -> nn.Module:
    """The decoder layer for 0-based `layer_idx`: its kind's class, MoE or dense as `config.is_moe_layer` says."""
    return MOE_DECODER_LAYER_CLASSES[config.layer_kind(layer_idx)](config, layer_idx)


class MixLNMoePreTrainedModel(MixLNLlamaPreTrainedModel):
    config_class = MixLNMoeConfig
    config: MixLNMoeConfig
    _no_split_modules = [cls.__name__ for cls in MOE_DECODER_LAYER_CLASSES.values()]

    def _init_weights(self, module):
        # LLaMA's init, plus what Qwen2-MoE does for the parameters LLaMA's does not know: normal(0, std).
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, Qwen2MoeExperts):
            hf_init.normal_(module.gate_up_proj, mean=0.0, std=std)
            hf_init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, Qwen2MoeTopKRouter):
            hf_init.normal_(module.weight, mean=0.0, std=std)


class MixLNMoeModel(MixLNMoePreTrainedModel, MixLNLlamaModel):
    """MixLNLlamaModel (LLaMA's forward, masks, cache, rotary, final norm) with the MoE layer classes."""

    decoder_layer_classes = MOE_DECODER_LAYER_CLASSES

    def __init__(self, config: MixLNMoeConfig):
        if not callable(getattr(config, "is_moe_layer", None)):
            raise TypeError(f"MixLNMoeModel needs a MixLNMoeConfig, got {type(config).__name__}")
        super().__init__(config)


class MixLNMoeForCausalLM(MixLNMoePreTrainedModel, MixLNLlamaForCausalLM):
    """LlamaForCausalLM around a MixLNMoeModel; forward, loss, generate() and weight tying are LLaMA's."""

    base_model_class = MixLNMoeModel


__all__ = [
    "MOE_DECODER_LAYER_CLASSES",
    "MixLNMoeDeepNormDecoderLayer",
    "MixLNMoeForCausalLM",
    "MixLNMoeModel",
    "MixLNMoePostLNDecoderLayer",
    "MixLNMoePreLNDecoderLayer",
    "MixLNMoePreTrainedModel",
    "MixLNMoeSandwichDecoderLayer",
    "MixLNMoeSparseMoeBlock",
    "mixln_moe_decoder_layer",
]
