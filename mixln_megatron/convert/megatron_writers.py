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
    for layer in range(L):
        for role in src.layer_roles(layer):
            if role in M.SANDWICH_NORM_NAMES:  # stacked over the S sandwich layers only (model.layer)
                tensor(M.TD_LAYER_PREFIX + M.SANDWICH_NORM_NAMES[role], (sandwiches, h), (src.sandwich_rows[layer], 0),
                       (1, h), lambda l=layer, r=role: src.role_rows(l, r, 0, h).unsqueeze(0))
                continue
            shp = layer_shapes[role]
            row_bytes = dtype.itemsize * (shp[1] if len(shp) > 1 else 1)
            # Chunks of <= PIECE_BYTES: megatron-core reshards them at load like any other layout.
            for a, b in megatron_row_chunks(role, shape, row_bytes, PIECE_BYTES):
                tensor(M.TD_LAYER_PREFIX + M.td_layer_name(role, not stock), (L, *shp), (layer, a) + (0,) * (len(shp) - 1),
                       (1, b - a, *shp[1:]), lambda l=layer, r=role, a=a, b=b: src.role_rows(l, r, a, b).unsqueeze(0))
        for module in M.EXTRA_STATE_MODULES:
            plan.object(f"{M.TD_LAYER_PREFIX}{module}._extra_state/shard_{layer}_{L}", None)
    tensor(M.TD_FINAL_NORM, (h,), (0,), (h,), lambda: src.hf_tensor(M.HF_FINAL_NORM))
    plan.object("decoder.final_layernorm._extra_state/shard_0_1", None)
    if not shape.tie_embeddings:
        vocab(M.TD_OUTPUT, M.HF_OUTPUT)
    if not stock:
        plan.object(f"{M.TD_SETTINGS_RECORD}/shard_0_1", record)
    plan.object("common_state/shard_0_1", common)

    def on_write(data):
        if isinstance(data, torch.Tensor):
            bar.update(data.numel() * data.element_size())

    plan.save(out_dir, on_write)
    # The same common state as common.pt too: megatron-core 0.19 reads the object above, 0.17 /
    # 0.18 only common.pt; with both, every supported release loads the output.
    torch.save(common, os.path.join(out_dir, "common.pt"))


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
