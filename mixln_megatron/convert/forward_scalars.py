"""The scalars megatron-core multiplies into a GPT's forward pass besides its weights.

Four numbers, each one scalar in the math, that the HF export must reproduce (the Mix-LN HF
classes carry them: hf/configuration_mixln_llama.FORWARD_SCALAR_DEFAULTS):

  attention_scale       the softmax scale of q.k (None: megatron's 1/sqrt(kv_channels))
  embedding_multiplier  the word embeddings times this (muP's mup_embedding_mult)
  logits_multiplier     the output logits times this (muP's mup_output_mult)
  glu_linear_offset     SwiGLU as silu(gate) * (up + offset) (--glu-linear-offset)

Megatron-LM saves the raw flags (args), and TransformerConfig.__post_init__ turns the muP ones into
what the model uses: `forward_scalars` is that derivation, the one reading of saved args (its
agreement with megatron-core's own __post_init__ on each release is tested). Without --use-mup
every muP field is inert (megatron reads them only under use_mup).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

# Megatron-LM's muP arguments (TransformerConfig fields), in the order the HF record keeps them.
MUP_ARGS = ("use_mup", "mup_base_hidden_size", "mup_width_mult", "mup_embedding_mult", "mup_output_mult",
            "mup_base_head_dim", "mup_attn_scale_power")
# TransformerConfig's defaults of the muP fields (every supported release).
MUP_DEFAULTS = {"use_mup": False, "mup_base_hidden_size": None, "mup_width_mult": 1.0, "mup_embedding_mult": 1.0,
                "mup_output_mult": 1.0, "mup_base_head_dim": None, "mup_attn_scale_power": 1.0}


@dataclasses.dataclass(frozen=True)
class ForwardScalars:
    attention_scale: Optional[float] = None
    embedding_multiplier: float = 1.0
    logits_multiplier: float = 1.0
    glu_linear_offset: float = 0.0

    @property
    def is_default(self) -> bool:
        return self == ForwardScalars()

    def hf_fields(self) -> dict:
        """The non-default ones, under their HF config names (a default one is not written)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v != getattr(ForwardScalars, k)}


def mup_record(get: Callable[[str, object], object]) -> Optional[dict]:
    """The muP flags as saved (raw, before __post_init__), or None without --use-mup."""
    if not get("use_mup", False):
        return None
    return {name: get(name, MUP_DEFAULTS[name]) for name in MUP_ARGS}


def forward_scalars(get: Callable[[str, object], object], hidden_size: int, kv_channels: int) -> ForwardScalars:
    """What megatron-core's TransformerConfig.__post_init__ makes of the saved flags.

    `get(name, default)` reads one saved argument (None counts as absent). muP, when on: the base
    width defaults to hidden_size, width_mult = hidden / base; softmax_scale = sqrt(base_head_dim
    or 1) / kv_channels ** mup_attn_scale_power (megatron's default power 1.0 is 1/d_head, not
    1/sqrt(d_head)); an output multiplier left at 1.0 becomes 1 / width_mult."""
    offset = float(get("glu_linear_offset", 0.0))
    if not get("use_mup", False):
        return ForwardScalars(glu_linear_offset=offset)
    base = get("mup_base_hidden_size", None) or hidden_size
    width = hidden_size / base
    head = get("mup_base_head_dim", None)
    scale = (1.0 if head is None else head ** 0.5) / (kv_channels ** get("mup_attn_scale_power", 1.0))
    output = float(get("mup_output_mult", 1.0))
    if output == 1.0 and width != 1.0:
        output = 1.0 / width
    return ForwardScalars(attention_scale=float(scale), embedding_multiplier=float(get("mup_embedding_mult", 1.0)),
                          logits_multiplier=output, glu_linear_offset=offset)


def mup_flags_for(scalars: ForwardScalars, hidden_size: int, kv_channels: int, record: Optional[dict] = None) -> dict:
    """Megatron-LM muP arguments whose forward_scalars are `scalars` exactly (for from-hf).

    The record an export wrote (the flags the model was trained with) when given; otherwise width
    1 (base = hidden size) with the multipliers as they are and the softmax scale s (None: the HF
    model's head_dim ** -0.5) as sqrt(s * s) / kv_channels ** 0 (sqrt of a square is exact in IEEE
    arithmetic). {} when the scalars need no muP."""
    if record is not None:
        return {name: record.get(name, MUP_DEFAULTS[name]) for name in MUP_ARGS}
    mup = (scalars.attention_scale, scalars.embedding_multiplier, scalars.logits_multiplier)
    if mup == (None, 1.0, 1.0):
        return {}
    scale = kv_channels ** -0.5 if scalars.attention_scale is None else scalars.attention_scale
    return dict(MUP_DEFAULTS, use_mup=True, mup_base_hidden_size=hidden_size,
                mup_embedding_mult=scalars.embedding_multiplier, mup_output_mult=scalars.logits_multiplier,
                mup_base_head_dim=scale * scale, mup_attn_scale_power=0.0)


def config_problem(config) -> Optional[str]:
    """One line naming the forward scalars a built TransformerConfig (a Bridge provider, after its
    __post_init__) has, for code that cannot carry them; None when it has none."""
    found = []
    if getattr(config, "use_mup", False):
        found.append("muP (use_mup=True: softmax scale, embedding and output multipliers)")
    elif getattr(config, "softmax_scale", None) is not None:
        found.append(f"softmax_scale={config.softmax_scale!r}")
    if getattr(config, "glu_linear_offset", 0.0):
        found.append(f"glu_linear_offset={config.glu_linear_offset!r}")
    if not found:
        return None
    return (f"{' and '.join(found)}: the Megatron-Bridge path does not carry them; export with "
            "`mixln-megatron convert to-hf`, which does")


def args_getter(args) -> Callable[[str, object], object]:
    """`get(name, default)` over saved args: a None or missing value reads as the default."""
    def get(name, default):
        value = getattr(args, name, None)
        return default if value is None else value
    return get


__all__ = ["ForwardScalars", "MUP_ARGS", "MUP_DEFAULTS", "args_getter", "config_problem", "forward_scalars",
           "mup_flags_for", "mup_record"]
