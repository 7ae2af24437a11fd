"""The one adapter that applies the gradient-spike scaler (spike.py) to Megatron's reduced grads.

How it plugs in
  `config.finalize_model_grads_func` becomes a SpikeGradsHook: it runs the original finalize
  (megatron's finalize_model_grads when none was set), whose DP reduction, TP all-reduce of
  sequence-parallel norm grads, embedding sync and 1/num_tokens scaling are then complete, and
  then edits `param.main_grad` of the target norm parameters on this rank.

  * megatron-core users: `install_spike_scaler(model_chunks, config, optimizer)`.
  * stock Megatron-LM (core 0.19+, whose training.py keeps a finalize hook that is already set):
    MIXLN_SPIKE_SCALER=1 (or --mixln-spike-scaler) and the Mix-LN spec. The settings enable
    SpikeScalerLayer in the spec (plain data), and `install_on_config`, called by
    training_hooks.install_training_hooks before the model is built, installs the hook on the
    model's config; each SpikeScalerLayer then adds the state holder (for checkpoints) to
    itself. Megatron-LM itself is not patched. The optimizer is
    found at the hook's first call through `config.grad_scale_func` (Megatron-LM sets it to the
    optimizer's bound `scale_loss`).

Correctness under each kind of parallelism
  * DDP (all-reduce): main_grad is the reduced gradient on every DP rank; the rule runs as is.
  * Distributed optimizer: after the reduce-scatter only the rank's own shard of each bucket is
    reduced; the rest of main_grad still holds the local gradient. From DDP's bucket metadata
    (param_to_bucket_group -> bucket.param_to_index, the bucket's size and the rank in the
    intra-instance DP group) the hook knows which elements of each target this rank owns, and
    decides for exactly those (the rule is elementwise, spike.py): no communication per step, no
    double counting, and the owned elements are the only ones the optimizer reads. Each element's
    state is advanced by its owner only; `SpikeScaler.synchronize()` (a masked all-reduce of the
    state over the same group: every element comes from its one owner) makes the state replicated
    again, and runs whenever the state is checkpointed, so what is saved is the full state and
    does not depend on the layout. (Considered instead: all-reduce the target grads every step
    with the non-owned parts zeroed, so that every rank holds the whole state all the time. Same
    decisions, but one more collective per step inside a possibly captured region, for nothing
    the optimizer reads.)
  * TP / sequence parallelism: norm weights are replicated over TP and their grads are identical
    on every TP rank (SP norm grads are all-reduced over TP by finalize_model_grads), so every TP
    rank takes the same decisions without communication.
  * PP / VPP: each stage handles the targets it holds; everything is per element, so the
    decisions do not depend on where the stages split the model.
  * fp16 loss scaling: main_grad is still multiplied by the loss scale; the hook divides by the
    optimizer's current scale (a device tensor) and multiplies the replacement back.
  * Skipped steps: the hook only *proposes* the next state (SpikeState.propose, into preallocated
    buffers); the optimizer's `step` (wrapped on the instance, the class is untouched) commits it
    when it reports success and discards it otherwise (fp16 overflow, grad-norm skip). A rerun of
    forward-backward for the same step (Megatron's rerun machinery) proposes again from the same
    committed state: same result. Without any optimizer known, each proposal is committed at once
    (documented fallback for custom loops; then fp16 skips cannot be seen).
  * CUDA graphs: nothing in the hook reads a device value on the host; statistics stay on the
    device and are read at the logging interval, from the optimizer-step wrapper (never captured).

Checkpoints (torch_dist)
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
  target layer synchronizes the state over the DP group (a collective, as in every save/load).

Reporting: per committed step the number of scaled elements, the largest |g| / momentum and the
number of non-finite target elements, summed (max for the ratio) over the distributed
optimizer's shards and the pipeline stages, go to Megatron's TensorBoard / W&B writers when
they exist, else to this module's logger (INFO, from the last rank).
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .ddp_shards import owned_range
from ..model.layer import MixLNTransformerLayer
from ..model.placement import Placement
from ..model.settings import SPIKE_FIELDS
from .spike import (
    ResolvedSpikeSettings,
    SpikeSettings,
    SpikeState,
    resolve_spike_settings,
    target_layers,
)

logger = logging.getLogger(__name__)

HOLDER_NAME = "mixln_spike_scaler"
METADATA_KEY = "mixln_spike_scaler"
STATE_FORMAT = 1
DEFAULT_LOG_INTERVAL = 100

__all__ = [
    "SpikeGradsHook",
    "SpikeScaler",
    "SpikeScalerLayer",
    "SpikeStateHolder",
    "get_spike_scaler",
    "install_on_config",
    "install_spike_scaler",
    "norm_parameters",
    "remove_spike_scaler",
]


# --------------------------------------------------------------------------------------- targets
def _params_of(module, recurse: bool = True) -> List[Tuple[str, torch.nn.Parameter]]:
    if module is None:
        return []
    return [(name, p) for name, p in module.named_parameters(recurse=recurse)]


def norm_parameters(layer) -> List[Tuple[str, torch.nn.Parameter]]:
    """[(role, parameter)] of a Mix-LN layer's two norms, with backend-independent role names.

    norm1 is the layer's first norm in forward order (Pre-LN: before attention; Post-LN: N1 after
    the attention residual add), norm2 the second; roles are e.g. 'norm1.weight', 'norm2.bias'.
    TE's fused Pre-LN norms live in linear_qkv / linear_fc1 as layer_norm_weight / _bias.
    """
    if layer.is_post_ln:
        groups = [("norm1", _params_of(layer.post_attention_layernorm)),
                  ("norm2", _params_of(layer.post_mlp_layernorm))]
    else:
        def pre(norm, fused):
            own = _params_of(norm)
            if own:
                return own
            fused_params = _params_of(fused, recurse=False)
            return [(n[len("layer_norm_"):], p) for n, p in fused_params if n.startswith("layer_norm_")]

        groups = [
            ("norm1", pre(layer.input_layernorm, getattr(layer.self_attention, "linear_qkv", None))),
            ("norm2", pre(layer.pre_mlp_layernorm, getattr(layer.mlp, "linear_fc1", None))),
        ]
    return [(f"{group}.{name}", p) for group, params in groups for name, p in params]


class _Target:
    __slots__ = ("layer_number", "role", "param", "numel", "owned")

    def __init__(self, layer_number, role, param):
        self.layer_number, self.role, self.param = layer_number, role, param
        self.numel = param.numel()
        self.owned = (0, self.numel)  # elements of main_grad this rank's optimizer reads

    @property
    def name(self) -> str:
        return f"layer{self.layer_number}.{self.role}"


# --------------------------------------------------------------------------------------- scaler
class SpikeScaler:
    """Per-process owner of the rule's state, the hook's logic, the commit and the reporting."""

    def __init__(self, settings: ResolvedSpikeSettings, placement: Placement, config=None):
        self.config = config
        self._configure(settings, placement)
        self.optimizer = None
        self.has_grad_scaler = False
        self.eager_commit = False
        self.state: Optional[SpikeState] = None
        self.targets: List[_Target] = []
        self.is_set_up = False
        self._distopt = None  # (owned mask [K, n], intra-instance DP group) under the distributed optimizer
        self._holders: Dict[int, "SpikeStateHolder"] = {}
        self._pending_load: Dict[Tuple[int, str], dict] = {}
        self._own_markers: List[dict] = []
        self.state_from_checkpoint = False
        self.committed_steps = 0
        self.optimizer_steps = 0
        # scaled, max ratio, non-finite over the steps already reported: reduced, and this rank's own
        self._reported_totals = [0.0, 0.0, 0.0]
        self._local_totals = [0.0, 0.0, 0.0]
        self._ring = None
        self._ring_iterations: List[int] = []
        self._pp_group = None
        self.timing: Optional[dict] = None  # enable_timing()
        # debug: recorder(scaler, grads [K, n], spike, replacement, scale, owned mask or None)
        self.recorder: Optional[Callable] = None
        self.last_report: Optional[List[dict]] = None

    def _configure(self, settings: ResolvedSpikeSettings, placement: Placement) -> None:
        self.settings = settings
        self.placement = placement
        self.layers = target_layers(settings.targets, placement)

    def describe(self) -> str:
        return (
            f"[mixln_megatron] gradient-spike scaler on the norms of global layers "
            f"{', '.join(map(str, self.layers))} (P={self.placement.post_ln_layers} of "
            f"L={self.placement.num_layers}): {self.settings.describe()}"
        )

    # -- installation pieces ---------------------------------------------------------------------
    def attach(self, layer) -> "SpikeStateHolder":
        """Give `layer` its checkpoint holder (idempotent)."""
        holder = layer._modules.get(HOLDER_NAME)
        if isinstance(holder, SpikeStateHolder):
            holder.bind(self, layer)
        else:
            holder = SpikeStateHolder(self, layer)
            layer.add_module(HOLDER_NAME, holder)
        if holder.is_target:
            self._holders[holder.layer_number] = holder
        return holder

    def set_optimizer(self, optimizer) -> None:
        """Commit proposals after `optimizer.step()` reports success (wraps the instance's step)."""
        if optimizer is None or optimizer is self.optimizer:
            return
        self.optimizer = optimizer
        subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
        self.has_grad_scaler = any(getattr(o, "grad_scaler", None) is not None for o in subs)
        self.eager_commit = False
        if getattr(optimizer, "_mixln_spike_scaler", None) is self:
            return
        original = optimizer.step
        scaler = self

        @functools.wraps(original)
        def step(*args, **kwargs):
            result = original(*args, **kwargs)
            success = result[0] if isinstance(result, tuple) else result
            scaler.after_optimizer_step(bool(success))
            return result

        optimizer.step = step
        optimizer._mixln_spike_scaler = self

    def enable_timing(self) -> dict:
        """Accumulate the wall-clock time of the hook's own work and of the commit."""
        self.timing = {"hook_s": 0.0, "commit_s": 0.0, "hook_calls": 0, "commits": 0}
        return self.timing

    # -- set-up at the first hook call (eager, before any CUDA graph capture) -----------------------
    def _setup(self, model_chunks) -> None:
        found = []
        for chunk in model_chunks:
            for module in chunk.modules():
                if isinstance(module, MixLNTransformerLayer):
                    found.append((chunk, module))
                    self.attach(module)
        targets, owner = [], {}
        for chunk, layer in found:
            if layer.layer_number not in self.layers or getattr(layer, "is_mtp_layer", False):
                continue
            for role, param in norm_parameters(layer):
                if param.requires_grad:
                    targets.append(_Target(layer.layer_number, role, param))
                    owner[id(param)] = chunk
        targets.sort(key=lambda t: (t.layer_number, t.role))
        self.targets = targets
        if self.optimizer is None and self.config is not None:
            bound = getattr(self.config, "grad_scale_func", None)
            candidate = getattr(bound, "__self__", None)
            if candidate is not None and hasattr(candidate, "step") and hasattr(candidate, "get_loss_scale"):
                self.set_optimizer(candidate)
        if self.optimizer is None:
            self.eager_commit = True
            logger.warning(
                "mixln spike scaler: no optimizer known (pass optimizer= to install_spike_scaler, or "
                "set config.grad_scale_func = optimizer.scale_loss as Megatron-LM does); each step's "
                "decisions are committed at once, so a step the optimizer skips still counts"
            )
            if self.config is not None and getattr(self.config, "fp16", False):
                logger.warning("mixln spike scaler: fp16 without a known optimizer: the loss scale is unknown")
        if targets:
            for t in targets:
                if getattr(t.param, "main_grad", None) is None:
                    raise RuntimeError(
                        f"mixln spike scaler: {t.name} has no main_grad; the scaler needs the model "
                        "chunks wrapped in megatron.core.distributed.DistributedDataParallel"
                    )
            device = targets[0].param.main_grad.device
            self.state = SpikeState(
                [t.numel for t in targets], self.settings.threshold, self.settings.beta,
                self.settings.warmup_steps, device=device,
            )
            for k, t in enumerate(targets):
                data = self._pending_load.pop((t.layer_number, t.role), None)
                if data is not None:
                    self.state.set_target(k, data["momentum"], data["step"])
            self._setup_distopt(targets, owner)
        self.is_set_up = True

    def _setup_distopt(self, targets, owner) -> None:
        chunk = owner[id(targets[0].param)]
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None or not hasattr(chunk, "param_to_bucket_group"):
            raise RuntimeError(
                "mixln spike scaler: the model chunks must be megatron.core.distributed."
                "DistributedDataParallel instances (found " + type(chunk).__name__ + ")"
            )
        if getattr(ddp_config, "use_megatron_fsdp", False):
            raise NotImplementedError("mixln spike scaler: Megatron-FSDP is not supported")
        if not ddp_config.use_distributed_optimizer:
            return
        group, mask_parts = None, []
        for t in targets:
            bucket_group = owner[id(t.param)].param_to_bucket_group[t.param]
            t.owned = owned_range(owner[id(t.param)], t.param)
            this_group = bucket_group.intra_distributed_optimizer_instance_group
            if group is not None and this_group is not group:
                raise NotImplementedError(
                    "mixln spike scaler: target norm parameters in different data-parallel groups"
                )
            group = this_group
            part = torch.zeros(self.state.shape[1], dtype=torch.bool, device=self.state.device)
            part[t.owned[0]:t.owned[1]] = True
            mask_parts.append(part)
        if group.size() > 1:
            self._distopt = (torch.stack(mask_parts), group)  # owned [K, n], intra-instance DP group

    # -- the hook's own work ---------------------------------------------------------------------
    def after_finalize(self, model_chunks, force_all_reduce: bool = False, pg_collection=None) -> None:
        """Runs right after the original finalize_model_grads. With force_all_reduce megatron
        all-reduced even under the distributed optimizer: the owned shards are reduced all the same,
        so the hook proceeds unchanged."""
        if not self.is_set_up:
            if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
                self._pp_group = pg_collection.pp
            self._setup(model_chunks)
        if not self.targets:
            if self.eager_commit:
                self._after_commit(True)
            return
        started = time.perf_counter() if self.timing is not None else 0.0
        grads = [t.param.main_grad.view(-1) for t in self.targets]
        local = self.state.rows(grads)  # [K, n], a copy
        owned = self._distopt[0] if self._distopt is not None else None
        scale = self.optimizer.get_loss_scale() if self.has_grad_scaler else None
        spike, replacement = self.state.propose(local, scale, owned)
        # Only the spiking elements change; the others are written back exactly as they were.
        out = torch.where(spike, replacement.to(local.dtype), local)
        dst, src = [], []
        for k, (t, g) in enumerate(zip(self.targets, grads)):
            lo, hi = t.owned
            if hi - lo == t.numel:
                dst.append(g)
                src.append(out[k] if t.numel == out.shape[1] else out[k, :hi])
            elif hi > lo:
                dst.append(g[lo:hi])
                src.append(out[k, lo:hi])
        if dst:
            torch._foreach_copy_(dst, src)
        if self.timing is not None:
            self.timing["hook_s"] += time.perf_counter() - started
            self.timing["hook_calls"] += 1
        if self.recorder is not None:
            self.recorder(self, local, spike, replacement, scale, owned)
        if self.eager_commit:
            self._after_commit(True)

    # -- commit / discard ------------------------------------------------------------------------
    def after_optimizer_step(self, update_successful: bool) -> None:
        """Called by the wrapped optimizer.step with its success flag."""
        self._after_commit(update_successful)

    def commit(self, update_successful: bool = True) -> None:
        """For custom loops without a megatron optimizer: commit (or drop) the last proposal."""
        self._after_commit(update_successful)

    def _after_commit(self, success: bool) -> None:
        started = time.perf_counter() if self.timing is not None else 0.0
        self.optimizer_steps += 1
        if self.state is not None:
            if success:
                self.state.commit()
            else:
                self.state.discard()
        if success:
            self.committed_steps += 1
            self._record_step()
        if self.timing is not None:
            self.timing["commit_s"] += time.perf_counter() - started
            self.timing["commits"] += 1
        if self.optimizer_steps % self.log_interval() == 0:
            self.report()

    # -- statistics ------------------------------------------------------------------------------
    def log_interval(self) -> int:
        if self.settings.log_interval:
            return int(self.settings.log_interval)
        args = _megatron_args()
        return int(getattr(args, "log_interval", None) or DEFAULT_LOG_INTERVAL)

    def _stats_device(self) -> torch.device:
        if self.state is not None:
            return self.state.device
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _record_step(self) -> None:
        size = self.log_interval()
        if self._ring is None or self._ring.shape[0] < size:
            self._ring = torch.zeros(size, 3, dtype=torch.float32, device=self._stats_device())
        index = len(self._ring_iterations)
        if index >= self._ring.shape[0]:
            return
        if self.state is not None:
            self._ring[index].copy_(self.state.last_stats)
        else:
            self._ring[index].zero_()
        args = _megatron_args()
        iteration = getattr(args, "curr_iteration", None)
        self._ring_iterations.append(int(iteration) + 1 if iteration is not None else self.committed_steps)

    def report(self) -> List[dict]:
        """Reduce the steps recorded since the last report over the distributed optimizer's shards
        and the pipeline stages, and write them. Host sync and collectives (every rank calls it at
        the same step, through the optimizer-step wrapper)."""
        n = len(self._ring_iterations)
        if n == 0 or self._ring is None:
            return []
        local = self._ring[:n].clone()
        self._add_to_totals(self._local_totals, local.tolist())
        values = self._reduce_stats(local.clone()).tolist()
        self._add_to_totals(self._reported_totals, values)
        report = [
            {"iteration": it, "scaled": int(v[0]), "max_ratio": float(v[1]), "nonfinite": int(v[2])}
            for it, v in zip(self._ring_iterations, values)
        ]
        self._ring_iterations = []
        self.last_report = report
        _write_report(report)
        return report

    def _stat_groups(self) -> list:
        groups = []
        if self._distopt is not None:
            groups.append(self._distopt[1])  # each rank counted the shard it owns
        group = self._pp_group
        if group is None and torch.distributed.is_initialized():
            try:
                from megatron.core import parallel_state

                if parallel_state.model_parallel_is_initialized():
                    group = parallel_state.get_pipeline_model_parallel_group()
            except Exception:  # pragma: no cover - no parallel state
                group = None
        if group is not None and torch.distributed.get_world_size(group) > 1:
            groups.append(group)
        return groups

    def _reduce_stats(self, rows: torch.Tensor) -> torch.Tensor:
        """Sum (count columns) / max (ratio column) of [.., 3] statistics over shards and stages."""
        for group in self._stat_groups():
            sums = rows[..., [0, 2]].contiguous()
            torch.distributed.all_reduce(sums, group=group)
            maxes = rows[..., 1].contiguous()
            torch.distributed.all_reduce(maxes, op=torch.distributed.ReduceOp.MAX, group=group)
            rows[..., 0], rows[..., 2], rows[..., 1] = sums[..., 0], sums[..., 1], maxes
        return rows

    @staticmethod
    def _add_to_totals(totals: list, rows) -> None:
        for scaled, ratio, nonfinite in rows:
            totals[0] += scaled
            totals[1] = max(totals[1], ratio)
            totals[2] += nonfinite

    def totals(self, reduce: bool = False) -> dict:
        """Totals over committed steps (host sync). reduce=False: this rank's own counts (under the
        distributed optimizer, its shard of the targets; under PP, its stage's targets).
        reduce=True: over shards and pipeline stages; collectives over the distributed optimizer's
        DP group and the PP group, so every rank must call it at the same point."""
        n = len(self._ring_iterations)
        rows = self._ring[:n].clone() if n else torch.zeros(0, 3, device=self._stats_device())
        if reduce:
            rows = self._reduce_stats(rows)
            scaled, ratio, nonfinite = self._reported_totals
        else:
            scaled, ratio, nonfinite = self._local_totals
        for s, r, f in rows.tolist():
            scaled, ratio, nonfinite = scaled + s, max(ratio, r), nonfinite + f
        return {"scaled": int(scaled), "max_ratio": float(ratio), "nonfinite": int(nonfinite),
                "committed_steps": self.committed_steps}

    @torch.no_grad()
    def synchronize(self) -> None:
        """Make the state replicated over the distributed optimizer's DP group (each element from
        its owner). Collective over that group; a no-op without the distributed optimizer."""
        if self._distopt is None or self.state is None:
            return
        owned, group = self._distopt
        for tensor in (self.state.momentum, self.state.step):
            mine = torch.where(owned, tensor, torch.zeros((), dtype=tensor.dtype, device=tensor.device))
            torch.distributed.all_reduce(mine, group=group)
            tensor.copy_(mine)

    def target_names(self) -> List[str]:
        return [t.name for t in self.targets]

    # -- checkpoint support (called by the holders) ------------------------------------------------
    def has_state(self) -> bool:
        return self.committed_steps > 0 or self.state_from_checkpoint

    def checkpoint_layers(self, metadata) -> Tuple[int, ...]:
        """Which layers' state the sharded state dict carries, for this save or load (see module doc)."""
        if not isinstance(metadata, dict):
            return self.layers
        marker = metadata.get(METADATA_KEY)
        if marker is not None:
            layers = tuple(int(n) for n in marker.get("layers", ()))
            if layers and not any(marker is own for own in self._own_markers):
                self.state_from_checkpoint = True  # a load: the checkpoint carries spike state
            return layers
        caller_keys = [k for k in metadata if k != "dp_cp_group"]
        layers = self.layers if (not caller_keys or self.has_state()) else ()
        marker = {"format": STATE_FORMAT, "layers": list(layers)}
        self._own_markers = (self._own_markers + [marker])[-8:]
        metadata[METADATA_KEY] = marker
        return layers

    def layer_state(self, layer_number: int, roles: Sequence[Tuple[str, int]]) -> dict:
        """The full state of one layer's targets (synchronizes first: collective over the
        distributed optimizer's DP group, which every DP peer reaches in its sharded_state_dict)."""
        self.synchronize()
        out = {}
        index = {(t.layer_number, t.role): k for k, t in enumerate(self.targets)}
        for role, numel in roles:
            k = index.get((layer_number, role))
            if k is not None and self.state is not None:
                out[role] = self.state.get_target(k)
            elif (layer_number, role) in self._pending_load:
                data = self._pending_load[(layer_number, role)]
                out[role] = {"momentum": data["momentum"].clone(), "step": data["step"].clone()}
            else:
                out[role] = {"momentum": torch.zeros(numel, dtype=torch.float32),
                             "step": torch.zeros(numel, dtype=torch.int64)}
        return {"format": STATE_FORMAT, "layer": layer_number, "targets": out,
                "settings": {"threshold": self.settings.threshold, "beta": self.settings.beta,
                             "warmup_steps": self.settings.warmup_steps}}

    def load_layer_state(self, layer_number: int, roles: Sequence[Tuple[str, int]], data) -> None:
        if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
            raise RuntimeError(
                f"mixln spike scaler: unreadable spike-scaler state for layer {layer_number} in the "
                f"checkpoint (format {getattr(data, 'get', lambda k: None)('format')!r}, expected {STATE_FORMAT})"
            )
        stored = data.get("targets", {})
        index = {(t.layer_number, t.role): k for k, t in enumerate(self.targets)}
        for role, numel in roles:
            entry = stored.get(role)
            if entry is None:
                self._warn_missing(layer_number, role)
                continue
            momentum = torch.as_tensor(entry["momentum"], dtype=torch.float32).reshape(-1).cpu()
            step = torch.as_tensor(entry["step"], dtype=torch.int64).reshape(-1).cpu().expand(numel).clone()
            if momentum.numel() != numel:
                raise RuntimeError(
                    f"mixln spike scaler: the checkpoint's state for layer {layer_number} {role} has "
                    f"{momentum.numel()} elements, the model's parameter {numel}"
                )
            k = index.get((layer_number, role))
            if k is not None and self.state is not None:
                self.state.set_target(k, momentum, step)
            else:
                self._pending_load[(layer_number, role)] = {"momentum": momentum.clone(), "step": step}
        self.state_from_checkpoint = True

    def _warn_missing(self, layer_number: int, role: Optional[str] = None) -> None:
        """Once per holder and load (a load calls each holder's _load_from_state_dict once)."""
        what = f"layer {layer_number}" + (f" {role}" if role else "")
        logger.warning(
            f"mixln spike scaler: the checkpoint has no spike-scaler state for {what} (saved without "
            f"the scaler or with other targets); its momentum starts fresh and nothing is scaled "
            f"there for the first {self.settings.warmup_steps} steps"
        )


def _megatron_args():
    """Megatron-LM's global args when megatron.training is in use, else None (never imports it)."""
    module = sys.modules.get("megatron.training.global_vars")
    if module is None or getattr(module, "_GLOBAL_ARGS", None) is None:
        return None
    return module._GLOBAL_ARGS


def _write_report(report: List[dict]) -> None:
    module = sys.modules.get("megatron.training.global_vars")
    tb = module.get_tensorboard_writer() if module is not None else None
    wandb = module.get_wandb_writer() if module is not None else None
    for row in report:
        if tb is not None:
            tb.add_scalar("mixln-spike/scaled-elements", row["scaled"], row["iteration"])
            tb.add_scalar("mixln-spike/max-ratio", row["max_ratio"], row["iteration"])
            tb.add_scalar("mixln-spike/nonfinite-elements", row["nonfinite"], row["iteration"])
        if wandb is not None:
            wandb.log({"mixln-spike/scaled-elements": row["scaled"], "mixln-spike/max-ratio": row["max_ratio"],
                       "mixln-spike/nonfinite-elements": row["nonfinite"]}, row["iteration"])
    if tb is None and wandb is None:
        is_last = (not torch.distributed.is_initialized()
                   or torch.distributed.get_rank() == torch.distributed.get_world_size() - 1)
        if is_last and report:
            scaled = sum(r["scaled"] for r in report)
            logger.info(
                "mixln spike scaler: iterations %d-%d: %d elements scaled (per step %s), largest "
                "|g|/momentum %.3g, %d non-finite target gradient elements left alone",
                report[0]["iteration"], report[-1]["iteration"], scaled,
                [r["scaled"] for r in report], max(r["max_ratio"] for r in report),
                sum(r["nonfinite"] for r in report),
            )


# --------------------------------------------------------------------------------------- holder
class SpikeStateHolder(torch.nn.Module):
    """Child module of a Mix-LN layer that carries the scaler's state in torch_dist checkpoints.

    No parameters or buffers: only `sharded_state_dict` (save and load requests) and
    `_load_from_state_dict` (receives the loaded object) do anything.
    """

    def __init__(self, scaler: SpikeScaler, layer):
        super().__init__()
        self.bind(scaler, layer)

    def bind(self, scaler: SpikeScaler, layer) -> None:
        self.__dict__["_scaler"] = scaler  # a plain attribute, not a submodule
        self.__dict__["_pg_collection"] = getattr(layer, "pg_collection", None)
        self.layer_number = int(layer.layer_number)
        self.is_target = self.layer_number in scaler.layers and not getattr(layer, "is_mtp_layer", False)
        self.roles = [(role, p.numel()) for role, p in norm_parameters(layer)] if self.is_target else []

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
        scaler = self._scaler
        layers = scaler.checkpoint_layers(metadata)
        if not self.is_target or self.layer_number not in layers:
            return {}
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        data = scaler.layer_state(self.layer_number, self.roles)
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
            self._scaler._warn_missing(self.layer_number)
            return
        try:
            self._scaler.load_layer_state(self.layer_number, self.roles, data)
        except RuntimeError as exc:
            error_msgs.append(str(exc))


# --------------------------------------------------------------------------------------- hook
class SpikeGradsHook:
    """What `config.finalize_model_grads_func` becomes: the original finalize, then the scaler."""

    def __init__(self, scaler: SpikeScaler, original: Optional[Callable] = None):
        self.mixln_spike_scaler = scaler
        self.original = original

    def __call__(self, model, *args, **kwargs):
        original = self.original
        if original is None:
            from megatron.core.distributed import finalize_model_grads as original
        result = original(model, *args, **kwargs)
        pg_collection = kwargs.get("pg_collection", args[1] if len(args) > 1 else None)
        force_all_reduce = kwargs.get("force_all_reduce", args[2] if len(args) > 2 else False)
        chunks = model if isinstance(model, (list, tuple)) else [model]
        self.mixln_spike_scaler.after_finalize(chunks, bool(force_all_reduce), pg_collection)
        return result

    def __repr__(self) -> str:
        return f"SpikeGradsHook(original={self.original!r})"


def get_spike_scaler(config) -> Optional[SpikeScaler]:
    """The scaler installed on `config` (a TransformerConfig, or Megatron-LM's wrapper), if any."""
    config = getattr(config, "transformer", config)
    return getattr(getattr(config, "finalize_model_grads_func", None), "mixln_spike_scaler", None)


def _install_hook(config, scaler: SpikeScaler) -> None:
    current = getattr(config, "finalize_model_grads_func", None)
    config.finalize_model_grads_func = SpikeGradsHook(scaler, current)


def remove_spike_scaler(config) -> None:
    """Put back the finalize function that was there before the scaler (tests, notebooks)."""
    config = getattr(config, "transformer", config)
    hook = getattr(config, "finalize_model_grads_func", None)
    if isinstance(hook, SpikeGradsHook):
        config.finalize_model_grads_func = hook.original


def _announce(text: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(text, flush=True)


def _iter_mixln_layers(model_chunks):
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, MixLNTransformerLayer):
                yield module


def install_spike_scaler(model_chunks, config=None, optimizer=None, settings=None, **overrides) -> Optional[SpikeScaler]:
    """Enable the gradient-spike scaler on a megatron-core model (list of DDP-wrapped chunks).

    settings: a mixln_megatron.training.spike.SpikeSettings or dict (threshold, beta, warmup_steps, targets,
    log_interval); unset fields take the defaults. Keyword overrides are merged into it. Calling
    this enables the scaler whatever settings.enabled says.
    optimizer: the megatron optimizer whose step() decides whether a step's decisions are kept;
    without it the scaler looks for `config.grad_scale_func.__self__` at its first call.
    Install before loading a checkpoint, so the state is restored. Returns None (and installs
    nothing) when the targets are the boundary and the model has none.
    """
    from megatron.core.utils import get_model_config

    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    config = getattr(config, "transformer", config) if config is not None else get_model_config(chunks[0])
    if isinstance(settings, SpikeSettings):
        settings = {name: getattr(settings, name) for name in SPIKE_FIELDS}
    merged = {**(settings or {}), **overrides, "enabled": True}
    resolved = resolve_spike_settings(SpikeSettings(**merged))
    layers = list(_iter_mixln_layers(chunks))
    if not layers:
        raise ValueError("install_spike_scaler: the model has no Mix-LN layers (MixLNTransformerLayer)")
    placement = layers[0].placement
    if not target_layers(resolved.targets, placement):
        _announce(f"[mixln_megatron] gradient-spike scaler disabled: the model has no Post/Pre-LN "
                  f"boundary (P={placement.post_ln_layers}, L={placement.num_layers})")
        return None
    scaler = get_spike_scaler(config)
    if scaler is None:
        scaler = SpikeScaler(resolved, placement, config)
        _install_hook(config, scaler)
        _announce(scaler.describe())
    elif resolved != scaler.settings:
        if scaler.is_set_up:
            raise RuntimeError("install_spike_scaler: the scaler already ran with other settings")
        scaler._configure(resolved, placement)
        _announce(scaler.describe())
    for layer in layers:
        scaler.attach(layer)
    if optimizer is not None:
        scaler.set_optimizer(optimizer)
    return scaler


def install_on_config(config, placement: Placement, settings: ResolvedSpikeSettings) -> Optional[SpikeScaler]:
    """Install the hook on a model's config before the model is built (Megatron-LM's path; called
    by training_hooks.install_training_hooks). Layers built from a spec with the scaler enabled
    (SpikeScalerLayer) then attach their checkpoint holders. Idempotent (one call per VPP chunk).
    Returns None, and announces it once, when the targets are the boundary and there is none."""
    config = getattr(config, "transformer", config)
    if not target_layers(settings.targets, placement):
        if not getattr(config, "_mixln_spike_disabled_announced", False):
            _announce(f"[mixln_megatron] gradient-spike scaler disabled: the model has no Post/Pre-LN "
                      f"boundary (P={placement.post_ln_layers}, L={placement.num_layers})")
            config._mixln_spike_disabled_announced = True
        return None
    scaler = get_spike_scaler(config)
    if scaler is None:
        scaler = SpikeScaler(settings, placement, config)
        _install_hook(config, scaler)
        _announce(scaler.describe())
    return scaler


class SpikeScalerLayer(MixLNTransformerLayer):
    """MixLNTransformerLayer that joins the spike scaler installed on its config (install_on_config)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        scaler = get_spike_scaler(self.config)
        if scaler is not None:
            scaler.attach(self)
