"""A torch_dist checkpoint's files read with torch.distributed.checkpoint, without process groups.

    files = DCPFiles(iter_dir)
    files.tensors      {key: TensorStorageMetadata}  (global size, dtype, saved chunks)
    files.read({key: (offsets, dest)})   fills each preallocated `dest` with the box of `key` at `offsets`
    files.read_object(key)               a byte item (ShardedObject), through the allow-list
    files.read_raw(key)                  a byte item's stored bytes (copied, never unpickled)

Everything goes through DCP's public pieces: its FileSystemReader reads the chunks and
`create_read_items_for_chunk_list` plans the sub-box reads (the resharding DCP itself uses);
`dcp.load(..., no_dist=True)` runs the plan. Two things are ours, because DCP's defaults unpickle
without an allow-list: FileSystemReader.read_metadata is plain `pickle.load`, and the default
planner's load_bytes is `torch.load(weights_only=False)`. Here the `.metadata` and every byte
item go through mixln_megatron.safe_unpickle instead; tensors are loaded by DCP with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import os
import warnings
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   StorageMeta, TensorStorageMetadata)
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..errors import ConversionError, UnsafeCheckpointError
from ..safe_unpickle import load_pickle, load_torch

METADATA = ".metadata"
Box = Tuple[Sequence[int], torch.Tensor]


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's FileSystemReader with its `.metadata` read through the allow-list (once, then kept)."""

    def __init__(self, path: str):
        super().__init__(path)
        self._metadata: Optional[Metadata] = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            path = os.path.join(str(self.path), METADATA)
            md = load_pickle(path, what=path)
            if not isinstance(md, Metadata) or not isinstance(getattr(md, "state_dict_metadata", None), dict) \
                    or not isinstance(getattr(md, "storage_data", None), dict):
                raise UnsafeCheckpointError(f"{path} is unreadable: it holds a {type(md).__name__}, not "
                                            "torch.distributed.checkpoint metadata")
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            self._metadata = md
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _BoxPlanner(LoadPlanner):
    """Reads tensor boxes into preallocated tensors and byte items as raw bytes (unpickled by the caller)."""

    def __init__(self, boxes: Dict[str, Box], byte_keys: Sequence[str]):
        self.boxes, self.byte_keys = boxes, list(byte_keys)
        self.raw: Dict[str, bytes] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = list(create_default_local_load_plan({k: io.BytesIO() for k in self.byte_keys}, self.metadata,
                                                    True).items) if self.byte_keys else []
        for key, (offsets, dest) in self.boxes.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=dest.size())
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.raw[read_item.dest_index.fqn] = value.read()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self.boxes[read_item.dest_index.fqn][1]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, int(offset), int(length))
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class DCPFiles:
    """One saved iteration of a torch_dist checkpoint: its metadata, tensor boxes and byte items."""

    def __init__(self, path: str):
        self.path = path
        self._reader = SafeFileSystemReader(path)
        md = self._reader.read_metadata()
        self.tensors: Dict[str, TensorStorageMetadata] = {}
        self.objects = set()
        for key, entry in md.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                self.tensors[key] = entry
            elif isinstance(entry, BytesStorageMetadata):
                self.objects.add(key)
        self.storage = md.storage_data

    def _load(self, boxes: Dict[str, Box], byte_keys: Sequence[str] = ()) -> _BoxPlanner:
        planner = _BoxPlanner(boxes, byte_keys)
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({}, storage_reader=self._reader, planner=planner, no_dist=True)
        except UnsafeCheckpointError:
            raise
        except BaseException as e:  # noqa: BLE001 - DCP wraps failures in CheckpointException (a BaseException)
            inner = [exc for exc, _ in getattr(e, "failures", {}).values()] or [e]
            for cause in inner:  # a signal (safe_output.Interrupted, Ctrl-C) stays a signal, even when wrapped
                if not isinstance(cause, Exception):
                    raise cause from None
            keys = ", ".join(sorted(list(boxes) + list(byte_keys))[:3])
            detail = " ".join(str(e).split())[-300:]
            raise ConversionError(f"cannot read {keys} from {self.path} (truncated or corrupt shard?): {detail}") \
                from None
        return planner

    def read(self, boxes: Dict[str, Box]) -> None:
        """Fill each `dest` with the box of its key that starts at `offsets` (one pass over the files)."""
        if boxes:
            self._load(boxes)

    def read_raw(self, key: str) -> bytes:
        """The stored bytes of the byte item `key`, not unpickled (to copy it into another checkpoint)."""
        raw = self._load({}, [key]).raw.get(key)
        if raw is None:
            raise ConversionError(f"{self.path}: no data was read for {key}")
        return raw

    def read_object(self, key: str, what: str):
        """The value of the byte item `key` (a torch.save archive), through the allow-list."""
        files = sorted({info.relative_path for index, info in self.storage.items() if index.fqn == key})
        where = os.path.join(self.path, files[0]) if files else self.path
        raw = self._load({}, [key]).raw.get(key)
        if raw is None:
            raise ConversionError(f"{where}: no data was read for {key}")
        return load_torch(raw, what=f"{where} ({what}, item {key})")
