"""The checkpoint keys a Mix-LN model writes, and which HybridModel layer holds which GPT block's tensor.

The one place for both facts (issue 28): the model writes these keys (model.layer, model.checkpoint,
the spike scaler's state), the readers and converters read them (convert.mapping, convert.hybrid_keys,
convert.torch_dist_reader, convert.gpt_hybrid), the test builders rename state dicts with them
(dev.testing). Pure Python: no torch, no megatron.

GPTModel stacks every layer-local tensor under one key with a leading layer axis
(`decoder.layers.<name>`, [L, ...]); HybridStack keeps one key per layer (`decoder.layers.<j>.<name>`,
j the global 0-based hybrid index, no layer axis). A Mix-LN pattern is L `*-` pairs, so GPT block
i (0-based) is hybrid layers 2i (`*`: attention) and 2i+1 (`-`: MLP) (model.hybrid_pattern's rule):

    layer-local name                                   hybrid layer of block i
    input_layernorm.*, self_attention.*,               2i      (the `*` layer)
    post_attention_layernorm.*, mixln_settings (i = 0)
    pre_mlp_layernorm.*, mlp.*, post_mlp_layernorm.*   2i + 1  (the `-` layer)
    mixln_norm_a.* (Pre-LN input norm | Post-LN N2)    Pre-LN: 2i      Post-LN: 2i + 1
    mixln_norm_b.* (Pre-LN MLP norm | Post-LN N1)      Pre-LN: 2i + 1  Post-LN: 2i
    mixln_norm_c.* | mixln_norm_d.* (sandwich N_b | N_d)  2i | 2i + 1 (GPTModel: stacked over the sandwich layers)
    mixln_spike_scaler.layer<i+1>.norm1.* | .norm2.*   2i | 2i + 1 (spike-scaler state)
    decoder.final_layernorm.*  <->  decoder.final_norm.*
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

from . import hybrid_pattern
from .hybrid_pattern import ATTENTION, MLP

# ------------------------------------------------------------------------------ model keys
LAYERS = "decoder.layers."
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
GPT_FINAL_NORM, HYBRID_FINAL_NORM = "decoder.final_layernorm.", "decoder.final_norm."
# The Mix-LN settings record (model.checkpoint): a replicated ShardedObject of global layer 1
# (unique key <key>/shard_0_1), and the entry of Megatron-LM's content metadata.
RECORD = "mixln_settings"
GPT_RECORD_KEY = LAYERS + RECORD
HYBRID_RECORD_KEY = f"{LAYERS}0.{RECORD}"
METADATA_KEY = "mixln"
# Megatron-core 0.19+ saves the common state (args, iteration, content metadata) as this object.
COMMON_STATE_KEY = "common_state/shard_0_1"
# A Mix-LN layer (P > 0 or LNS) stores its two norms here, whatever its kind (model.layer).
MIXLN_NORM_A, MIXLN_NORM_B = "mixln_norm_a.", "mixln_norm_b."
# A sandwich layer's output norms: N_b after attention (c), N_d after the MLP (d). Stacked over the
# S sandwich layers of the model only (GPTModel: `decoder.layers.mixln_norm_c.weight` [S, ...], a
# layer's row its 0-based rank among the sandwich layers), since torch_dist needs a stacked key to
# cover its whole axis (model.layer).
MIXLN_NORM_C, MIXLN_NORM_D = "mixln_norm_c.", "mixln_norm_d."
SPIKE_SCALER = "mixln_spike_scaler."

HYBRID_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
SPIKE = re.compile(r"^mixln_spike_scaler\.layer(\d+)\.(norm[1-4])\.(.+)$")

# ------------------------------------------------------------------------------ halves of a block
ATTENTION_NAMES = ("input_layernorm.", "self_attention.", "self_attn_bda.", "post_attention_layernorm.",
                   "attn_output_layernorm.", MIXLN_NORM_C)
MLP_NAMES = ("pre_mlp_layernorm.", "mlp.", "mlp_bda.", "post_mlp_layernorm.", "mlp_output_layernorm.", MIXLN_NORM_D)
# Names of a layer that make it something other than a Mix-LN `*` or `-` layer.
FOREIGN_NAMES = {"mixer.": "M (Mamba)", "mlp.experts.": "E (MoE)", "mlp.router.": "E (MoE)",
                 "self_attention.linear_q_down_proj": "+ (MLA)", "self_attention.linear_kv_down_proj": "+ (MLA)"}
MOE, MLA = "E (MoE)", "+ (MLA)"


def foreign_names(what: str) -> Tuple[str, ...]:
    """The FOREIGN_NAMES of one kind (MOE, MLA, ...)."""
    return tuple(name for name, kind in FOREIGN_NAMES.items() if kind == what)


def part_of_name(name: str, post_ln: bool) -> Optional[str]:
    """ATTENTION or MLP: the half of a transformer block that holds the layer-local tensor `name`
    (the block Post-LN or not); None for a name that is neither's."""
    spike = SPIKE.match(name)
    if spike:
        return ATTENTION if spike.group(2) in ("norm1", "norm3") else MLP
    if name.startswith(ATTENTION_NAMES) or name == RECORD:
        return ATTENTION
    if name.startswith(MLP_NAMES):
        return MLP
    if name.startswith(MIXLN_NORM_A):
        return MLP if post_ln else ATTENTION
    if name.startswith(MIXLN_NORM_B):
        return ATTENTION if post_ln else MLP
    return None


def hybrid_index(block: int, part: str) -> int:
    """The global 0-based hybrid layer of 0-based block `block`'s `part`."""
    attention, mlp = hybrid_pattern.layer_numbers_of_block(block + 1)
    return (attention if part == ATTENTION else mlp) - 1


def block_of_hybrid_index(index: int) -> int:
    """The 0-based block of global 0-based hybrid layer `index`."""
    return hybrid_pattern.block_of_layer(index + 1) - 1


def hybrid_layer_of(block: int, name: str, post_ln: bool) -> Optional[int]:
    """The global 0-based hybrid layer that holds 0-based block `block`'s layer-local `name`; None
    for a name of neither half."""
    part = part_of_name(name, post_ln)
    return None if part is None else hybrid_index(block, part)


def hybrid_state_key(gpt_key: str, post_ln: bool = False) -> str:
    """The HybridModel (`*-*-...`) name of a GPTModel state-dict key with per-layer names
    (`decoder.layers.<i>.<name>`, one stage, PP1; a state_dict, not a sharded one); the final norm
    renamed, other keys as they are. `post_ln`: whether block i is Post-LN (only the Mix-LN norm
    keys depend on it). ValueError for a layer name of neither half."""
    match = HYBRID_LAYER.match(gpt_key)
    if match is None:
        return HYBRID_FINAL_NORM + gpt_key[len(GPT_FINAL_NORM):] if gpt_key.startswith(GPT_FINAL_NORM) else gpt_key
    block, name = int(match.group(1)), match.group(2)
    index = hybrid_layer_of(block, name, post_ln)
    if index is None:
        raise ValueError(f"{gpt_key}: a layer key of neither attention's nor the MLP's half of a block")
    return f"{LAYERS}{index}.{name}"
