"""What the user chose, and where each value came from: one frozen `MixLNSettings`. Pure Python.

It holds the placement (alpha | post_ln_layers | layout, scheme, DeepNorm's alpha and beta), the
spike scaler's `SpikeSettings` and the telemetry's `TelemetrySettings`. One constructor per source
(arguments, from_environ, from_args, from_checkpoint); every value remembers its source by the
name the user typed. `layered(highest, ..., lowest)` combines sources: per group, the first that
sets a value wins (alpha, post_ln_layers and layout are one group). Unset values (None) take the
defaults when used. The only module that reads MIXLN_* (FIELDS names them all).
"""

from __future__ import annotations

import dataclasses
import math
import os
from fractions import Fraction
from typing import Mapping, Optional, Sequence, Tuple, Union

from ..errors import MixLNConfigError
from .hybrid_pattern import blocks_of_args
from .layout import POST_LN_KINDS, check_layout_syntax, first_p_kinds, layout_text, leading_post_count, parse_layout

ARGUMENT, DEFAULT, CHECKPOINT = "argument", "default", "the checkpoint"
# mixln: Post-LN for the first P layers, Pre-LN after. lns: LayerNorm Scaling, Pre-LN everywhere
# with each norm output in layer l scaled by 1/sqrt(l). mixln+lns: LNS on the Pre-LN layers.
SCHEMES = ("mixln", "lns", "mixln+lns")
# Spike scaler defaults: threshold 50 (the Mix-LN authors' value), beta 0.99 (a ~100-step memory),
# warm-up 100 steps (one such span); targets: the norms of the last Post-LN and first Pre-LN layer.
DEFAULT_THRESHOLD, DEFAULT_BETA, DEFAULT_WARMUP_STEPS, DEFAULT_TARGETS = 50.0, 0.99, 100, "boundary"

# (field, its Megatron-LM flag, its environment variable, the kind of value, the flag's help)
FIELDS = (
    ("alpha", "--mixln-alpha", "MIXLN_ALPHA", str,
     "Fraction of layers that are Post-LN: P = floor(alpha * num_layers). The paper uses 0.25 "
     "up to 1B and 0.0625 at 7B. Exclusive with --mixln-post-ln-layers."),
    ("post_ln_layers", "--mixln-post-ln-layers", "MIXLN_POST_LN_LAYERS", int,
     "Number P of leading Post-LN layers (global numbering). Exclusive with --mixln-alpha."),
    ("layout", "--mixln-layout", "MIXLN_LAYOUT", str,
     "The norm kind of every layer (pre, post, deepnorm, sandwich), e.g. 'post:1-2,pre:3-', "
     "'deepnorm:1-2,pre:3-', 'sandwich:*', 'post:every4,pre:*' (see mixln_megatron.model.layout). "
     "Exclusive with --mixln-alpha / --mixln-post-ln-layers."),
    ("deepnorm_alpha", "--mixln-deepnorm-alpha", "MIXLN_DEEPNORM_ALPHA", str,
     "Residual scale of deepnorm layers, y = N(alpha * x + F(x)); default DeepNet's (2L)^(1/4). "
     "The Mix-LN authors' arm: 2.8284271247461903."),
    ("deepnorm_beta", "--mixln-deepnorm-beta", "MIXLN_DEEPNORM_BETA", str,
     "Init factor of deepnorm layers' fc1, fc2, attention output and value projections (times "
     "megatron's base init, --init-method-std, also for the two output projections); default "
     "DeepNet's (8L)^(-1/4). The Mix-LN authors' arm: (8L)^(1/4)."),
    ("scheme", "--mixln-scheme", "MIXLN_SCHEME", str,
     "mixln (default), lns (LayerNorm Scaling: Pre-LN, norm outputs of layer l scaled by "
     "1/sqrt(l)), or mixln+lns (LNS on the Pre-LN layers of a Mix-LN model)."),
    ("spike.enabled", "--mixln-spike-scaler", "MIXLN_SPIKE_SCALER", bool,
     "Scale gradient spikes on the Post/Pre boundary norm weights down to their momentum."),
    ("spike.threshold", "--mixln-spike-threshold", "MIXLN_SPIKE_THRESHOLD", float,
     "Spike when |g| > threshold * momentum (default 50)."),
    ("spike.beta", "--mixln-spike-beta", "MIXLN_SPIKE_BETA", float,
     "EMA coefficient of the gradient-magnitude momentum."),
    ("spike.warmup_steps", "--mixln-spike-warmup-steps", "MIXLN_SPIKE_WARMUP_STEPS", int,
     "Steps of momentum warm-up before anything is scaled."),
    ("spike.targets", "--mixln-spike-targets", "MIXLN_SPIKE_TARGETS", str,
     "boundary (default: last Post-LN and first Pre-LN layer's norms), all, or a comma list of "
     "global layer numbers."),
    ("telemetry.interval", "--mixln-telemetry-interval", "MIXLN_TELEMETRY_INTERVAL", int,
     "Log per-layer gradient norms every N steps (0 = off, the default; see "
     "mixln_megatron.training.telemetry). Written to TensorBoard/W&B when configured and to "
     "a JSONL file (--mixln-telemetry-path)."),
    ("telemetry.path", "--mixln-telemetry-path", "MIXLN_TELEMETRY_PATH", str,
     "Write the telemetry JSONL here instead of <save>/mixln_telemetry.jsonl (runs/mixln_telemetry.jsonl "
     "without --save)."),
)
CPU, ANALYSIS_CACHE = "MIXLN_CPU", "MIXLN_ANALYSIS_CACHE"  # the harness; the analysis text cache


class SpikeConfigError(MixLNConfigError):
    """A spike-scaler setting is invalid; the message names it and the accepted values."""


# --------------------------------------------------------------------------------------- parsers
def parse_alpha(value: Union[str, float, int, Fraction], source: str) -> Fraction:
    """Parse alpha exactly. A float is taken by its shortest decimal repr, so 0.29 means 29/100."""
    bad = f"alpha from {source} must be a number in [0, 1] (e.g. 0.25, or 0.0625 for a 32-layer 7B model), got {value!r}"
    if isinstance(value, bool):
        raise MixLNConfigError(bad)
    try:
        text = repr(value) if isinstance(value, float) else str(value).strip()
        if text.lower().lstrip("+-") in ("nan", "inf", "infinity"):
            raise ValueError
        frac = value if isinstance(value, Fraction) else Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise MixLNConfigError(bad) from None
    if not 0 <= frac <= 1:
        raise MixLNConfigError(f"alpha from {source} must lie in [0, 1] (0 = all Pre-LN, 1 = all Post-LN), got {value!r}")
    return frac


def parse_positive(value: Union[str, float, int], source: str, what: str) -> float:
    """A finite number > 0 (DeepNorm's alpha and beta), taken from text or a number."""
    try:
        if isinstance(value, bool):
            raise ValueError
        out = float(value if isinstance(value, (int, float)) else str(value).strip())
    except ValueError:
        raise MixLNConfigError(f"{what} from {source} must be a number > 0, got {value!r:.80}") from None
    if not math.isfinite(out) or out <= 0:
        raise MixLNConfigError(f"{what} from {source} must be a finite number > 0, got {value!r:.80}")
    return out


def parse_count(value: Union[str, int], source: str, what: str) -> int:
    """A non-negative integer, e.g. post_ln_layers."""
    try:
        if isinstance(value, bool):
            raise ValueError
        out = value if isinstance(value, int) else int(str(value).strip())
    except ValueError:
        raise MixLNConfigError(f"{what} from {source} must be a non-negative integer, got {value!r}") from None
    if out < 0:
        raise MixLNConfigError(f"{what} from {source} must be >= 0, got {value!r}")
    return out


def parse_targets(value, source: str) -> Union[str, Tuple[int, ...]]:
    """Spike targets: 'boundary', 'all', or global 1-based layer numbers (a list or '6,7')."""
    accepted = "must be 'boundary', 'all' or a comma list of global layer numbers such as '6,7'"
    if isinstance(value, str):
        if value.strip().lower() in ("boundary", "all"):
            return value.strip().lower()
        value = [p for p in value.replace(" ", "").split(",") if p]
    try:
        layers = tuple(sorted({int(v) for v in value}))
    except (TypeError, ValueError):
        raise SpikeConfigError(f"spike targets from {source} {accepted}, got {value!r}") from None
    if not layers or layers[0] < 1:
        raise SpikeConfigError(f"spike target layers from {source} are 1-based and non-empty, got {value!r}")
    return layers


# --------------------------------------------------------------------------------------- the objects
class _Sourced:
    """A frozen dataclass whose `sources` names where each set field came from."""

    def __post_init__(self):
        sources = self.sources.items() if isinstance(self.sources, Mapping) else self.sources
        object.__setattr__(self, "sources", tuple(sorted((str(k), str(v)) for k, v in sources)))

    def source(self, name: str) -> str:
        """Where field `name` came from: 'default' when unset, else its recorded source or 'argument'."""
        return DEFAULT if getattr(self, name) is None else dict(self.sources).get(name, ARGUMENT)

    def _where(self, name: str) -> str:
        """The source as a message names it: a flag or variable by name, else 'the arguments'."""
        return "the arguments" if self.source(name) == ARGUMENT else self.source(name)


_SOURCES = dataclasses.field(default=(), compare=False)


@dataclasses.dataclass(frozen=True)
class SpikeSettings(_Sourced):
    """Spike-scaler options. None means: not given here (a lower layer, then the default)."""

    enabled: Optional[bool] = None
    threshold: Optional[float] = None
    beta: Optional[float] = None
    warmup_steps: Optional[int] = None
    targets: Optional[Union[str, Sequence[int]]] = None
    log_interval: Optional[int] = None  # None: Megatron-LM's --log-interval when present, else 100
    sources: Tuple[Tuple[str, str], ...] = _SOURCES

    def __post_init__(self):
        super().__post_init__()
        e, t, b, w, li = self.enabled, self.threshold, self.beta, self.warmup_steps, self.log_interval
        if e is not None and not isinstance(e, bool):
            raise SpikeConfigError(f"spike enabled from {self._where('enabled')} must be true or false, got {e!r}")
        if t is not None and (isinstance(t, bool) or not math.isfinite(float(t)) or float(t) < 1):
            raise SpikeConfigError(
                f"spike threshold from {self._where('threshold')} must be a finite number >= 1 (default "
                f"{DEFAULT_THRESHOLD:g}: a spike is |g| > threshold * momentum), got {t!r}")
        if b is not None and (isinstance(b, bool) or not 0 <= float(b) < 1):
            raise SpikeConfigError(
                f"spike beta from {self._where('beta')} must lie in [0, 1) (EMA coefficient of |g|, "
                f"default {DEFAULT_BETA}), got {b!r}")
        if w is not None and (isinstance(w, bool) or int(w) != w or w < 0):
            raise SpikeConfigError(f"spike warmup_steps from {self._where('warmup_steps')} must be an integer >= 0, got {w!r}")
        if self.targets is not None:
            parse_targets(self.targets, self._where("targets"))
        if li is not None and (isinstance(li, bool) or int(li) < 1):
            raise SpikeConfigError(f"spike log_interval from {self._where('log_interval')} must be >= 1, got {li!r}")

    def resolved(self) -> "SpikeSettings":
        """These settings with the defaults filled in (enabled defaults to False)."""
        pick = lambda name, default: default if getattr(self, name) is None else getattr(self, name)  # noqa: E731
        return dataclasses.replace(
            self, enabled=bool(pick("enabled", False)), threshold=float(pick("threshold", DEFAULT_THRESHOLD)),
            beta=float(pick("beta", DEFAULT_BETA)), warmup_steps=int(pick("warmup_steps", DEFAULT_WARMUP_STEPS)),
            targets=parse_targets(pick("targets", DEFAULT_TARGETS), self._where("targets")))

    def describe(self) -> str:
        targets = self.targets if isinstance(self.targets, str) else ",".join(map(str, self.targets))
        return f"threshold={self.threshold:g} beta={self.beta:g} warmup_steps={self.warmup_steps} targets={targets}"


@dataclasses.dataclass(frozen=True)
class TelemetrySettings(_Sourced):
    """Per-layer gradient-norm telemetry: every `interval` steps (0 or None: off), JSONL at `path`."""

    interval: Optional[int] = None
    path: Optional[str] = None
    sources: Tuple[Tuple[str, str], ...] = _SOURCES

    def __post_init__(self):
        super().__post_init__()
        if self.interval is not None:
            parse_count(self.interval, self._where("interval"), "telemetry interval (steps)")


@dataclasses.dataclass(frozen=True)
class MixLNSettings(_Sourced):
    """What the user asked for. At most one of `alpha`, `post_ln_layers` and `layout` per source."""

    alpha: Optional[Union[str, float, Fraction]] = None
    post_ln_layers: Optional[int] = None
    layout: Optional[str] = None
    scheme: Optional[str] = None
    deepnorm_alpha: Optional[Union[str, float]] = None
    deepnorm_beta: Optional[Union[str, float]] = None
    spike: SpikeSettings = dataclasses.field(default_factory=SpikeSettings)
    telemetry: TelemetrySettings = dataclasses.field(default_factory=TelemetrySettings)
    sources: Tuple[Tuple[str, str], ...] = _SOURCES

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "spike", self.spike or SpikeSettings())
        object.__setattr__(self, "telemetry", self.telemetry or TelemetrySettings())
        given = [name for name in PLACEMENT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            a, b = given[:2]
            if self.source(a) == self.source(b) == ARGUMENT:
                raise MixLNConfigError(
                    f"give either {a} ({getattr(self, a)!r}) or {b} ({getattr(self, b)!r}), not both: alpha sets P = floor(alpha * num_layers), post_ln_layers sets P "
                    "directly, layout gives every layer's kind")
            raise MixLNConfigError(f"both {self.source(a)} {getattr(self, a)} and {self.source(b)} {getattr(self, b)} "
                                   "were given; pass one (alpha sets P = floor(alpha * num_layers), post_ln_layers "
                                   "sets P directly, layout gives every layer's kind)")
        if self.alpha is not None:
            parse_alpha(self.alpha, self._where("alpha"))
        if self.post_ln_layers is not None:
            parse_count(self.post_ln_layers, self._where("post_ln_layers"), "post_ln_layers")
        if self.layout is not None:
            check_layout_syntax(self.layout, self._where("layout"))
        for name in ("deepnorm_alpha", "deepnorm_beta"):
            if getattr(self, name) is not None:
                parse_positive(getattr(self, name), self._where(name), name.replace("_", " "))
        if self.scheme is not None and str(self.scheme).strip().lower() not in SCHEMES:
            raise MixLNConfigError(f"scheme from {self._where('scheme')} must be one of {', '.join(SCHEMES)}; got {self.scheme!r}")

    @property
    def placement_source(self) -> str:
        """Where the layer kinds come from: alpha's, post_ln_layers' or layout's source, or 'default'."""
        given = next((name for name in PLACEMENT_FIELDS if getattr(self, name) is not None), None)
        return DEFAULT if given is None else self.source(given)

    # -- constructors, one per source -----------------------------------------------------------
    @classmethod
    def _from_values(cls, values: dict, names: dict) -> "MixLNSettings":
        """values / names: field (as in FIELDS) -> value / the source's name."""
        group = lambda prefix: {k.split(".")[1]: v for k, v in values.items() if k.startswith(prefix)}  # noqa: E731
        named = lambda prefix: {k.split(".")[1]: v for k, v in names.items() if k.startswith(prefix)}  # noqa: E731
        return cls(**{k: v for k, v in values.items() if "." not in k},
                   spike=SpikeSettings(**group("spike."), sources=named("spike.")),
                   telemetry=TelemetrySettings(**group("telemetry."), sources=named("telemetry.")),
                   sources={k: v for k, v in names.items() if "." not in k})

    @classmethod
    def from_environ(cls, environ: Optional[Mapping[str, str]] = None) -> "MixLNSettings":
        """The MIXLN_* variables (os.environ unless a mapping is given); empty values are unset."""
        env = os.environ if environ is None else environ
        values = {}
        for field, _, var, kind, _ in FIELDS:
            text = (env.get(var) or "").strip()
            if not text:
                continue
            error = SpikeConfigError if field.startswith("spike.") else MixLNConfigError
            if kind is bool:
                if text.lower() not in _TRUE + _FALSE:
                    raise error(f"{var} must be 1 or 0, got {text!r}")
                values[field] = text.lower() in _TRUE
            elif field in _COUNTS:
                values[field] = parse_count(text, var, _COUNTS[field])
            else:
                try:
                    values[field] = kind(text)
                except ValueError:
                    what = "an integer" if kind is int else "a number"
                    raise error(f"environment variable {var} must be {what}, got {text!r}") from None
        placement = [var for field, _, var, _, _ in FIELDS if field in PLACEMENT_FIELDS and field in values]
        if len(placement) > 1:
            raise MixLNConfigError(f"both {placement[0]}={env.get(placement[0])!r} and {placement[1]}="
                                   f"{env.get(placement[1])!r} are set; unset one")
        return cls._from_values(values, {field: var for field, _, var, _, _ in FIELDS if field in values})

    @classmethod
    def from_args(cls, args) -> "MixLNSettings":
        """Megatron-LM's parsed --mixln-* flags (megatron_args.add_mixln_args); sources: the flags."""
        values = {field: getattr(args, flag[2:].replace("-", "_"), None) for field, flag, _, _, _ in FIELDS}
        values = {k: v for k, v in values.items() if v is not None}
        return cls._from_values(values, {field: flag for field, flag, _, _, _ in FIELDS if field in values})

    @classmethod
    def from_checkpoint(cls, saved, record=None, metadata=None, num_layers=None) -> Optional["MixLNSettings"]:
        """The placement a checkpoint carries, its sources cross-checked (saved_settings): `saved`
        is its saved args or a Mix-LN record (Placement.record()); `record` / `metadata` its
        settings record and content-metadata entry when known. None when it carries none."""
        if isinstance(saved, Mapping):
            saved, record = None, saved if record is None else record
        if num_layers is None and saved is not None and getattr(saved, "num_layers", None) is not None:
            num_layers = blocks_of_args(saved)
        found = saved_settings(num_layers, record=record, metadata=metadata, args=saved)
        if found is None:
            return None
        post, layout = found["post_ln_layers"], found["layout"]
        placement = {"layout": layout} if layout is not None else (
            {"alpha": found["alpha"]} if post is None else {"post_ln_layers": post})
        deepnorm = {k: found[k] for k in ("deepnorm_alpha", "deepnorm_beta") if found[k] is not None}
        values = {**placement, "scheme": found["scheme"], **deepnorm}
        return cls(**values, sources=dict.fromkeys(values, CHECKPOINT))


class MixLNSavedSettingsDisagree(MixLNConfigError):
    """Two places a checkpoint keeps its Mix-LN settings in say different things."""


# One group: which layers are which kind (alpha and post_ln_layers: Mix-LN's first P; layout: any).
PLACEMENT_FIELDS = ("alpha", "post_ln_layers", "layout")
SETTINGS_RECORD, CONTENT_METADATA, SAVED_ARGS = ("the settings record", "the content metadata",
                                                 "the saved --mixln-* args")


def saved_settings(num_layers: Optional[int] = None, record=None, metadata=None, args=None) -> Optional[dict]:
    """The Mix-LN settings a checkpoint carries, the one reading for a resume, conversion and
    analysis: {scheme, post_ln_layers, alpha, layout (only one other than Mix-LN's first P),
    deepnorm_alpha, deepnorm_beta, source (the first source that has any)}, None when none has.

    Sources: the settings `record`, the `mixln` entry of the content `metadata`, the saved
    --mixln-* `args`; `num_layers` (L, when known) turns a saved alpha into P. Two sources that
    disagree are one MixLNSavedSettingsDisagree naming both."""
    sources = []  # dicts: name, scheme, P, alpha, layout (canonical, when L is known or recorded), deepnorm_*

    def kinds_text(layout, p, layers, name):
        if layout is not None and layers is not None:
            return layout_text(parse_layout(layout, int(layers), name))
        if p is not None and layers is not None and p <= int(layers):
            return layout_text(first_p_kinds(int(layers), p))
        return None

    for name, saved in ((SETTINGS_RECORD, record), (CONTENT_METADATA, metadata)):
        if saved is None:
            continue
        if not isinstance(saved, Mapping):
            raise MixLNSavedSettingsDisagree(f"{name} of the checkpoint is {type(saved).__name__}, not a Mix-LN record")
        saved_layers = saved.get("num_layers")
        if num_layers is not None and saved_layers is not None and int(saved_layers) != num_layers:
            raise MixLNSavedSettingsDisagree(
                f"the Mix-LN record ({name}) is for {saved_layers} layers but the checkpoint has {num_layers}")
        layers = num_layers if num_layers is not None else saved_layers
        p = parse_count(saved.get("post_ln_layers", 0), name, "post_ln_layers")
        layout = saved.get("layout")
        sources.append({"name": name, "scheme": saved.get("scheme", "mixln"), "p": p, "alpha": saved.get("alpha"),
                        "kinds": kinds_text(layout, None if layout else p, layers, name),
                        "deepnorm_alpha": saved.get("deepnorm_alpha"), "deepnorm_beta": saved.get("deepnorm_beta")})
    p_arg, alpha_arg = getattr(args, "mixln_post_ln_layers", None), getattr(args, "mixln_alpha", None)
    layout_arg, scheme_arg = getattr(args, "mixln_layout", None), getattr(args, "mixln_scheme", None)
    dn_args = {k: getattr(args, f"mixln_{k}", None) for k in ("deepnorm_alpha", "deepnorm_beta")}
    if any(v is not None for v in (p_arg, alpha_arg, layout_arg, scheme_arg, *dn_args.values())):
        p = None if p_arg is None else parse_count(p_arg, SAVED_ARGS, "post_ln_layers")
        p_alpha = None if alpha_arg is None or num_layers is None else \
            math.floor(parse_alpha(alpha_arg, SAVED_ARGS) * num_layers)
        if p is not None and p_alpha is not None and p != p_alpha:
            raise MixLNSavedSettingsDisagree(
                f"the checkpoint's Mix-LN settings disagree: the saved --mixln-post-ln-layers says P={p}, the saved "
                f"--mixln-alpha {alpha_arg} says P={p_alpha} of L={num_layers}")
        p = p if p is not None else p_alpha
        kinds = kinds_text(layout_arg, p, num_layers, SAVED_ARGS)
        if layout_arg is not None and kinds is not None:
            p = sum(k in POST_LN_KINDS for k in parse_layout(layout_arg, num_layers, SAVED_ARGS))
        sources.append({"name": SAVED_ARGS, "scheme": scheme_arg, "p": p, "kinds": kinds,
                        "alpha": str(alpha_arg) if alpha_arg is not None else None,
                        **{k: None if v is None else parse_positive(v, SAVED_ARGS, k) for k, v in dn_args.items()}})

    def show(src):  # Mix-LN's first-P layouts (canonical runs post, pre) by their P, as before layouts
        runs = [run.partition(":")[0] for run in src["kinds"].split(",")] if src["kinds"] else []
        first_p = runs in ([], ["post"], ["pre"], ["post", "pre"]) and src["p"] is not None
        return f"scheme={src['scheme']} " + (f"P={src['p']}" if first_p else f"layout {src['kinds']}")

    for i, one in enumerate(sources):
        for two in sources[i + 1:]:
            differ = [key for key in ("scheme", "kinds", "deepnorm_alpha", "deepnorm_beta")
                      if one[key] is not None and two[key] is not None and one[key] != two[key]]
            if one["kinds"] is None or two["kinds"] is None:
                differ += ["p"] if one["p"] is not None and two["p"] is not None and one["p"] != two["p"] else []
            if differ:
                extra = "".join(f" ({key}: {one[key]} vs {two[key]})" for key in differ if key.startswith("deepnorm"))
                raise MixLNSavedSettingsDisagree(
                    f"the checkpoint's Mix-LN settings disagree: {one['name']} says {show(one)}, {two['name']} "
                    f"says {show(two)}{extra}")
    if not sources:
        return None

    def first(key):
        return next((src[key] for src in sources if src[key] is not None), None)

    kinds = first("kinds")
    layout = None
    if kinds is not None:
        parsed = parse_layout(kinds, _layers_of(kinds), SETTINGS_RECORD)
        layout = None if leading_post_count(parsed) is not None else kinds
    return {"scheme": first("scheme"), "post_ln_layers": first("p"), "alpha": first("alpha"), "layout": layout,
            "deepnorm_alpha": first("deepnorm_alpha"), "deepnorm_beta": first("deepnorm_beta"),
            "source": sources[0]["name"]}


def _layers_of(canonical: str) -> int:
    """The layer count of a canonical layout (its last run's last layer)."""
    return int(canonical.rsplit(":", 1)[1].rsplit("-", 1)[-1])


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_COUNTS = {"post_ln_layers": "post_ln_layers", "telemetry.interval": "the telemetry interval (steps)"}


def layered(*layers: Optional[MixLNSettings]) -> MixLNSettings:
    """Combine settings, highest precedence first: per group, the first layer that sets it wins."""
    layers = [layer for layer in layers if layer is not None]
    values, names = {}, {}

    def take(owner, field: str, name: str) -> None:
        if getattr(owner, name) is not None:
            values[field], names[field] = getattr(owner, name), owner.source(name)

    placement = next((s for s in layers if any(getattr(s, f) is not None for f in PLACEMENT_FIELDS)), None)
    for field, _, _, _, _ in FIELDS:
        group, _, name = field.rpartition(".")
        if field in PLACEMENT_FIELDS:
            if placement is not None:
                take(placement, field, name)
            continue
        owner = next((getattr(s, group) if group else s for s in layers
                      if getattr(getattr(s, group) if group else s, name) is not None), None)
        if owner is not None:
            take(owner, field, name)
    owner = next((s.spike for s in layers if s.spike.log_interval is not None), None)
    if owner is not None:
        take(owner, "spike.log_interval", "log_interval")
    return MixLNSettings._from_values(values, names)


# --------------------------------------------------------------------------------------- the rest of MIXLN_*
def settings_variables_set(environ: Optional[Mapping[str, str]] = None) -> list:
    """The names of the MIXLN_* settings variables that are set (non-empty), MIXLN_CPU aside."""
    env = os.environ if environ is None else environ
    return [var for _, _, var, _, _ in FIELDS if (env.get(var) or "").strip()]


def cpu_requested(environ: Optional[Mapping[str, str]] = None) -> bool:
    """MIXLN_CPU=1: the entry point enters the CPU harness (development only)."""
    value = ((os.environ if environ is None else environ).get(CPU) or "").strip().lower()
    if value and value not in _TRUE + _FALSE:
        raise MixLNConfigError(f"{CPU} must be 1 or 0, got {value!r}")
    return value in _TRUE


def analysis_cache_dir(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """MIXLN_ANALYSIS_CACHE: where the analysis tools cache tokenized text (None: a temp dir)."""
    return ((os.environ if environ is None else environ).get(ANALYSIS_CACHE) or "").strip() or None
