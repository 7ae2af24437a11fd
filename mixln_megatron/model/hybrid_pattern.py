"""HybridModel layer patterns as Mix-LN reads them: pure Python, no megatron import.

A pattern of L `*-` pairs is the GPT decoder of L transformer blocks split in two, so Mix-LN's
rule counts blocks: hybrid layer n (global, 1-based) belongs to block ceil(n / 2), whose N1 sits
in layer 2k - 1 and N2 in layer 2k. An `E` (megatron's MoE MLP) may stand for a `-` (HF
conversion refuses it: moe=False); `|` splits may sit anywhere. Other symbols, MTP and patterns
that do not strictly alternate are refused with the reason (docs/training.md, HybridModel).
"""

from __future__ import annotations

from typing import Optional, Sequence

from .support import MixLNUnsupportedError

ATTENTION, MLP = "attention", "mlp"  # MixLNTransformerLayer(hybrid_part=...)
SYMBOL = {ATTENTION: "*", MLP: "-"}
MOE_MLP = "E"  # an MLP half whose MLP is megatron's MoE layer
PIPE, MTP_SEPARATOR = "|", "/"

_OTHER_SYMBOLS = {
    "M": "Mamba", "G": "gated delta net", "D": "DeepSeek sparse attention",
    "+": "multi-latent attention",
}
_WHY = ("Mix-LN is defined on transformer blocks (attention then MLP), so a HybridModel pattern "
        "must be L strictly alternating '*-' pairs ('*-*-...*-', '|' splits allowed, 'E' for a '-')")


def part_of_layer(layer_number: int) -> str:
    """The part a strictly alternating pattern has at global 1-based layer `layer_number`."""
    return ATTENTION if layer_number % 2 == 1 else MLP


def block_of_layer(layer_number: int) -> int:
    """The 1-based transformer block of global 1-based hybrid layer `layer_number` (its inverse:
    layer_numbers_of_block)."""
    return (layer_number + 1) // 2


def block_number(layer_number: int, part: Optional[str]) -> int:
    """The 1-based transformer block of a layer: a GPT layer is one block (part None)."""
    if part is None:
        return layer_number
    if part not in SYMBOL:
        raise ValueError(f"hybrid_part must be {ATTENTION!r}, {MLP!r} or None, got {part!r}")
    if part_of_layer(layer_number) != part:
        raise MixLNUnsupportedError(
            f"hybrid layer {layer_number} is '{SYMBOL[part]}', but in a Mix-LN pattern layer "
            f"{layer_number} must be '{SYMBOL[part_of_layer(layer_number)]}': {_WHY}")
    return block_of_layer(layer_number)


def num_blocks(num_layers: int, part: Optional[str]) -> int:
    """Transformer blocks of a model of `num_layers` megatron layers (hybrid: pattern length)."""
    if part is None:
        return num_layers
    if num_layers % 2:
        raise MixLNUnsupportedError(
            f"the hybrid pattern has {num_layers} layers, an odd number: {_WHY}")
    return num_layers // 2


def layer_numbers_of_block(block: int) -> tuple:
    """(attention layer, MLP layer): the global 1-based hybrid layers of transformer block `block`."""
    return 2 * block - 1, 2 * block


def _symbol_problem(symbol: str, position: int, moe: bool = True) -> Optional[str]:
    expected = SYMBOL[part_of_layer(position)]
    if symbol == expected:
        return None
    if symbol == MOE_MLP and expected == SYMBOL[MLP]:
        return None if moe else (f"layer {position} is 'E' (MoE), which conversion cannot carry "
                                 "(a Llama has no experts)")
    if symbol == MOE_MLP:
        return f"layer {position} is 'E' (MoE) where '{expected}' belongs: {_WHY}"
    if symbol in _OTHER_SYMBOLS:
        return (f"layer {position} is '{symbol}' ({_OTHER_SYMBOLS[symbol]}), which Mix-LN does not "
                f"support yet: {_WHY}")
    if symbol in SYMBOL.values():
        return f"layer {position} is '{symbol}' where '{expected}' belongs: {_WHY}"
    return f"layer {position} is {symbol!r}, not a HybridModel symbol: {_WHY}"


def pattern_problem(pattern: Optional[str], moe: bool = True) -> Optional[str]:
    """None when `pattern` (the whole --hybrid-layer-pattern) is a Mix-LN pattern, else why not.
    moe=False: `E` layers refused too (what HF conversion can carry)."""
    if not pattern:
        return f"no hybrid layer pattern was given: {_WHY}"
    main, sep, _mtp = pattern.partition(MTP_SEPARATOR)
    if sep:
        return (f"the pattern {pattern!r} has multi-token-prediction layers ('/'), which Mix-LN "
                "does not support (the decoder only); drop the '/...' part")
    layers = main.replace(PIPE, "")
    for position, symbol in enumerate(layers, 1):
        problem = _symbol_problem(symbol, position, moe)
        if problem:
            return f"the hybrid pattern {pattern!r}: {problem}"
    if not layers or len(layers) % 2:
        return f"the hybrid pattern {pattern!r} has {len(layers)} layers, not whole blocks: {_WHY}"
    return None


def check_pattern(pattern: Optional[str]) -> int:
    """The number of transformer blocks L of a Mix-LN pattern; MixLNUnsupportedError otherwise."""
    problem = pattern_problem(pattern)
    if problem:
        raise MixLNUnsupportedError(problem)
    return len(pattern.replace(PIPE, "")) // 2


def check_segment(layer_types: Sequence[str], pp_layer_offset: int) -> None:
    """One pipeline stage's part of the pattern (HybridStack's layer_type_list and offset)."""
    for i, symbol in enumerate(layer_types):
        problem = _symbol_problem(symbol, i + 1 + pp_layer_offset)
        if problem:
            raise MixLNUnsupportedError(f"the hybrid pattern: {problem}")


def pattern_of_args(args) -> Optional[str]:
    """The pattern Megatron-LM's arguments (parsed or saved) ask for: --hybrid-layer-pattern, or the
    deprecated --hybrid-override-pattern its validation renames; None for a GPT model."""
    return getattr(args, "hybrid_layer_pattern", None) or getattr(args, "hybrid_override_pattern", None) or None


def blocks_of_args(args) -> int:
    """L, the transformer blocks Mix-LN counts, of Megatron-LM's arguments (parsed or saved): a
    Mix-LN pattern's `*-` pairs, else num_layers (a GPTModel). The one reading of it, for the entry
    point and the checkpoint readers. MixLNUnsupportedError for a pattern Mix-LN does not define."""
    pattern = pattern_of_args(args)
    return check_pattern(pattern) if pattern else args.num_layers


def pattern_for(num_blocks: int, stage_blocks: Optional[Sequence[int]] = None) -> str:
    """`*-` * num_blocks, split into pipeline stages of `stage_blocks` blocks each when given."""
    if stage_blocks is None:
        return "*-" * num_blocks
    if sum(stage_blocks) != num_blocks or any(n < 1 for n in stage_blocks):
        raise ValueError(f"stage_blocks {list(stage_blocks)} must be positive and sum to {num_blocks}")
    return PIPE.join("*-" * n for n in stage_blocks)
