"""MoE through Megatron-Bridge: refused in one line, naming the gap and what to use instead.

This package's Bridge support is the Mix-LN Llama bridge. A Mix-LN MoE bridge would need, beyond
it, the router / per-expert / shared-expert (and gate) mappings, the dense-layer pattern
(`mlp_only_layers` <-> --moe-layer-freq), the MoE layers' own pre-MLP norm names per kind, and the
MoE export config; Bridge 0.6.2 has no Qwen2-MoE or Mixtral bridge to build them on (only
Qwen3-MoE's, with QK norms and every layer MoE). Until then an MoE model meets a clear refusal
instead of a half-mapped model:
  - an HF folder of the Mix-LN MoE model code (architecture MixLNMoeForCausalLM, model_type
    "mixln_moe"): a registered bridge whose provider and mappings refuse;
  - a MixLNModelProvider with num_moe_experts: refused when it is finalized (before any build).
`mixln-megatron convert from-hf` / `convert to-hf` carry Mix-LN MoE models between HF and Megatron.
"""

from __future__ import annotations

from ..model.support import MixLNUnsupportedError

MOE_ARCHITECTURE = "MixLNMoeForCausalLM"
MOE_MODEL_TYPE = "mixln_moe"
INSTEAD = ("convert it with `mixln-megatron convert from-hf` (HF -> Megatron torch_dist) or `convert to-hf` "
           "(Megatron -> HF) instead")


class MixLNBridgeMoEError(MixLNUnsupportedError):
    """An MoE model given to this package's Megatron-Bridge support; the message says what to use."""


def moe_refusal(what: str) -> MixLNBridgeMoEError:
    return MixLNBridgeMoEError(f"Megatron-Bridge: {what}, but this package has no Mix-LN MoE bridge (router, "
                               f"expert and shared-expert mappings); {INSTEAD}")


def refuse_moe_provider(provider) -> None:
    """A provider asked to build MoE layers (num_moe_experts) is refused before anything is built."""
    experts = getattr(provider, "num_moe_experts", None)
    if experts:
        raise moe_refusal(f"the provider has num_moe_experts={experts}")
