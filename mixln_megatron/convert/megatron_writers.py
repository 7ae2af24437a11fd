"""Megatron-LM checkpoint files written from an HFRoleSource: torch_dist or legacy per-rank torch.

torch_dist is written with torch.distributed.checkpoint's own writer, through convert.dcp_writer
(tensors are produced only when the writer asks for them), so one chunk is in memory at a time. Legacy files are one torch.save per TP x PP rank, so one rank's state dict is resident.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import torch

from . import mapping as M
from .dcp_writer import LazyTorchDistWriter
from .hf_roles import HFRoleSource
from .layouts import megatron_row_chunks, split_tp_shard
from .shape import ModelShape

PIECE_BYTES = 8 << 20  # largest piece converted / written at once


def write_torch_dist(out_dir: str, src: HFRoleSource, shape: ModelShape, padded_vocab: int, record: dict,
                     common: dict, stock: bool, bar) -> None:
    """A megatron-core torch_dist checkpoint in `out_dir`, one chunk in memory at a time."""
    dtype = src.dtype
    plan = LazyTorchDistWriter()

    def tensor(key, global_shape, offsets, sizes, produce):
        plan.tensor(key, global_shape, offsets, sizes, dtype, produce)

    h, L = shape.hidden_size, shape.num_layers
    block = max(1, PIECE_BYTES // (h * dtype.itemsize))

    def vocab(key, hf_name):
        for start in range(0, padded_vocab, block):
            stop = min(padded_vocab, start + block)
            tensor(key, (padded_vocab, h), (start, 0), (stop - start, h),
                   lambda a=start, b=stop: src.vocab_rows(hf_name, a, b))

    vocab(M.TD_EMBEDDING, M.HF_EMBEDDING)
    layer_shapes = shape.megatron_layer_shapes()
    sandwiches = len(src.sandwich_rows)
    # megatron keeps one key per layer (no layer axis) when dense and MoE layers mix
    per_layer = shape.moe is not None and not all(shape.moe.moe_layers)
    lead = (lambda layer: ((), ())) if per_layer else (lambda layer: ((L,), (layer,)))
    for layer in range(L):
        prefix = f"{M.TD_LAYER_PREFIX}{layer}." if per_layer else M.TD_LAYER_PREFIX
        lead_shape, lead_offset = lead(layer)
        ones = (1,) * len(lead_shape)
        for role in src.layer_roles(layer):
            if role in M.SANDWICH_NORM_NAMES and per_layer:  # the layer's own [hidden]
                tensor(prefix + M.SANDWICH_NORM_NAMES[role], (h,), (0,), (h,),
                       lambda l=layer, r=role: src.role_rows(l, r, 0, h))
                continue
            if role in M.SANDWICH_NORM_NAMES:  # stacked over the S sandwich layers only (model.layer)
                tensor(M.TD_LAYER_PREFIX + M.SANDWICH_NORM_NAMES[role], (sandwiches, h), (src.sandwich_rows[layer], 0),
                       (1, h), lambda l=layer, r=role: src.role_rows(l, r, 0, h).unsqueeze(0))
                continue
            if src.is_moe_layer(layer) and (role in M.MOE_ROLE_NAMES or M.split_expert_role(role)):
                _moe_role(tensor, src, shape, layer, role, prefix + M.td_layer_name(role, not stock),
                          lead_shape, lead_offset, dtype)
                continue
            shp = layer_shapes[role]
            row_bytes = dtype.itemsize * (shp[1] if len(shp) > 1 else 1)
            # Chunks of <= PIECE_BYTES: megatron-core reshards them at load like any other layout.
            for a, b in megatron_row_chunks(role, shape, row_bytes, PIECE_BYTES):
                tensor(prefix + M.td_layer_name(role, not stock), (*lead_shape, *shp),
                       lead_offset + (a,) + (0,) * (len(shp) - 1), (*ones, b - a, *shp[1:]),
                       lambda l=layer, r=role, a=a, b=b, o=ones, s=shp: src.role_rows(l, r, a, b).reshape(
                           *o, b - a, *s[1:]))
        for name in _extra_state_objects(src, shape, layer, L, per_layer):
            plan.object(name, None)
    tensor(M.TD_FINAL_NORM, (h,), (0,), (h,), lambda: src.hf_tensor(M.HF_FINAL_NORM))
    plan.object("decoder.final_layernorm._extra_state/shard_0_1", None)
    if not shape.tie_embeddings:
        vocab(M.TD_OUTPUT, M.HF_OUTPUT)
    if not stock:  # global layer 1's record (per-layer keys: its own)
        plan.object(f"{M.TD_LAYER_PREFIX}0.{M.TD_SETTINGS_RECORD[len(M.TD_LAYER_PREFIX):]}/shard_0_1" if per_layer
                    else f"{M.TD_SETTINGS_RECORD}/shard_0_1", record)
    plan.object("common_state/shard_0_1", common)

    def on_write(data):
        if isinstance(data, torch.Tensor):
            bar.update(data.numel() * data.element_size())

    plan.save(out_dir, on_write)
    # The same common state as common.pt too: megatron-core 0.19 reads the object above, 0.17 /
    # 0.18 only common.pt; with both, every supported release loads the output.
    torch.save(common, os.path.join(out_dir, "common.pt"))


def _moe_role(tensor, src: HFRoleSource, shape: ModelShape, layer: int, role: str, key: str, lead_shape, lead_offset,
              dtype) -> None:
    """One MoE role's chunks: the router / shared expert as one tensor, an expert as its row e of the
    layer's [E, rows, columns] tensor; an fc1's chunks lie inside its gate or up half."""
    parts = src.moe_role_parts(role)
    rows, cols = sum(p[1][0] for p in parts), parts[0][1][1]
    expert = M.split_expert_role(role)
    e_shape, e_offset = ((shape.moe.num_experts,), (expert[0],)) if expert else ((), ())
    ones = (1,) * (len(lead_shape) + len(e_shape))
    per = max(1, PIECE_BYTES // max(1, cols * dtype.itemsize))
    start = 0
    for _, (part_rows, _) in parts:
        for a in range(start, start + part_rows, per):
            b = min(start + part_rows, a + per)
            tensor(key, (*lead_shape, *e_shape, rows, cols), lead_offset + e_offset + (a, 0), (*ones, b - a, cols),
                   lambda a=a, b=b: src.role_rows(layer, role, a, b).reshape(*ones, b - a, cols))
        start += part_rows


def _extra_state_objects(src: HFRoleSource, shape: ModelShape, layer: int, L: int, per_layer: bool):
    """The (empty) `_extra_state` objects megatron-core saves for a layer's linears: per-layer keys
    shard_0_1 (experts: one per global expert, shard_<e>_<E>), stacked keys shard_<layer>_<L>
    (experts shard_<layer>.<e>_<L>.<E>)."""
    prefix = f"{M.TD_LAYER_PREFIX}{layer}." if per_layer else M.TD_LAYER_PREFIX
    one = "shard_0_1" if per_layer else f"shard_{layer}_{L}"
    modules = list(M.EXTRA_STATE_MODULES[:2])
    if not src.is_moe_layer(layer):
        return [f"{prefix}{m}._extra_state/{one}" for m in M.EXTRA_STATE_MODULES]
    if shape.moe.shared_ffn is not None:
        modules += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
    names = [f"{prefix}{m}._extra_state/{one}" for m in modules]
    e_count = shape.moe.num_experts
    for fc in ("linear_fc1", "linear_fc2"):
        for e in range(e_count):
            shard = f"shard_{e}_{e_count}" if per_layer else f"shard_{layer}.{e}_{L}.{e_count}"
            names.append(f"{prefix}mlp.experts.experts.{fc}._extra_state/{shard}")
    return names


def write_legacy(out_dir: str, src: HFRoleSource, shape: ModelShape, padded_vocab: int, record: dict, common: dict,
                 stock: bool, tp: int, pp: int, transformer_impl: str, bar) -> None:
    """release/mp_rank_TT[_PPP]/model_optim_rng.pt files (one rank's state dict in memory at a time)."""
    L = shape.num_layers
    per_stage = L // pp
    for p in range(pp):
        layers = range(p * per_stage, (p + 1) * per_stage)
        for t in range(tp):
            model = OrderedDict()
            rows = padded_vocab // tp
            if p == 0:
                model[M.TD_EMBEDDING] = src.vocab_rows(M.HF_EMBEDDING, t * rows, (t + 1) * rows)
            for local, layer in enumerate(layers):
                names = M.legacy_write_names(transformer_impl, src.kinds[layer])
                prefix = f"decoder.layers.{local}."
                for role in src.layer_roles(layer):
                    full = src.role(layer, role)
                    name = names[role] if role in names else M.LAYER_ROLE_NAMES[role]
                    model[prefix + name] = split_tp_shard(role, full, tp, t)
                    del full
                for module in M.EXTRA_STATE_MODULES:
                    model[f"{prefix}{module}._extra_state"] = None
                if layer == 0 and not stock:
                    model[prefix + "mixln_settings"] = dict(record)
            if p == pp - 1:
                model[M.TD_FINAL_NORM] = src.hf_tensor(M.HF_FINAL_NORM)
                if not shape.tie_embeddings:
                    model[M.TD_OUTPUT] = src.vocab_rows(M.HF_OUTPUT, t * rows, (t + 1) * rows)
                elif pp > 1:
                    # Tied weights: the last stage keeps its own copy of the embedding for the output.
                    model[M.TD_OUTPUT] = src.vocab_rows(M.HF_EMBEDDING, t * rows, (t + 1) * rows)
                model["output_layer._extra_state"] = None
            state = {"args": common["args"], "checkpoint_version": 3.0, "iteration": 0, "model": model,
                     "num_floating_point_operations_so_far": 0}
            name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
            os.makedirs(os.path.join(out_dir, name))
            torch.save(state, os.path.join(out_dir, name, "model_optim_rng.pt"))
            bar.update(sum(v.numel() * v.element_size() for v in model.values() if torch.is_tensor(v)))
            del model, state
