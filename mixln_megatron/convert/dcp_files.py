"""A torch_dist checkpoint's files, read and written with torch.distributed.checkpoint, without process groups.

    files = DCPFiles(iter_dir)
    files.tensors      {key: TensorStorageMetadata}  (global size, dtype, saved chunks)
    files.read({key: (offsets, dest)})   fills each preallocated `dest` with the box of `key` at `offsets`
    files.read_object(key)               a byte item (ShardedObject), through the allow-list
    files.read_raw(key)                  a byte item's stored bytes (copied, never unpickled)

    writer = LazyTorchDistWriter()
    writer.tensor(key, global_shape, offsets, sizes, dtype, produce)   # produce() -> the chunk
    writer.object(unique_key, value)          # a ShardedObject (megatron stores [value])
    writer.raw_object(unique_key, data)       # a byte item copied verbatim from another checkpoint
    writer.save(out_dir, on_write)

DCP's public pieces read the chunks and plan the sub-box reads; two are replaced because they
unpickle without an allow-list (FileSystemReader.read_metadata, the planner's load_bytes): the
`.metadata` and every byte item go through mixln_megatron.safe_unpickle. The folder is untrusted
input, confined and checked before anything is read through it (check_metadata; the rules:
docs/untrusted-input.md). Writing produces each chunk only when DCP's writer asks for it (one chunk
held at a time), in megatron-core's dist_checkpointing layout; the caller writes the common state.
"""

from __future__ import annotations

import gc
import io
import itertools
import json
import math
import os
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_local_load_plan
from torch.distributed.checkpoint.planner import (LoadPlan, LoadPlanner, ReadItem, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..errors import ConversionError, MixLNError, UnsafeCheckpointError
from ..input_root import LIMITS, InputRoot
from ..safe_unpickle import check_archive, load_pickle, load_torch

METADATA = ".metadata"
Box = Tuple[Sequence[int], torch.Tensor]


class _ConfinedFileSystem(FileSystem):
    """DCP's FileSystem for reading only, every file opened through the folder's InputRoot."""

    def __init__(self, root: InputRoot):
        super().__init__()
        self.root = root

    @contextmanager
    def create_stream(self, path, mode: str):
        path = Path(path)
        if mode != "rb" or str(path.parent) != self.root.given:
            raise UnsafeCheckpointError(f"{self.root.given}: refused to open {path} ({mode}): only files of the "
                                        "checkpoint folder are read")
        with self.root.open(path.name) as stream:
            yield stream


class _Window(io.RawIOBase):
    """[offset, offset + length) of an open file as a seekable file of its own (for zipfile)."""

    def __init__(self, base, offset: int, length: int):
        super().__init__()
        self.base, self.offset, self.length, self.pos = base, offset, length, 0

    def seekable(self):
        return True

    def readable(self):
        return True

    def seek(self, pos, whence=os.SEEK_SET):
        self.pos = max(0, {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence] + pos)
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        n = max(0, min(len(b), self.length - self.pos))
        self.base.seek(self.offset + self.pos)
        data = self.base.read(n)
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)


METADATA_BYTES_PER_FILE = 16 << 20  # far above what one rank's chunks add to .metadata (a 405B rank: ~0.3 MB)


def metadata_limit(root: InputRoot) -> int:
    """The most bytes this folder's `.metadata` may hold: LIMITS[".metadata"], or 16 MiB for each
    .distcp file when that is more. The metadata grows with the chunks, the chunks with the ranks
    that wrote them, and every rank writes its own files: a 1T model at DP 256 has thousands."""
    files = sum(1 for name in root.listdir() if name.endswith(".distcp"))
    return max(LIMITS[METADATA], METADATA_BYTES_PER_FILE * files)


_cache: Optional[dict] = None  # while metadata_cache() is open: {file identity: (Metadata, byte items)}


@contextmanager
def metadata_cache():
    """Within the block, a `.metadata` already read and checked by this process (same file: path,
    inode, size, mtime) is not read again; its objects are dropped at the end (a 405B run's take
    a few GiB)."""
    global _cache
    outer = _cache
    _cache = {} if outer is None else outer
    try:
        yield
    finally:
        _cache = outer


def read_checked_metadata(root: InputRoot):
    """(Metadata, {byte item: its storage entry}) of the folder's `.metadata`: read within its bound,
    through the allow-list, checked (check_metadata), with the garbage collector paused (the objects
    hold no cycles, and collecting over millions of them would cost more than the read)."""
    path = os.path.join(root.given, METADATA)
    st = os.stat(root.check_file(METADATA))
    identity = (root.path(METADATA), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if _cache is not None and identity in _cache:
        return _cache[identity]
    was_on = gc.isenabled()
    gc.disable()
    try:
        limit = metadata_limit(root)
        md = load_pickle(root.read_bytes(METADATA, METADATA, limit=limit), what=path, limit=limit)
        items = check_metadata(md, root)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
    finally:
        if was_on:
            gc.enable()
    if _cache is not None:
        _cache[identity] = (md, items)
    return md, items


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's FileSystemReader confined to one iteration folder: its `.metadata` read as a bounded
    file through the allow-list and checked (check_metadata) once, then kept; files opened only
    inside the folder; torch.save slices checked as stored zips before torch reads them."""

    def __init__(self, path: str, root: Optional[InputRoot] = None):
        super().__init__(path)
        self.root = root or InputRoot(path, "checkpoint folder")
        self.path = Path(self.root.given)
        self.fs = _ConfinedFileSystem(self.root)
        self._metadata: Optional[Metadata] = None
        self.byte_items: Dict[str, _StorageInfo] = {}
        self._checked_slices = set()

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            self._metadata, self.byte_items = read_checked_metadata(self.root)
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def _slice_file(self, file, sinfo):
        view = super()._slice_file(file, sinfo)
        key = (sinfo.relative_path, sinfo.offset, sinfo.length)
        if key not in self._checked_slices and sinfo.length >= 4:
            file.seek(sinfo.offset)
            if file.read(4) == b"PK\x03\x04":  # a torch.save zip: stored entries only, inside the slice
                what = f"{os.path.join(self.root.given, sinfo.relative_path)} (bytes {sinfo.offset}.." \
                       f"{sinfo.offset + sinfo.length})"
                check_archive(_Window(file, sinfo.offset, sinfo.length), sinfo.length, what)[0].close()
            self._checked_slices.add(key)
            view.seek(0)
        return view


def _bad(root: InputRoot, problem: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"{os.path.join(root.given, METADATA)} is unreadable: {problem} (a damaged or "
                                 "crafted checkpoint?)")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shape(value, rank: Optional[int] = None) -> bool:
    return isinstance(value, torch.Size) and all(_count(v) for v in value) and (rank is None or len(value) == rank)


def _size(value) -> bool:
    """A torch.Size of non-negative sizes (torch.Size holds int64 values only)."""
    return type(value) is torch.Size and (not value or min(value) >= 0)


def _only(values, *classes) -> bool:
    """Every value of exactly one of `classes` (one pass in C)."""
    return set(map(type, values)) <= set(classes)


def check_metadata(md, root: InputRoot) -> Dict[str, _StorageInfo]:
    """Every entry of DCP metadata well formed and every storage entry inside the folder and its file;
    one UnsafeCheckpointError naming the first problem otherwise. Returns where each byte item is
    stored ({key: its first storage entry}), the index every later look-up uses.

    A 405B run's metadata has over a million chunks: the checks run over whole columns (numpy)
    with one Python step per entry; any problem sends the metadata through _first_problem, which
    walks it entry by entry and names the first one."""
    try:
        index = _check_columns(md, root)
    except _Problem:
        index = None
    if index is None:
        _first_problem(md, root)
        raise _bad(root, "it does not describe its tensors and files consistently")
    return index


class _Problem(Exception):
    """Something in the metadata needs _first_problem to name it."""


def _check_columns(md, root: InputRoot) -> Optional[Dict[str, _StorageInfo]]:
    """check_metadata's checks over whole columns: None (or _Problem) where any fails. Only exact
    classes pass (the allow-list builds no subclasses); torch.Size holds int64 values only."""
    def column(values, count):
        return np.fromiter(itertools.chain.from_iterable(values), dtype=np.int64, count=count)

    if type(md) is not Metadata or type(md.state_dict_metadata) is not dict or type(md.storage_data) is not dict:
        return None
    byte_keys = set()
    for key, entry in md.state_dict_metadata.items():
        if type(key) is not str:
            return None
        if type(entry) is BytesStorageMetadata:
            byte_keys.add(key)
            continue
        if type(entry) is not TensorStorageMetadata or type(entry.properties) is not TensorProperties \
                or not isinstance(entry.properties.dtype, torch.dtype) or not _size(entry.size) \
                or type(entry.chunks) is not list:
            return None
        chunks, rank = entry.chunks, len(entry.size)
        if not chunks:
            continue
        if not _only(chunks, ChunkStorageMetadata):
            return None
        offsets, sizes = [c.offsets for c in chunks], [c.sizes for c in chunks]
        if not _only(offsets, torch.Size) or not _only(sizes, torch.Size) \
                or set(map(len, offsets)) != {rank} or set(map(len, sizes)) != {rank}:
            return None
        if rank:
            start, extent = column(offsets, rank * len(chunks)), column(sizes, rank * len(chunks))
            if (start < 0).any() or (extent < 0).any() \
                    or (start.reshape(-1, rank) + extent.reshape(-1, rank) > np.array(entry.size)).any():
                return None
    keys, infos = list(md.storage_data), list(md.storage_data.values())
    if not _only(keys, MetadataIndex) or not _only(infos, _StorageInfo):
        return None
    fqns, where = [k.fqn for k in keys], [k.offset for k in keys]
    hints = [k.index for k in keys if k.index is not None]
    if not _only(fqns, str) or not _only(where, type(None), torch.Size) \
            or min(map(min, filter(None, where)), default=0) < 0 \
            or not _only(hints, int) or min(hints, default=0) < 0 \
            or any(i.transform_descriptors for i in infos):
        return None
    rels, starts, lengths = [i.relative_path for i in infos], [i.offset for i in infos], [i.length for i in infos]
    if not _only(starts, int) or not _only(lengths, int):
        return None
    files = {rel: n for n, rel in enumerate(dict.fromkeys(rels))}
    for rel in files:
        if type(rel) is not str or not rel or rel in (".", "..") or "/" in rel or "\\" in rel or "\x00" in rel \
                or os.path.isabs(rel):
            return None
    items: Dict[str, _StorageInfo] = {}
    for fqn, info in zip(fqns, infos):
        if fqn in byte_keys:
            if info.length > LIMITS["byte item"]:
                return None
            if fqn not in items or info.relative_path < items[fqn].relative_path:
                items[fqn] = info
    if not infos:
        return items
    try:
        start_a, length_a = np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64)
    except OverflowError:
        raise _Problem from None
    fid_a, end_a = np.fromiter(map(files.__getitem__, rels), dtype=np.int64, count=len(rels)), start_a + length_a
    if (start_a < 0).any() or (length_a < 0).any():
        return None
    order = np.lexsort((start_a, fid_a))  # by file, then offset: each item ends before the next begins
    fid_s, start_s, end_s = fid_a[order], start_a[order], end_a[order]
    if ((fid_s[1:] == fid_s[:-1]) & (start_s[1:] < end_s[:-1])).any():
        return None
    need = np.zeros(len(files), dtype=np.int64)
    np.maximum.at(need, fid_a, end_a)
    for rel, fid in files.items():  # one stat per file, on the one process that vets
        if not root.exists(rel) or os.path.getsize(root.check_file(rel)) < int(need[fid]):
            return None
    return items


def _first_problem(md, root: InputRoot) -> None:
    """check_metadata entry by entry: raises naming the first problem it meets."""
    if not isinstance(md, Metadata) or not isinstance(getattr(md, "state_dict_metadata", None), dict) \
            or not isinstance(getattr(md, "storage_data", None), dict):
        raise UnsafeCheckpointError(f"{os.path.join(root.given, METADATA)} is unreadable: it holds a "
                                    f"{type(md).__name__}, not torch.distributed.checkpoint metadata")
    byte_keys = set()
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise _bad(root, f"a state dict key is a {type(key).__name__}, not a string")
        shown = key[:120]
        if isinstance(entry, BytesStorageMetadata):
            byte_keys.add(key)
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise _bad(root, f"{shown} is described by a {type(entry).__name__}, not tensor or bytes metadata")
        if not isinstance(entry.properties, TensorProperties) or not isinstance(entry.properties.dtype, torch.dtype):
            raise _bad(root, f"{shown} has no tensor dtype")
        if not _shape(entry.size):
            raise _bad(root, f"{shown} has the size {entry.size!r}, not a torch.Size of non-negative integers")
        if not isinstance(entry.chunks, list):
            raise _bad(root, f"{shown} has no list of chunks")
        for chunk in entry.chunks:
            if not isinstance(chunk, ChunkStorageMetadata) or not _shape(chunk.offsets, len(entry.size)) \
                    or not _shape(chunk.sizes, len(entry.size)):
                raise _bad(root, f"{shown} has a chunk that is not offsets and sizes of rank {len(entry.size)}")
            if any(o + s > g for o, s, g in zip(chunk.offsets, chunk.sizes, entry.size)):
                raise _bad(root, f"{shown} has a chunk at {tuple(chunk.offsets)} of {tuple(chunk.sizes)} outside its "
                                 f"size {tuple(entry.size)}")
    per_file: Dict[str, list] = {}
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str) \
                or not (index.offset is None or _shape(index.offset)) \
                or not (index.index is None or _count(index.index)):
            raise _bad(root, f"a storage key is not a well-formed index ({type(index).__name__})")
        if not isinstance(info, _StorageInfo):
            raise _bad(root, f"the storage of {index.fqn[:120]} is a {type(info).__name__}, not a file location")
        rel = info.relative_path
        if not isinstance(rel, str) or not rel or rel in (".", "..") or "/" in rel or "\\" in rel \
                or "\x00" in rel or os.path.isabs(rel):
            raise UnsafeCheckpointError(
                f"{os.path.join(root.given, METADATA)}: {index.fqn[:120]} is stored in {str(rel)[:200]!r}, which is not "
                "a file of the checkpoint folder; only files inside the folder are read (a crafted checkpoint?)")
        if not _count(info.offset) or not _count(info.length):
            raise _bad(root, f"{index.fqn[:120]} has the storage offset {info.offset!r} and length {info.length!r}, "
                             "not non-negative integers")
        if info.transform_descriptors:
            raise _bad(root, f"{index.fqn[:120]} is stored with transforms {list(info.transform_descriptors)[:4]!r}, "
                             "which torch_dist checkpoints do not use")
        if index.fqn in byte_keys and info.length > LIMITS["byte item"]:
            raise _bad(root, f"the byte item {index.fqn[:120]} holds {info.length} bytes, more than any real one "
                             f"({LIMITS['byte item']} bytes)")
        per_file.setdefault(rel, []).append((info.offset, info.length, index.fqn))
    for rel, spans in sorted(per_file.items()):
        full = os.path.join(root.given, rel)
        if not root.exists(rel):
            raise ConversionError(f"checkpoint shard {full} is missing (the .metadata references it)")
        real = root.check_file(rel)  # inside the folder (no link out), a regular file
        size = os.path.getsize(real)
        end = max(o + n for o, n, _ in spans)
        if end > size:
            raise ConversionError(f"checkpoint shard {full} is truncated: {size} bytes, the .metadata needs {end}")
        spans.sort()
        for (o1, n1, k1), (o2, n2, k2) in zip(spans, spans[1:]):
            if o2 < o1 + n1:
                raise _bad(root, f"items {k1[:80]} and {k2[:80]} overlap in {full} (bytes {o1}..{o1 + n1} and "
                                 f"{o2}..{o2 + n2})")


def tensor_volume_problem(entry: TensorStorageMetadata) -> Optional[str]:
    """Why reading the tensor `entry` describes could cost more than its saved chunks hold, or None."""
    total = math.prod(entry.size)
    saved = sum(math.prod(c.sizes) for c in entry.chunks)
    if saved < total:
        return f"its chunks hold {saved} of its {total} elements"
    return None


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
    """One saved iteration of a torch_dist checkpoint: its metadata, tensor boxes and byte items.

    Opening it checks the metadata and every file it names (SafeFileSystemReader, check_metadata):
    missing, truncated, outside or overlapping storage is refused before anything is read, for every
    user (the readers and gpt-to-hybrid's copy path alike)."""

    def __init__(self, path: str, root: Optional[InputRoot] = None):
        self.path = path
        self._reader = SafeFileSystemReader(path, root)
        self.root = self._reader.root
        md = self._reader.read_metadata()
        self.tensors: Dict[str, TensorStorageMetadata] = {}
        self.objects = set()
        for key, entry in md.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                self.tensors[key] = entry
            elif isinstance(entry, BytesStorageMetadata):
                self.objects.add(key)
        self.storage = md.storage_data

    def check_tensor(self, key: str) -> TensorStorageMetadata:
        """The metadata of tensor `key`, refused when its chunks do not hold all of it (reading it
        would allocate more than the files hold)."""
        entry = self.tensors.get(key)
        if entry is None:
            raise ConversionError(f"{self.path} has no tensor {key}")
        problem = tensor_volume_problem(entry)
        if problem:
            raise _bad(self.root, f"the tensor {key[:120]} of size {tuple(entry.size)} cannot be read: {problem}")
        return entry

    def _load(self, boxes: Dict[str, Box], byte_keys: Sequence[str] = ()) -> _BoxPlanner:
        for key in boxes:
            self.check_tensor(key)
        planner = _BoxPlanner(boxes, byte_keys)
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({}, storage_reader=self._reader, planner=planner, no_dist=True)
        except MixLNError:
            raise
        except BaseException as e:  # noqa: BLE001 - DCP wraps failures in CheckpointException (a BaseException)
            inner = [exc for exc, _ in getattr(e, "failures", {}).values()] or [e]
            for cause in inner:  # a signal (safe_output.Interrupted, Ctrl-C) stays a signal, even when wrapped
                if not isinstance(cause, Exception):
                    raise cause from None
            for cause in inner:  # our own refusal (a bomb in a slice, a file outside), raised inside DCP
                if isinstance(cause, MixLNError):
                    raise cause from None
            keys = sorted(list(boxes) + list(byte_keys))
            shown = ", ".join(k[:120] for k in keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            wanted = set(keys)
            files = sorted({info.relative_path for index, info in self.storage.items() if index.fqn in wanted})
            where = ", ".join(os.path.join(self.path, f) for f in files[:3]) or self.path
            cause = inner[0]
            detail = " ".join(str(cause).splitlines()[0].split())[:160] if str(cause).strip() else ""
            raise ConversionError(
                f"cannot read {shown} from {where}: the stored bytes are not the saved data (truncated, corrupt or "
                f"overlapping shard?): {type(cause).__name__}" + (f": {detail}" if detail else "")) from None
        return planner

    def read(self, boxes: Dict[str, Box]) -> None:
        """Fill each `dest` with the box of its key that starts at `offsets` (one pass over the files)."""
        if boxes:
            self._load(boxes)

    def _item_file(self, key: str) -> str:
        """The .distcp file of the byte item `key` (from the index check_metadata built), else the folder."""
        info = self._reader.byte_items.get(key)
        return os.path.join(self.path, info.relative_path) if info is not None else self.path

    def read_raw(self, key: str) -> bytes:
        """The stored bytes of the byte item `key`, not unpickled (to copy it into another checkpoint)."""
        raw = self._load({}, [key]).raw.get(key)
        if raw is None:
            raise ConversionError(f"{self._item_file(key)}: no data was read for {key}")
        return raw

    def read_object(self, key: str, what: str):
        """The value of the byte item `key` (a torch.save archive), through the allow-list."""
        return load_torch(self.read_raw(key), what=f"{self._item_file(key)} ({what}, item {key})")


# ------------------------------------------------------------------------------- writing
TORCH_DIST_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}


def torch_save_bytes(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


class _LazySavePlanner(DefaultSavePlanner):
    """Save planner whose data is produced only when the storage writer asks for it."""

    def __init__(self, items, producers, on_write):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items, self._producers, self._on_write = items, producers, on_write

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self):
        self.plan = SavePlan(list(self._items))
        return self.plan

    def resolve_data(self, write_item):
        offset = write_item.index.offset
        key = (write_item.index.fqn, tuple(offset) if offset is not None else None)
        data = self._producers.pop(key)()
        self._on_write(data)
        return data


class LazyTorchDistWriter:
    """The write plan of one torch_dist checkpoint: tensor chunks and byte items, produced lazily."""

    def __init__(self):
        self.items: List = []
        self._producers: Dict[tuple, Callable] = {}

    def tensor(self, key: str, global_shape, offsets, sizes, dtype: torch.dtype, produce: Callable) -> None:
        """The chunk [offsets, offsets + sizes) of the global tensor `key`; produce() returns it."""
        self.items.append(WriteItem(
            index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                properties=TensorProperties(dtype=dtype), size=torch.Size(global_shape)),
        ))
        self._producers[(key, tuple(offsets))] = lambda: produce().contiguous()

    def raw_object(self, unique_key: str, data: Callable) -> None:
        """A byte item (megatron's ShardedObject `unique_key`); data() returns its bytes."""
        self.items.append(WriteItem(index=MetadataIndex(unique_key), type=WriteItemType.BYTE_IO))
        self._producers[(unique_key, None)] = lambda: io.BytesIO(data())

    def object(self, unique_key: str, value) -> None:
        """A ShardedObject holding `value` (megatron-core saves the list [value])."""
        self.raw_object(unique_key, lambda: torch_save_bytes([value]).getvalue())

    def save(self, out_dir: str, on_write: Optional[Callable] = None, metadata: Optional[dict] = None) -> None:
        planner = _LazySavePlanner(self.items, self._producers, on_write or (lambda data: None))
        writer = dcp.FileSystemWriter(out_dir, single_file_per_rank=True, thread_count=1, sync_files=True)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
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
