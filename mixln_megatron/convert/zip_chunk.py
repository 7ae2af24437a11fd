"""The fast path of torch_dist reads: a chunk's exact bytes, found inside its torch.save zip.

Each chunk in a .distcp file is a torch.save archive (a zip, stored uncompressed). Reading its
data.pkl with an unpickler that records the tensor's dtype, shape and storage offset instead of
building it gives the byte offset of the raw data, so a read of a few rows touches only those
bytes. Anything unusual (compressed, strided, big-endian, not a plain tensor) makes locate()
return None and the caller falls back to torch.distributed.checkpoint's reader.
"""

from __future__ import annotations

import collections
import io
import itertools
import pickle
import struct
import zipfile
from typing import Optional

import torch

from . import ConversionError

_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


class _TensorRecord:
    __slots__ = ("dtype", "key", "storage_offset", "size", "stride")


class _StorageRef:
    def __init__(self, dtype, key):
        self.dtype, self.key = dtype, key


def _capture_rebuild(storage, storage_offset, size, stride, *unused):
    rec = _TensorRecord()
    rec.dtype, rec.key = storage.dtype, storage.key
    rec.storage_offset, rec.size, rec.stride = int(storage_offset), tuple(size), tuple(stride)
    return rec


class _StorageType:
    def __init__(self, dtype):
        self.dtype = dtype


class _LayoutUnpickler(pickle.Unpickler):
    """Reads the data.pkl of a torch.save'd plain tensor without building it."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _capture_rebuild
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "torch" and name == "Size":
            return tuple
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"not a plain tensor ({module}.{name})")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise pickle.UnpicklingError("unexpected persistent id")
        storage_type = pid[1]
        dtype = storage_type.dtype if isinstance(storage_type, _StorageType) else None
        if dtype is None:
            raise pickle.UnpicklingError("unknown storage type")
        return _StorageRef(dtype, str(pid[2]))


class _SliceFile(io.RawIOBase):
    """A read-only, seekable window [start, start + length) of an open binary file."""

    def __init__(self, f, start, length):
        self._f, self._start, self._len, self._pos = f, start, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, pos, whence=0):
        if whence == 1:
            pos += self._pos
        elif whence == 2:
            pos += self._len
        self._pos = max(0, min(pos, self._len))
        return self._pos

    def read(self, n=-1):
        if n is None or n < 0:
            n = self._len - self._pos
        n = max(0, min(n, self._len - self._pos))
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return data

    def readinto(self, b):
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


class ChunkLayout:
    """Where a chunk's raw, contiguous, little-endian tensor data starts in its file."""

    __slots__ = ("path", "data_offset", "dtype", "shape")


def contiguous_strides(shape):
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def locate(path: str, offset: int, length: int, chunk_size) -> Optional[ChunkLayout]:
    """The layout of the torch.save archive at [offset, offset + length) of `path`, or None when
    it is not a plain contiguous tensor of `chunk_size` stored uncompressed (OSError propagates)."""
    try:
        with open(path, "rb") as f:
            view = _SliceFile(f, offset, length)
            zf = zipfile.ZipFile(view)
            names = zf.namelist()
            pkl = next(n for n in names if n.endswith("data.pkl"))
            prefix = pkl[: -len("data.pkl")]
            order = prefix + "byteorder"
            little = (zf.read(order).strip() == b"little") if order in names else True
            rec = _LayoutUnpickler(io.BytesIO(zf.read(pkl))).load()
            zinfo = zf.getinfo(f"{prefix}data/{rec.key}")
            if not (little and isinstance(rec, _TensorRecord) and zinfo.compress_type == zipfile.ZIP_STORED
                    and rec.size == tuple(chunk_size) and rec.stride == contiguous_strides(rec.size)):
                return None
            view.seek(zinfo.header_offset)
            header = view.read(30)
            if header[:4] != b"PK\x03\x04":
                return None
            name_len, extra_len = struct.unpack("<HH", header[26:30])
    except (StopIteration, zipfile.BadZipFile, pickle.UnpicklingError, KeyError, EOFError,
            AttributeError, struct.error, ValueError, TypeError):
        return None
    layout = ChunkLayout()
    layout.path = path
    layout.data_offset = offset + zinfo.header_offset + 30 + name_len + extra_len + rec.storage_offset * rec.dtype.itemsize
    layout.dtype, layout.shape = rec.dtype, rec.size
    return layout


def read_region(layout: ChunkLayout, key: str, c_off, lo, hi, offsets, dest: torch.Tensor) -> None:
    """Copy the global box [lo, hi) from the chunk at global offset c_off into dest (whose global
    origin is `offsets`), one contiguous byte range per index of the leading partial dims."""
    shape = layout.shape
    c_lo = [l - c for l, c in zip(lo, c_off)]
    c_hi = [h - c for h, c in zip(hi, c_off)]
    ndim = len(shape)
    # The first dim k after which the region spans whole dims: each index of the dims before k
    # then maps to one contiguous byte range of the chunk (rows c_lo[k]:c_hi[k], full trailing dims).
    k = ndim - 1
    while k > 0 and c_lo[k] == 0 and c_hi[k] == shape[k]:
        k -= 1
    strides = contiguous_strides(shape)
    itemsize = layout.dtype.itemsize
    outer = [range(c_lo[j], c_hi[j]) for j in range(k)]
    d_lo = [l - o for l, o in zip(lo, offsets)]
    with open(layout.path, "rb") as f:
        for idx in itertools.product(*outer):
            start = sum(i * st for i, st in zip(idx, strides)) + c_lo[k] * strides[k]
            count = (c_hi[k] - c_lo[k]) * strides[k]
            target = dest
            for j, i in enumerate(idx):
                target = target.select(0, d_lo[j] + (i - c_lo[j]))
            target = target.narrow(0, d_lo[k], c_hi[k] - c_lo[k])
            for j in range(k + 1, ndim):
                target = target.narrow(j - k, d_lo[j], shape[j])
            f.seek(layout.data_offset + start * itemsize)
            buf = target if target.is_contiguous() else torch.empty(count, dtype=layout.dtype)
            got = f.readinto(memoryview(buf.reshape(-1).view(torch.uint8).numpy()))
            if got != count * itemsize:
                raise ConversionError(f"checkpoint shard {layout.path} is truncated (reading {key})")
            if buf is not target:
                target.copy_(buf.view(target.shape))
