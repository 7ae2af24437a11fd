"""A torch_dist checkpoint's `.metadata`, read without importing torch.distributed.checkpoint.

The file is a pickle of torch.distributed.checkpoint dataclasses. Unpickling it into inert
stand-ins keeps conversion free of process-group machinery and of code execution from the file;
light_metadata() then reduces real or stand-in metadata to what the reader needs: each key's
global shape, dtype and chunk boxes, and where each chunk's bytes lie.
"""

from __future__ import annotations

import collections
import pickle
from typing import Dict, Tuple

import torch


class _Rec:
    """Stand-in for a torch.distributed.checkpoint dataclass in a .metadata pickle."""

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            self.__dict__.update(state[0] or {})
            self.__dict__.update(state[1] or {})
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self._state = state


class _RecIndex(_Rec):
    """Stand-in for MetadataIndex: equal / hashed by (fqn, offset), like the real one."""

    def _key(self):
        offset = self.__dict__.get("offset")
        return (self.__dict__.get("fqn"), tuple(offset) if offset is not None else None)

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, _RecIndex) and self._key() == other._key()


class _RecEnum:
    def __init__(self, *args):
        self.args = args


class MetadataUnpickler(pickle.Unpickler):
    """Reads a DCP .metadata into stand-in classes; anything else in the pickle is refused."""

    _classes: Dict[str, type] = {}

    def find_class(self, module, name):
        if module.startswith("torch.distributed.checkpoint"):
            if name in ("_MEM_FORMAT_ENCODING", "WriteItemType", "LoadItemType"):
                return _RecEnum
            key = f"{module}.{name}"
            if key not in self._classes:
                base = _RecIndex if name == "MetadataIndex" else _Rec
                self._classes[key] = type(name, (base,), {"__module__": __name__})
            return self._classes[key]
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return lambda text: text
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"unexpected class {module}.{name} in .metadata")


class TensorMeta:
    __slots__ = ("size", "dtype", "chunks")

    def __init__(self, size, dtype, chunks):
        self.size, self.dtype, self.chunks = tuple(int(x) for x in size), dtype, chunks


class StorageEntry:
    __slots__ = ("relative_path", "offset", "length", "transformed")

    def __init__(self, relative_path, offset, length, transformed):
        self.relative_path, self.offset, self.length, self.transformed = relative_path, int(offset), int(length), transformed


def light_metadata(md) -> Tuple[Dict[str, object], Dict[tuple, StorageEntry]]:
    """(fqn -> TensorMeta or "bytes", (fqn, offsets|None) -> StorageEntry) from real or stand-in metadata."""
    tensors: Dict[str, object] = {}
    for fqn, entry in md.state_dict_metadata.items():
        chunks = getattr(entry, "chunks", None)
        if chunks is None:
            tensors[fqn] = "bytes"
            continue
        props = entry.properties
        dtype = getattr(props, "dtype", None)
        if dtype is None and isinstance(getattr(props, "_state", None), tuple):
            dtype = props._state[0]  # TensorProperties pickles (dtype, layout, ...) as its state
        if not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"no dtype for {fqn}")
        tensors[fqn] = TensorMeta(entry.size, dtype, [
            (tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)) for c in chunks])
    storage: Dict[tuple, StorageEntry] = {}
    for index, info in md.storage_data.items():
        offset = getattr(index, "offset", None)
        key = (index.fqn, tuple(int(x) for x in offset) if offset is not None else None)
        storage[key] = StorageEntry(info.relative_path, info.offset, info.length,
                                    bool(getattr(info, "transform_descriptors", None)))
    return tensors, storage
