"""Which gradients the spike scaler edits, which of their elements this rank owns, and the views
through which one step reads and writes all of them at once.

Targets: the two norms' parameters (MixLNTransformerLayer.norm_parameters()) of the target Mix-LN
layers held by this pipeline stage, keyed and sorted by (block_number, role). A Mix-LN layer is a
transformer block: a GPTModel layer (block_number == layer_number), or in a HybridModel the `*`
layer 2k-1 (its norm: norm1) and the `-` layer 2k (norm2) of block k, which may sit on different
pipeline stages; either way the targets, their names and their order are the same for the same
network. Multi-token-prediction layers are never targets.

Ownership (megatron DDP): under the all-reduce every element of main_grad is reduced on every
rank. Under the distributed optimizer only this rank's shard of each bucket is reduced (the rest
still holds the local gradient) and only that shard is read by the optimizer, so the rule decides
for exactly those elements (ddp_shards.owned_range): no communication per step, no double
counting. TP/SP replicas hold identical reduced norm grads and decide alike without talking.

Batched access: each target's flat main_grad is copied into its row of one fp32 [K, n] buffer
and the owned slices are copied back, each direction one foreach op over views made once, so a
step's op count does not grow with the number of targets. Copying back through fp32 is exact for
every element the rule leaves alone (bf16/fp16 -> fp32 -> bf16/fp16 round-trips).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from ...errors import refuse_in_training
from ...model import support
from ...model.layer import MixLNTransformerLayer
from ...model.support import MixLNUnsupportedError
from ...model.settings import SpikeConfigError
from ..ddp_shards import owned_range


def placement_text(placement) -> str:
    """How the scaler's lines name the model's layout: 'P=2 of L=24' for Mix-LN's first P,
    'layout post:1-2,pre:3-4,... of L=...' (with its boundaries) otherwise."""
    if placement.is_first_p:
        return f"P={placement.post_ln_layers} of L={placement.num_layers}"
    pairs = ", ".join(f"{a}|{b}" for a, b in placement.boundaries[:8]) + (", ..." if len(placement.boundaries) > 8 else "")
    return (f"layout {placement.layout} of L={placement.num_layers}, Post/Pre boundaries: "
            f"{pairs or 'none'}")


def target_layers(targets: Union[str, Tuple[int, ...]], placement) -> Tuple[int, ...]:
    """Global 1-based Mix-LN layer (transformer block) numbers whose norm parameters the scaler
    watches: "boundary" (the blocks on either side of every place where a Post-LN kind, post or
    deepnorm, is followed by a Pre-LN kind, pre or sandwich: Placement.boundary_layers; several
    for an interleaved layout, () when the model has none, and the scaler is then disabled and
    says so), "all" (every block; not the decoder's final norm), or the given blocks. A target
    block's norms are all of its layer's norm_parameters() (a sandwich layer's four).
    `placement` counts blocks (a HybridModel's `*-` pair is one)."""
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
        # The FSDP wrappers: the support table's refusal, one line (the edges refuse them first;
        # this is where a megatron-core user's own loop meets it).
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
