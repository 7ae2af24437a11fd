"""The slim adapter on Megatron's finalize hook, and the ways the scaler gets installed.

`config.finalize_model_grads_func` becomes a SpikeGradsHook: it runs the original finalize
(megatron's finalize_model_grads when none was set), whose DP reduction, TP all-reduce of
sequence-parallel norm grads, embedding sync and 1/num_tokens scaling are then complete, and then
hands the model chunks to the SpikeScaler, which edits `param.main_grad` of the target norms.

  * megatron-core users: `install_spike_scaler(model_chunks, config, optimizer)` on a built,
    DDP-wrapped model, or MixLNSettings(spike=...) + mixln_megatron.install_training_hooks.
  * Megatron-LM: `install_on_config`, called by training.hooks.install_training_hooks before the
    model is built, puts the hook on the model's config and asks each Mix-LN layer then built
    with it (model.layer.on_layer_built) to take its checkpoint holder. Megatron-LM itself is not patched; the optimizer is found at the first
    call through `config.grad_scale_func` (Megatron-LM sets it to the optimizer's scale_loss).
`install_finalize_hook` is the one function that touches the config: a release whose train()
replaces the finalize function (mixln_megatron.compat) re-runs or wraps it. `remove_spike_scaler`
undoes all of it (config, optimizer, layers).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from ...model.layer import on_layer_built, remove_on_layer_built
from ...model.placement import Placement
from ...model.settings import SpikeSettings
from ... import compat
from .. import runtime
from ..hooks_finalize import FinalizeWrapper, unwrap_finalize
from .scaler import SpikeScaler
from .targets import mixln_layers, placement_text, target_layers


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
    """Undo every install of the scaler on `config` (tests, notebooks, a second scaler): the
    finalize function before it is back (whatever was wrapped around it since stays), the
    optimizer's step is unwrapped, the layers lose their checkpoint holders and later builds
    their callback. Returns the removed scaler, or None."""
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
    """Enable the gradient-spike scaler on a megatron-core model (list of DDP-wrapped chunks).

    settings: a SpikeSettings or dict (threshold, beta, warmup_steps, targets, log_interval);
    unset fields take the defaults. Keyword overrides are merged into it. Calling this enables
    the scaler whatever settings.enabled says.
    optimizer: the megatron optimizer whose step() decides whether a step's decisions are kept;
    without it the scaler looks for `config.grad_scale_func.__self__` at its first call.
    Install before loading a checkpoint, so the state is restored. Returns None (and installs
    nothing) when the targets are the boundary and the model has none.
    """
    from megatron.core.utils import get_model_config

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
    """Install the hook on a model's config before the model is built (Megatron-LM's path; called
    by training.hooks.install_training_hooks). The target layers built next with `config` take
    their checkpoint holders. Idempotent (one call per VPP chunk).
    Returns None, and announces it once, when the targets are the boundary and there is none."""
    config = _transformer_config(config)
    if not target_layers(settings.targets, placement):
        if not getattr(config, "_mixln_spike_disabled_announced", False):
            runtime.print_rank_0(_no_boundary(placement))
            config._mixln_spike_disabled_announced = True
        return None
    scaler = _scaler_on(config, settings, placement)
    on_layer_built(config, scaler.attach)  # the layers built next carry the scaler's state
    return scaler
