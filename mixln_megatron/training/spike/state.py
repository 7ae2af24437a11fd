"""The spike scaler's state in torch_dist checkpoints: replicated tensors, one set per target layer.

Each layer holding norms of a target block gets a child module `mixln_spike_scaler`
(SpikeStateHolder, no parameters or buffers, so regular state dicts, HF export and the optimizer do
not see it). Its sharded state dict holds, per norm parameter of that layer (role `norm1.weight`,
...), two replicated fp32 ShardedTensors of the parameter's size, `<layer key>.layer<N>.<role>.momentum`
and `....step`, N the global block number:
  * GPTModel: `decoder.layers.mixln_spike_scaler.layer<N>...` (TransformerBlock swaps the layer's
    prefix for `decoder.layers.`; the block number keeps the layers apart, no layer axis);
  * HybridModel: `decoder.layers.<global hybrid index>.mixln_spike_scaler.layer<N>...` (HybridStack
    keeps a per-layer prefix): block N's `*` layer saves norm1, its `-` layer norm2.
Keys depend only on global numbers, so the state reshards across TP/PP/DP changes (also across a
pipeline split inside a block); save and load build the same request. Under the distributed
optimizer, building it first makes the state whole over the DP group (a collective, as in every
save/load).

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
import weakref
from typing import Dict, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

HOLDER_NAME = "mixln_spike_scaler"
FORMAT1_METADATA_KEY = "mixln_spike_scaler"  # read only: what format-1 saves wrote


class CheckpointState:
    """A SpikeScaler's state as checkpoints see it, per (block, role); keeps loaded state until
    the scaler has set itself up (a checkpoint is loaded before the first step).

    `holders`: {global layer_number of the layer module that holds it: holder}; for a GPTModel
    that is the block number, a HybridModel block has two (its `*` and `-` layers)."""

    def __init__(self, scaler):
        self.scaler = scaler
        self.holders: Dict[int, "SpikeStateHolder"] = {}
        self.pending_load: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]] = {}

    def take_loaded(self, block_number: int, role: str):
        return self.pending_load.pop((block_number, role), None)

    def layer_state(self, block_number: int, roles: Sequence[Tuple[str, int]], device=None) -> dict:
        """{role: (momentum, step)} fp32 tensors on `device` (default cpu), the full state of one
        block's targets `roles` (synchronizes first: collective over the distributed optimizer's
        DP group)."""
        scaler = self.scaler
        scaler.synchronize()
        index = scaler.target_index()
        out = {}
        for role, numel in roles:
            k = index.get((block_number, role))
            if k is not None and scaler.state is not None:
                n = scaler.state.sizes[k]
                out[role] = (scaler.state.momentum[k, :n].cpu().clone(), scaler.state.step[k, :n].cpu().clone())
            elif (block_number, role) in self.pending_load:
                out[role] = tuple(t.clone() for t in self.pending_load[(block_number, role)])
            else:
                out[role] = (torch.zeros(numel), torch.zeros(numel))
        return {role: tuple(t.to(device) for t in pair) for role, pair in out.items()} if device is not None else out

    def held_state(self) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
        """{target name `layer<block>.<role>`: (momentum, step)} of every holder on this rank, what
        a save writes from here (a collective under the distributed optimizer, like a save)."""
        return {f"layer{holder.block_number}.{role}": pair
                for _, holder in sorted(self.holders.items())
                for role, pair in self.layer_state(holder.block_number, holder.roles).items()}

    def load(self, block_number: int, role: str, numel: int, momentum, step, where: Optional[str] = None) -> None:
        momentum = torch.as_tensor(momentum, dtype=torch.float32).reshape(-1).cpu()
        step = torch.as_tensor(step, dtype=torch.float32).reshape(-1).cpu()
        if momentum.numel() != numel or step.numel() not in (1, numel):  # checked before expanding
            raise RuntimeError(
                f"mixln spike scaler: the checkpoint's state for {where or f'layer {block_number}'} {role} "
                f"has {momentum.numel()} elements, the model's parameter {numel}"
            )
        step = step.expand(numel).clone()
        k = self.scaler.target_index().get((block_number, role))
        if k is not None and self.scaler.state is not None:
            self.scaler.state.set_target(k, momentum, step)
        else:
            self.pending_load[(block_number, role)] = (momentum.clone(), step)

    def warn_missing(self, block_number: int, role: Optional[str] = None, where: Optional[str] = None) -> None:
        what = (where or f"layer {block_number}") + (f" {role}" if role else "")
        logger.warning(
            f"mixln spike scaler: the checkpoint has no spike-scaler state for {what} (saved without "
            f"the scaler or with other targets); its momentum starts fresh and nothing is scaled "
            f"there for the first {self.scaler.settings.warmup_steps} steps"
        )


class SpikeStateHolder(torch.nn.Module):
    """Child module of a Mix-LN layer holding norms of a target block that carries the scaler's
    state of those norms in torch_dist checkpoints: only `sharded_state_dict` (save and load
    requests) and `_load_from_state_dict` (receives the loaded tensors) do anything."""

    def __init__(self, scaler, layer):
        super().__init__()
        self.bind(scaler, layer)

    def bind(self, scaler, layer) -> None:
        self.__dict__["_checkpoint"] = scaler.checkpoint  # a plain attribute, not a submodule
        self.__dict__["_layer"] = weakref.ref(layer)  # so that SpikeScaler.detach can take it out
        self.__dict__["_pg_collection"] = getattr(layer, "pg_collection", None)
        self.layer_number = int(layer.layer_number)  # the holding module's own (global) number
        self.block_number = int(layer.block_number)  # the Mix-LN layer whose state it carries
        self.hybrid_part = getattr(layer, "hybrid_part", None)
        norms = layer.norm_parameters()
        self.roles = [(role, p.numel()) for role, p in norms]
        # The tensors live where the parameters do when saved (collective checkpoint strategies
        # exchange them); a parameter object stays the same when the model moves to the GPU.
        self.__dict__["_param"] = norms[0][1] if norms else None

    @property
    def layer(self):
        """The layer this holder was attached to (None once the layer is gone)."""
        return self._layer()

    def forward(self, *args, **kwargs):  # pragma: no cover - never called
        raise RuntimeError("SpikeStateHolder holds checkpoint state only")

    def extra_repr(self) -> str:
        if self.hybrid_part is None:
            return f"layer={self.layer_number}"
        return f"block={self.block_number}, layer={self.layer_number}"

    @property
    def where(self) -> str:
        """How messages name the norms it holds: `layer N` (GPT), `block N (hybrid layer n)`."""
        if self.hybrid_part is None:
            return f"layer {self.block_number}"
        return f"block {self.block_number} (hybrid layer {self.layer_number})"

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

        from ...model.checkpoint import replica_id

        # GPT: the layer's prefix (decoder.layers.<local index>.) is replaced by decoder.layers. for
        # sharding, so the global block number in the key keeps the layers apart (no layer axis).
        # Hybrid: the prefix becomes decoder.layers.<global index>. (module doc).
        key = f"{prefix}layer{self.block_number}"
        device = None if self._param is None else self._param.device
        state = self._checkpoint.layer_state(self.block_number, self.roles, device)
        format1 = metadata.get(FORMAT1_METADATA_KEY) if isinstance(metadata, dict) else None
        if format1 is not None:  # a load of a format-1 checkpoint (module doc)
            if self.block_number not in [int(n) for n in format1.get("layers", ())]:
                return {}
            return {f"{prefix}state": ShardedObject(key, {}, (1,), (0,), replica_id=replica_id(self._pg_collection))}
        return {
            f"{prefix}{role}.{name}": ShardedTensor.from_rank_offsets(
                f"{key}.{role}.{name}", tensor, replica_id=replica_id(self._pg_collection))
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
                    checkpoint.warn_missing(self.block_number, role, self.where)
                else:
                    checkpoint.load(self.block_number, role, numel, momentum, step, self.where)
        except RuntimeError as exc:
            error_msgs.append(str(exc))
