"""The arms of the Mix-LN paper's comparison, each a per-layer layout of the same model.

One table for the CPU benchmark (benchmarks/schemes.py) and for the cluster launchers
(examples/compare_schemes.sh), so that the arm a user trains at 1B is the arm the benchmark measured:

    mixln-megatron arms --num-layers 24 mix_deepnorm     (or python -m mixln_megatron.analysis.arms ...)
    export MIXLN_LAYOUT='deepnorm:1-6,pre:*'
    export MIXLN_SCHEME='mixln'

Without an arm it prints the table: every arm's name, what it is, and its layout at that depth.

Pure Python (model.settings / model.placement only).
"""

from __future__ import annotations

import math
import shlex
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from ..cli_parsing import CommandParser, add_flag, refused
from ..errors import MixLNError
from ..model.placement import resolve_placement
from ..model.settings import MixLNSettings

ALPHA = 0.25  # Mix-LN's alpha up to 1B: P = floor(L / 4) Post-LN layers
AUTHORS_DEEPNORM_ALPHA = "2.8284271247461903"  # pixeli99/MixLN's fixed alpha: (2N)^(1/4) at N = 32


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    layout: str  # {P} = floor(ALPHA * L) (Mix-LN's P), {Q} = L - P, filled in per depth
    scheme: str = "mixln"
    authors_deepnorm: bool = False  # the Mix-LN authors' DeepNorm constants instead of DeepNet's

    def values(self, num_layers: int, alpha: float = ALPHA) -> dict:
        """The settings of this arm at `num_layers` layers (P = floor(alpha * L)), as MixLNSettings
        keyword arguments."""
        p = math.floor(alpha * num_layers)
        values = {"layout": self.layout.format(P=p, Q=num_layers - p), "scheme": self.scheme}
        if self.authors_deepnorm:  # their alpha at every depth; their init gain (8N)^(1/4) multiplies
            values.update(deepnorm_alpha=AUTHORS_DEEPNORM_ALPHA, deepnorm_beta=repr((8.0 * num_layers) ** 0.25))
        return values

    def settings(self, num_layers: int, alpha: float = ALPHA) -> MixLNSettings:
        return MixLNSettings(**self.values(num_layers, alpha))


ARMS = (
    Arm("pre_ln", "Pre-LN", "pre:*"),
    Arm("post_ln", "Post-LN", "post:*"),
    Arm("deepnorm", "DeepNorm (DeepNet)", "deepnorm:*"),
    Arm("deepnorm_authors", "DeepNorm (authors' constants)", "deepnorm:*", authors_deepnorm=True),
    Arm("sandwich", "Sandwich-LN", "sandwich:*"),
    Arm("lns", "LayerNorm Scaling", "pre:*", scheme="lns"),
    Arm("mix_ln", "Mix-LN (Post-LN first alpha*L)", "post:1-{P},pre:*"),
    Arm("mix_deepnorm", "DeepNorm first alpha*L, then Pre-LN", "deepnorm:1-{P},pre:*"),
    Arm("pre_post", "Pre-LN, Post-LN last alpha*L", "pre:1-{Q},post:*"),
    Arm("post_every4", "Post-LN every 4th layer", "post:every4,pre:*"),
    Arm("pre_every4", "Pre-LN every 4th layer, else Post-LN", "pre:every4,post:*"),
    Arm("pre_sandwich", "Pre-LN, Sandwich last alpha*L", "pre:1-{Q},sandwich:*"),
)
ARM_BY_NAME = {arm.name: arm for arm in ARMS}
_VARIABLES = {"layout": "MIXLN_LAYOUT", "scheme": "MIXLN_SCHEME", "deepnorm_alpha": "MIXLN_DEEPNORM_ALPHA",
              "deepnorm_beta": "MIXLN_DEEPNORM_BETA"}


def build_parser(prog: Optional[str] = None) -> CommandParser:
    ap = CommandParser(prog=prog or "mixln-megatron arms",
                       description="The arms of the Mix-LN paper's comparison at one depth: the table, or "
                       "the MIXLN_* exports of one arm (for Megatron-LM's pretrain_gpt.py with --spec).")
    add_flag(ap, "--num-layers", "--layers", type=int, required=True, help="the model's number of layers L")
    add_flag(ap, "--mixln-alpha", "--alpha", type=float, default=ALPHA,
             help="Mix-LN's alpha, the size of the L/4 groups (default 0.25; the paper's 7B: 0.0625)")
    ap.add_argument("arm", nargs="?", choices=sorted(ARM_BY_NAME),
                    help="the arm whose exports to print (default: print the table of every arm)")
    return ap


def table(num_layers: int, alpha: float = ALPHA) -> str:
    """Every arm at `num_layers` layers: name, layout (and scheme when not mixln), what it is."""
    rows = []
    for arm in ARMS:
        values = arm.values(num_layers, alpha)
        scheme = "" if values["scheme"] == "mixln" else f" scheme={values['scheme']}"
        rows.append((arm.name, values["layout"] + scheme, arm.label))
    width = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{name:{width[0]}s}  {layout:{width[1]}s}  {label}" for name, layout, label in rows)


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    ap = build_parser(prog)
    a = ap.parse_args(argv)
    try:
        if a.arm is None:
            for arm in ARMS:  # every layout must fit L before anything is printed
                resolve_placement(a.num_layers, arm.settings(a.num_layers, a.mixln_alpha))
            print(table(a.num_layers, a.mixln_alpha))
            return 0
        arm = ARM_BY_NAME[a.arm]
        resolve_placement(a.num_layers, arm.settings(a.num_layers, a.mixln_alpha))  # a layout that does not fit L fails here
    except MixLNError as error:
        return refused(ap.prog, error)
    for name, value in arm.values(a.num_layers, a.mixln_alpha).items():
        print(f"export {_VARIABLES[name]}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m mixln_megatron.analysis.arms"))
