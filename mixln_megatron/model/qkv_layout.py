"""Megatron's fused QKV rows: the one statement of their layout. Per query group, [its q heads;
k; v], `head_dim` rows each; TP splits whole groups, so a shard has the same layout with fewer
groups. DeepNorm's init and the HF conversion use it. Torch only where tensors are merged.
"""

from __future__ import annotations

from typing import Tuple


def group_rows(q_per_group: int, head_dim: int) -> int:
    """Rows of one query group: its q heads, then one k and one v head."""
    return (q_per_group + 2) * head_dim


def value_rows(q_per_group: int, head_dim: int) -> slice:
    """The v head's rows inside one group's rows (the last head of the group)."""
    return slice((q_per_group + 1) * head_dim, group_rows(q_per_group, head_dim))


def separate_rows(first_group: int, stop_group: int, q_per_group: int, head_dim: int) -> Tuple[slice, slice]:
    """(rows of the separate q tensor, rows of each of the separate k and v tensors) that query
    groups [first_group, stop_group) come from (HF's q_proj / k_proj / v_proj, heads in order)."""
    q = slice(first_group * q_per_group * head_dim, stop_group * q_per_group * head_dim)
    return q, slice(first_group * head_dim, stop_group * head_dim)


def split(qkv, groups: int, q_per_group: int, head_dim: int):
    """Fused QKV rows (weight [rows, h] or bias [rows]) -> (q, k, v), each with its heads in order."""
    rest = tuple(qkv.shape[1:])
    grouped = qkv.reshape(groups, q_per_group + 2, head_dim, *rest)
    q = grouped[:, :q_per_group].reshape(groups * q_per_group * head_dim, *rest)
    k = grouped[:, q_per_group].reshape(groups * head_dim, *rest)
    v = grouped[:, q_per_group + 1].reshape(groups * head_dim, *rest)
    return q, k, v


def merge(q, k, v, groups: int, q_per_group: int, head_dim: int):
    """q, k, v (heads in order) -> the fused QKV rows grouped per query group."""
    import torch

    rest = tuple(q.shape[1:])
    parts = [q.reshape(groups, q_per_group, head_dim, *rest), k.reshape(groups, 1, head_dim, *rest),
             v.reshape(groups, 1, head_dim, *rest)]
    return torch.cat(parts, dim=1).reshape(groups * group_rows(q_per_group, head_dim), *rest)
