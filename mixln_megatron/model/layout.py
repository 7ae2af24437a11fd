"""Per-layer norm kinds: the layout string users write, parsed into one kind per layer. Pure Python.

The four kinds and the string's syntax are in docs/configuration.md ("Layer kinds and layouts"):
`pre` (megatron's stock layer), `post`, `deepnorm` (DeepNet's Post-LN) and `sandwich` (four
norms); `post` and `deepnorm` are Post-LN kinds (the residual stream is normalised). The spike
scaler's boundary is where a Post-LN kind is followed by a Pre-LN kind. Items are `kind:layers`,
layers 1-based global (`N`, `N-M`, `N-`, `everyK`, `*`); the canonical text (`layout_text`)
lists runs in order.
"""

from __future__ import annotations

import re
from typing import Dict, Sequence, Tuple

from ..errors import MixLNConfigError

PRE, POST, DEEPNORM, SANDWICH = "pre", "post", "deepnorm", "sandwich"
KINDS = (PRE, POST, DEEPNORM, SANDWICH)
POST_LN_KINDS = frozenset((POST, DEEPNORM))  # the residual stream goes through the norm
FOUR_NORM_KINDS = frozenset((SANDWICH,))  # norms after each sublayer as well as before
# The authors' names for their placements (pixeli99/MixLN NORM_TYPE), as layouts (README).
EXAMPLES = ("post:1-2,pre:3-", "deepnorm:1-2,pre:3-", "sandwich:*", "post:every4,pre:*")

_SPAN = re.compile(r"^(?:(\*)|every([0-9]+)|([0-9]+)(?:(-)([0-9]*))?)$")
_MAX_TEXT = 4096  # a layout longer than this is not something a user typed


def _fail(source: str, text: str, why: str) -> MixLNConfigError:
    return MixLNConfigError(
        f"layout from {source} {why}; got {text!r:.120}. A layout is comma-separated kind:layers "
        f"items with kinds {', '.join(KINDS)} and layers N, N-M, N-, everyK or * (the rest), "
        f"e.g. {EXAMPLES[0]!r} or {EXAMPLES[3]!r}")


def _items(text: str, source: str):
    """[(kind, span-match)] of a layout string, syntax only (no layer count needed)."""
    if not isinstance(text, str):
        raise MixLNConfigError(f"layout from {source} must be text such as {EXAMPLES[0]!r}, got {text!r:.80}")
    if len(text) > _MAX_TEXT:
        raise _fail(source, text, f"is longer than {_MAX_TEXT} characters")
    compact = re.sub(r"\s+", "", text).lower()
    if not compact:
        raise _fail(source, text, "is empty")
    items, stars = [], 0
    for item in compact.split(","):
        kind, colon, span = item.partition(":")
        if not colon or kind not in KINDS:
            raise _fail(source, text, f"has item {item!r} whose kind is not one of {', '.join(KINDS)}"
                        if colon else f"has item {item!r} without 'kind:layers'")
        match = _SPAN.match(span)
        if not match or (match.group(2) is not None and int(match.group(2)) < 1) or (
                match.group(3) is not None and int(match.group(3)) < 1):
            raise _fail(source, text, f"has item {item!r} whose layers are not N, N-M, N-, everyK (K >= 1) or *")
        stars += match.group(1) is not None
        items.append((kind, item, match))
    if stars > 1:
        raise _fail(source, text, "has more than one '*' item")
    return items


def check_layout_syntax(text: str, source: str) -> None:
    """Refuse a malformed layout before the layer count is known (settings construction)."""
    _items(text, source)


def parse_layout(text: str, num_layers: int, source: str) -> Tuple[str, ...]:
    """The kind of each layer: element l-1 is the kind of global layer l (1-based)."""
    kinds = [None] * num_layers
    rest = None
    for kind, item, match in _items(text, source):
        star, every, first, dash, last = match.groups()
        if star:
            rest = kind
            continue
        if every:
            layers = range(int(every), num_layers + 1, int(every))
            if not layers:
                raise _fail(source, text, f"has item {item!r} that names no layer of {num_layers}")
        else:
            lo = int(first)
            hi = (int(last) if last else num_layers) if dash else lo
            if hi < lo:
                raise _fail(source, text, f"has item {item!r} whose range runs backwards")
            if hi > num_layers:
                raise _fail(source, text, f"has item {item!r} beyond the model's {num_layers} layers")
            layers = range(lo, hi + 1)
        for layer in layers:
            if kinds[layer - 1] is not None:
                raise _fail(source, text, f"names layer {layer} twice ({kinds[layer - 1]} and {kind})")
            kinds[layer - 1] = kind
    missing = [i + 1 for i, k in enumerate(kinds) if k is None]
    if missing and rest is None:
        shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        raise _fail(source, text, f"leaves layers {shown} of {num_layers} without a kind (add e.g. 'pre:*')")
    return tuple(k if k is not None else rest for k in kinds)


def layout_text(kinds: Sequence[str]) -> str:
    """The canonical layout of per-layer kinds: its runs in order, e.g. 'post:1-2,pre:3-32'."""
    runs, start = [], 1
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[i - 1]:
            runs.append(f"{kinds[i - 1]}:{start}" + (f"-{i}" if i > start else ""))
            start = i + 1
    return ",".join(runs)


def first_p_kinds(num_layers: int, post_ln_layers: int) -> Tuple[str, ...]:
    """Mix-LN's own layout: layers 1..P Post-LN, the rest Pre-LN."""
    return (POST,) * post_ln_layers + (PRE,) * (num_layers - post_ln_layers)


def sandwich_rows(kinds: Sequence[str]) -> Dict[int, int]:
    """{0-based layer: its row} for the sandwich layers of `kinds`, in row order: a sandwich layer's
    output norms are stacked over the S sandwich layers alone ([S, h] keys mixln_norm_c / _d), a
    layer's row its 0-based rank among them. Global, like the layer number, so every pipeline split
    (and every reader and converter) agrees."""
    return {layer: row for row, layer in enumerate(i for i, kind in enumerate(kinds) if kind == SANDWICH)}


def leading_post_count(kinds: Sequence[str]):
    """P when `kinds` is Mix-LN's first-P layout (post then pre only), else None."""
    p = 0
    while p < len(kinds) and kinds[p] == POST:
        p += 1
    return p if all(k == PRE for k in kinds[p:]) else None


def boundaries(kinds: Sequence[str]) -> Tuple[Tuple[int, int], ...]:
    """Every (last Post-LN-kind layer, first Pre-LN-kind layer) pair of adjacent layers, 1-based."""
    return tuple((i, i + 1) for i in range(1, len(kinds))
                 if kinds[i - 1] in POST_LN_KINDS and kinds[i] not in POST_LN_KINDS)
