"""The placement rule: which global layers are Post-LN, and how norms are scaled. Pure Python.

Everything else (layers, checkpoints, the HF export, the CLI) asks one question: given L layers
and the user's MixLNSettings (settings.py), which 1-based global layer numbers are Post-LN. Without
a setting the paper's default alpha = 0.25 applies, and only to models of at most 24 layers.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Optional, Tuple, Union

from ..errors import MixLNConfigError
from . import layout
from .settings import ARGUMENT, DEFAULT, SCHEMES, MixLNSettings, parse_alpha, parse_count, parse_positive

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
    """The resolved decision for one model: the kind of every layer (layout.py), and how norms scale.

    `post_ln_layers` counts the Post-LN-kind layers; for Mix-LN's own layout (layers 1..P Post-LN,
    the rest Pre-LN) it is P, the integer recorded everywhere. Any other layout is recorded as its
    canonical text (`layout`), with DeepNorm's alpha and beta when a layer is deepnorm.
    """

    num_layers: int
    post_ln_layers: int  # Mix-LN's P, or the number of post / deepnorm layers of a layout
    scheme: str = "mixln"
    alpha: Optional[str] = None  # exact text of the alpha that produced P, if P came from alpha
    source: str = DEFAULT  # where the kinds came from: a flag, a variable, the checkpoint, argument, default
    scheme_source: str = DEFAULT
    kinds: Tuple[str, ...] = ()  # kinds[l - 1] is global layer l's kind; () means first P post, rest pre
    deepnorm_alpha: Optional[float] = None  # residual scale of deepnorm layers (set iff one exists)
    deepnorm_beta: Optional[float] = None  # their init factor

    def __post_init__(self):
        if self.num_layers < 1:
            raise MixLNConfigError(f"num_layers must be >= 1, got {self.num_layers}")
        if not self.kinds:
            if not 0 <= self.post_ln_layers <= self.num_layers:
                raise MixLNConfigError(f"post_ln_layers = {self.post_ln_layers} is outside [0, num_layers = {self.num_layers}]")
            object.__setattr__(self, "kinds", layout.first_p_kinds(self.num_layers, self.post_ln_layers))
        kinds = tuple(self.kinds)
        object.__setattr__(self, "kinds", kinds)
        if len(kinds) != self.num_layers or any(k not in layout.KINDS for k in kinds):
            raise MixLNConfigError(f"a placement needs one of {', '.join(layout.KINDS)} per layer, got {kinds!r:.200}")
        if self.post_ln_layers != sum(k in layout.POST_LN_KINDS for k in kinds):
            raise MixLNConfigError(f"post_ln_layers = {self.post_ln_layers} does not count the Post-LN layers of "
                                   f"{layout.layout_text(kinds)}")
        if self.scheme == "lns" and self.post_ln_layers:
            raise MixLNConfigError(f"scheme 'lns' keeps every layer Pre-LN, but post_ln_layers = {self.post_ln_layers}; "
                                   "use scheme 'mixln+lns' for LNS on top of Mix-LN")
        has_deepnorm = layout.DEEPNORM in kinds
        if has_deepnorm != (self.deepnorm_alpha is not None) or has_deepnorm != (self.deepnorm_beta is not None):
            raise MixLNConfigError("DeepNorm's alpha and beta are set exactly when a layer is deepnorm")

    def kind(self, layer_number: int) -> str:
        """pre, post, deepnorm or sandwich (layout.py) for Megatron's global, 1-based layer_number."""
        self._check_layer(layer_number)
        return self.kinds[layer_number - 1]

    def is_post_ln(self, layer_number: int) -> bool:
        """`layer_number` is Megatron's global, 1-based TransformerLayer.layer_number."""
        return self.kind(layer_number) in layout.POST_LN_KINDS

    def norm_output_scale(self, layer_number: int) -> float:
        """LayerNorm Scaling factor 1/sqrt(l) for the pre-norms of Pre-LN-kind layers (pre, sandwich)
        under lns schemes, else 1."""
        self._check_layer(layer_number)
        if self.scheme == "mixln" or self.is_post_ln(layer_number):
            return 1.0
        return 1.0 / math.sqrt(layer_number)

    def _check_layer(self, layer_number: int) -> None:
        if not 1 <= layer_number <= self.num_layers:
            raise ValueError(f"layer_number {layer_number} outside 1..{self.num_layers}")

    @property
    def is_first_p(self) -> bool:
        """Mix-LN's own layout (layers 1..P post, the rest pre): what alpha / post_ln_layers express."""
        return layout.leading_post_count(self.kinds) is not None

    @property
    def layout(self) -> str:
        """The canonical layout text, e.g. 'post:1-2,pre:3-32'."""
        return layout.layout_text(self.kinds)

    @property
    def post_ln_layer_numbers(self) -> list:
        return [i for i, k in enumerate(self.kinds, 1) if k in layout.POST_LN_KINDS]

    @property
    def is_stock(self) -> bool:
        """True when the network equals megatron's stock Pre-LN GPT layer."""
        return self.post_ln_layers == 0 and self.scheme == "mixln" and set(self.kinds) == {layout.PRE}

    @property
    def boundaries(self) -> tuple:
        """Every (last Post-LN-kind layer, first Pre-LN-kind layer) pair: none, one or several."""
        return layout.boundaries(self.kinds)

    @property
    def boundary_layers(self) -> tuple:
        """The layers on either side of every Post/Pre boundary, ascending; () when there is none."""
        return tuple(sorted({layer for pair in self.boundaries for layer in pair}))

    def record(self) -> dict:
        """What checkpoints and HF configs store (plain JSON types): format 1 for Mix-LN's first-P
        layout (unchanged since the first release), format 2 with the layout text otherwise."""
        base = {"format": 1, "scheme": self.scheme, "num_layers": self.num_layers,
                "post_ln_layers": self.post_ln_layers, "alpha": self.alpha}
        if self.is_first_p:
            return base
        return {**base, "format": 2, "layout": self.layout, "deepnorm_alpha": self.deepnorm_alpha,
                "deepnorm_beta": self.deepnorm_beta}

    def describe(self) -> str:
        """The one line rank 0 prints at model build."""
        lns = "; LayerNorm Scaling 1/sqrt(l) on Pre-LN layers" if self.scheme != "mixln" else ""
        scheme = "" if self.scheme_source == DEFAULT else f" ({_from(self.scheme_source)})"
        if not self.is_first_p:
            pairs = self.boundaries
            edges = ", ".join(f"{a}|{b}" for a, b in pairs[:8]) + (", ..." if len(pairs) > 8 else "")
            deepnorm = (f"; deepnorm alpha={self.deepnorm_alpha:.6g} beta={self.deepnorm_beta:.6g}"
                        if self.deepnorm_alpha is not None else "")
            return (f"[mixln_megatron] scheme={self.scheme}{scheme} L={self.num_layers} layout={self.layout} "
                    f"({_from(self.source)}); Post/Pre boundaries: {edges or 'none'}{deepnorm}{lns}")
        layers = self.post_ln_layer_numbers
        shown = "none" if not layers else (", ".join(map(str, layers)) if len(layers) <= 8 else f"{layers[0]}..{layers[-1]}")
        alpha = f"alpha={self.alpha}" if self.alpha is not None else "alpha=n/a (P given directly)"
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
    if s.layout is not None:
        return _resolve_layout(num_layers, s, scheme, scheme_source)
    if s.deepnorm_alpha is not None or s.deepnorm_beta is not None:
        name = "deepnorm_alpha" if s.deepnorm_alpha is not None else "deepnorm_beta"
        raise MixLNConfigError(f"{name} (from {s._where(name)}) applies to deepnorm layers, but no layout with a "
                               "deepnorm layer was given (e.g. --mixln-layout deepnorm:1-2,pre:3-)")
    if s.alpha is None and s.post_ln_layers is None:
        if scheme == "lns":
            return Placement(num_layers, 0, scheme, None, "scheme lns", scheme_source)
        if num_layers > DEFAULT_ALPHA_MAX_LAYERS:
            raise MixLNConfigError(
                f"the model has {num_layers} layers and no Mix-LN setting was given; the default "
                f"alpha = {DEFAULT_ALPHA} applies only up to {DEFAULT_ALPHA_MAX_LAYERS} layers (the "
                f"paper needed alpha = 0.0625, i.e. 2 Post-LN layers, at 32 layers): set alpha, P or a layout "
                f"explicitly: --mixln-alpha / --mixln-post-ln-layers / --mixln-layout, MIXLN_ALPHA / "
                f"MIXLN_POST_LN_LAYERS / MIXLN_LAYOUT, or the spec factory's alpha= / post_ln_layers= / layout=")
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


def deepnorm_defaults(num_layers: int) -> Tuple[float, float]:
    """DeepNet's decoder-only constants for N = num_layers: alpha = (2N)^(1/4), beta = (8N)^(-1/4)."""
    return (2.0 * num_layers) ** 0.25, (8.0 * num_layers) ** -0.25


def _resolve_layout(num_layers: int, s: MixLNSettings, scheme: str, scheme_source: str) -> Placement:
    where = s._where("layout")
    kinds = layout.parse_layout(s.layout, num_layers, where)
    post = sum(k in layout.POST_LN_KINDS for k in kinds)
    if scheme == "lns" and post:
        raise MixLNConfigError(
            f"scheme 'lns' (LayerNorm Scaling, all Pre-LN) was combined with the layout {s.layout!r} (from "
            f"{where}), which has {post} Post-LN layers; use scheme 'mixln+lns', or a layout of pre / sandwich only")
    dn_alpha = dn_beta = None
    if layout.DEEPNORM in kinds:
        dn_alpha, dn_beta = deepnorm_defaults(num_layers)
        if s.deepnorm_alpha is not None:
            dn_alpha = parse_positive(s.deepnorm_alpha, s._where("deepnorm_alpha"), "deepnorm alpha")
        if s.deepnorm_beta is not None:
            dn_beta = parse_positive(s.deepnorm_beta, s._where("deepnorm_beta"), "deepnorm beta")
    else:
        for name in ("deepnorm_alpha", "deepnorm_beta"):
            if getattr(s, name) is not None:
                raise MixLNConfigError(f"{name} (from {s._where(name)}) applies to deepnorm layers, but the layout "
                                       f"{s.layout!r} (from {where}) has none")
    return Placement(num_layers, post, scheme, None, s.placement_source, scheme_source, kinds, dn_alpha, dn_beta)
