"""The spike scaler's state in torch_dist checkpoints.

Each Mix-LN layer gets a child module `mixln_spike_scaler` (SpikeStateHolder, no parameters or
buffers, so regular state dicts, HF export and the optimizer do not see it). On the target
layers it contributes one ShardedObject `decoder.layers.mixln_spike_scaler.layer<N>` (N global),
replicated over TP and DP, holding the momentum and step count of that layer's norm targets.
Keys depend only on global layer numbers, so the state reshards across TP/PP/DP changes.

Old checkpoints: Megatron-LM's default strictness fails on a requested key that a checkpoint
lacks, so the objects are requested only when the checkpoint is known to have them: at save the
holders write a marker {"layers": [...]} into the sharded_state_dict metadata, which Megatron-LM
stores as content metadata and passes back at load. A load whose metadata has no marker (a
checkpoint saved without the scaler) requests nothing and the layers start fresh with a
warning. Callers that pass no metadata at all (plain megatron-core) always get the objects;
to load a checkpoint without them, pass Megatron-LM-style metadata (save: `md = {...};
model.sharded_state_dict(metadata=md)`, then `dist_checkpointing.save(..., content_metadata=md)`;
load: `md = dist_checkpointing.load_content_metadata(dir)`) or load with
strict="log_unexpected". Under the distributed optimizer, building the sharded state dict of a
target layer first makes the state whole over the DP group (a collective, as in every save/load).
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .targets import is_target_layer

logger = logging.getLogger(__name__)

HOLDER_NAME = "mixln_spike_scaler"
METADATA_KEY = "mixln_spike_scaler"
STATE_FORMAT = 1


class CheckpointState:
    """Saves and restores a SpikeScaler's state per target layer; keeps loaded state until the
    scaler has set itself up (a checkpoint is loaded before the first step)."""

    def __init__(self, scaler):
        self.scaler = scaler
        self.holders: Dict[int, "SpikeStateHolder"] = {}
        self.pending_load: Dict[Tuple[int, str], dict] = {}
        self.own_markers: List[dict] = []
        self.from_checkpoint = False

    def take_loaded(self, layer_number: int, role: str) -> Optional[dict]:
        return self.pending_load.pop((layer_number, role), None)

    def layers_for(self, metadata) -> Tuple[int, ...]:
        """Which layers' state the sharded state dict carries, for this save or load (module doc)."""
        scaler = self.scaler
        if not isinstance(metadata, dict):
            return scaler.layers
        marker = metadata.get(METADATA_KEY)
        if marker is not None:
            layers = tuple(int(n) for n in marker.get("layers", ()))
            if layers and not any(marker is own for own in self.own_markers):
                self.from_checkpoint = True  # a load: the checkpoint carries spike state
            return layers
        caller_keys = [k for k in metadata if k != "dp_cp_group"]
        has_state = scaler.committed_steps > 0 or self.from_checkpoint
        layers = scaler.layers if (not caller_keys or has_state) else ()
        marker = {"format": STATE_FORMAT, "layers": list(layers)}
        self.own_markers = (self.own_markers + [marker])[-8:]
        metadata[METADATA_KEY] = marker
        return layers

    def layer_state(self, layer_number: int, roles: Sequence[Tuple[str, int]]) -> dict:
        """The full state of one layer's targets (synchronizes first: collective over the
        distributed optimizer's DP group, which every DP peer reaches in its sharded_state_dict)."""
        scaler = self.scaler
        scaler.synchronize()
        out = {}
        index = scaler.target_index()
        for role, numel in roles:
            k = index.get((layer_number, role))
            if k is not None and scaler.state is not None:
                out[role] = scaler.state.get_target(k)
            elif (layer_number, role) in self.pending_load:
                data = self.pending_load[(layer_number, role)]
                out[role] = {"momentum": data["momentum"].clone(), "step": data["step"].clone()}
            else:
                out[role] = {"momentum": torch.zeros(numel, dtype=torch.float32),
                             "step": torch.zeros(numel, dtype=torch.int64)}
        settings = scaler.settings
        return {"format": STATE_FORMAT, "layer": layer_number, "targets": out,
                "settings": {"threshold": settings.threshold, "beta": settings.beta,
                             "warmup_steps": settings.warmup_steps}}

    def load_layer_state(self, layer_number: int, roles: Sequence[Tuple[str, int]], data) -> None:
        if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
            raise RuntimeError(
                f"mixln spike scaler: unreadable spike-scaler state for layer {layer_number} in the "
                f"checkpoint (format {getattr(data, 'get', lambda k: None)('format')!r}, expected {STATE_FORMAT})"
            )
        scaler = self.scaler
        stored = data.get("targets", {})
        index = scaler.target_index()
        for role, numel in roles:
            entry = stored.get(role)
            if entry is None:
                self.warn_missing(layer_number, role)
                continue
            momentum = torch.as_tensor(entry["momentum"], dtype=torch.float32).reshape(-1).cpu()
            step = torch.as_tensor(entry["step"], dtype=torch.int64).reshape(-1).cpu().expand(numel).clone()
            if momentum.numel() != numel:
                raise RuntimeError(
                    f"mixln spike scaler: the checkpoint's state for layer {layer_number} {role} has "
                    f"{momentum.numel()} elements, the model's parameter {numel}"
                )
            k = index.get((layer_number, role))
            if k is not None and scaler.state is not None:
                scaler.state.set_target(k, momentum, step)
            else:
                self.pending_load[(layer_number, role)] = {"momentum": momentum.clone(), "step": step}
        self.from_checkpoint = True

    def warn_missing(self, layer_number: int, role: Optional[str] = None) -> None:
        """Once per holder and load (a load calls each holder's _load_from_state_dict once)."""
        what = f"layer {layer_number}" + (f" {role}" if role else "")
        logger.warning(
            f"mixln spike scaler: the checkpoint has no spike-scaler state for {what} (saved without "
            f"the scaler or with other targets); its momentum starts fresh and nothing is scaled "
            f"there for the first {self.scaler.settings.warmup_steps} steps"
        )


class SpikeStateHolder(torch.nn.Module):
    """Child module of a Mix-LN layer that carries the scaler's state in torch_dist checkpoints.

    No parameters or buffers: only `sharded_state_dict` (save and load requests) and
    `_load_from_state_dict` (receives the loaded object) do anything.
    """

    def __init__(self, scaler, layer):
        super().__init__()
        self.bind(scaler, layer)

    def bind(self, scaler, layer) -> None:
        self.__dict__["_checkpoint"] = scaler.checkpoint  # a plain attribute, not a submodule
        self.__dict__["_pg_collection"] = getattr(layer, "pg_collection", None)
        self.layer_number = int(layer.layer_number)
        self.is_target = is_target_layer(layer, scaler.layers)
        self.roles = [(role, p.numel()) for role, p in layer.norm_parameters()] if self.is_target else []

    def forward(self, *args, **kwargs):  # pragma: no cover - never called
        raise RuntimeError("SpikeStateHolder holds checkpoint state only")

    def extra_repr(self) -> str:
        return f"layer={self.layer_number}, target={self.is_target}"

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
        checkpoint = self._checkpoint
        layers = checkpoint.layers_for(metadata)  # every holder: it also writes the save's marker
        if not self.is_target or self.layer_number not in layers:
            return {}
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        data = checkpoint.layer_state(self.layer_number, self.roles)
        # The layer's prefix (decoder.layers.<local index>.) is replaced by decoder.layers. for
        # sharding, so the global layer number in the key keeps the objects apart.
        key = f"{prefix}layer{self.layer_number}"
        return {f"{prefix}state": ShardedObject(key, data, (1,), (0,), replica_id=self._replica_id())}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        data = state_dict.pop(f"{prefix}state", None)
        if not self.is_target:
            return
        if data is None:
            self._checkpoint.warn_missing(self.layer_number)
            return
        try:
            self._checkpoint.load_layer_state(self.layer_number, self.roles, data)
        except RuntimeError as exc:
            error_msgs.append(str(exc))
