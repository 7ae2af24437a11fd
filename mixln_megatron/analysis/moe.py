"""The MoE part of an analysis model: megatron's routing settings read from a checkpoint's args, and
which expert a model tensor belongs to (for convert's per-expert roles).

The analyses run megatron's own MoELayer in evaluation mode, so every routing setting that changes
the forward pass is carried as the run saved it (the router, top-k, pre-softmax, score function,
scaling, groups, expert bias, dtype, capacity, probabilities on the input, sinkhorn's and quantile
balancing's evaluation routing with the saved qb_beta, shared experts and their gate): which ones,
and which are refused, is model.moe_fields.TABLE. How the run executed the experts is not
carried: the model here always uses local sequential experts and the allgather dispatcher, the
only ones that run in one CPU process. That changes no weight: megatron saves grouped-GEMM and
sequential experts under the same keys ([E, ...] over the global experts), whatever the
expert-parallel size; convert's reader reads them by role (convert.mapping), one expert at a time.
The one exception is a GLU interleave (TE grouped GEMM's fc1 rows in [gate s; up s] blocks),
which sequential experts ignore: those rows are put back in plain order on load (plain_glu_rows).
Input jitter is not carried (megatron applies its noise in evaluation too; the analysis measures
the noise-free model).

Pure Python over an argparse Namespace; no megatron import.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

from ..errors import MixLNError
from ..model import moe_fields


class MoEAnalysisError(MixLNError, ValueError):
    """An MoE setting the analysis model cannot carry; the message names the flag."""


# All three derive from model.moe_fields.TABLE (the one list of megatron's MoE settings).
# TransformerConfig field <- Megatron-LM argument, for the settings megatron's own layer computes.
CARRIED = {row.name: row.dests[0] for row in moe_fields.TABLE if row.analysis == moe_fields.CARRY}
# How the experts run in one CPU process (the weights do not depend on it, see the docstring).
CPU_EXECUTION = {row.name: row.analysis[1] for row in moe_fields.TABLE if isinstance(row.analysis, tuple)}
# Forward-changing settings the CPU model does not build: refused in one line when on.
REFUSED = tuple(row for row in moe_fields.TABLE if row.analysis == "refuse")


def is_moe(args) -> bool:
    return bool(moe_fields.num_experts(args))


def _refusal(row, value) -> str:
    return (f"{row.where} [{row.label}={value!r:.40}]: the analysis loader does not build it; analyze a "
            "checkpoint trained without it")


def moe_config_fields(args) -> dict:
    """TransformerConfig keyword arguments for the MoE layers of a checkpoint's args ({} for a
    dense model); a setting that cannot be carried is refused in one line naming its flag.
    Load balancing is carried only where it routes (sinkhorn's evaluation routing, quantile
    balancing with the saved qb_beta); the loss types only train."""
    if not is_moe(args):
        return {}
    get = moe_fields.getter(args)
    for row in REFUSED:
        if moe_fields.row_changes(row, get):
            raise MoEAnalysisError(_refusal(row, get(row.name)))
    problem = glu_rows_problem(args)
    if problem:
        raise MoEAnalysisError(problem)
    fields = {field: getattr(args, arg) for field, arg in CARRIED.items() if getattr(args, arg, None) is not None}
    if moe_fields.balancing(get) == "plain":
        fields.pop("moe_router_load_balancing_type", None)
    fields.update(CPU_EXECUTION)
    return fields


# ------------------------------------------------------------------ GLU-interleaved fc1 rows
def glu_interleaves(args) -> Tuple[Optional[int], Optional[int]]:
    """(experts', shared expert's) GLU interleave of the saved fc1 rows; None: plain [gate; up].
    The CPU model's sequential experts and plain shared expert read plain rows only."""
    get = moe_fields.getter(args)
    return moe_fields.expert_glu_interleave(get), moe_fields.shared_glu_interleave(get)


def glu_rows_problem(args) -> Optional[str]:
    """Interleaved rows whose saved order depends on the (expert) tensor-parallel size (model.moe_fields)."""
    return moe_fields.interleave_rank_problem(moe_fields.getter(args))


_LOCAL_FC1 = re.compile(r"\.mlp\.experts\.local_experts\.\d+\.linear_fc1\.weight$")
_SHARED_FC1 = ".mlp.shared_experts.linear_fc1.weight"


def plain_glu_rows(state: dict, args) -> None:
    """Reorder, in `state` (the CPU model's state dict as read), the fc1 rows of experts saved
    GLU-interleaved ([gate s; up s] repeated) into the plain [gate; up] the CPU model computes with."""
    experts, shared = glu_interleaves(args)
    if experts is None and shared is None:
        return
    import torch

    from ..convert.layouts import split_glu_rows

    for key, value in state.items():
        size = experts if _LOCAL_FC1.search(key) else shared if key.endswith(_SHARED_FC1) else None
        if size is not None:
            state[key] = torch.cat(split_glu_rows(value, size))


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
