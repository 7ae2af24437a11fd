"""torch_dist checkpoints read without process groups and without megatron.

<iter>/.metadata + *.distcp + metadata.json (megatron-core dist_checkpointing over
torch.distributed.checkpoint). Per-layer tensors are stacked under one key with a leading layer
axis ([L, ...]); every rank saved its own chunks (one per layer and TP slice). Reads ask for a
sub-box (one layer of one key, or a block of vocabulary rows) and touch only the chunks that
intersect it. Common state (args, iteration, content metadata) lives in common.pt (older
megatron-core) or in the files as the object `common_state` (0.19+).

Reading a chunk: the fast path parses the chunk's torch.save zip (stored, uncompressed) and reads
exactly the byte range of the requested rows into the destination; any chunk it does not
recognise goes through torch.distributed.checkpoint's FileSystemReader.read_data instead (which
loads whole chunks). Both give identical tensors.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import zipfile
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch

from . import ConversionError, UnsupportedModelError
from . import mapping as M
from .reader_base import ReaderBase, RowSource
from .safe_unpickle import safe_load

COMMON_PT = "common.pt"
COMMON_STATE_KEY = "common_state/shard_0_1"
PIECE_BYTES = 8 << 20  # largest piece read / converted / written at once (torch_dist)

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


class _ChunkLayout:
    __slots__ = ("path", "data_offset", "dtype", "shape", "contiguous")


def _contiguous_strides(shape):
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


class _BoxPlanner:
    """Minimal LoadPlanner for FileSystemReader.read_data: reads into preallocated boxes."""

    def __init__(self, dests: Dict[str, torch.Tensor]):
        self.dests = dests
        self.bytes: Dict[str, bytes] = {}

    def load_bytes(self, read_item, value):
        self.bytes[read_item.dest_index.fqn] = value.read()

    def resolve_tensor(self, read_item):
        tensor = self.dests[read_item.dest_index.fqn]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            tensor = tensor.narrow(dim, int(offset), int(length))
        return tensor

    def commit_tensor(self, read_item, tensor):
        pass


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


class _MetadataUnpickler(pickle.Unpickler):
    """Reads a DCP .metadata without importing torch.distributed.checkpoint (stand-in classes only)."""

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


class _TensorMeta:
    __slots__ = ("size", "dtype", "chunks")

    def __init__(self, size, dtype, chunks):
        self.size, self.dtype, self.chunks = tuple(int(x) for x in size), dtype, chunks


class _StorageEntry:
    __slots__ = ("relative_path", "offset", "length", "transformed")

    def __init__(self, relative_path, offset, length, transformed):
        self.relative_path, self.offset, self.length, self.transformed = relative_path, int(offset), int(length), transformed


def _light_metadata(md) -> Tuple[Dict[str, object], Dict[tuple, _StorageEntry]]:
    """(fqn -> _TensorMeta or "bytes", (fqn, offsets|None) -> _StorageEntry) from real or stand-in metadata."""
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
        tensors[fqn] = _TensorMeta(entry.size, dtype, [
            (tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)) for c in chunks])
    storage: Dict[tuple, _StorageEntry] = {}
    for index, info in md.storage_data.items():
        offset = getattr(index, "offset", None)
        key = (index.fqn, tuple(int(x) for x in offset) if offset is not None else None)
        storage[key] = _StorageEntry(info.relative_path, info.offset, info.length,
                                     bool(getattr(info, "transform_descriptors", None)))
    return tensors, storage


class TorchDistCheckpoint(ReaderBase):
    format = "torch_dist"

    def __init__(self, path: str, fast_reads: bool = True):
        self.path = path
        self.fast_reads = fast_reads
        self._dcp_state = None
        meta_path = os.path.join(path, ".metadata")
        try:
            with open(meta_path, "rb") as f:
                md = _MetadataUnpickler(f).load()
            self._sd_md, self._storage = _light_metadata(md)
        except (pickle.UnpicklingError, AttributeError, EOFError, TypeError, ValueError, KeyError, ImportError):
            # Anything unexpected: torch's own reader (imports torch.distributed.checkpoint).
            reader, md = self._dcp()
            self._sd_md, self._storage = _light_metadata(md)
        except OSError as e:
            raise ConversionError(f"{meta_path} is unreadable: {e}") from None
        self._layouts: Dict[Tuple[str, int], Optional[_ChunkLayout]] = {}
        self._check_files()
        self._check_keys()
        common = self._read_common()
        self.common = common
        self.args = common.get("args")
        self.iteration = common.get("iteration")
        self.content_metadata = common.get("content_metadata")
        record_key = f"{M.TD_SETTINGS_RECORD}/shard_0_1"
        if record_key in self._sd_md:
            loaded = safe_load(self._read_bytes(record_key), what="the Mix-LN settings record")
            self.settings_record = loaded[0] if isinstance(loaded, list) else loaded
        emb = self._sd_md[M.TD_EMBEDDING]
        self.padded_vocab_size = emb.size[0]
        self.dtype = emb.dtype
        self.has_output_layer = M.TD_OUTPUT in self._sd_md
        mixln_norm = M.TD_LAYER_PREFIX + M.MIXLN_NORM_NAMES["norm_a"]
        self.norm_layout = "mixln" if mixln_norm in self._sd_md else "stock"

    def _dcp(self):
        """torch.distributed.checkpoint's FileSystemReader and the real metadata (lazily)."""
        if self._dcp_state is None:
            from torch.distributed.checkpoint import FileSystemReader

            reader = FileSystemReader(self.path)
            try:
                md = reader.read_metadata()
            except Exception as e:  # noqa: BLE001 - pickle / OS errors of a damaged .metadata
                raise ConversionError(f"{self.path}/.metadata is unreadable (truncated or corrupt?): {e}") from None
            reader.set_up_storage_reader(md, True)
            self._dcp_state = (reader, md)
        return self._dcp_state

    # ---------------------------------------------------------------- validation
    def _check_files(self) -> None:
        """Every file the metadata points to exists and is long enough (missing / truncated shards)."""
        needed: Dict[str, int] = {}
        for info in self._storage.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for rel, end in sorted(needed.items()):
            full = os.path.join(self.path, rel)
            if not os.path.isfile(full):
                raise ConversionError(f"checkpoint shard {full} is missing (the .metadata references it)")
            size = os.path.getsize(full)
            if size < end:
                raise ConversionError(
                    f"checkpoint shard {full} is truncated: {size} bytes, the .metadata needs {end}"
                )

    def _check_keys(self) -> None:
        keys = set(self._sd_md)
        model_keys = [k for k in keys if k.startswith("decoder.") or k.startswith("embedding.")
                      or k.startswith("output_layer.") or k.startswith("mtp.")]
        if any(".mlp.experts." in k or ".mlp.router." in k for k in model_keys):
            raise UnsupportedModelError("this checkpoint has MoE layers (mlp.experts / mlp.router keys): Llama has no experts")
        if any("linear_q_down_proj" in k or "linear_kv_down_proj" in k for k in model_keys):
            raise UnsupportedModelError("this checkpoint uses multi-latent attention (MLA): Llama cannot express it")
        if any(k.startswith("mtp.") for k in model_keys):
            raise UnsupportedModelError("this checkpoint has multi-token-prediction (mtp.*) layers")
        if M.TD_EMBEDDING not in keys:
            raise ConversionError(f"{self.path} has no {M.TD_EMBEDDING}: not a GPT model checkpoint")

    # ---------------------------------------------------------------- raw access
    def _read_bytes(self, key: str) -> bytes:
        info = self._storage.get((key, None))
        if info is not None and not info.transformed:
            path = os.path.join(self.path, info.relative_path)
            try:
                with open(path, "rb") as f:
                    f.seek(info.offset)
                    data = f.read(info.length)
            except OSError as e:
                raise ConversionError(f"cannot read {key} from {path}: {e}") from None
            if len(data) != info.length:
                raise ConversionError(f"checkpoint shard {path} is truncated (reading {key})")
            return data
        from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

        reader, md = self._dcp()
        plan = create_default_local_load_plan({key: io.BytesIO()}, md, True)
        planner = _BoxPlanner({})
        try:
            reader.read_data(plan, planner).wait()
        except (OSError, ValueError, RuntimeError) as e:
            raise ConversionError(f"cannot read {key} from {self.path}: {e}") from None
        return planner.bytes[key]

    def _read_common(self) -> dict:
        common_pt = os.path.join(self.path, COMMON_PT)
        if os.path.isfile(common_pt):
            common = safe_load(common_pt, what=common_pt)
        elif COMMON_STATE_KEY in self._sd_md:
            loaded = safe_load(self._read_bytes(COMMON_STATE_KEY), what="the checkpoint's common state")
            common = loaded[0] if isinstance(loaded, list) else loaded
        else:
            raise ConversionError(
                f"{self.path} has neither common.pt nor a common_state object: not a Megatron-LM checkpoint "
                "(args and iteration are missing)"
            )
        if not isinstance(common, dict):
            raise ConversionError(f"{self.path}: unexpected common state of type {type(common).__name__}")
        return common

    def has(self, key: str) -> bool:
        return key in self._sd_md

    def global_shape(self, key: str) -> Tuple[int, ...]:
        return self._sd_md[key].size

    def read(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """The sub-box [offsets, offsets + sizes) of the global tensor `key`, in its saved dtype."""
        md = self._sd_md.get(key)
        if not isinstance(md, _TensorMeta):
            raise ConversionError(f"{self.path} has no tensor {key}")
        offsets, sizes = tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)
        if len(offsets) != len(md.size) or any(o + s > g for o, s, g in zip(offsets, sizes, md.size)):
            raise ConversionError(f"{key}: box {offsets}+{sizes} outside the saved shape {md.size}")
        dest = torch.empty(sizes, dtype=md.dtype)
        covered = 0
        slow = False
        for c_off, c_size in md.chunks:
            lo = [max(o, c) for o, c in zip(offsets, c_off)]
            hi = [min(o + s, c + cs) for o, s, c, cs in zip(offsets, sizes, c_off, c_size)]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            n = 1
            for l, h in zip(lo, hi):
                n *= h - l
            covered += n
            if not (self.fast_reads and self._read_chunk_fast(key, c_off, c_size, lo, hi, offsets, dest)):
                slow = True
        if covered != dest.numel():
            raise ConversionError(f"{key}: the saved chunks do not cover box {offsets}+{sizes} (incomplete checkpoint)")
        if slow:
            self._read_slow(key, offsets, sizes, dest)
        return dest

    def _read_slow(self, key, offsets, sizes, dest):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        reader, md = self._dcp()
        items = create_read_items_for_chunk_list(
            key, md.state_dict_metadata[key], [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))]
        )
        try:
            reader.read_data(LoadPlan(items), _BoxPlanner({key: dest})).wait()
        except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
            raise ConversionError(f"cannot read {key} from {self.path} (truncated or corrupt shard?): {e}") from None

    def _chunk_layout(self, key, c_off, c_size) -> Optional[_ChunkLayout]:
        info = self._storage.get((key, tuple(c_off)))
        if info is None:
            raise ConversionError(f"{key}: chunk at {tuple(c_off)} has no storage entry in .metadata")
        cache_key = (info.relative_path, info.offset)
        if cache_key in self._layouts:
            return self._layouts[cache_key]
        layout = None
        if not info.transformed:
            path = os.path.join(self.path, info.relative_path)
            try:
                with open(path, "rb") as f:
                    view = _SliceFile(f, info.offset, info.length)
                    zf = zipfile.ZipFile(view)
                    names = zf.namelist()
                    pkl = next(n for n in names if n.endswith("data.pkl"))
                    prefix = pkl[: -len("data.pkl")]
                    order = prefix + "byteorder"
                    little = (zf.read(order).strip() == b"little") if order in names else True
                    rec = _LayoutUnpickler(io.BytesIO(zf.read(pkl))).load()
                    zinfo = zf.getinfo(f"{prefix}data/{rec.key}")
                    if (little and isinstance(rec, _TensorRecord) and zinfo.compress_type == zipfile.ZIP_STORED
                            and rec.size == tuple(c_size) and rec.stride == _contiguous_strides(rec.size)):
                        view.seek(zinfo.header_offset)
                        header = view.read(30)
                        if header[:4] == b"PK\x03\x04":
                            name_len, extra_len = struct.unpack("<HH", header[26:30])
                            layout = _ChunkLayout()
                            layout.path = path
                            layout.data_offset = (info.offset + zinfo.header_offset + 30 + name_len + extra_len
                                                  + rec.storage_offset * rec.dtype.itemsize)
                            layout.dtype, layout.shape = rec.dtype, rec.size
            except (StopIteration, zipfile.BadZipFile, pickle.UnpicklingError, KeyError, EOFError,
                    AttributeError, struct.error, ValueError, TypeError):
                layout = None
            except OSError as e:
                raise ConversionError(f"cannot read checkpoint shard {path}: {e}") from None
        self._layouts[cache_key] = layout
        return layout

    def _read_chunk_fast(self, key, c_off, c_size, lo, hi, offsets, dest) -> bool:
        layout = self._chunk_layout(key, c_off, c_size)
        if layout is None or layout.dtype != dest.dtype or not layout.shape:
            return False
        shape = layout.shape
        c_lo = [l - c for l, c in zip(lo, c_off)]
        c_hi = [h - c for h, c in zip(hi, c_off)]
        ndim = len(shape)
        # The first dim k after which the region spans whole dims: each index of the dims before k
        # then maps to one contiguous byte range of the chunk (rows c_lo[k]:c_hi[k], full trailing dims).
        k = ndim - 1
        while k > 0 and c_lo[k] == 0 and c_hi[k] == shape[k]:
            k -= 1
        strides = _contiguous_strides(shape)
        itemsize = layout.dtype.itemsize
        outer = [range(c_lo[j], c_hi[j]) for j in range(k)]
        d_lo = [l - o for l, o in zip(lo, offsets)]
        with open(layout.path, "rb") as f:
            for idx in _product(outer):
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
        return True

    # ---------------------------------------------------------------- model tensors
    def _layer_key(self, layer: int, role: str) -> Tuple[str, bool]:
        name = M.td_layer_name(role, self.norm_layout == "mixln")
        stacked = M.TD_LAYER_PREFIX + name
        if stacked in self._sd_md:
            return stacked, True
        single = f"{M.TD_LAYER_PREFIX}{layer}.{name}"
        if single in self._sd_md:
            return single, False
        raise ConversionError(
            f"{self.path} has no {stacked} (nor per-layer {single}): the model lacks '{role}'"
        )

    def read_role_rows(self, layer: int, role: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of one layer's tensor of `role` (global layout)."""
        key, stacked = self._layer_key(layer, role)
        shape = self.global_shape(key)
        if stacked:
            rest = shape[1:]
            return self.read(key, (layer, start) + (0,) * (len(rest) - 1), (1, stop - start) + rest[1:])[0]
        return self.read(key, (start,) + (0,) * (len(shape) - 1), (stop - start,) + shape[1:])

    def layer_source(self, layer: int, roles: Sequence[str]):
        return RowSource(lambda role, a, b: self.read_role_rows(layer, role, a, b))

    def read_layer(self, layer: int, roles: Iterable[str]) -> Dict[str, torch.Tensor]:
        out = {}
        for role in roles:
            key, stacked = self._layer_key(layer, role)
            rows = (self.global_shape(key)[1] if stacked else self.global_shape(key)[0])
            out[role] = self.read_role_rows(layer, role, 0, rows)
        return out

    def num_stacked_layers(self) -> Optional[int]:
        key = M.TD_LAYER_PREFIX + M.LAYER_ROLE_NAMES["qkv.weight"]
        return self.global_shape(key)[0] if key in self._sd_md else None

    def read_vocab_rows(self, which: str, start: int, stop: int) -> torch.Tensor:
        key = M.TD_EMBEDDING if which == "embedding" else M.TD_OUTPUT
        h = self.global_shape(key)[1]
        return self.read(key, (start, 0), (stop - start, h))

    def vocab_block_rows(self, row_bytes: int) -> Optional[int]:
        return max(1, PIECE_BYTES // max(1, row_bytes))

    def read_final_norm(self) -> torch.Tensor:
        if M.TD_FINAL_NORM not in self._sd_md:
            raise ConversionError(f"{self.path} has no {M.TD_FINAL_NORM}")
        return self.read(M.TD_FINAL_NORM, (0,), self.global_shape(M.TD_FINAL_NORM))

    def model_tensor_bytes(self) -> int:
        total = 0
        for key, md in self._sd_md.items():
            if isinstance(md, _TensorMeta) and (key.startswith("decoder.") or key.startswith("embedding.")
                                                or key.startswith("output_layer.")):
                n = 1
                for s in md.size:
                    n *= s
                total += n * md.dtype.itemsize
        return total

    def check_shapes(self, shape: M.ModelShape) -> None:
        """The stacked tensors have the shapes the args describe."""
        n = self.num_stacked_layers()
        if n is not None and n != shape.num_layers:
            raise ConversionError(f"the checkpoint stacks {n} layers but its args say num_layers={shape.num_layers}")
        for role, want in shape.megatron_layer_shapes().items():
            key, stacked = self._layer_key(0, role)
            got = self.global_shape(key)[1:] if stacked else self.global_shape(key)
            if tuple(got) != tuple(want):
                raise ConversionError(f"{key} has shape {tuple(got)}, the args imply {tuple(want)}")
        if shape.add_bias_linear is False:
            extra = [r for r in ("qkv.bias", "fc1.bias") if (M.TD_LAYER_PREFIX + M.LAYER_ROLE_NAMES[r]) in self._sd_md]
            if extra:
                raise ConversionError(f"the checkpoint has biases ({extra}) but its args say add_bias_linear=False")
        emb = self._sd_md[M.TD_EMBEDDING].size
        if emb[1] != shape.hidden_size:
            raise ConversionError(f"{M.TD_EMBEDDING} has shape {emb}, the args imply hidden size {shape.hidden_size}")


def _product(ranges):
    if not ranges:
        yield ()
        return
    first, rest = ranges[0], ranges[1:]
    for i in first:
        for tail in _product(rest):
            yield (i,) + tail


# --------------------------------------------------------------------------- legacy (torch)
