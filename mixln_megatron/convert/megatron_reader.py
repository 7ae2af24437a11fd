"""Read Megatron-LM checkpoints layer by layer, without process groups and without megatron.

One entry point, open_checkpoint(load, iteration), over modules split by job:
  locate             which iteration directory, and which format (torch_dist / legacy torch)
  torch_dist_reader  one layer's boxes of the stacked torch_dist tensors (over dcp_files:
                     torch.distributed.checkpoint's reader, with the allow-list)
  legacy_reader      per-rank model_optim_rng.pt files, one layer resident at a time
Every pickle goes through mixln_megatron.safe_unpickle. What the checkpoint says about the model
(args, shape, epsilon, Mix-LN record) is read by convert.inspect, for conversion and analysis alike.
"""

from __future__ import annotations

from typing import Optional

from ..errors import ConversionError
from .legacy_reader import LEGACY_FILE, LegacyCheckpoint
from .locate import TRACKER, detect_format, resolve_checkpoint_dir
from .torch_dist_reader import COMMON_PT, COMMON_STATE_KEY, TorchDistCheckpoint


def open_checkpoint(load: str, iteration: Optional[int] = None):
    """The reader (TorchDistCheckpoint or LegacyCheckpoint) of a Megatron-LM checkpoint."""
    path, label = resolve_checkpoint_dir(load, iteration)
    fmt = detect_format(path)
    if fmt is None:
        raise ConversionError(
            f"not a Megatron-LM checkpoint: {path} holds neither torch_dist files (.metadata, "
            "metadata.json) nor legacy mp_rank_*/model_optim_rng.pt files"
        )
    reader = TorchDistCheckpoint(path) if fmt == "torch_dist" else LegacyCheckpoint(path)
    reader.label = label
    return reader


__all__ = ["COMMON_PT", "COMMON_STATE_KEY", "LEGACY_FILE", "TRACKER", "LegacyCheckpoint", "TorchDistCheckpoint",
           "open_checkpoint", "resolve_checkpoint_dir"]
