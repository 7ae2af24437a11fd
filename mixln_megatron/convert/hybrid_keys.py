"""torch_dist keys of a Mix-LN HybridModel next to a GPTModel's: which hybrid layer holds what.

GPTModel stacks every layer-local tensor under one key with a leading layer axis
(`decoder.layers.<name>`, [L, ...]); HybridStack keeps one key per layer
(`decoder.layers.<j>.<name>`, j the global 0-based hybrid index, no layer axis). A Mix-LN
pattern is L `*-` pairs, so GPT block i (0-based) is hybrid layers 2i (`*`: attention) and 2i+1
(`-`: MLP). The tensors themselves are the same layer class's, with the same global layout:

    layer-local name                                   hybrid layer of block i
    input_layernorm.*, self_attention.*,               2i      (the `*` layer)
    post_attention_layernorm.*, mixln_settings (i = 0)
    pre_mlp_layernorm.*, mlp.*, post_mlp_layernorm.*   2i + 1  (the `-` layer)
    mixln_norm_a.* (Pre-LN input norm | Post-LN N2)    Pre-LN: 2i      Post-LN: 2i + 1
    mixln_norm_b.* (Pre-LN MLP norm | Post-LN N1)      Pre-LN: 2i + 1  Post-LN: 2i
    mixln_spike_scaler.layer<i+1>.norm1.* | .norm2.*   2i | 2i + 1 (spike-scaler state)
    decoder.final_layernorm.*  <->  decoder.final_norm.*

Pure Python: no torch, no megatron.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

from ..model import hybrid_pattern

GPT, HYBRID = "gpt", "hybrid"
LAYERS = "decoder.layers."
GPT_FINAL_NORM, HYBRID_FINAL_NORM = "decoder.final_layernorm.", "decoder.final_norm."
RECORD = "mixln_settings"
GPT_RECORD_KEY = LAYERS + RECORD  # (a ShardedObject: unique key <key>/shard_0_1)
HYBRID_RECORD_KEY = f"{LAYERS}0.{RECORD}"

HYBRID_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
SPIKE = re.compile(r"^mixln_spike_scaler\.layer(\d+)\.(norm[12])\.(.+)$")
OBJECT_SHARD = re.compile(r"^(.+)/shard_([0-9.]*)_([0-9.]*)$")

ATTENTION_NAMES = ("input_layernorm.", "self_attention.", "post_attention_layernorm.")
MLP_NAMES = ("pre_mlp_layernorm.", "mlp.", "post_mlp_layernorm.")
# Names of a layer that make it something other than a Mix-LN `*` or `-` layer.
FOREIGN_NAMES = {"mixer.": "M (Mamba)", "mlp.experts.": "E (MoE)", "mlp.router.": "E (MoE)",
                 "self_attention.linear_q_down_proj": "+ (MLA)", "self_attention.linear_kv_down_proj": "+ (MLA)"}


def part_of_name(name: str, post_ln: bool) -> Optional[str]:
    """hybrid_pattern.ATTENTION or MLP: the half of a transformer block that holds the layer-local
    tensor `name` (block Post-LN or not); None for a name that is neither's."""
    spike = SPIKE.match(name)
    if spike:
        return hybrid_pattern.ATTENTION if spike.group(2) == "norm1" else hybrid_pattern.MLP
    if name.startswith(ATTENTION_NAMES) or name == RECORD:
        return hybrid_pattern.ATTENTION
    if name.startswith(MLP_NAMES):
        return hybrid_pattern.MLP
    if name.startswith("mixln_norm_a."):
        return hybrid_pattern.MLP if post_ln else hybrid_pattern.ATTENTION
    if name.startswith("mixln_norm_b."):
        return hybrid_pattern.ATTENTION if post_ln else hybrid_pattern.MLP
    return None


def hybrid_index(block: int, part: str) -> int:
    """The global 0-based hybrid layer of 0-based block `block`'s `part`."""
    attention, mlp = hybrid_pattern.layer_numbers_of_block(block + 1)
    return (attention if part == hybrid_pattern.ATTENTION else mlp) - 1


def model_kind(tensor_keys: Iterable[str]) -> str:
    """GPT (stacked layer keys, decoder.final_layernorm) or HYBRID (per-layer keys, decoder.final_norm)."""
    keys = list(tensor_keys)
    if any(k.startswith(HYBRID_FINAL_NORM) for k in keys):
        return HYBRID
    if any(HYBRID_LAYER.match(k) for k in keys):
        return HYBRID
    return GPT


def layer_names(tensor_keys: Iterable[str]) -> dict:
    """{global 0-based hybrid layer: [layer-local names]} of a hybrid checkpoint's tensors."""
    layers: dict = {}
    for key in tensor_keys:
        m = HYBRID_LAYER.match(key)
        if m:
            layers.setdefault(int(m.group(1)), []).append(m.group(2))
    return layers


def layer_symbol(names: Iterable[str]) -> str:
    """The pattern symbol a hybrid layer's tensors say it is: `*`, `-`, or what else it is."""
    names = list(names)
    for prefix, what in FOREIGN_NAMES.items():
        if any(n.startswith(prefix) for n in names):
            return what.split()[0]
    attention = any(n.startswith("self_attention.") for n in names)
    mlp = any(n.startswith("mlp.") for n in names)
    if attention and not mlp:
        return hybrid_pattern.SYMBOL[hybrid_pattern.ATTENTION]
    if mlp and not attention:
        return hybrid_pattern.SYMBOL[hybrid_pattern.MLP]
    return "?"


def pattern_of_keys(tensor_keys: Iterable[str]) -> str:
    """The hybrid layer pattern (no `|`) a hybrid checkpoint's tensor keys describe."""
    layers = layer_names(tensor_keys)
    if not layers:
        return ""
    return "".join(layer_symbol(layers.get(j, ())) for j in range(max(layers) + 1))


def pattern_problem(args_pattern: Optional[str], keys_pattern: str) -> Optional[str]:
    """Why a hybrid checkpoint is not a Mix-LN `*-` model (from its args' pattern, else its keys)."""
    if args_pattern:
        problem = hybrid_pattern.pattern_problem(args_pattern)
        if problem:
            return problem
        if args_pattern.replace(hybrid_pattern.PIPE, "") != keys_pattern:
            return (f"the args' hybrid layer pattern {args_pattern!r} does not match the layers the "
                    f"checkpoint holds ({keys_pattern!r}): the checkpoint is incomplete or was edited")
        return None
    problem = hybrid_pattern.pattern_problem(keys_pattern)
    return f"{problem} (read from the checkpoint's layers)" if problem else None
