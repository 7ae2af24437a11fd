"""The one place that installs Mix-LN's training hooks on a model's config, from a MixLNSettings
(specs are plain data), and where rank 0 prints the build line once per placement. The spike
scaler wraps config.finalize_model_grads_func, the telemetry wraps it again after the scaler, so
it sees the gradients the optimizer receives. Called by the `--spec` functions, the entry point's
model provider, and megatron-core users between the spec and the model (docs/training.md).
Idempotent: Megatron calls the spec / model provider once per virtual pipeline chunk.

A full-iteration CUDA graph would capture both hooks: the telemetry counts steps in Python and
reads norms on the host, and the scaler finds its targets at its first call and, under fp16,
keeps the loss-scale tensor the optimizer later replaces; so either hook with such a graph is
refused in one line (per-layer CUDA graphs do not capture the hook).
"""

from __future__ import annotations

from typing import Optional

from .. import compat
from ..errors import MixLNError
from ..model import hybrid_pattern, support
from ..model.placement import resolve_placement
from ..model.settings import MixLNSettings
from . import runtime


class HooksUnderCudaGraph(MixLNError, NotImplementedError):
    """A training hook asked for together with a CUDA graph that would capture it."""


def check_no_full_iteration_graph(config, spike: bool, telemetry: bool) -> None:
    """HooksUnderCudaGraph when a hook that is on would run inside a full-iteration CUDA graph."""
    graph = compat.full_iteration_cuda_graph(config)
    if graph is None or not (spike or telemetry):
        return
    names = " and ".join(n for n, on in (("the gradient-spike scaler (--mixln-spike-scaler)", spike),
                                          ("the gradient telemetry (--mixln-telemetry-interval)", telemetry)) if on)
    raise HooksUnderCudaGraph(
        f"{names} cannot run under {graph}: that graph captures the gradient-finalize step the "
        "hooks run in, and its replays would skip their host-side work; drop the hook, or use "
        "per-layer CUDA graphs (--cuda-graph-impl local / transformer_engine without the "
        "full_iteration scope)")


def install_training_hooks(config, settings: Optional[MixLNSettings] = None, hybrid: bool = False) -> dict:
    """Install what `settings` asks for on `config`; returns {"spike_scaler": ..., "telemetry": ...}.
    `hybrid`: the config is a HybridModel's (num_layers counts `*` and `-` layers, two per block)."""
    from . import telemetry  # heavy: both import megatron-core
    from .spike import install_on_config, resolve_spike_settings

    config = getattr(config, "transformer", config)  # Megatron-LM's GPTModelConfig wraps it
    settings = settings or MixLNSettings()
    installed = {"spike_scaler": None, "telemetry": None}
    part = hybrid_pattern.ATTENTION if hybrid else None
    placement = resolve_placement(hybrid_pattern.num_blocks(config.num_layers, part), settings)
    support.announce(placement, *runtime.schedule())
    spike = resolve_spike_settings(settings.spike)
    interval = settings.telemetry.interval or 0
    check_no_full_iteration_graph(config, spike.enabled, interval > 0)
    if spike.enabled:
        installed["spike_scaler"] = install_on_config(config, placement, spike)
    if interval > 0:
        installed["telemetry"] = telemetry.install_telemetry(config, interval, settings.telemetry.path)
    compat.keep_finalize_hook(config)  # 0.17/0.18's train() would replace it
    return installed
