"""The Mix-LN settings record in checkpoints.

Both layer kinds store their two norms under the same keys (layer.py), so a checkpoint's tensor
layout does not reveal P. The settings therefore travel with the weights, in three places:

1. torch_dist: a replicated ShardedObject `decoder.layers.mixln_settings`, emitted by global
   layer 1 of every model that is not plain Pre-LN. Loading into such a model a checkpoint with a
   different P or scheme, or one without the record (a stock Pre-LN checkpoint), fails with a
   message that names both. The record is NOT emitted at P = 0 with scheme mixln, so that a stock
   checkpoint loads at Megatron's default strictness (which raises on requested-but-missing keys)
   and a P = 0 checkpoint loads into megatron's stock spec.
2. Megatron-LM's checkpoint content metadata (`mixln` entry): Megatron-LM hands the loaded
   metadata back to `sharded_state_dict(metadata=...)`, so every Mix-LN model, P = 0 included,
   checks it before any tensor is read.
3. Legacy (per-rank torch) checkpoints: the same record in the regular state_dict of layer 1.

A mismatch is a refusal wherever it is found: one `[mixln_megatron] ERROR:` line, then, under
Megatron-LM's training, errors.Refusal (SystemExit 2, no traceback; str() is the line) on every rank
that finds it; a library caller (megatron-core's own load, the analysis tools) gets
MixLNCheckpointMismatch itself (errors.refuse_in_training). In the content metadata Megatron-LM's load_checkpoint hands back, before any
tensor is read; in the sharded record or a legacy checkpoint's record (Megatron-LM's
load_state_dict of the rank's model_optim_rng.pt, --ckpt-format torch) when load_state_dict reaches
layer 1. A SystemExit passes through Megatron-LM's `except Exception` retry of a failed strict load
(which, with load_state_dict's `error_msgs`, printed the line twice and then torch's RuntimeError
traceback).
"""

from __future__ import annotations

from typing import Optional

from ..errors import MixLNError, refuse_in_training
from .checkpoint_keys import METADATA_KEY, RECORD as RECORD_NAME  # noqa: F401  (METADATA_KEY: API)
from .placement import Placement


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


def mismatch_message(checkpoint_record: Optional[dict], model_placement: Placement) -> Optional[str]:
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
    alike: the settings record here and the spike scaler's state (training.spike.state). One
    computation for both: megatron-core's make_sharded_object_for_checkpoint reads only the global
    parallel_state (it ignores a model's own process groups), its make_sharded_tensor_for_checkpoint
    takes the groups; the model's `pg_collection` (tp, dp_cp) comes first, parallel_state after."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_pg_rank

    tp = getattr(pg_collection, "tp", None)
    dp_cp = getattr(pg_collection, "dp_cp", None)
    tp_rank = get_pg_rank(tp) if tp is not None else parallel_state.get_tensor_model_parallel_rank()
    dp_rank = get_pg_rank(dp_cp) if dp_cp is not None else parallel_state.get_data_parallel_rank(
        with_context_parallel=True)
    return (0, tp_rank, dp_rank)


def add_settings_record(layer, sharded: dict, prefix: str, metadata: Optional[dict]) -> None:
    """Called from MixLNTransformerLayer.sharded_state_dict (save and load alike)."""
    placement: Placement = layer.placement
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
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    key = f"{prefix}{RECORD_NAME}"
    sharded[key] = ShardedObject(key, placement.record(), (1,), (0,), replica_id=replica_id(layer.pg_collection))


def add_legacy_record(layer, state_dict: dict, prefix: str) -> None:
    """state_dict hook: the record for legacy (torch.save of state_dict) checkpoints."""
    if not layer.placement.is_stock and layer.layer_number == 1 and not getattr(layer, "is_mtp_layer", False):
        state_dict[f"{prefix}{RECORD_NAME}"] = layer.placement.record()


def check_settings_record(layer, state_dict: dict, prefix: str, error_msgs: list) -> None:
    """Called from MixLNTransformerLayer._load_from_state_dict: pop the record and compare; a
    mismatch is refused (one line, exit 2). `error_msgs` is load_state_dict's, left untouched."""
    record = state_dict.pop(f"{prefix}{RECORD_NAME}", None)
    if layer.layer_number != 1 or getattr(layer, "is_mtp_layer", False):
        return
    if record is None and layer.placement.is_stock:
        return  # a stock checkpoint into a P = 0 model: nothing to say
    problem = mismatch_message(record, layer.placement)
    if problem:
        # Under Megatron-LM, one line and exit 2: its legacy resume retries a failed strict load
        # non-strictly under `except Exception`, which a SystemExit passes (no second line, no traceback).
        refuse_in_training(MixLNCheckpointMismatch(problem))

