"""Mix-LN on megatron's HybridModel: the stack and the two layer kinds of a `*-*-...` pattern.

A `*` layer is a MixLNTransformerLayer with attention only, a `-` layer one with the MLP only (an
`E` layer: megatron's MoE MLP); block k's two layers 2k-1, 2k are the GPT layer k split at its
two residual steps, with the same norms, keys and record, so with the same weights the network
is the GPTModel one exactly. MixLNHybridStack is megatron's HybridStack that refuses patterns
Mix-LN does not define (per stage) and builds the backend's final norm (HybridStack hard-codes
TENorm).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from ..errors import report
from . import hybrid_pattern
from .support import MixLNUnsupportedError


def hybrid_layer_submodules(layer: TransformerLayerSubmodules, part: str) -> TransformerLayerSubmodules:
    """The GPT layer's submodules cut down to one hybrid part (the shared spec is not mutated)."""
    if part == hybrid_pattern.ATTENTION:
        return dataclasses.replace(layer, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp)
    if part == hybrid_pattern.MLP:
        return dataclasses.replace(
            layer, input_layernorm=IdentityOp, self_attention=IdentityOp, self_attn_bda=IdentityFuncOp)
    raise ValueError(f"part must be {hybrid_pattern.ATTENTION!r} or {hybrid_pattern.MLP!r}, got {part!r}")


def _check_stage(config, layer_type_list, pp_layer_offset: int, post_process: bool, moe_layer=IdentityOp) -> None:
    """This pipeline stage's part of the pattern, and that the stages add up to the model."""
    if getattr(config, "mtp_num_layers", None):
        raise MixLNUnsupportedError(
            f"multi-token prediction (mtp_num_layers={config.mtp_num_layers}) is not supported "
            "in a Mix-LN HybridModel: the Mix-LN stack builds the decoder only")
    blocks = hybrid_pattern.num_blocks(config.num_layers, hybrid_pattern.ATTENTION)
    if layer_type_list is None:
        return
    hybrid_pattern.check_segment(layer_type_list, pp_layer_offset)
    if hybrid_pattern.MOE_MLP in layer_type_list and moe_layer is IdentityOp:
        # megatron would build an identity for each `E`: a model without its MoE MLPs
        raise MixLNUnsupportedError(
            "the hybrid pattern has 'E' (MoE) layers, but the Mix-LN stack spec has no MoE layer: build it "
            "with get_mixln_hybrid_stack_spec(config, ...) of a config with num_moe_experts")
    end = pp_layer_offset + len(layer_type_list)
    if end > config.num_layers:
        raise MixLNUnsupportedError(
            f"the hybrid pattern has more layers than config.num_layers = {config.num_layers} "
            f"({blocks} blocks); set num_layers to the pattern's length")
    if post_process and end != config.num_layers:
        # megatron reads `|` segments as pipeline x virtual-pipeline stages: at PP1 "*-|*-"
        # would silently build the first segment only.
        raise MixLNUnsupportedError(
            f"the last pipeline stage ends at hybrid layer {end}, but the model has "
            f"{config.num_layers} layers: the pattern's '|' segments must match the pipeline "
            "(x virtual pipeline) stages")


class MixLNHybridStack(HybridStack):
    """HybridStack for Mix-LN patterns, with the final norm `final_norm` (a norm class called as
    (config=, hidden_size=, eps=); None keeps HybridStack's TENorm)."""

    def __init__(
        self,
        config,
        submodules,
        pre_process: bool = True,
        layer_type_list: Optional[list] = None,
        pp_layer_offset: int = 0,
        post_layer_norm: bool = True,
        post_process: bool = True,
        *args,
        final_norm=None,
        **kwargs,
    ):
        try:
            _check_stage(config, layer_type_list, pp_layer_offset, post_process,
                         getattr(submodules, "moe_layer", IdentityOp))
        except MixLNUnsupportedError as error:
            # One line, before megatron's build_module re-raises it with a suffix; the error itself
            # leaves (a megatron-core user gets the exception); under Megatron-LM the --spec stack
            # class turns it into exit 2 (spec.HybridStackFromStockSpec).
            report(error)
            raise
        own_final_norm = final_norm is not None and post_process and post_layer_norm
        super().__init__(
            config, submodules, pre_process, layer_type_list, pp_layer_offset,
            post_layer_norm and not own_final_norm, post_process, *args, **kwargs,
        )
        if own_final_norm:
            self.post_layer_norm = True  # forward applies self.final_norm
            self.final_norm = final_norm(
                config=self.config, hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)
