"""Mix-LN settings and the placement rule: which global layers are Post-LN.

Pure Python on purpose: no torch, no megatron, no torch.distributed. Everything else in the
package (layers, checkpoints, the HF export, the CLI) asks this module one question: given
L layers, which 1-based global layer numbers are Post-LN, and how are norms scaled.

Sources of settings, highest first:
  1. explicit arguments (the spec factory, a MixLNSettings object, the --mixln-* flags),
  2. the environment: MIXLN_ALPHA, MIXLN_POST_LN_LAYERS, MIXLN_SCHEME (the only channel that
     stock Megatron-LM's pretrain_gpt.py leaves a plugin),
  3. the paper's default alpha = 0.25, used only for models of at most 24 layers.
"""

from __future__ import annotations

import dataclasses
import math
import os
from fractions import Fraction
from typing import Mapping, Optional, Union

ENV_ALPHA = "MIXLN_ALPHA"
ENV_POST_LN_LAYERS = "MIXLN_POST_LN_LAYERS"
ENV_SCHEME = "MIXLN_SCHEME"

DEFAULT_ALPHA = "0.25"
# The paper's default alpha is 0.25 for 71M-1B models (12 -> 3, 24 -> 6 Post-LN layers). At 7B
# (32 layers) the authors needed alpha = 0.0625 (2 layers); 0.25 would silently give 8.
DEFAULT_ALPHA_MAX_LAYERS = 24

# mixln: Post-LN for the first P layers, Pre-LN after.  lns: LayerNorm Scaling, Pre-LN
# everywhere with each norm output in layer l scaled by 1/sqrt(l).  mixln+lns: LNS on the
# Pre-LN layers of a Mix-LN model.
SCHEMES = ("mixln", "lns", "mixln+lns")


class MixLNConfigError(ValueError):
    """A Mix-LN setting is invalid; the message says which and what to do."""


def _parse_alpha(value: Union[str, float, int, Fraction], source: str) -> Fraction:
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


def _parse_int(value: Union[str, int], source: str, what: str) -> int:
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


def _parse_scheme(value: str, source: str) -> str:
    scheme = str(value).strip().lower()
    if scheme not in SCHEMES:
        raise MixLNConfigError(f"scheme from {source} must be one of {', '.join(SCHEMES)}; got {value!r}")
    return scheme


def _fraction_text(frac: Fraction) -> str:
    """Shortest exact decimal text of a fraction when it has one (0.0625), else 'n/d'."""
    den = frac.denominator
    while den % 2 == 0:
        den //= 2
    while den % 5 == 0:
        den //= 5
    if den != 1:
        return f"{frac.numerator}/{frac.denominator}"
    digits = 0
    while (frac * 10**digits).denominator != 1:
        digits += 1
    text = f"{float(frac):.{digits}f}" if digits else str(int(frac))
    return text


@dataclasses.dataclass(frozen=True)
class MixLNSettings:
    """What the user asked for. Unset fields (None) fall through to the environment, then defaults.

    Exactly one of `alpha` and `post_ln_layers` may be given at the same level of precedence.
    """

    alpha: Optional[Union[str, float, Fraction]] = None
    post_ln_layers: Optional[int] = None
    scheme: Optional[str] = None

    def __post_init__(self):
        if self.alpha is not None and self.post_ln_layers is not None:
            raise MixLNConfigError(
                f"give either alpha ({self.alpha!r}) or post_ln_layers ({self.post_ln_layers!r}), "
                "not both: alpha sets P = floor(alpha * num_layers), post_ln_layers sets P directly"
            )
        if self.alpha is not None:
            _parse_alpha(self.alpha, "the arguments")
        if self.post_ln_layers is not None:
            _parse_int(self.post_ln_layers, "the arguments", "post_ln_layers")
        if self.scheme is not None:
            _parse_scheme(self.scheme, "the arguments")

    def resolve(self, num_layers: int, environ: Optional[Mapping[str, str]] = None) -> "Placement":
        """Apply precedence (arguments > environment > default) and the rule for `num_layers`."""
        return resolve_placement(num_layers, self, environ)


@dataclasses.dataclass(frozen=True)
class Placement:
    """The resolved decision for one model: the integer P is what is recorded everywhere."""

    num_layers: int
    post_ln_layers: int  # P: global layers 1..P are Post-LN
    scheme: str = "mixln"
    alpha: Optional[str] = None  # exact text of the alpha that produced P, if P came from alpha
    source: str = "default"  # where P came from: arguments | environment | default

    def __post_init__(self):
        if self.num_layers < 1:
            raise MixLNConfigError(f"num_layers must be >= 1, got {self.num_layers}")
        if not 0 <= self.post_ln_layers <= self.num_layers:
            raise MixLNConfigError(
                f"post_ln_layers = {self.post_ln_layers} is outside [0, num_layers = {self.num_layers}]"
            )
        if self.scheme == "lns" and self.post_ln_layers:
            raise MixLNConfigError(
                "scheme 'lns' keeps every layer Pre-LN, but post_ln_layers = "
                f"{self.post_ln_layers}; use scheme 'mixln+lns' for LNS on top of Mix-LN"
            )

    def is_post_ln(self, layer_number: int) -> bool:
        """`layer_number` is Megatron's global, 1-based TransformerLayer.layer_number."""
        self._check_layer(layer_number)
        return layer_number <= self.post_ln_layers

    def norm_output_scale(self, layer_number: int) -> float:
        """LayerNorm Scaling factor 1/sqrt(l) for Pre-LN layers under lns schemes, else 1."""
        self._check_layer(layer_number)
        if self.scheme == "mixln" or self.is_post_ln(layer_number):
            return 1.0
        return 1.0 / math.sqrt(layer_number)

    def _check_layer(self, layer_number: int) -> None:
        if not 1 <= layer_number <= self.num_layers:
            raise ValueError(f"layer_number {layer_number} outside 1..{self.num_layers}")

    @property
    def post_ln_layer_numbers(self) -> list:
        return list(range(1, self.post_ln_layers + 1))

    @property
    def is_stock(self) -> bool:
        """True when the network equals megatron's stock Pre-LN GPT layer."""
        return self.post_ln_layers == 0 and self.scheme == "mixln"

    @property
    def boundary_layers(self) -> tuple:
        """(last Post-LN layer, first Pre-LN layer), or () when there is no Post/Pre boundary."""
        if 0 < self.post_ln_layers < self.num_layers:
            return (self.post_ln_layers, self.post_ln_layers + 1)
        return ()

    def record(self) -> dict:
        """What checkpoints and HF configs store (plain JSON types)."""
        return {
            "format": 1,
            "scheme": self.scheme,
            "num_layers": self.num_layers,
            "post_ln_layers": self.post_ln_layers,
            "alpha": self.alpha,
        }

    def describe(self) -> str:
        """The one line rank 0 prints at model build."""
        layers = self.post_ln_layer_numbers
        shown = (
            "none"
            if not layers
            else (", ".join(map(str, layers)) if len(layers) <= 8 else f"{layers[0]}..{layers[-1]}")
        )
        alpha = f"alpha={self.alpha}" if self.alpha is not None else "alpha=n/a (P given directly)"
        lns = "; LayerNorm Scaling 1/sqrt(l) on Pre-LN layers" if self.scheme != "mixln" else ""
        return (
            f"[mixln_megatron] scheme={self.scheme} L={self.num_layers} P={self.post_ln_layers} "
            f"{alpha} (from {self.source}); Post-LN layers: {shown}{lns}"
        )


def post_ln_count(alpha: Union[str, float, Fraction], num_layers: int) -> int:
    """P = floor(alpha * L), exactly (no float error: alpha '0.29', L = 100 gives 29)."""
    return math.floor(_parse_alpha(alpha, "the arguments") * num_layers)


def settings_from_env(environ: Optional[Mapping[str, str]] = None) -> MixLNSettings:
    """MixLNSettings from MIXLN_* variables (empty strings count as unset)."""
    env = os.environ if environ is None else environ
    alpha = env.get(ENV_ALPHA, "").strip() or None
    post = env.get(ENV_POST_LN_LAYERS, "").strip() or None
    scheme = env.get(ENV_SCHEME, "").strip() or None
    if alpha is not None and post is not None:
        raise MixLNConfigError(
            f"both {ENV_ALPHA}={alpha!r} and {ENV_POST_LN_LAYERS}={post!r} are set; unset one"
        )
    if alpha is not None:
        _parse_alpha(alpha, f"environment variable {ENV_ALPHA}")
    if post is not None:
        post = _parse_int(post, f"environment variable {ENV_POST_LN_LAYERS}", "post_ln_layers")
    if scheme is not None:
        scheme = _parse_scheme(scheme, f"environment variable {ENV_SCHEME}")
    return MixLNSettings(alpha=alpha, post_ln_layers=post, scheme=scheme)


def resolve_placement(
    num_layers: int,
    settings: Optional[MixLNSettings] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Placement:
    """Resolve P for a model of `num_layers` layers from arguments > environment > default."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise MixLNConfigError(f"num_layers must be a positive integer, got {num_layers!r}")
    args = settings or MixLNSettings()
    env = settings_from_env(environ)

    scheme = args.scheme or env.scheme or "mixln"
    if args.alpha is not None or args.post_ln_layers is not None:
        chosen, source = args, "arguments"
    elif env.alpha is not None or env.post_ln_layers is not None:
        chosen, source = env, "environment"
    elif scheme == "lns":
        return Placement(num_layers, 0, scheme, None, "scheme lns")
    else:
        if num_layers > DEFAULT_ALPHA_MAX_LAYERS:
            raise MixLNConfigError(
                f"the model has {num_layers} layers and no Mix-LN setting was given. The default "
                f"alpha = {DEFAULT_ALPHA} applies only up to {DEFAULT_ALPHA_MAX_LAYERS} layers (the "
                f"paper needed alpha = 0.0625, i.e. 2 Post-LN layers, at 32 layers). Set "
                f"{ENV_ALPHA} or {ENV_POST_LN_LAYERS} (or --mixln-alpha / --mixln-post-ln-layers, "
                f"or the spec factory's alpha=/post_ln_layers=) explicitly."
            )
        chosen, source = MixLNSettings(alpha=DEFAULT_ALPHA), "default"

    where = "the arguments" if source == "arguments" else (
        "the environment" if source == "environment" else "the default")
    if chosen.alpha is not None:
        frac = _parse_alpha(chosen.alpha, where)
        p = math.floor(frac * num_layers)
        alpha_text = _fraction_text(frac)
    else:
        p = _parse_int(chosen.post_ln_layers, where, "post_ln_layers")
        if p > num_layers:
            raise MixLNConfigError(
                f"post_ln_layers = {p} (from {where}) exceeds the model's num_layers = {num_layers}"
            )
        alpha_text = None
    if scheme == "lns" and p:
        raise MixLNConfigError(
            f"scheme 'lns' (LayerNorm Scaling, all Pre-LN) was combined with {p} Post-LN layers "
            f"from {where}; use scheme 'mixln+lns', or drop the alpha / post_ln_layers setting"
        )
    return Placement(num_layers, p, scheme, alpha_text, source)
