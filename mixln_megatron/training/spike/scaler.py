"""SpikeScaler: one process's owner of the rule's state, the per-step work after Megatron's
finalize_model_grads, the commit after the optimizer step and the reporting; and its installation
on `config.finalize_model_grads_func` (a SpikeGradsHook: the original finalize, then the scaler
edits the target norms' `main_grad`). Where it sits and why: CONTRIBUTING.md, "Where the spike
scaler sits"; the user's view: docs/configuration.md.

Per parallelism: DDP runs the rule as is; under the distributed optimizer each rank decides for
its own shard and `synchronize()` (a masked all-reduce) makes the state whole when it is
checkpointed (rather than one more collective per step); TP / SP replicas decide alike; PP
stages handle the targets they hold. The hook only proposes: the optimizer's `step`, wrapped on
the instance (CommitAfterStep), commits on success and discards otherwise; without a known
optimizer each proposal is committed at once. Nothing per step reads a device value on the host.
`install_finalize_hook` is the one function that touches the config; `remove_spike_scaler`
undoes every install (config, optimizer, layers).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Callable, List, Optional

import torch

from ... import compat
from ...model.layer import on_layer_built, remove_on_layer_built
from ...model.placement import Placement
from ...model.settings import SpikeSettings
from .. import runtime
from ..runtime import FinalizeWrapper, SharedByConfigCopies, unwrap_finalize
from .rule import DEFAULT_LOG_INTERVAL, SpikeState, StepStats
from .state import (HOLDER_NAME, CheckpointState, SpikeStateHolder, Target, TargetSet, find_targets, is_target_layer,
                    mixln_layers, placement_text, target_layers)

logger = logging.getLogger(__name__)


class CommitAfterStep:
    """What `optimizer.step` becomes on one optimizer instance (its class untouched): the step,
    then the scaler's commit or discard. A wrapper because Megatron's optimizers have no step hook
    and torch's step post-hook never runs for a step Megatron skips. uninstall() restores it."""

    _ABSENT = object()

    def __init__(self, optimizer, scaler, previous):
        functools.update_wrapper(self, optimizer.step)
        self.original = optimizer.step
        self.optimizer = optimizer
        self.scaler = scaler
        self.previous = previous  # the instance's own `step` attribute before, or _ABSENT

    @classmethod
    def install(cls, optimizer, scaler) -> "CommitAfterStep":
        wrapper = cls(optimizer, scaler, optimizer.__dict__.get("step", cls._ABSENT))
        optimizer.step = wrapper
        return wrapper

    def __call__(self, *args, **kwargs):
        result = self.original(*args, **kwargs)
        if self.scaler is not None:
            success = result[0] if isinstance(result, tuple) else result
            self.scaler.after_optimizer_step(bool(success))
        return result

    def uninstall(self) -> None:
        self.scaler = None  # inert even where someone wrapped step again on top of it
        if self.optimizer.__dict__.get("step") is self:
            if self.previous is self._ABSENT:
                del self.optimizer.step  # the class's step again
            else:
                self.optimizer.step = self.previous


class SpikeScaler(SharedByConfigCopies):
    """Per-process owner of the rule's state, the hook's work, the commit and the reporting."""

    def __init__(self, settings: SpikeSettings, placement: Placement, config=None):
        self.config = config
        self._configure(settings, placement)
        self.optimizer = None
        self._step_wrapper: Optional[CommitAfterStep] = None
        self.has_grad_scaler = False
        self.eager_commit = False
        self.state: Optional[SpikeState] = None
        self.targets: List[Target] = []
        self.target_set: Optional[TargetSet] = None
        self.is_set_up = False
        self.checkpoint = CheckpointState(self)
        self.stats = StepStats()
        self.committed_steps = 0
        self.optimizer_steps = 0
        self._pp_group = None
        self.timing: Optional[dict] = None  # enable_timing()
        # debug: recorder(scaler, grads [K, n] before the rule, spike, replacement, scale, owned mask or None)
        self.recorder: Optional[Callable] = None

    def _configure(self, settings: SpikeSettings, placement: Placement) -> None:
        self.settings = settings
        self.placement = placement
        self.layers = target_layers(settings.targets, placement)

    def describe(self) -> str:
        return (
            f"[mixln_megatron] gradient-spike scaler on the norms of global layers "
            f"{', '.join(map(str, self.layers))} ({placement_text(self.placement)}): {self.settings.describe()}"
        )

    @property
    def last_report(self) -> Optional[List[dict]]:
        return self.stats.last_report

    # -- installation pieces ---------------------------------------------------------------------
    def attach(self, layer) -> Optional[SpikeStateHolder]:
        """Give a layer holding norms of a target block its checkpoint holder (idempotent); None
        for other layers. Holders are keyed by the layer's own global number (two per hybrid block)."""
        if not is_target_layer(layer, self.layers):
            return None
        holder = layer._modules.get(HOLDER_NAME)
        if isinstance(holder, SpikeStateHolder):
            holder.bind(self, layer)
        else:
            holder = SpikeStateHolder(self, layer)
            layer.add_module(HOLDER_NAME, holder)
        self.checkpoint.holders[holder.layer_number] = holder
        return holder

    def set_optimizer(self, optimizer) -> None:
        """Commit proposals after `optimizer.step()` reports success (wraps the instance's step;
        release_optimizer() puts it back)."""
        if optimizer is None or optimizer is self.optimizer:
            return
        self.release_optimizer()
        self.optimizer = optimizer
        subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
        self.has_grad_scaler = any(getattr(o, "grad_scaler", None) is not None for o in subs)
        self.eager_commit = False
        self._step_wrapper = CommitAfterStep.install(optimizer, self)

    def release_optimizer(self) -> None:
        """Undo set_optimizer: the optimizer's step is what it was, and no longer drives this scaler."""
        wrapper, self._step_wrapper = self._step_wrapper, None
        if wrapper is not None:
            wrapper.uninstall()
        self.optimizer = None
        self.has_grad_scaler = False

    def detach(self) -> None:
        """Undo what the scaler installed on the model and the optimizer: the checkpoint holders
        it added to layers, and the optimizer's step wrapper (remove_spike_scaler calls it)."""
        self.release_optimizer()
        for holder in self.checkpoint.holders.values():
            layer = holder.layer
            if layer is not None and layer._modules.get(HOLDER_NAME) is holder:
                delattr(layer, HOLDER_NAME)
        self.checkpoint.holders.clear()

    def enable_timing(self) -> dict:
        """Accumulate the wall-clock time of the hook's own work, of the commit and of the reports."""
        self.timing = {"hook_s": 0.0, "commit_s": 0.0, "hook_calls": 0, "commits": 0,
                       "report_s": 0.0, "reports": 0}
        return self.timing

    # -- set-up at the first hook call (eager, before any CUDA graph capture) -----------------------
    def _setup(self, model_chunks) -> None:
        for _, layer in mixln_layers(model_chunks):
            self.attach(layer)
        targets, chunk_of = find_targets(model_chunks, self.layers)
        self.targets = targets
        self._find_optimizer()
        if targets:
            self.target_set = TargetSet(targets, chunk_of, (len(targets), max(t.numel for t in targets)))
            self.state = SpikeState(
                [t.numel for t in targets], self.settings.threshold, self.settings.beta,
                self.settings.warmup_steps, device=self.target_set.device,
            )
            for k, t in enumerate(targets):
                loaded = self.checkpoint.take_loaded(t.block_number, t.role)
                if loaded is not None:
                    self.state.set_target(k, *loaded)
        self.is_set_up = True

    def _find_optimizer(self) -> None:
        """Megatron-LM sets config.grad_scale_func to the optimizer's bound scale_loss."""
        if self.optimizer is None and self.config is not None:
            candidate = getattr(getattr(self.config, "grad_scale_func", None), "__self__", None)
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

    def target_index(self) -> dict:
        """{(block_number, role): row of the state} of this rank's targets."""
        return {t.key: k for k, t in enumerate(self.targets)}

    def target_names(self) -> List[str]:
        return [t.name for t in self.targets]

    # -- the hook's own work ---------------------------------------------------------------------
    def after_finalize(self, model_chunks, force_all_reduce: bool = False, pg_collection=None) -> None:
        """Runs right after the original finalize_model_grads (force_all_reduce changes nothing:
        the owned shards are reduced either way)."""
        if not self.is_set_up:
            if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
                self._pp_group = pg_collection.pp
            self._setup(model_chunks)
        if not self.targets:
            if self.eager_commit:
                self._after_commit(True)
            return
        started = time.perf_counter() if self.timing is not None else 0.0
        targets = self.target_set
        grads = targets.gather()  # fp32 [K, n], rewritten in place below
        before = grads.clone() if self.recorder is not None else None
        scale = self.optimizer.get_loss_scale() if self.has_grad_scaler else None
        spike, replacement = self.state.propose_in_place(grads, scale, targets.owned)
        targets.scatter()  # only the spiking elements differ from what main_grad holds
        if self.timing is not None:
            self.timing["hook_s"] += time.perf_counter() - started
            self.timing["hook_calls"] += 1
        if self.recorder is not None:
            self.recorder(self, before, spike, replacement, scale, targets.owned)
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
        interval = self.log_interval()
        if success:
            self.committed_steps += 1
            iteration = runtime.current_iteration()
            slot = self.stats.slot_for(iteration if iteration is not None else self.committed_steps,
                                       interval, self._stats_device)
            if self.state is not None:
                self.state.commit(stats_into=slot)  # the step's statistics straight into the ring
            elif slot is not None:
                slot.zero_()  # no targets on this rank
        elif self.state is not None:
            self.state.discard()
        if self.timing is not None:
            self.timing["commit_s"] += time.perf_counter() - started
            self.timing["commits"] += 1
        if self.optimizer_steps % interval == 0:
            started = time.perf_counter()
            self.report()
            if self.timing is not None:  # kept apart: once per logging interval, like Megatron's own
                self.timing["report_s"] += time.perf_counter() - started
                self.timing["reports"] += 1

    # -- statistics ------------------------------------------------------------------------------
    def log_interval(self) -> int:
        if self.settings.log_interval:
            return int(self.settings.log_interval)
        return int(runtime.arg("log_interval", DEFAULT_LOG_INTERVAL))

    def _stats_device(self) -> torch.device:
        if self.state is not None:
            return self.state.device
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _stat_groups(self) -> list:
        """Where statistics are split: the distributed optimizer's shards, the pipeline stages."""
        groups = []
        if self.target_set is not None and self.target_set.group is not None:
            groups.append(self.target_set.group)
        group = self._pp_group
        if group is None and torch.distributed.is_initialized():
            from megatron.core import parallel_state  # heavy

            if parallel_state.model_parallel_is_initialized():
                group = parallel_state.get_pipeline_model_parallel_group()
        if group is not None and torch.distributed.get_world_size(group) > 1:
            groups.append(group)
        return groups

    def report(self) -> List[dict]:
        """Reduce the steps recorded since the last report and write them (host sync and
        collectives: every rank calls it at the same step, through the optimizer-step wrapper)."""
        return self.stats.report(self._stat_groups())

    def totals(self, reduce: bool = False) -> dict:
        """Totals over committed steps (host sync). reduce=False: this rank's own counts (its
        shard, its stage); reduce=True: over shards and stages, a collective every rank must call."""
        out = self.stats.totals(self._stat_groups() if reduce else [], reduce, self._stats_device())
        return {**out, "committed_steps": self.committed_steps}

    @torch.no_grad()
    def synchronize(self) -> None:
        """Make the state replicated over the distributed optimizer's DP group (each element from
        its owner). Collective over that group; a no-op without the distributed optimizer."""
        if self.state is None or self.target_set is None or self.target_set.group is None:
            return
        owned, group = self.target_set.owned, self.target_set.group
        for tensor in (self.state.momentum, self.state.step):
            mine = torch.where(owned, tensor, torch.zeros((), dtype=tensor.dtype, device=tensor.device))
            torch.distributed.all_reduce(mine, group=group)
            tensor.copy_(mine)


# --------------------------------------------------------------------------------------- the hook and its installation
def resolve_spike_settings(settings=None) -> SpikeSettings:
    """SpikeSettings (or a dict of its fields) with the defaults filled in; enabled defaults to False."""
    if settings is None or isinstance(settings, dict):
        settings = SpikeSettings(**(settings or {}))
    return settings.resolved()


class SpikeGradsHook(FinalizeWrapper):
    """What `config.finalize_model_grads_func` becomes: the original finalize, then the scaler."""

    def __init__(self, scaler: SpikeScaler, original: Optional[Callable] = None):
        super().__init__(original)
        self.mixln_spike_scaler = scaler

    def after_finalize(self, model, args: tuple, kwargs: dict) -> None:
        pg_collection = kwargs.get("pg_collection", args[1] if len(args) > 1 else None)
        force_all_reduce = kwargs.get("force_all_reduce", args[2] if len(args) > 2 else False)
        chunks = model if isinstance(model, (list, tuple)) else [model]
        self.mixln_spike_scaler.after_finalize(chunks, bool(force_all_reduce), pg_collection)

    def __repr__(self) -> str:
        return f"SpikeGradsHook(original={self.original!r})"


def _transformer_config(config):
    return getattr(config, "transformer", config)  # Megatron-LM's GPTModelConfig wraps it


def get_spike_scaler(config) -> Optional[SpikeScaler]:
    """The scaler installed on `config` (a TransformerConfig, or Megatron-LM's wrapper), if any."""
    hook = compat.finalize_chain_head(_transformer_config(config))
    return getattr(hook, "mixln_spike_scaler", None)


def install_finalize_hook(config, scaler: SpikeScaler) -> SpikeGradsHook:
    """Wrap whatever `config.finalize_model_grads_func` holds (None: megatron's finalize) so that
    `scaler` runs after it. The only place the scaler touches a config."""
    config = _transformer_config(config)
    hook = SpikeGradsHook(scaler, getattr(config, "finalize_model_grads_func", None))
    config.finalize_model_grads_func = hook
    return hook


def remove_spike_scaler(config) -> Optional[SpikeScaler]:
    """Undo every install of the scaler on `config`: the finalize function, the optimizer's step,
    the layers' checkpoint holders and the layer-built callback. Returns the scaler, or None."""
    hook = unwrap_finalize(config, SpikeGradsHook)
    if hook is None:
        return None
    scaler = hook.mixln_spike_scaler
    remove_on_layer_built(_transformer_config(config), scaler.attach)
    scaler.detach()
    return scaler


def _no_boundary(placement: Placement) -> str:
    return (f"[mixln_megatron] gradient-spike scaler disabled: the model has no Post/Pre-LN "
            f"boundary ({placement_text(placement)}); targets other than 'boundary' "
            "(--mixln-spike-targets all, or layer numbers) enable it")


def _scaler_on(config, settings: SpikeSettings, placement: Placement) -> SpikeScaler:
    """The scaler already on `config`, or a new one installed and announced."""
    scaler = get_spike_scaler(config)
    if scaler is None:
        scaler = SpikeScaler(settings, placement, config)
        install_finalize_hook(config, scaler)
        runtime.print_rank_0(scaler.describe())
    return scaler


def install_spike_scaler(model_chunks, config=None, optimizer=None, settings=None, **overrides) -> Optional[SpikeScaler]:
    """Enable the gradient-spike scaler on a megatron-core model (list of DDP-wrapped chunks),
    whatever settings.enabled says. settings: a SpikeSettings or dict, keyword overrides merged
    in, unset fields the defaults. optimizer: the one whose step() decides whether a step's
    decisions are kept (None: `config.grad_scale_func.__self__`, at the first call). Install
    before loading a checkpoint. None, nothing installed, when the model has no boundary."""
    from megatron.core.utils import get_model_config  # heavy

    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    config = _transformer_config(config) if config is not None else get_model_config(chunks[0])
    if isinstance(settings, SpikeSettings):
        settings = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.name != "sources"}
    resolved = resolve_spike_settings(SpikeSettings(**{**(settings or {}), **overrides, "enabled": True}))
    layers = [layer for _, layer in mixln_layers(chunks)]
    if not layers:
        raise ValueError("install_spike_scaler: the model has no Mix-LN layers (MixLNTransformerLayer)")
    placement = layers[0].placement
    if not target_layers(resolved.targets, placement):
        runtime.print_rank_0(_no_boundary(placement))
        return None
    existing = get_spike_scaler(config)
    scaler = _scaler_on(config, resolved, placement)
    if existing is not None and resolved != scaler.settings:
        if scaler.is_set_up:
            raise RuntimeError("install_spike_scaler: the scaler already ran with other settings")
        scaler._configure(resolved, placement)
        runtime.print_rank_0(scaler.describe())
    for layer in layers:
        scaler.attach(layer)
    if optimizer is not None:
        scaler.set_optimizer(optimizer)
    return scaler


def install_on_config(config, placement: Placement, settings: SpikeSettings) -> Optional[SpikeScaler]:
    """Install the hook on a model's config before the build (Megatron-LM's path): the target
    layers built next take their checkpoint holders. Idempotent (one call per VPP chunk); None,
    announced once, when the model has no boundary."""
    config = _transformer_config(config)
    if not target_layers(settings.targets, placement):
        if not getattr(config, "_mixln_spike_disabled_announced", False):
            runtime.print_rank_0(_no_boundary(placement))
            config._mixln_spike_disabled_announced = True
        return None
    scaler = _scaler_on(config, settings, placement)
    on_layer_built(config, scaler.attach)  # the layers built next carry the scaler's state
    return scaler
