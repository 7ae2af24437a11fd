"""The spike scaler's settings with the defaults filled in (SpikeSettings, with where each value
came from, is model/settings.py's; flags --mixln-spike-*, or MIXLN_SPIKE_* on the --spec path).

Defaults: threshold 50 (the Mix-LN authors' value), beta 0.99 (a ~100-step memory, so one unlucky
step does not define "typical"), warm-up 100 steps (one such memory span). Targets: "boundary"
(default: both norms of the last Post-LN and the first Pre-LN layer), "all" (both norms of every
transformer layer; the decoder's final norm is not included), or global 1-based layer numbers.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Tuple, Union

from ...model.settings import (
    DEFAULT_BETA,
    DEFAULT_TARGETS,
    DEFAULT_THRESHOLD,
    DEFAULT_WARMUP_STEPS,
    SpikeConfigError,
    SpikeSettings,
    parse_targets,
)


@dataclasses.dataclass(frozen=True)
class ResolvedSpikeSettings:
    enabled: bool
    threshold: float
    beta: float
    warmup_steps: int
    targets: Union[str, Tuple[int, ...]]
    log_interval: Optional[int]

    def describe(self) -> str:
        targets = self.targets if isinstance(self.targets, str) else ",".join(map(str, self.targets))
        return (
            f"threshold={self.threshold:g} beta={self.beta:g} warmup_steps={self.warmup_steps} "
            f"targets={targets}"
        )


def resolve_spike_settings(settings: Optional[Union[SpikeSettings, Mapping]] = None) -> ResolvedSpikeSettings:
    """The given settings with the defaults filled in. `enabled` defaults to False."""
    if settings is None:
        settings = SpikeSettings()
    elif isinstance(settings, Mapping):
        settings = SpikeSettings(**settings)

    def pick(name, default):
        value = getattr(settings, name)
        return default if value is None else value

    return ResolvedSpikeSettings(
        enabled=bool(pick("enabled", False)),
        threshold=float(pick("threshold", DEFAULT_THRESHOLD)),
        beta=float(pick("beta", DEFAULT_BETA)),
        warmup_steps=int(pick("warmup_steps", DEFAULT_WARMUP_STEPS)),
        targets=parse_targets(pick("targets", DEFAULT_TARGETS), "the settings"),
        log_interval=settings.log_interval,
    )


def target_layers(targets: Union[str, Tuple[int, ...]], placement) -> Tuple[int, ...]:
    """Global 1-based layer numbers whose norm parameters the scaler watches.

    `placement` is a mixln_megatron.model.placement.Placement. "boundary" gives () when the model has no
    Post/Pre boundary (P = 0 or P = L): the scaler is then disabled.
    """
    if targets == "boundary":
        return tuple(placement.boundary_layers)
    if targets == "all":
        return tuple(range(1, placement.num_layers + 1))
    bad = [n for n in targets if not 1 <= n <= placement.num_layers]
    if bad:
        raise SpikeConfigError(
            f"spike target layers {bad} are outside 1..{placement.num_layers} (global, 1-based)"
        )
    return tuple(targets)


__all__ = ["DEFAULT_BETA", "DEFAULT_TARGETS", "DEFAULT_THRESHOLD", "DEFAULT_WARMUP_STEPS", "ResolvedSpikeSettings",
           "SpikeConfigError", "SpikeSettings", "resolve_spike_settings", "target_layers"]
