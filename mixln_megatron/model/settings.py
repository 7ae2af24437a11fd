"""What the user chose, and where each value came from. Pure Python (no torch, no megatron).

One frozen object, `MixLNSettings`, holds the placement (alpha | post_ln_layers, scheme), the
gradient-spike scaler options (`SpikeSettings`) and the telemetry options (`TelemetrySettings`).
Every value remembers its source, by the name the user typed: `--mixln-alpha` (a flag),
`MIXLN_ALPHA` (an environment variable), `the checkpoint`, `argument` (a Python argument) or
`default`. The object is built once at an edge and then passed down explicitly:
  * the `--spec` functions (stock Megatron-LM leaves them only the environment, and the
    patched parser's flags): mixln_megatron.spec;
  * the entry point's flags and the patch's flags: mixln_megatron.megatron_args;
  * the factories' arguments (MixLNTransformerLayerSpec(alpha=...), get_mixln_decoder_block_spec).
Reading MIXLN_* is env_settings.py's job and no other module's. The placement rule itself (which
layers are Post-LN for a given L) lives in placement.py.

Several sources combine with `layered(highest, ..., lowest)`: per group, the first layer that sets
a value wins (alpha and post_ln_layers are one group, so a flag's alpha beats an inherited
MIXLN_POST_LN_LAYERS).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Mapping, Optional, Sequence, Tuple, Union

from ..errors import MixLNConfigError

ARGUMENT = "argument"
DEFAULT = "default"
CHECKPOINT = "the checkpoint"

# mixln: Post-LN for the first P layers, Pre-LN after.  lns: LayerNorm Scaling, Pre-LN
# everywhere with each norm output in layer l scaled by 1/sqrt(l).  mixln+lns: LNS on the
# Pre-LN layers of a Mix-LN model.
SCHEMES = ("mixln", "lns", "mixln+lns")

# Spike scaler defaults (see spike.py for the rule and why these values).
DEFAULT_THRESHOLD = 50.0  # the Mix-LN authors' value
DEFAULT_BETA = 0.99
DEFAULT_WARMUP_STEPS = 100
DEFAULT_TARGETS = "boundary"


class SpikeConfigError(MixLNConfigError):
    """A spike-scaler setting is invalid; the message names it and the accepted values."""


# --------------------------------------------------------------------------------------- parsers
def parse_alpha(value: Union[str, float, int, Fraction], source: str) -> Fraction:
    """Parse alpha exactly. A float is taken by its shortest decimal repr, so 0.29 means 29/100."""
    if isinstance(value, bool):
        raise MixLNConfigError(f"alpha from {source} must be a number in [0, 1], got {value!r}")
    if isinstance(value, Fraction):
        frac = value
    else:
        text = repr(value) if isinstance(value, float) else str(value).strip()
        try:
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError
            if text.lower() in ("nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity"):
                raise ValueError
            frac = Fraction(text)
        except (ValueError, ZeroDivisionError):
            raise MixLNConfigError(
                f"alpha from {source} must be a number in [0, 1] (e.g. 0.25, or 0.0625 for a "
                f"32-layer 7B model), got {value!r}"
            ) from None
    if not 0 <= frac <= 1:
        raise MixLNConfigError(
            f"alpha from {source} must lie in [0, 1] (0 = all Pre-LN, 1 = all Post-LN), got {value!r}"
        )
    return frac


def parse_count(value: Union[str, int], source: str, what: str) -> int:
    """A non-negative integer, e.g. post_ln_layers."""
    if isinstance(value, bool):
        raise MixLNConfigError(f"{what} from {source} must be a non-negative integer, got {value!r}")
    if isinstance(value, int):
        out = value
    else:
        try:
            out = int(str(value).strip())
        except ValueError:
            raise MixLNConfigError(
                f"{what} from {source} must be a non-negative integer, got {value!r}"
            ) from None
    if out < 0:
        raise MixLNConfigError(f"{what} from {source} must be >= 0, got {value!r}")
    return out


def parse_scheme(value: str, source: str) -> str:
    scheme = str(value).strip().lower()
    if scheme not in SCHEMES:
        raise MixLNConfigError(f"scheme from {source} must be one of {', '.join(SCHEMES)}; got {value!r}")
    return scheme


def parse_targets(value, source: str) -> Union[str, Tuple[int, ...]]:
    """Spike targets: 'boundary', 'all', or global 1-based layer numbers (a list or '6,7')."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("boundary", "all"):
            return text
        parts = [p for p in text.replace(" ", "").split(",") if p]
        if not parts:
            raise SpikeConfigError(
                f"spike targets from {source} must be 'boundary', 'all' or a comma list of global "
                f"layer numbers such as '6,7', got {value!r}"
            )
        value = parts
    try:
        layers = tuple(sorted({int(v) for v in value}))
    except (TypeError, ValueError):
        raise SpikeConfigError(
            f"spike targets from {source} must be 'boundary', 'all' or a list of global layer "
            f"numbers, got {value!r}"
        ) from None
    if not layers or layers[0] < 1:
        raise SpikeConfigError(f"spike target layers from {source} are 1-based and non-empty, got {value!r}")
    return layers


# --------------------------------------------------------------------------------------- sources
class _Sourced:
    """A frozen dataclass whose `sources` names where each set field came from."""

    def _sources_dict(self) -> dict:
        return dict(self.sources)

    def source(self, name: str) -> str:
        """Where field `name` came from: 'default' when unset, else its recorded source or 'argument'."""
        if getattr(self, name) is None:
            return DEFAULT
        return self._sources_dict().get(name, ARGUMENT)

    def _where(self, name: str) -> str:
        """The source as a message names it: a flag or variable by name, else 'the arguments'."""
        src = self.source(name)
        return "the arguments" if src == ARGUMENT else src


def _freeze_sources(obj) -> None:
    sources = obj.sources
    if isinstance(sources, Mapping):
        sources = sources.items()
    object.__setattr__(obj, "sources", tuple(sorted((str(k), str(v)) for k, v in sources)))


# --------------------------------------------------------------------------------------- spike
@dataclasses.dataclass(frozen=True)
class SpikeSettings(_Sourced):
    """Spike-scaler options. None means: not given here (a lower layer, then the default)."""

    enabled: Optional[bool] = None
    threshold: Optional[float] = None
    beta: Optional[float] = None
    warmup_steps: Optional[int] = None
    targets: Optional[Union[str, Sequence[int]]] = None
    log_interval: Optional[int] = None  # None: Megatron-LM's --log-interval when present, else 100
    sources: Tuple[Tuple[str, str], ...] = ()

    def __post_init__(self):
        _freeze_sources(self)
        if self.enabled is not None and not isinstance(self.enabled, bool):
            raise SpikeConfigError(f"spike enabled from {self._where('enabled')} must be true or false, got {self.enabled!r}")
        t = self.threshold
        if t is not None and (isinstance(t, bool) or not math.isfinite(float(t)) or float(t) < 1):
            raise SpikeConfigError(
                f"spike threshold from {self._where('threshold')} must be a finite number >= 1 (default "
                f"{DEFAULT_THRESHOLD:g}: a spike is |g| > threshold * momentum), got {t!r}"
            )
        if self.beta is not None and (isinstance(self.beta, bool) or not 0 <= float(self.beta) < 1):
            raise SpikeConfigError(
                f"spike beta from {self._where('beta')} must lie in [0, 1) (EMA coefficient of |g|, "
                f"default {DEFAULT_BETA}), got {self.beta!r}"
            )
        w = self.warmup_steps
        if w is not None and (isinstance(w, bool) or int(w) != w or w < 0):
            raise SpikeConfigError(f"spike warmup_steps from {self._where('warmup_steps')} must be an integer >= 0, got {w!r}")
        if self.targets is not None:
            parse_targets(self.targets, self._where("targets"))
        li = self.log_interval
        if li is not None and (isinstance(li, bool) or int(li) < 1):
            raise SpikeConfigError(f"spike log_interval from {self._where('log_interval')} must be >= 1, got {li!r}")


SPIKE_FIELDS = ("enabled", "threshold", "beta", "warmup_steps", "targets", "log_interval")


# --------------------------------------------------------------------------------------- telemetry
@dataclasses.dataclass(frozen=True)
class TelemetrySettings(_Sourced):
    """Per-layer gradient-norm telemetry: every `interval` steps (0 or None: off), JSONL at `path`."""

    interval: Optional[int] = None
    path: Optional[str] = None
    sources: Tuple[Tuple[str, str], ...] = ()

    def __post_init__(self):
        _freeze_sources(self)
        if self.interval is not None:
            parse_count(self.interval, self._where("interval"), "telemetry interval (steps)")


# --------------------------------------------------------------------------------------- all
@dataclasses.dataclass(frozen=True)
class MixLNSettings(_Sourced):
    """What the user asked for. Unset fields (None) fall through to lower layers, then defaults.

    Exactly one of `alpha` and `post_ln_layers` may be given at the same level of precedence.
    """

    alpha: Optional[Union[str, float, Fraction]] = None
    post_ln_layers: Optional[int] = None
    scheme: Optional[str] = None
    spike: SpikeSettings = dataclasses.field(default_factory=SpikeSettings)
    telemetry: TelemetrySettings = dataclasses.field(default_factory=TelemetrySettings)
    sources: Tuple[Tuple[str, str], ...] = ()

    def __post_init__(self):
        _freeze_sources(self)
        if self.spike is None:
            object.__setattr__(self, "spike", SpikeSettings())
        if self.telemetry is None:
            object.__setattr__(self, "telemetry", TelemetrySettings())
        if self.alpha is not None and self.post_ln_layers is not None:
            a, p = self.source("alpha"), self.source("post_ln_layers")
            if a == p == ARGUMENT:
                raise MixLNConfigError(
                    f"give either alpha ({self.alpha!r}) or post_ln_layers ({self.post_ln_layers!r}), "
                    "not both: alpha sets P = floor(alpha * num_layers), post_ln_layers sets P directly"
                )
            raise MixLNConfigError(
                f"both {a} ({self.alpha}) and {p} ({self.post_ln_layers}) were given; pass one "
                "(alpha sets P = floor(alpha * num_layers), post_ln_layers sets P directly)"
            )
        if self.alpha is not None:
            parse_alpha(self.alpha, self._where("alpha"))
        if self.post_ln_layers is not None:
            parse_count(self.post_ln_layers, self._where("post_ln_layers"), "post_ln_layers")
        if self.scheme is not None:
            parse_scheme(self.scheme, self._where("scheme"))

    @property
    def placement_source(self) -> str:
        """Where P comes from: alpha's or post_ln_layers' source, or 'default'."""
        if self.alpha is not None:
            return self.source("alpha")
        if self.post_ln_layers is not None:
            return self.source("post_ln_layers")
        return DEFAULT

    def resolve(self, num_layers: int):
        """The Placement for a model of `num_layers` layers (placement.resolve_placement)."""
        from .placement import resolve_placement

        return resolve_placement(num_layers, self)

    def describe_sources(self) -> str:
        """'alpha=0.0625 (from --mixln-alpha), scheme=mixln (default), ...' for logs."""
        parts = []
        for name in ("alpha", "post_ln_layers", "scheme"):
            if getattr(self, name) is not None:
                parts.append(f"{name}={getattr(self, name)} (from {self.source(name)})")
        return ", ".join(parts) or "nothing set (defaults)"


def layered(*layers: MixLNSettings) -> MixLNSettings:
    """Combine settings, highest precedence first: per group, the first layer that sets it wins."""
    layers = [layer for layer in layers if layer is not None]
    if not layers:
        return MixLNSettings()
    fields, sources = {}, {}
    placement = next((s for s in layers if s.alpha is not None or s.post_ln_layers is not None), None)
    if placement is not None:
        for name in ("alpha", "post_ln_layers"):
            if getattr(placement, name) is not None:
                fields[name] = getattr(placement, name)
                sources[name] = placement.source(name)
    scheme = next((s for s in layers if s.scheme is not None), None)
    if scheme is not None:
        fields["scheme"], sources["scheme"] = scheme.scheme, scheme.source("scheme")

    spike, spike_sources = {}, {}
    for name in SPIKE_FIELDS:
        owner = next((s.spike for s in layers if getattr(s.spike, name) is not None), None)
        if owner is not None:
            spike[name], spike_sources[name] = getattr(owner, name), owner.source(name)
    telemetry, telemetry_sources = {}, {}
    for name in ("interval", "path"):
        owner = next((s.telemetry for s in layers if getattr(s.telemetry, name) is not None), None)
        if owner is not None:
            telemetry[name], telemetry_sources[name] = getattr(owner, name), owner.source(name)
    return MixLNSettings(
        **fields,
        spike=SpikeSettings(**spike, sources=spike_sources),
        telemetry=TelemetrySettings(**telemetry, sources=telemetry_sources),
        sources=sources,
    )
