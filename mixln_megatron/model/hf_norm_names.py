"""The HF module name of each norm of a Mix-LN layer, by layer kind and norm role. Pure Python.

The one table that the HF conversion (convert.mapping) and the Megatron-Bridge bridge
(bridge.llama) both build from. The names are those of this package's HF decoder layers
(mixln_megatron.hf); a sandwich layer names its four norms as Gemma 2 does.

A norm's role is the same for every Megatron flavour (the torch_dist keys are mixln_<role>.*,
model.checkpoint_keys):
    role    Pre-LN kinds (pre, sandwich)         Post-LN kinds (post, deepnorm)
    norm_a  the attention pre-norm               N2, after the MLP residual add
    norm_b  the MLP pre-norm                     N1, after the attention residual add
    norm_c  sandwich: N_b, on the attention output
    norm_d  sandwich: N_d, on the MLP output
"""

from __future__ import annotations

from typing import Dict

from . import layout

NORM_A, NORM_B, NORM_C, NORM_D = "norm_a", "norm_b", "norm_c", "norm_d"

_PRE_LN = {NORM_A: "input_layernorm", NORM_B: "post_attention_layernorm"}
_POST_LN = {NORM_A: "post_feedforward_layernorm", NORM_B: "post_attention_layernorm"}

# kind -> role -> HF module name inside model.layers.<i>. (append .weight / .bias).
HF_NORM_MODULES: Dict[str, Dict[str, str]] = {
    layout.PRE: _PRE_LN,
    layout.POST: _POST_LN,
    layout.DEEPNORM: _POST_LN,  # DeepNorm scales the residual, its norms are Post-LN's
    layout.SANDWICH: {NORM_A: "input_layernorm", NORM_B: "pre_feedforward_layernorm",
                      NORM_C: "post_attention_layernorm", NORM_D: "post_feedforward_layernorm"},
}


def hf_norm_module(kind: str, role: str) -> str:
    """The HF module name (inside model.layers.<i>.) of the `role` norm of a layer of `kind`."""
    return HF_NORM_MODULES[kind][role]
