"""torch_dist checkpoints of a Mix-LN HybridModel next to a GPTModel's: which kind a checkpoint is,
and the hybrid pattern its keys describe.

The keys themselves and the GPT <-> hybrid layer rule (which of a block's two hybrid layers holds
each tensor) are model.checkpoint_keys': the model writes them, this module reads them.

Pure Python: no torch, no megatron.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

from ..errors import UnsupportedModelError
from ..model import hybrid_pattern
from ..model.checkpoint_keys import FOREIGN_NAMES, GPT_FINAL_NORM, HYBRID_FINAL_NORM, HYBRID_LAYER

GPT, HYBRID = "gpt", "hybrid"
OBJECT_SHARD = re.compile(r"^(.+)/shard_([0-9.]*)_([0-9.]*)$")


def model_kind(tensor_keys: Iterable[str]) -> str:
    """GPT (stacked layer keys, decoder.final_layernorm) or HYBRID (per-layer keys, decoder.final_norm).

    A GPTModel as Megatron-LM saves it (TransformerBlock without the non_homogeneous_layers /
    singleton_local_shards metadata, which Megatron-LM sets False) replaces each layer's
    `decoder.layers.<local index>.` prefix by `decoder.layers.` with a layer axis, so a
    `decoder.layers.<n>.` tensor is a HybridModel's (HybridStack keeps the index in the key). A
    GPTModel checkpoint with per-layer keys (decoder.final_layernorm beside them) is refused."""
    keys = list(tensor_keys)
    per_layer = any(HYBRID_LAYER.match(k) for k in keys)
    if any(k.startswith(GPT_FINAL_NORM) for k in keys) and per_layer:
        # Megatron-LM never writes these for a dense GPTModel; a megatron-core caller can (its
        # sharded_state_dict metadata non_homogeneous_layers / singleton_local_shards).
        raise UnsupportedModelError(
            "this GPTModel checkpoint keeps one key per layer (decoder.layers.<n>.*, saved with the "
            "non_homogeneous_layers or singleton_local_shards metadata); only the stacked layout "
            "Megatron-LM saves (decoder.layers.* with a layer axis) is read")
    if per_layer or any(k.startswith(HYBRID_FINAL_NORM) for k in keys):
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
    """Why a hybrid checkpoint is not a Mix-LN `*-` model a conversion carries (from its args'
    pattern, else its keys): `E` (MoE) layers are refused here though the model builds them."""
    if args_pattern:
        problem = hybrid_pattern.pattern_problem(args_pattern, moe=False)
        if problem:
            return problem
        if args_pattern.replace(hybrid_pattern.PIPE, "") != keys_pattern:
            return (f"the args' hybrid layer pattern {args_pattern!r} does not match the layers the "
                    f"checkpoint holds ({keys_pattern!r}): the checkpoint is incomplete or was edited")
        return None
    problem = hybrid_pattern.pattern_problem(keys_pattern, moe=False)
    return f"{problem} (read from the checkpoint's layers)" if problem else None
