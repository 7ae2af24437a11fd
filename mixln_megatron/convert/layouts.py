"""How Megatron lays out a layer's tensors, and the conversions to HF's layout.

  * QKV rows are grouped per query group (model.qkv_layout); tensor parallelism splits whole
    groups, so concatenating the TP shards of a legacy checkpoint gives torch_dist's layout.
  * fc1 (SwiGLU) is [gate; up]. torch_dist stores the layout-independent [gate_all; up_all]; each
    legacy TP rank holds [gate_r; up_r] of its own slice. MoE fc1s saved with a GLU interleave
    (--moe-mlp-glu-interleave-size / the fused shared expert's) hold blocks [gate s; up s] repeated
    instead (split_glu_rows).
  * Row ranges ("chunks") let the import write a tensor in bounded pieces without a range ever
    straddling what HF keeps apart.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

from ..model import qkv_layout
from .shape import ModelShape

# Legacy tensor-parallel layout of each role: ("cat", dim), "glu" ([gate_r; up_r] per rank) or
# "replicated" (every rank holds the full tensor).
LEGACY_TP_LAYOUT: Dict[str, object] = {
    "qkv.weight": ("cat", 0),
    "qkv.bias": ("cat", 0),
    "proj.weight": ("cat", 1),
    "proj.bias": "replicated",
    "fc1.weight": "glu",
    "fc1.bias": "glu",
    "fc2.weight": ("cat", 1),
    "fc2.bias": "replicated",
    "norm_a": "replicated",
    "norm_b": "replicated",
    "norm_c": "replicated",
    "norm_d": "replicated",
}


def _ranges(start: int, stop: int, step: int):
    """[start, stop) cut into consecutive ranges of at most `step`."""
    return [(i, min(stop, i + step)) for i in range(start, stop, step)]


def split_qkv(qkv, shape: ModelShape):
    """Megatron's grouped QKV rows -> (q, k, v) in HF head order (weight [rows, h] or bias [rows])."""
    ng = shape.num_query_groups
    qpg = shape.num_attention_heads // ng  # the shape's fields only: an export's writing never calls back into it
    return qkv_layout.split(qkv, ng, qpg, shape.kv_channels)


def merge_qkv(q, k, v, shape: ModelShape):
    """HF q, k, v -> Megatron's QKV rows grouped per query group."""
    return qkv_layout.merge(q, k, v, shape.num_query_groups, shape.q_per_group, shape.kv_channels)


def deinterleave_rope_rows(t, num_heads: int, head_dim: int):
    """Rows of q or k for Megatron's interleaved RoPE -> HF's rotate-half order, per head.

    Interleaved RoPE rotates the pairs (2j, 2j+1) with frequency j, rotate-half the pairs
    (j, j + d/2); moving row 2j to j and 2j+1 to j + d/2 in both q and k maps one onto the other
    (the attention scores are sums over the head dimension, so a shared permutation cancels).
    """
    rest = tuple(t.shape[1:])
    return t.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(num_heads * head_dim, *rest)


def split_glu_rows(tensor, interleave_size: Optional[int] = None):
    """An fc1's rows (weight [2I, H] or bias [2I]) -> (gate, up), each [I, ...].

    `interleave_size` None: plain [gate; up]. Else s: the rows come in blocks [gate s rows; up s
    rows] repeated (TE grouped GEMM's layout; megatron undoes it on the fc1 output with
    `_remove_glu_interleaving`). Whole blocks are required: a row count that is not a multiple of 2s
    is not such a layout (ConversionError).
    """
    if interleave_size is None:
        gate, up = tensor.chunk(2, dim=0)
        return gate, up
    rows, rest = tensor.shape[0], tuple(tensor.shape[1:])
    if interleave_size < 1 or rows % (2 * interleave_size):
        from ..errors import ConversionError

        raise ConversionError(f"an fc1 of {rows} rows cannot hold GLU blocks of {interleave_size} gate + "
                              f"{interleave_size} up rows (the saved GLU interleave size does not fit the tensor)")
    blocks = tensor.reshape(rows // (2 * interleave_size), 2, interleave_size, *rest)
    gate = blocks[:, 0].reshape(rows // 2, *rest)
    up = blocks[:, 1].reshape(rows // 2, *rest)
    return gate, up


def merge_glu_ranks(shards: Sequence):
    """Legacy TP shards [gate_r; up_r] -> the global [gate_all; up_all]."""
    import torch

    gates, ups = [], []
    for shard in shards:
        half = shard.shape[0] // 2
        gates.append(shard[:half])
        ups.append(shard[half:])
    return torch.cat(gates + ups, dim=0)


def split_glu_rank(fc1, tp: int, rank: int):
    """The global [gate_all; up_all] -> legacy TP rank `rank`'s [gate_r; up_r]."""
    import torch

    ffn = fc1.shape[0] // 2
    part = ffn // tp
    gate = fc1[rank * part:(rank + 1) * part]
    up = fc1[ffn + rank * part:ffn + (rank + 1) * part]
    return torch.cat([gate, up], dim=0)


def merge_tp_shards(role: str, shards: Sequence):
    """Legacy TP shards of one role (rank order) -> the global tensor."""
    import torch

    layout = LEGACY_TP_LAYOUT[role]
    if layout == "replicated" or len(shards) == 1:
        return shards[0]
    if layout == "glu":
        return merge_glu_ranks(shards)
    return torch.cat(list(shards), dim=layout[1])


def split_tp_shard(role: str, tensor, tp: int, rank: int):
    """The global tensor of a role -> legacy TP rank `rank`'s shard (a contiguous copy)."""
    layout = LEGACY_TP_LAYOUT[role]
    if layout == "replicated" or tp == 1:
        return tensor.contiguous()
    if layout == "glu":
        return split_glu_rank(tensor, tp, rank).contiguous()
    dim = layout[1]
    size = tensor.shape[dim] // tp
    return tensor.narrow(dim, rank * size, size).contiguous()


def megatron_row_chunks(role: str, shape: ModelShape, row_bytes: int, piece_bytes: int):
    """Row ranges [a, b) that split one layer's Megatron `role` tensor into chunks of <= piece_bytes.

    Chunks never straddle what HF keeps apart: QKV chunks are whole query groups (so each is built
    from row slices of q, k and v), fc1 chunks lie inside the gate or the up half.
    """
    per = max(1, piece_bytes // max(1, row_bytes))

    if role.startswith("qkv."):
        group = qkv_layout.group_rows(shape.q_per_group, shape.kv_channels)
        return _ranges(0, shape.qkv_rows, max(1, per // group) * group)
    if role.startswith("fc1."):
        f = shape.ffn_hidden_size
        return _ranges(0, f, per) + _ranges(f, 2 * f, per)
    return _ranges(0, shape.megatron_layer_shapes()[role][0], per)
