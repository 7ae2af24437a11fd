"""The spike scaler's targets (which gradients it edits, which of their elements this rank owns,
the views through which one step reads and writes all of them at once) and its checkpoint state.

Targets: the norm_parameters() of the target Mix-LN layers on this pipeline stage, keyed and
sorted by (block_number, role), so the same network has the same targets whatever the model kind
(a HybridModel block's `*` layer holds norm1, its `-` layer norm2) or split. MTP layers never are.

Ownership: under the distributed optimizer only this rank's shard of each bucket is reduced and
read by the optimizer, so the rule decides for exactly those elements (runtime.owned_range).
Batched access: one foreach copy each way between main_grad and the fp32 [K, n] buffer (exact
for every element the rule leaves alone).

Checkpoints (keys and load strictness: docs/configuration.md): each layer holding norms of a
target block gets a child module `mixln_spike_scaler` (SpikeStateHolder, no parameters or
buffers) whose sharded state dict holds two replicated fp32 tensors per norm parameter,
`<prefix>layer<N>.<role>.momentum` / `.step`, N the global block number, so the state reshards.
GPTModel's prefix is `decoder.layers.` (the block number keeps layers apart), HybridModel's
`decoder.layers.<global hybrid index>.`. Format 1 (older saves): one ShardedObject per target
layer, announced by a `mixln_spike_scaler` content-metadata entry; when a load's metadata
carries it, the holders request the objects instead.
"""

from __future__ import annotations

import logging
import weakref
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from ...errors import refuse_in_training
from ...model import support
from ...model.checkpoint import replica_id
from ...model.layer import MixLNTransformerLayer
from ...model.settings import SpikeConfigError
from ...model.support import MixLNUnsupportedError
from ..runtime import owned_range

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------- targets
def placement_text(placement) -> str:
    """How the scaler's lines name the model's layout: 'P=2 of L=24' for Mix-LN's first P,
    'layout post:1-2,pre:3-4,... of L=...' (with its boundaries) otherwise."""
    if placement.is_first_p:
        return f"P={placement.post_ln_layers} of L={placement.num_layers}"
    pairs = ", ".join(f"{a}|{b}" for a, b in placement.boundaries[:8]) + (", ..." if len(placement.boundaries) > 8 else "")
    return (f"layout {placement.layout} of L={placement.num_layers}, Post/Pre boundaries: "
            f"{pairs or 'none'}")


def target_layers(targets: Union[str, Tuple[int, ...]], placement) -> Tuple[int, ...]:
    """Global 1-based block numbers whose norms the scaler watches: "boundary"
    (Placement.boundary_layers; () when the model has none), "all" (not the final norm), or the
    given blocks (checked against the depth)."""
    if targets == "boundary":
        return tuple(placement.boundary_layers)
    if targets == "all":
        return tuple(range(1, placement.num_layers + 1))
    bad = [n for n in targets if not 1 <= n <= placement.num_layers]
    if bad:
        raise SpikeConfigError(f"spike target layers {bad} are outside 1..{placement.num_layers} (global, 1-based)")
    return tuple(targets)


class Target:
    __slots__ = ("block_number", "role", "param", "numel", "owned")

    def __init__(self, block_number: int, role: str, param: torch.nn.Parameter):
        self.block_number, self.role, self.param = block_number, role, param
        self.numel = param.numel()
        self.owned = (0, self.numel)  # elements of main_grad this rank's optimizer reads

    @property
    def layer_number(self) -> int:  # the Mix-LN layer: a GPT layer's number, a hybrid block's
        return self.block_number

    @property
    def key(self) -> Tuple[int, str]:
        return (self.block_number, self.role)

    @property
    def name(self) -> str:
        return f"layer{self.block_number}.{self.role}"


def mixln_layers(model_chunks) -> List[Tuple[torch.nn.Module, MixLNTransformerLayer]]:
    """(chunk, layer) for every Mix-LN layer of the model chunks."""
    return [(chunk, module) for chunk in model_chunks for module in chunk.modules()
            if isinstance(module, MixLNTransformerLayer)]


def is_target_layer(layer, blocks: Sequence[int]) -> bool:
    """Whether `layer` holds norms of a target block (both hybrid layers of one block do)."""
    return layer.block_number in blocks and not getattr(layer, "is_mtp_layer", False)


def find_targets(model_chunks, blocks: Sequence[int]) -> Tuple[List[Target], Dict[int, torch.nn.Module]]:
    """The trainable norm parameters of the target blocks on this rank, sorted by (block, role),
    and each one's chunk (by id)."""
    targets, chunk_of = [], {}
    for chunk, layer in mixln_layers(model_chunks):
        if not is_target_layer(layer, blocks):
            continue
        for role, param in layer.norm_parameters():
            if param.requires_grad:
                targets.append(Target(layer.block_number, role, param))
                chunk_of[id(param)] = chunk
    targets.sort(key=lambda t: t.key)
    return targets, chunk_of


class TargetSet:
    """The targets of one rank, their ownership, and the fp32 [K, n] buffer the rule runs on."""

    def __init__(self, targets: List[Target], chunk_of: Dict[int, torch.nn.Module], shape: Tuple[int, int]):
        for t in targets:
            if getattr(t.param, "main_grad", None) is None:
                raise RuntimeError(
                    f"mixln spike scaler: {t.name} has no main_grad; the scaler needs the model "
                    "chunks wrapped in megatron.core.distributed.DistributedDataParallel"
                )
        self.targets = targets
        self.device = targets[0].param.main_grad.device
        self.owned: Optional[torch.Tensor] = None  # [K, n] bool under the distributed optimizer
        self.group = None  # the distributed optimizer's intra-instance DP group (size > 1)
        self._find_ownership(chunk_of, shape)
        self.buffer = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self._make_views()

    def _find_ownership(self, chunk_of, shape) -> None:
        chunk = chunk_of[id(self.targets[0].param)]
        ddp_config = getattr(chunk, "ddp_config", None)
        # The FSDP wrappers: the support table's refusal (for a megatron-core user's own loop).
        if getattr(ddp_config, "use_megatron_fsdp", False):
            refuse_in_training(MixLNUnsupportedError("mixln spike scaler: " + support.message_of("use_megatron_fsdp")))
        if type(chunk).__name__ == "TorchFullyShardedDataParallel":
            refuse_in_training(MixLNUnsupportedError("mixln spike scaler: " + support.message_of("use_torch_fsdp2")))
        if ddp_config is None or not hasattr(chunk, "param_to_bucket_group"):
            raise RuntimeError(
                "mixln spike scaler: the model chunks must be megatron.core.distributed."
                "DistributedDataParallel instances (found " + type(chunk).__name__ + ")"
            )
        if not ddp_config.use_distributed_optimizer:
            return
        group = None
        owned = torch.zeros(shape, dtype=torch.bool, device=self.device)
        for k, t in enumerate(self.targets):
            chunk = chunk_of[id(t.param)]
            this_group = chunk.param_to_bucket_group[t.param].intra_distributed_optimizer_instance_group
            if group is not None and this_group is not group:
                raise NotImplementedError(
                    "mixln spike scaler: target norm parameters in different data-parallel groups"
                )
            group = this_group
            t.owned = owned_range(chunk, t.param)
            owned[k, t.owned[0]:t.owned[1]] = True
        if group.size() > 1:
            self.owned, self.group = owned, group

    def _make_views(self) -> None:
        """Views made once (main_grad is a fixed view into DDP's grad buffer); remade if it changes."""
        self._sources = [t.param.main_grad for t in self.targets]
        grads = [g.view(-1) for g in self._sources]
        self._rows = [self.buffer[k, :t.numel] for k, t in enumerate(self.targets)]
        owned = [(k, t.owned) for k, t in enumerate(self.targets) if t.owned[1] > t.owned[0]]
        self._out_grads = [grads[k][lo:hi] for k, (lo, hi) in owned]
        self._out_rows = [self._rows[k][lo:hi] for k, (lo, hi) in owned]
        self._in_grads = grads

    def gather(self) -> torch.Tensor:
        """The targets' main_grad, as rows of the fp32 buffer (one foreach copy)."""
        if any(t.param.main_grad is not source for t, source in zip(self.targets, self._sources)):
            self._make_views()
        torch._foreach_copy_(self._rows, self._in_grads)
        return self.buffer

    def scatter(self) -> None:
        """Write the buffer's owned elements back into main_grad (one foreach copy)."""
        if self._out_grads:
            torch._foreach_copy_(self._out_grads, self._out_rows)


# --------------------------------------------------------------------------------------- checkpoints
HOLDER_NAME = "mixln_spike_scaler"
FORMAT1_METADATA_KEY = "mixln_spike_scaler"  # read only: what format-1 saves wrote


class CheckpointState:
    """A SpikeScaler's state as checkpoints see it, per (block, role); keeps loaded state until
    the scaler has set itself up. `holders`: {the holding layer's global layer_number: holder}."""

    def __init__(self, scaler):
        self.scaler = scaler
        self.holders: Dict[int, "SpikeStateHolder"] = {}
        self.pending_load: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]] = {}

    def take_loaded(self, block_number: int, role: str):
        return self.pending_load.pop((block_number, role), None)

    def layer_state(self, block_number: int, roles: Sequence[Tuple[str, int]], device=None) -> dict:
        """{role: (momentum, step)} fp32 tensors on `device` (default cpu) of one block's targets
        `roles`, synchronized first (a collective under the distributed optimizer)."""
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
        """{`layer<block>.<role>`: (momentum, step)} of every holder on this rank, what a save
        writes from here."""
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
    """Child module of a target layer carrying the scaler's state of its norms in torch_dist
    checkpoints: only `sharded_state_dict` and `_load_from_state_dict` do anything."""

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
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # heavy

        # The keys: module doc.
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
