"""Writing a torch_dist checkpoint with torch.distributed.checkpoint, one chunk in memory at a time.

    writer = LazyTorchDistWriter()
    writer.tensor(key, global_shape, offsets, sizes, dtype, produce)   # produce() -> the chunk
    writer.object(unique_key, value)          # a ShardedObject (megatron stores [value])
    writer.raw_object(unique_key, data)       # a byte item copied verbatim from another checkpoint
    writer.save(out_dir, on_write)

Every tensor chunk is produced only when DCP's storage writer asks for it, so a conversion holds
one chunk at a time. The layout (keys, global shapes, chunks, byte items) is what megatron-core's
dist_checkpointing writes and reshards at load; `save` also writes metadata.json (megatron's
marker of a torch_dist checkpoint). The caller writes the common state (an object, and common.pt
for releases before 0.19).
"""

from __future__ import annotations

import io
import json
import os
import warnings
from typing import Callable, Dict, List, Optional

import torch

from ..errors import ConversionError

TORCH_DIST_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}


def torch_save_bytes(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _lazy_planner_class():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class LazySavePlanner(DefaultSavePlanner):
        """Save planner whose data is produced only when the storage writer asks for it."""

        def __init__(self, items, producers, on_write):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self._items, self._producers, self._on_write = items, producers, on_write

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            self.state_dict = {}
            self.is_coordinator = is_coordinator

        def create_local_plan(self):
            from torch.distributed.checkpoint.planner import SavePlan

            self.plan = SavePlan(list(self._items))
            return self.plan

        def resolve_data(self, write_item):
            offset = write_item.index.offset
            key = (write_item.index.fqn, tuple(offset) if offset is not None else None)
            data = self._producers.pop(key)()
            self._on_write(data)
            return data

    return LazySavePlanner


class LazyTorchDistWriter:
    """The write plan of one torch_dist checkpoint: tensor chunks and byte items, produced lazily."""

    def __init__(self):
        self.items: List = []
        self._producers: Dict[tuple, Callable] = {}

    def tensor(self, key: str, global_shape, offsets, sizes, dtype: torch.dtype, produce: Callable) -> None:
        """The chunk [offsets, offsets + sizes) of the global tensor `key`; produce() returns it."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        self.items.append(WriteItem(
            index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                properties=TensorProperties(dtype=dtype), size=torch.Size(global_shape)),
        ))
        self._producers[(key, tuple(offsets))] = lambda: produce().contiguous()

    def raw_object(self, unique_key: str, data: Callable) -> None:
        """A byte item (megatron's ShardedObject `unique_key`); data() returns its bytes."""
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

        self.items.append(WriteItem(index=MetadataIndex(unique_key), type=WriteItemType.BYTE_IO))
        self._producers[(unique_key, None)] = lambda: io.BytesIO(data())

    def object(self, unique_key: str, value) -> None:
        """A ShardedObject holding `value` (megatron-core saves the list [value])."""
        self.raw_object(unique_key, lambda: torch_save_bytes([value]).getvalue())

    def save(self, out_dir: str, on_write: Optional[Callable] = None, metadata: Optional[dict] = None) -> None:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint import save as dcp_save
        from torch.distributed.checkpoint.api import CheckpointException

        planner = _lazy_planner_class()(self.items, self._producers, on_write or (lambda data: None))
        writer = FileSystemWriter(out_dir, single_file_per_rank=True, thread_count=1, sync_files=True)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                dcp_save({}, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as e:
            for failure in getattr(e, "failures", {}).values():
                inner = failure[0] if isinstance(failure, tuple) else failure
                if not isinstance(inner, Exception):
                    raise inner from None  # Ctrl-C / SIGTERM inside torch's writer: stop, not "failed"
                if isinstance(inner, (ConversionError, OSError)):
                    raise inner from None  # e.g. an unreadable input shard: the message says which
            raise ConversionError(f"writing the torch_dist checkpoint failed: {e}") from None
        with open(os.path.join(out_dir, "metadata.json"), "w") as f:
            json.dump(metadata or TORCH_DIST_METADATA, f)
