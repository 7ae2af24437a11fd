"""The one place that installs Mix-LN's training hooks on a model's config.

Specs are plain data; hooks are installed here and nowhere else, from a MixLNSettings, and rank 0
prints the build line (placement and sources, model/advice.py) here, once per placement:
  * the gradient-spike scaler (settings.spike.enabled) wraps config.finalize_model_grads_func;
  * the per-layer gradient telemetry (settings.telemetry.interval > 0) wraps it again, after
    the scaler, so it sees the gradients the optimizer receives.
Called by the two `--spec` functions (stock Megatron-LM gives a plugin no other place), by the
entry point's model provider, and by megatron-core users after building the spec and before
building the model:

    settings = MixLNSettings(alpha=0.25, spike=SpikeSettings(enabled=True))
    block_spec = get_mixln_decoder_block_spec(config, backend="te", settings=settings)
    mixln_megatron.install_training_hooks(config, settings)
    model = GPTModel(config=config, transformer_layer_spec=block_spec, ...)

Idempotent: Megatron calls the spec / model provider once per virtual pipeline chunk.
"""

from __future__ import annotations

from typing import Optional

from .. import compat
from ..model import advice, hybrid_pattern
from ..model.placement import resolve_placement
from ..model.settings import MixLNSettings


def install_training_hooks(config, settings: Optional[MixLNSettings] = None, hybrid: bool = False) -> dict:
    """Install what `settings` asks for on `config`; returns {"spike_scaler": ..., "telemetry": ...}.
    `hybrid`: the config is a HybridModel's (num_layers counts `*` and `-` layers, two per block)."""
    from . import runtime, telemetry
    from .spike import install_on_config, resolve_spike_settings

    config = getattr(config, "transformer", config)  # Megatron-LM's GPTModelConfig wraps it
    settings = settings or MixLNSettings()
    installed = {"spike_scaler": None, "telemetry": None}
    part = hybrid_pattern.ATTENTION if hybrid else None
    placement = resolve_placement(hybrid_pattern.num_blocks(config.num_layers, part), settings)
    advice.announce(placement, *runtime.schedule())
    spike = resolve_spike_settings(settings.spike)
    if spike.enabled:
        installed["spike_scaler"] = install_on_config(config, placement, spike)
    interval = settings.telemetry.interval or 0
    if interval > 0:
        installed["telemetry"] = telemetry.install_telemetry(config, interval, settings.telemetry.path)
    compat.keep_finalize_hook(config)  # 0.17/0.18's train() would replace it
    return installed
