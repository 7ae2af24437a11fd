"""The spike scaler's state in torch_dist checkpoints: replicated tensors, one set per target layer.

Each target layer gets a child module `mixln_spike_scaler` (SpikeStateHolder, no parameters or
buffers, so regular state dicts, HF export and the optimizer do not see it). Its sharded state
dict holds, per norm parameter of the layer (role `norm1.weight`, ...), two replicated fp32
ShardedTensors of the parameter's size, `decoder.layers.mixln_spike_scaler.layer<N>.<role>.momentum`
and `....step` (N global). Keys depend only on global layer numbers, so the state reshards across
TP/PP/DP changes; save and load build the same request. Under the distributed optimizer,
building it first makes the state whole over the DP group (a collective, as in every save/load).

What a load finds is megatron's load strictness's business: a checkpoint saved without the scaler
lacks the keys, which megatron's default (`assume_ok_unexpected`) refuses ("Missing key in
checkpoint state_dict: decoder.layers.mixln_spike_scaler..."); with `log_unexpected` (Megatron-LM:
`--dist-ckpt-strictness log_unexpected`) the keys are dropped from the request and the scaler
starts fresh there with a warning.

Format 1 (checkpoints of mixln_megatron before these tensors): one ShardedObject per target layer
(`decoder.layers.mixln_spike_scaler.layer<N>`), announced by a `mixln_spike_scaler` entry in
Megatron-LM's content metadata. Such a checkpoint still loads: when the loaded metadata carries
that entry (only a load of a format-1 checkpoint can), the holders request the objects instead.
"""

from __future__ import annotations

import logging
from typing import Dict, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

HOLDER_NAME = "mixln_spike_scaler"
FORMAT1_METADATA_KEY = "mixln_spike_scaler"  # read only: what format-1 saves wrote


class CheckpointState:
    """A SpikeScaler's state as checkpoints see it, per (layer, role); keeps loaded state until
    the scaler has set itself up (a checkpoint is loaded before the first step)."""

    def __init__(self, scaler):
        self.scaler = scaler
        self.holders: Dict[int, "SpikeStateHolder"] = {}
        self.pending_load: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]] = {}

    def take_loaded(self, layer_number: int, role: str):
        return self.pending_load.pop((layer_number, role), None)

    def layer_state(self, layer_number: int, roles: Sequence[Tuple[str, int]], device=None) -> dict:
        """{role: (momentum, step)} fp32 tensors on `device` (default cpu), the full state of one
        layer's targets (synchronizes first: collective over the distributed optimizer's DP group)."""
        scaler = self.scaler
        scaler.synchronize()
        index = scaler.target_index()
        out = {}
        for role, numel in roles:
            k = index.get((layer_number, role))
            if k is not None and scaler.state is not None:
                n = scaler.state.sizes[k]
                out[role] = (scaler.state.momentum[k, :n].cpu().clone(), scaler.state.step[k, :n].cpu().clone())
            elif (layer_number, role) in self.pending_load:
                out[role] = tuple(t.clone() for t in self.pending_load[(layer_number, role)])
            else:
                out[role] = (torch.zeros(numel), torch.zeros(numel))
        return {role: tuple(t.to(device) for t in pair) for role, pair in out.items()} if device is not None else out

    def load(self, layer_number: int, role: str, numel: int, momentum, step) -> None:
        momentum = torch.as_tensor(momentum, dtype=torch.float32).reshape(-1).cpu()
        step = torch.as_tensor(step, dtype=torch.float32).reshape(-1).cpu().expand(numel).clone()
        if momentum.numel() != numel:
            raise RuntimeError(
                f"mixln spike scaler: the checkpoint's state for layer {layer_number} {role} has "
                f"{momentum.numel()} elements, the model's parameter {numel}"
            )
        k = self.scaler.target_index().get((layer_number, role))
        if k is not None and self.scaler.state is not None:
            self.scaler.state.set_target(k, momentum, step)
        else:
            self.pending_load[(layer_number, role)] = (momentum.clone(), step)

    def warn_missing(self, layer_number: int, role: Optional[str] = None) -> None:
        what = f"layer {layer_number}" + (f" {role}" if role else "")
        logger.warning(
            f"mixln spike scaler: the checkpoint has no spike-scaler state for {what} (saved without "
            f"the scaler or with other targets); its momentum starts fresh and nothing is scaled "
            f"there for the first {self.scaler.settings.warmup_steps} steps"
        )


class SpikeStateHolder(torch.nn.Module):
    """Child module of a target Mix-LN layer that carries the scaler's state in torch_dist
    checkpoints: only `sharded_state_dict` (save and load requests) and `_load_from_state_dict`
    (receives the loaded tensors) do anything."""

    def __init__(self, scaler, layer):
        super().__init__()
        self.bind(scaler, layer)

    def bind(self, scaler, layer) -> None:
        self.__dict__["_checkpoint"] = scaler.checkpoint  # a plain attribute, not a submodule
        self.__dict__["_pg_collection"] = getattr(layer, "pg_collection", None)
        self.layer_number = int(layer.layer_number)
        norms = layer.norm_parameters()
        self.roles = [(role, p.numel()) for role, p in norms]
        # The tensors live where the parameters do when saved (collective checkpoint strategies
        # exchange them); a parameter object stays the same when the model moves to the GPU.
        self.__dict__["_param"] = norms[0][1] if norms else None

    def forward(self, *args, **kwargs):  # pragma: no cover - never called
        raise RuntimeError("SpikeStateHolder holds checkpoint state only")

    def extra_repr(self) -> str:
        return f"layer={self.layer_number}"

    def _replica_id(self) -> tuple:
        from megatron.core import parallel_state
        from megatron.core.utils import get_pg_rank

        pgs = self._pg_collection
        tp_rank = get_pg_rank(pgs.tp) if pgs is not None else parallel_state.get_tensor_model_parallel_rank()
        dp_cp = getattr(pgs, "dp_cp", None) if pgs is not None else None
        if dp_cp is not None:
            dp_rank = get_pg_rank(dp_cp)
        else:
            dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
        return (0, tp_rank, dp_rank)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

        # The layer's prefix (decoder.layers.<local index>.) is replaced by decoder.layers. for
        # sharding, so the global layer number in the key keeps the layers apart (no layer axis).
        key = f"{prefix}layer{self.layer_number}"
        device = None if self._param is None else self._param.device
        state = self._checkpoint.layer_state(self.layer_number, self.roles, device)
        format1 = metadata.get(FORMAT1_METADATA_KEY) if isinstance(metadata, dict) else None
        if format1 is not None:  # a load of a format-1 checkpoint (module doc)
            if self.layer_number not in [int(n) for n in format1.get("layers", ())]:
                return {}
            return {f"{prefix}state": ShardedObject(key, {}, (1,), (0,), replica_id=self._replica_id())}
        return {
            f"{prefix}{role}.{name}": ShardedTensor.from_rank_offsets(
                f"{key}.{role}.{name}", tensor, replica_id=self._replica_id())
            for role, tensors in state.items() for name, tensor in zip(("momentum", "step"), tensors)
        }

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        checkpoint = self._checkpoint
        format1 = state_dict.pop(f"{prefix}state", None)
        try:
            for role, numel in self.roles:
                momentum = state_dict.pop(f"{prefix}{role}.momentum", None)
                step = state_dict.pop(f"{prefix}{role}.step", None)
                if format1 is not None:
                    entry = format1.get("targets", {}).get(role) if isinstance(format1, dict) else None
                    momentum, step = (entry["momentum"], entry["step"]) if entry else (None, None)
                if momentum is None or step is None:
                    checkpoint.warn_missing(self.layer_number, role)
                else:
                    checkpoint.load(self.layer_number, role, numel, momentum, step)
        except RuntimeError as exc:
            error_msgs.append(str(exc))
