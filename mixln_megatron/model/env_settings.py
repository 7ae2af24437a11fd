"""The MIXLN_* environment: the only module of the package that reads it.

Stock Megatron-LM's pretrain_gpt.py calls a `--spec` object as `spec(config, vp_stage=...)` and
passes nothing else, so for that path the environment is the one channel a plugin has (export the
variables where torchrun starts, on every node). Everything else gets its settings as arguments:
the spec functions turn the environment into a MixLNSettings here, once, and pass it down.
Each value's source is the variable's name (e.g. `MIXLN_ALPHA`), which the build line and the
error messages repeat. Empty values count as unset.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from ..errors import MixLNConfigError
from .settings import MixLNSettings, SpikeConfigError, SpikeSettings, TelemetrySettings, parse_count

ALPHA = "MIXLN_ALPHA"
POST_LN_LAYERS = "MIXLN_POST_LN_LAYERS"
SCHEME = "MIXLN_SCHEME"
SPIKE = "MIXLN_SPIKE_SCALER"
SPIKE_THRESHOLD = "MIXLN_SPIKE_THRESHOLD"
SPIKE_BETA = "MIXLN_SPIKE_BETA"
SPIKE_WARMUP = "MIXLN_SPIKE_WARMUP_STEPS"
SPIKE_TARGETS = "MIXLN_SPIKE_TARGETS"
TELEMETRY_INTERVAL = "MIXLN_TELEMETRY_INTERVAL"
TELEMETRY_PATH = "MIXLN_TELEMETRY_PATH"
CPU = "MIXLN_CPU"
ANALYSIS_CACHE = "MIXLN_ANALYSIS_CACHE"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _environ(environ: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _get(env: Mapping[str, str], name: str) -> Optional[str]:
    return (env.get(name) or "").strip() or None


def _flag(env, name: str, error=MixLNConfigError) -> Optional[bool]:
    value = _get(env, name)
    if value is None:
        return None
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise error(f"{name} must be 1 or 0, got {value!r}")


def _number(env, name: str, kind, error=MixLNConfigError):
    value = _get(env, name)
    if value is None:
        return None
    try:
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise error(f"environment variable {name} must be {what}, got {value!r}") from None


def settings_from_environ(environ: Optional[Mapping[str, str]] = None) -> MixLNSettings:
    """MixLNSettings from the MIXLN_* variables (os.environ unless a mapping is given)."""
    env = _environ(environ)
    alpha, post, scheme = _get(env, ALPHA), _get(env, POST_LN_LAYERS), _get(env, SCHEME)
    if alpha is not None and post is not None:
        raise MixLNConfigError(f"both {ALPHA}={alpha!r} and {POST_LN_LAYERS}={post!r} are set; unset one")
    spike_fields = dict(
        enabled=_flag(env, SPIKE, SpikeConfigError),
        threshold=_number(env, SPIKE_THRESHOLD, float, SpikeConfigError),
        beta=_number(env, SPIKE_BETA, float, SpikeConfigError),
        warmup_steps=_number(env, SPIKE_WARMUP, int, SpikeConfigError),
        targets=_get(env, SPIKE_TARGETS),
    )
    spike_names = dict(enabled=SPIKE, threshold=SPIKE_THRESHOLD, beta=SPIKE_BETA,
                       warmup_steps=SPIKE_WARMUP, targets=SPIKE_TARGETS)
    interval = _get(env, TELEMETRY_INTERVAL)
    if interval is not None:
        interval = parse_count(interval, TELEMETRY_INTERVAL, "the telemetry interval (steps)")
    if post is not None:
        post = parse_count(post, POST_LN_LAYERS, "post_ln_layers")
    return MixLNSettings(
        alpha=alpha,
        post_ln_layers=post,
        scheme=scheme,
        spike=SpikeSettings(**spike_fields, sources=spike_names),
        telemetry=TelemetrySettings(
            interval=interval, path=_get(env, TELEMETRY_PATH),
            sources={"interval": TELEMETRY_INTERVAL, "path": TELEMETRY_PATH},
        ),
        sources={"alpha": ALPHA, "post_ln_layers": POST_LN_LAYERS, "scheme": SCHEME},
    )


def settings_variables_set(environ: Optional[Mapping[str, str]] = None) -> list:
    """The names of the MIXLN_* settings variables that are set (non-empty), MIXLN_CPU aside."""
    env = _environ(environ)
    names = (ALPHA, POST_LN_LAYERS, SCHEME, SPIKE, SPIKE_THRESHOLD, SPIKE_BETA, SPIKE_WARMUP,
             SPIKE_TARGETS, TELEMETRY_INTERVAL, TELEMETRY_PATH)
    return [name for name in names if _get(env, name) is not None]


def cpu_requested(environ: Optional[Mapping[str, str]] = None) -> bool:
    """MIXLN_CPU=1: the entry point enters the CPU harness (development only)."""
    return bool(_flag(_environ(environ), CPU))


def analysis_cache_dir(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """MIXLN_ANALYSIS_CACHE: where the analysis tools cache tokenized text (None: a temp dir)."""
    return _get(_environ(environ), ANALYSIS_CACHE)
