"""A Mix-LN model's checkpoints: the keys it writes, which HybridModel layer holds which GPT block's
tensor, and the Mix-LN settings record that travels with the weights.

The keys are written once, here: the model writes them, convert/ and the tests read them. Pure
Python at module level; megatron is imported only where a record is saved or loaded.

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

The settings record: every kind stores its norms under the same keys, so the tensor layout does
not reveal the layer kinds; the settings travel with the weights (docs/checkpoints.md) as a
replicated ShardedObject `decoder.layers.mixln_settings` of global layer 1 (not at P = 0 with
scheme mixln, so stock and P = 0 checkpoints load into each other), in Megatron-LM's content
metadata (`mixln`, checked before any tensor is read) and in a legacy checkpoint's layer 1.
A mismatch is a refusal wherever it is found (errors.refuse_in_training): one line and exit 2
under Megatron-LM's training, a SystemExit that passes its `except Exception` retry of a failed
strict load; a library caller gets MixLNCheckpointMismatch itself.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

from ..errors import MixLNError, refuse_in_training
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
# A sandwich layer's output norms N_b (c) and N_d (d), stacked over the sandwich layers only.
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


# ------------------------------------------------------------------------------ the settings record
class MixLNCheckpointMismatch(MixLNError, RuntimeError):
    """A checkpoint's Mix-LN settings differ from the model's."""


def _comparable(record: Optional[dict]) -> tuple:
    """What must agree: scheme, P, a layout other than Mix-LN's first P, DeepNorm's constants."""
    if record is None:
        return ("mixln", 0, None, None, None)
    return (record.get("scheme", "mixln"), int(record.get("post_ln_layers", 0)), record.get("layout"),
            record.get("deepnorm_alpha"), record.get("deepnorm_beta"))


def describe_record(record: Optional[dict]) -> str:
    if record is None:
        return "no Mix-LN record (a stock Pre-LN checkpoint: P = 0)"
    alpha = record.get("alpha")
    if record.get("layout") is not None:
        deepnorm = "" if record.get("deepnorm_alpha") is None else \
            f" (deepnorm alpha={record['deepnorm_alpha']:.6g} beta={record.get('deepnorm_beta'):.6g})"
        return f"scheme={record.get('scheme', 'mixln')} layout={record['layout']}{deepnorm}"
    return (
        f"scheme={record.get('scheme', 'mixln')} P={record.get('post_ln_layers')} "
        f"of L={record.get('num_layers')}" + (f" (alpha={alpha})" if alpha is not None else "")
    )


def mismatch_message(checkpoint_record: Optional[dict], model_placement) -> Optional[str]:
    """None when compatible, else a message naming both settings."""
    if _comparable(checkpoint_record) == _comparable(model_placement.record()):
        return None
    return (
        f"Mix-LN settings differ: the checkpoint has {describe_record(checkpoint_record)}, the model "
        f"has {describe_record(model_placement.record())}. Set MIXLN_ALPHA / MIXLN_POST_LN_LAYERS / MIXLN_LAYOUT "
        f"(or --mixln-alpha / --mixln-post-ln-layers / --mixln-layout) to the checkpoint's values to continue it."
    )


def replica_id(pg_collection=None) -> tuple:
    """megatron-core's replica id, (0, TP rank, DP-with-CP rank), of what every TP and DP rank holds
    alike (the settings record, the spike scaler's state): from the model's `pg_collection` first,
    then the global parallel_state (megatron's own helpers disagree on which they read)."""
    from megatron.core import parallel_state  # heavy
    from megatron.core.utils import get_pg_rank

    tp = getattr(pg_collection, "tp", None)
    dp_cp = getattr(pg_collection, "dp_cp", None)
    tp_rank = get_pg_rank(tp) if tp is not None else parallel_state.get_tensor_model_parallel_rank()
    dp_rank = get_pg_rank(dp_cp) if dp_cp is not None else parallel_state.get_data_parallel_rank(
        with_context_parallel=True)
    return (0, tp_rank, dp_rank)


def add_settings_record(layer, sharded: dict, prefix: str, metadata: Optional[dict]) -> None:
    """Called from MixLNTransformerLayer.sharded_state_dict (save and load alike)."""
    placement = layer.placement
    if isinstance(metadata, dict):
        loaded = metadata.get(METADATA_KEY)
        if loaded is not None:
            problem = mismatch_message(loaded, placement)
            if problem:
                refuse_in_training(MixLNCheckpointMismatch(problem))  # under Megatron-LM: one line, exit 2
        else:
            # Megatron-LM offers no hook to add content metadata: it saves the dict it passes here.
            # One key added, never an existing one changed, to a dict made for this one save
            # (or load), so nothing outlives it and there is nothing to undo.
            metadata[METADATA_KEY] = placement.record()
    if placement.is_stock or layer.layer_number != 1 or getattr(layer, "is_mtp_layer", False):
        return
    from megatron.core.dist_checkpointing.mapping import ShardedObject  # heavy

    key = f"{prefix}{RECORD}"
    sharded[key] = ShardedObject(key, placement.record(), (1,), (0,), replica_id=replica_id(layer.pg_collection))


def add_legacy_record(layer, state_dict: dict, prefix: str) -> None:
    """state_dict hook: the record for legacy (torch.save of state_dict) checkpoints."""
    if not layer.placement.is_stock and layer.layer_number == 1 and not getattr(layer, "is_mtp_layer", False):
        state_dict[f"{prefix}{RECORD}"] = layer.placement.record()


def check_settings_record(layer, state_dict: dict, prefix: str, error_msgs: list) -> None:
    """Called from MixLNTransformerLayer._load_from_state_dict: pop the record and compare; a
    mismatch is refused (one line, exit 2). `error_msgs` is load_state_dict's, left untouched."""
    record = state_dict.pop(f"{prefix}{RECORD}", None)
    if layer.layer_number != 1 or getattr(layer, "is_mtp_layer", False):
        return
    if record is None and layer.placement.is_stock:
        return  # a stock checkpoint into a P = 0 model: nothing to say
    problem = mismatch_message(record, layer.placement)
    if problem:
        # Under Megatron-LM, one line and exit 2: its legacy resume retries a failed strict load
        # non-strictly under `except Exception`, which a SystemExit passes (no second line, no traceback).
        refuse_in_training(MixLNCheckpointMismatch(problem))

