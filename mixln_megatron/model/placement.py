"""The placement rule: which global layers are Post-LN, and how norms are scaled. Pure Python.

Everything else (layers, checkpoints, the HF export, the CLI) asks one question: given L layers
and the user's MixLNSettings (settings.py), which 1-based global layer numbers are Post-LN. Without
a setting the paper's default alpha = 0.25 applies, and only to models of at most 24 layers.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Optional, Union

from ..errors import MixLNConfigError
from .settings import ARGUMENT, DEFAULT, SCHEMES, MixLNSettings, parse_alpha, parse_count

DEFAULT_ALPHA = "0.25"
# The paper's default alpha is 0.25 for 71M-1B models (12 -> 3, 24 -> 6 Post-LN layers). At 7B
# (32 layers) the authors needed alpha = 0.0625 (2 layers); 0.25 would silently give 8.
DEFAULT_ALPHA_MAX_LAYERS = 24

__all__ = [
    "DEFAULT_ALPHA", "DEFAULT_ALPHA_MAX_LAYERS", "SCHEMES", "MixLNConfigError", "MixLNSettings",
    "Placement", "post_ln_count", "resolve_placement",
]


@dataclasses.dataclass(frozen=True)
class Placement:
    """The resolved decision for one model: the integer P is what is recorded everywhere."""

    num_layers: int
    post_ln_layers: int  # P: global layers 1..P are Post-LN
    scheme: str = "mixln"
    alpha: Optional[str] = None  # exact text of the alpha that produced P, if P came from alpha
    source: str = DEFAULT  # where P came from: a flag, a variable, the checkpoint, argument, default
    scheme_source: str = DEFAULT

    def __post_init__(self):
        if self.num_layers < 1:
            raise MixLNConfigError(f"num_layers must be >= 1, got {self.num_layers}")
        if not 0 <= self.post_ln_layers <= self.num_layers:
            raise MixLNConfigError(f"post_ln_layers = {self.post_ln_layers} is outside [0, num_layers = {self.num_layers}]")
        if self.scheme == "lns" and self.post_ln_layers:
            raise MixLNConfigError(f"scheme 'lns' keeps every layer Pre-LN, but post_ln_layers = {self.post_ln_layers}; "
                                   "use scheme 'mixln+lns' for LNS on top of Mix-LN")

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
        return (self.post_ln_layers, self.post_ln_layers + 1) if 0 < self.post_ln_layers < self.num_layers else ()

    def record(self) -> dict:
        """What checkpoints and HF configs store (plain JSON types)."""
        return {"format": 1, "scheme": self.scheme, "num_layers": self.num_layers,
                "post_ln_layers": self.post_ln_layers, "alpha": self.alpha}

    def describe(self) -> str:
        """The one line rank 0 prints at model build."""
        layers = self.post_ln_layer_numbers
        shown = "none" if not layers else (", ".join(map(str, layers)) if len(layers) <= 8 else f"{layers[0]}..{layers[-1]}")
        alpha = f"alpha={self.alpha}" if self.alpha is not None else "alpha=n/a (P given directly)"
        lns = "; LayerNorm Scaling 1/sqrt(l) on Pre-LN layers" if self.scheme != "mixln" else ""
        scheme = "" if self.scheme_source == DEFAULT else f" ({_from(self.scheme_source)})"
        return (f"[mixln_megatron] scheme={self.scheme}{scheme} L={self.num_layers} P={self.post_ln_layers} "
                f"{alpha} ({_from(self.source)}); Post-LN layers: {shown}{lns}")


def _from(source: str) -> str:
    """'from --mixln-alpha', 'from MIXLN_ALPHA', 'from the checkpoint', 'from the arguments', 'default'."""
    return DEFAULT if source == DEFAULT else f"from {'the arguments' if source == ARGUMENT else source}"


def fraction_text(frac: Fraction) -> str:
    """Shortest exact decimal text of a fraction when it has one (0.0625), else 'n/d'."""
    den = frac.denominator
    for prime in (2, 5):
        while den % prime == 0:
            den //= prime
    if den != 1:
        return f"{frac.numerator}/{frac.denominator}"
    digits = 0
    while (frac * 10**digits).denominator != 1:
        digits += 1
    return f"{float(frac):.{digits}f}" if digits else str(int(frac))


def post_ln_count(alpha: Union[str, float, Fraction], num_layers: int) -> int:
    """P = floor(alpha * L), exactly (no float error: alpha '0.29', L = 100 gives 29)."""
    return math.floor(parse_alpha(alpha, "the arguments") * num_layers)


def resolve_placement(num_layers: int, settings: Optional[MixLNSettings] = None) -> Placement:
    """P for a model of `num_layers` layers: from the settings, else the default alpha."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise MixLNConfigError(f"num_layers must be a positive integer, got {num_layers!r}")
    s = settings or MixLNSettings()
    scheme = s.scheme.strip().lower() if s.scheme is not None else "mixln"
    scheme_source = s.source("scheme")
    if s.alpha is None and s.post_ln_layers is None:
        if scheme == "lns":
            return Placement(num_layers, 0, scheme, None, "scheme lns", scheme_source)
        if num_layers > DEFAULT_ALPHA_MAX_LAYERS:
            raise MixLNConfigError(
                f"the model has {num_layers} layers and no Mix-LN setting was given; the default "
                f"alpha = {DEFAULT_ALPHA} applies only up to {DEFAULT_ALPHA_MAX_LAYERS} layers (the "
                f"paper needed alpha = 0.0625, i.e. 2 Post-LN layers, at 32 layers): set "
                f"--mixln-alpha / --mixln-post-ln-layers, MIXLN_ALPHA / MIXLN_POST_LN_LAYERS, or the "
                f"spec factory's alpha= / post_ln_layers= explicitly")
        s = MixLNSettings(alpha=DEFAULT_ALPHA, scheme=s.scheme, sources={"alpha": DEFAULT, "scheme": scheme_source})
    source = s.placement_source
    where = "the arguments" if source == ARGUMENT else source
    alpha_text = None
    if s.alpha is not None:
        frac = parse_alpha(s.alpha, where)
        p, alpha_text = math.floor(frac * num_layers), fraction_text(frac)
    else:
        p = parse_count(s.post_ln_layers, where, "post_ln_layers")
        if p > num_layers:
            raise MixLNConfigError(f"post_ln_layers = {p} (from {where}) exceeds the model's num_layers = {num_layers}")
    if scheme == "lns" and p:
        raise MixLNConfigError(
            f"scheme 'lns' (LayerNorm Scaling, all Pre-LN) was combined with {p} Post-LN layers "
            f"from {where}; use scheme 'mixln+lns', or drop the alpha / post_ln_layers setting")
    return Placement(num_layers, p, scheme, alpha_text, source, scheme_source)
