"""The MoE part of an analysis model: megatron's routing settings read from a checkpoint's args, and
which expert a model tensor belongs to (for convert's per-expert roles).

The analyses run megatron's own MoELayer, so every routing setting that changes the forward pass
is carried as the run saved it (the router, top-k, pre-softmax, score function, scaling, groups,
expert bias, capacity, shared experts and their gate). How the run executed the experts is not
carried: the model here always uses local sequential experts and the allgather dispatcher, the
only ones that run in one CPU process. That changes no weight: megatron saves grouped-GEMM and
sequential experts under the same keys ([E, ...] over the global experts), whatever the
expert-parallel size; convert's reader reads them by role (convert.mapping), one expert at a time.

Pure Python over an argparse Namespace; no megatron import.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

from ..errors import MixLNError


class MoEAnalysisError(MixLNError, ValueError):
    """An MoE setting the analysis model cannot carry; the message names the flag."""


# TransformerConfig field <- Megatron-LM argument, for the settings that change what a layer computes.
CARRIED = {
    "num_moe_experts": "num_experts",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_layer_freq": "moe_layer_freq",
    "moe_router_topk": "moe_router_topk",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate": "moe_shared_expert_gate",
    "moe_router_pre_softmax": "moe_router_pre_softmax",
    "moe_router_score_function": "moe_router_score_function",
    "moe_router_topk_scaling_factor": "moe_router_topk_scaling_factor",
    "moe_router_num_groups": "moe_router_num_groups",
    "moe_router_group_topk": "moe_router_group_topk",
    "moe_router_enable_expert_bias": "moe_router_enable_expert_bias",
    "moe_router_dtype": "moe_router_dtype",
    "moe_apply_probs_on_input": "moe_apply_probs_on_input",
    "moe_expert_capacity_factor": "moe_expert_capacity_factor",
    "moe_pad_expert_input_to_capacity": "moe_pad_expert_input_to_capacity",
    "moe_token_drop_policy": "moe_token_drop_policy",
    "moe_mlp_glu_interleave_size": "moe_mlp_glu_interleave_size",
    "moe_shared_expert_glu_interleave_size": "moe_shared_expert_glu_interleave_size",
}
# How the experts run in one CPU process (the weights do not depend on it, see the docstring).
CPU_EXECUTION = {"moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": False,
                 "moe_permute_fusion": False, "moe_router_fusion": False, "moe_shared_expert_overlap": False}
# Forward-changing settings not carried: (argument, why, what instead).
REFUSED = (
    ("moe_latent_size", "latent MoE (--moe-latent-size) projections are not read by the analysis loader",
     "analyze a checkpoint without --moe-latent-size"),
)


def is_moe(args) -> bool:
    return bool(getattr(args, "num_experts", None))


def moe_config_fields(args) -> dict:
    """TransformerConfig keyword arguments for the MoE layers of a checkpoint's args ({} for a
    dense model); a setting that cannot be carried is refused in one line naming its flag."""
    if not is_moe(args):
        return {}
    for name, why, instead in REFUSED:
        if getattr(args, name, None) not in (None, 0, False):
            raise MoEAnalysisError(f"{why} [{name}={getattr(args, name)!r}]; {instead}")
    fields = {field: getattr(args, arg) for field, arg in CARRIED.items() if getattr(args, arg, None) is not None}
    fields.update(CPU_EXECUTION)
    return fields


def fresh_moe_fields(num_experts: int, topk: int, ffn_hidden_size: Optional[int] = None, layer_freq=1) -> dict:
    """TransformerConfig keyword arguments of a fresh MoE model (analyze grad-norms, the benchmark)."""
    fields = {"num_moe_experts": num_experts, "moe_router_topk": topk, "moe_layer_freq": layer_freq}
    if ffn_hidden_size:
        fields["moe_ffn_hidden_size"] = ffn_hidden_size
    fields.update(CPU_EXECUTION)
    return fields


# A sequential expert's tensor in the model: mlp.experts.local_experts.<e>.linear_fc<n>.weight
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_(fc[12])\.weight$")


def local_expert(layer_local_name: str) -> Optional[Tuple[int, str]]:
    """(expert index, "fc1" / "fc2") of a local expert's weight (layer-local name), else None.
    In one process every expert is local, so the local index is the global one (convert.mapping's
    expert roles read it from the checkpoint's [E, ...] tensor or its own key)."""
    m = _LOCAL_EXPERT.match(layer_local_name)
    return (int(m.group(1)), m.group(2)) if m else None
