"""Read Megatron-LM checkpoints layer by layer, without process groups and without megatron.

Two formats:
  torch_dist  <iter>/.metadata + *.distcp + metadata.json (megatron-core dist_checkpointing over
              torch.distributed.checkpoint). Per-layer tensors are stacked under one key with a
              leading layer axis ([L, ...]); every rank saved its own chunks (one per layer and TP
              slice). Reads ask for a sub-box (one layer of one key, or a block of vocabulary
              rows) and touch only the chunks that intersect it.
  torch       (legacy) <iter>/mp_rank_TT[_PPP]/model_optim_rng.pt: one torch.save per TP x PP rank,
              state_dict['model'] (or model0, model1, ... with virtual pipelining) with
              layer-local names (decoder.layers.<local>.*). Files are opened memory-mapped and
              re-opened per layer, so only the tensors of one layer are ever resident.

Common state (args, iteration, content metadata) lives in common.pt (older megatron-core) or in
the torch_dist files as the object `common_state` (0.19+). The Mix-LN settings record is the
ShardedObject `decoder.layers.mixln_settings` (torch_dist), `decoder.layers.0.mixln_settings` in
the first stage's state dict (legacy), and the `mixln` entry of the content metadata.

Unpickling is always `weights_only=True`. Classes the args refer to that are not plain data
(megatron enums, numpy RNG state) are replaced by inert stand-ins, so neither megatron nor any
code from the checkpoint is imported or run.

Reading a torch_dist tensor chunk: the fast path parses the chunk's torch.save zip (stored,
uncompressed) and reads exactly the byte range of the requested rows into the destination; any
chunk it does not recognise goes through torch.distributed.checkpoint's FileSystemReader.read_data
instead (which loads whole chunks). Both give identical tensors.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import pathlib
import pickle
import re
import struct
import types
import zipfile
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from . import ConversionError, UnsupportedModelError
from . import mapping as M

TRACKER = "latest_checkpointed_iteration.txt"
COMMON_PT = "common.pt"
COMMON_STATE_KEY = "common_state/shard_0_1"
LEGACY_FILE = "model_optim_rng.pt"
PIECE_BYTES = 8 << 20  # largest piece read / converted / written at once (torch_dist)
_LEGACY_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


# --------------------------------------------------------------------------- safe unpickling
_ALLOWED_REAL = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, pathlib.PurePosixPath]
_KNOWN_STUBS = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.enums.ModelType",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "signal.Signals",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.dtypes.UInt32DType",
)
_stub_cache: Dict[str, type] = {}


def _stub(name: str) -> type:
    """An inert stand-in for a class a checkpoint pickled (enum, config, numpy array...)."""
    if name not in _stub_cache:
        module, _, qual = name.rpartition(".")

        def __init__(self, *args, **kwargs):
            self._args, self._kwargs = args, kwargs

        def __setstate__(self, state):
            self._state = state

        def __repr__(self):
            return f"<{name} {getattr(self, '_args', ())!r} (not loaded)>"

        _stub_cache[name] = type(qual.split(".")[-1], (), {
            "__init__": __init__, "__setstate__": __setstate__, "__repr__": __repr__, "__module__": module,
        })
    return _stub_cache[name]


_UNSUPPORTED_GLOBAL = re.compile(r"GLOBAL ([\w\.]+) was not an allowed global")


def safe_load(source, *, mmap: bool = False, what: str = "checkpoint file"):
    """torch.load(weights_only=True) of a path or a bytes buffer, stubbing non-data classes."""
    registered = set()
    for entry in torch.serialization.get_safe_globals():
        if isinstance(entry, tuple):
            registered.add(entry[1])
        else:
            registered.add(f"{getattr(entry, '__module__', '')}.{getattr(entry, '__qualname__', '')}")
    # Names registered by the process (e.g. by megatron.core when it is imported) keep their real class.
    # Entries added here are removed again on exit, so none may duplicate an existing registration.
    extra = [c for c in _ALLOWED_REAL if f"{c.__module__}.{c.__qualname__}" not in registered]
    extra += [(_stub(n), n) for n in _KNOWN_STUBS if n not in registered]
    for _ in range(100):
        if isinstance(source, (bytes, bytearray)):
            src = io.BytesIO(source)
        else:
            src = source
        try:
            with torch.serialization.safe_globals(extra):
                return torch.load(src, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as e:
            match = _UNSUPPORTED_GLOBAL.search(str(e))
            if not match:
                raise ConversionError(f"cannot unpickle {what} safely: {e}") from None
            extra.append((_stub(match.group(1)), match.group(1)))
        except (RuntimeError, EOFError, OSError, zipfile.BadZipFile) as e:
            raise ConversionError(f"{what} is unreadable (truncated or corrupt?): {e}") from None
    raise ConversionError(f"cannot unpickle {what}: too many unknown classes")


# --------------------------------------------------------------------------- locating the dir
def resolve_checkpoint_dir(load: str, iteration: Optional[int] = None) -> Tuple[str, str]:
    """(directory of one saved iteration, its label) for a Megatron-LM --save directory.

    `load` is the --save/--load directory (with latest_checkpointed_iteration.txt), or one of its
    iter_XXXXXXX / release directories directly.
    """
    load = os.path.abspath(load)
    if not os.path.isdir(load):
        raise ConversionError(f"not a Megatron-LM checkpoint: {load} does not exist or is not a directory")
    if iteration is not None:
        name = "release" if str(iteration) == "release" else f"iter_{int(iteration):07d}"
        path = os.path.join(load, name)
        if not os.path.isdir(path):
            found = sorted(d for d in os.listdir(load) if d.startswith("iter_") or d == "release")
            raise ConversionError(
                f"{load} has no {name}/ directory for --iteration {iteration}"
                + (f" (found: {', '.join(found[-8:])})" if found else "")
            )
        return path, name
    tracker = os.path.join(load, TRACKER)
    if os.path.isfile(tracker):
        text = open(tracker).read().strip()
        if text == "release":
            name = "release"
        else:
            try:
                name = f"iter_{int(text):07d}"
            except ValueError:
                raise ConversionError(f"{tracker} does not hold an iteration number: {text!r}") from None
        path = os.path.join(load, name)
        if not os.path.isdir(path):
            raise ConversionError(f"{tracker} names {name}, but {path} does not exist (incomplete checkpoint?)")
        return path, name
    if _detect_format(load, quiet=True) is not None:
        return load, os.path.basename(load)
    found = sorted(d for d in os.listdir(load) if d.startswith("iter_"))
    if found:
        raise ConversionError(
            f"{load} has no {TRACKER}; pass --iteration N (found: {', '.join(found[-8:])})"
        )
    raise ConversionError(
        f"not a Megatron-LM checkpoint: {load} has no {TRACKER}, no iter_*/release directory, and no "
        "torch_dist (.metadata, metadata.json) or legacy (mp_rank_*/model_optim_rng.pt) files"
    )


def _detect_format(path: str, quiet: bool = False) -> Optional[str]:
    entries = os.listdir(path)
    if "metadata.json" in entries:
        import json

        try:
            config = json.load(open(os.path.join(path, "metadata.json")))
        except (OSError, ValueError) as e:
            raise ConversionError(f"{path}/metadata.json is unreadable: {e}") from None
        backend = config.get("sharded_backend")
        if backend != "torch_dist":
            raise UnsupportedModelError(
                f"{path} is a distributed checkpoint with sharded_backend {backend!r}; only torch_dist is supported"
            )
        if ".metadata" not in entries:
            raise ConversionError(f"{path} has metadata.json but no .metadata (incomplete torch_dist checkpoint)")
        return "torch_dist"
    if any(_LEGACY_DIR.match(e) for e in entries):
        return "torch"
    if ".metadata" in entries:
        if quiet:
            return None
        raise UnsupportedModelError(
            f"{path} is a plain torch.distributed.checkpoint (torch_dcp / fsdp_dtensor) checkpoint without "
            "megatron's metadata.json; save with --ckpt-format torch_dist or torch"
        )
    return None


def open_checkpoint(load: str, iteration: Optional[int] = None):
    """The reader (TorchDistCheckpoint or LegacyCheckpoint) of a Megatron-LM checkpoint."""
    path, label = resolve_checkpoint_dir(load, iteration)
    fmt = _detect_format(path)
    if fmt is None:
        raise ConversionError(
            f"not a Megatron-LM checkpoint: {path} holds neither torch_dist files (.metadata, "
            "metadata.json) nor legacy mp_rank_*/model_optim_rng.pt files"
        )
    reader = TorchDistCheckpoint(path) if fmt == "torch_dist" else LegacyCheckpoint(path)
    reader.label = label
    return reader


# --------------------------------------------------------------------------- common reader API
class _Base:
    format = "?"
    label = ""
    path = ""
    args = None
    iteration = None
    content_metadata: Optional[dict] = None
    settings_record: Optional[dict] = None  # the sharded / legacy record
    dtype = torch.float32
    padded_vocab_size = 0
    has_output_layer = True

    def _require_args(self):
        if self.args is None:
            raise ConversionError(
                f"{self.path} carries no Megatron args (saved without them?): the model shape cannot be read"
            )

    def mixln_record(self, num_layers: int) -> Tuple[dict, str]:
        """The Mix-LN settings of the checkpoint, from every source it has; disagreement is an error.

        Sources, most authoritative first: the settings record the layers saved, the `mixln` entry
        of the content metadata (Megatron-LM), the --mixln-* args of `mixln-megatron pretrain`
        (settings given through MIXLN_* variables leave those None: only what is set is compared).
        None of them: a stock Pre-LN checkpoint (P = 0).
        """
        from ..placement import MixLNConfigError, Placement, post_ln_count

        sources = []  # (name, scheme or None, P or None, alpha or None)
        if self.settings_record is not None:
            r = self.settings_record
            sources.append(("the settings record", r.get("scheme", "mixln"), int(r.get("post_ln_layers", 0)),
                            r.get("alpha")))
            if int(r.get("num_layers", num_layers)) != num_layers:
                raise ConversionError(
                    f"the Mix-LN record is for {r.get('num_layers')} layers but the checkpoint has {num_layers}"
                )
        meta = self.content_metadata.get("mixln") if isinstance(self.content_metadata, dict) else None
        if meta is not None:
            sources.append(("the content metadata", meta.get("scheme", "mixln"), int(meta.get("post_ln_layers", 0)),
                            meta.get("alpha")))
        args = self.args
        p_arg, alpha_arg = getattr(args, "mixln_post_ln_layers", None), getattr(args, "mixln_alpha", None)
        scheme_arg = getattr(args, "mixln_scheme", None)
        if p_arg is not None or alpha_arg is not None or scheme_arg is not None:
            p = int(p_arg) if p_arg is not None else (
                post_ln_count(alpha_arg, num_layers) if alpha_arg is not None else None)
            sources.append(("the saved --mixln-* args", scheme_arg, p,
                            str(alpha_arg) if alpha_arg is not None else None))
        if not sources:
            return (Placement(num_layers, 0, "mixln").record(), "no Mix-LN record (a stock Pre-LN checkpoint: P = 0)")
        for i, (n1, s1, p1, _) in enumerate(sources):
            for n2, s2, p2, _ in sources[i + 1:]:
                if (s1 is not None and s2 is not None and s1 != s2) or (p1 is not None and p2 is not None and p1 != p2):
                    raise ConversionError(
                        f"the checkpoint's Mix-LN settings disagree: {n1} says scheme={s1} P={p1}, "
                        f"{n2} says scheme={s2} P={p2}"
                    )
        scheme = next((x[1] for x in sources if x[1] is not None), "mixln")
        post = next((x[2] for x in sources if x[2] is not None), 0)
        alpha = next((x[3] for x in sources if x[3] is not None), None)
        try:
            placement = Placement(num_layers, post, scheme, alpha)
        except MixLNConfigError as e:
            raise ConversionError(f"the checkpoint's Mix-LN settings are invalid: {e}") from None
        return placement.record(), f"from {sources[0][0]}"

    def check_layer_kinds(self, post_ln_layers: int) -> None:
        """Formats that name the layer kind (legacy) compare it with the settings; torch_dist cannot."""


# --------------------------------------------------------------------------- torch_dist
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


class TorchDistCheckpoint(_Base):
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
        stacked = M.TD_LAYER_PREFIX + M.LAYER_ROLE_NAMES[role]
        if stacked in self._sd_md:
            return stacked, True
        single = f"{M.TD_LAYER_PREFIX}{layer}.{M.LAYER_ROLE_NAMES[role]}"
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
        return _RowSource(lambda role, a, b: self.read_role_rows(layer, role, a, b))

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


class _RowSource:
    """Rows of a layer's role tensors: read on demand (torch_dist) or sliced from a loaded layer (legacy)."""

    def __init__(self, rows_fn):
        self._rows = rows_fn

    def rows(self, role: str, start: int, stop: int) -> torch.Tensor:
        return self._rows(role, start, stop)


def _product(ranges):
    if not ranges:
        yield ()
        return
    first, rest = ranges[0], ranges[1:]
    for i in first:
        for tail in _product(rest):
            yield (i,) + tail


# --------------------------------------------------------------------------- legacy (torch)
class LegacyCheckpoint(_Base):
    format = "torch"

    def __init__(self, path: str):
        self.path = path
        ranks = {}
        for entry in os.listdir(path):
            m = _LEGACY_DIR.match(entry)
            if not m:
                continue
            if m.group(3) is not None:
                raise UnsupportedModelError(
                    f"{path}/{entry}: expert-parallel (MoE) legacy checkpoints are not supported: Llama has no experts"
                )
            ranks[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(path, entry, LEGACY_FILE)
        self.tp = max(t for t, _ in ranks) + 1
        self.pp = max(p for _, p in ranks) + 1
        for t in range(self.tp):
            for p in range(self.pp):
                f = ranks.get((t, p))
                if f is None or not os.path.isfile(f):
                    name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if self.pp > 1 else "")
                    raise ConversionError(
                        f"checkpoint shard {os.path.join(path, name, LEGACY_FILE)} is missing "
                        f"(TP {self.tp} x PP {self.pp} checkpoint)"
                    )
        self._files = ranks
        # Open every file once: checks that none is truncated and learns the layer layout.
        self._chunks: List[Tuple[int, str, int]] = []  # (pp, model key, local layer count), global order
        per_stage = {}
        for p in range(self.pp):
            for t in range(self.tp):
                sd = self._load(t, p)
                if t == 0:
                    keys = sorted((k for k in sd if re.fullmatch(r"model\d*", k)), key=lambda k: int(k[5:] or 0))
                    if not keys:
                        raise ConversionError(f"{self._files[(t, p)]} has no 'model' state dict")
                    per_stage[p] = [(k, _count_local_layers(sd[k])) for k in keys]
                    if p == 0:
                        self.args = sd.get("args")
                        self.iteration = sd.get("iteration")
                        first = sd[keys[0]]
                        self.settings_record = first.get("decoder.layers.0.mixln_settings")
                        emb = first.get(M.TD_EMBEDDING)
                        if emb is None:
                            raise ConversionError(f"{self._files[(0, 0)]} has no {M.TD_EMBEDDING}")
                        self.dtype = emb.dtype
                        self.padded_vocab_size = int(emb.shape[0]) * self.tp
                    if p == self.pp - 1:
                        last = sd[keys[-1]]
                        self.has_output_layer = M.TD_OUTPUT in last
                del sd
        nchunks = {len(v) for v in per_stage.values()}
        if len(nchunks) != 1:
            raise ConversionError(f"{path}: pipeline stages hold different numbers of model chunks")
        for v in range(nchunks.pop()):
            for p in range(self.pp):
                key, count = per_stage[p][v]
                self._chunks.append((p, key, count))
        self._layer_index = []  # global layer -> (pp, model key, local index)
        for p, key, count in self._chunks:
            for i in range(count):
                self._layer_index.append((p, key, i))
        self.num_layers_found = len(self._layer_index)

    def _load(self, t: int, p: int) -> dict:
        path = self._files[(t, p)]
        return safe_load(path, mmap=True, what=f"checkpoint shard {path}")

    def _model(self, sd: dict, key: str) -> dict:
        return sd[key]

    def layer_source(self, layer: int, roles: Sequence[str]):
        tensors = self.read_layer(layer, roles)
        return _RowSource(lambda role, a, b: tensors[role][a:b])

    def vocab_block_rows(self, row_bytes: int) -> Optional[int]:
        return None  # the TP shards are concatenated once, then written whole

    def check_layer_kinds(self, post_ln_layers: int) -> None:
        for t in range(1):
            for p in range(self.pp):
                sd = self._load(t, p)
                for layer, (pp, key, local) in enumerate(self._layer_index):
                    if pp != p:
                        continue
                    prefix = f"decoder.layers.{local}."
                    names = [k[len(prefix):] for k in sd[key] if k.startswith(prefix)]
                    has_post = any(n in M.LEGACY_POST_LN_NAMES for n in names)
                    want_post = layer < post_ln_layers
                    if has_post != want_post:
                        raise ConversionError(
                            f"layer {layer + 1} is stored as a {'Post' if has_post else 'Pre'}-LN layer but the "
                            f"Mix-LN settings (P={post_ln_layers}) make it {'Post' if want_post else 'Pre'}-LN"
                        )
                del sd

    def read_layer(self, layer: int, roles: Iterable[str]) -> Dict[str, torch.Tensor]:
        roles = list(roles)
        p, key, local = self._layer_index[layer]
        prefix = f"decoder.layers.{local}."
        shards: Dict[str, List[torch.Tensor]] = {r: [] for r in roles}
        for t in range(self.tp):
            sd = self._load(t, p)
            model = sd[key]
            found = {}
            for name, value in model.items():
                if not name.startswith(prefix):
                    continue
                rest = name[len(prefix):]
                if rest.endswith(M.LEGACY_IGNORED_SUFFIXES):
                    continue
                role = M.LEGACY_LAYER_NAMES.get(rest)
                if role is None:
                    hint = " (MoE)" if ("experts" in rest or "router" in rest) else ""
                    raise UnsupportedModelError(
                        f"{self._files[(t, p)]}: unsupported parameter {name}{hint}; a Llama layer has "
                        "qkv / proj / fc1 / fc2 linears and two norms"
                    )
                if role in found:
                    raise ConversionError(f"{self._files[(t, p)]}: layer {local} has two tensors for {role} "
                                          f"({found[role]} and {rest})")
                found[role] = rest
                if role in shards:
                    shards[role].append(value.detach().clone())
            missing = [r for r in roles if r not in found]
            if missing:
                raise ConversionError(
                    f"{self._files[(t, p)]}: layer {local} lacks {missing} (saved with add_bias_linear / "
                    "another model type?)"
                )
            del model, sd
        return {r: M.merge_tp_shards(r, shards[r]) for r in roles}

    def _stage_tensor(self, p: int, key_index: int, name: str, dim: Optional[int]) -> torch.Tensor:
        parts = []
        for t in range(self.tp if dim is not None else 1):
            sd = self._load(t, p)
            keys = sorted((k for k in sd if re.fullmatch(r"model\d*", k)), key=lambda k: int(k[5:] or 0))
            model = sd[keys[key_index]]
            if name not in model:
                raise ConversionError(f"{self._files[(t, p)]} has no {name}")
            parts.append(model[name].detach().clone())
            del model, sd
        return parts[0] if dim is None else torch.cat(parts, dim=dim)

    def read_vocab_rows(self, which: str, start: int, stop: int) -> torch.Tensor:
        if which == "embedding":
            full = self._stage_tensor(0, 0, M.TD_EMBEDDING, 0)
        else:
            full = self._stage_tensor(self.pp - 1, -1, M.TD_OUTPUT, 0)
        return full[start:stop].clone()

    def read_final_norm(self) -> torch.Tensor:
        return self._stage_tensor(self.pp - 1, -1, M.TD_FINAL_NORM, None)

    def model_tensor_bytes(self) -> int:
        total = 0
        for (t, p) in self._files:
            sd = self._load(t, p)
            for k in sd:
                if re.fullmatch(r"model\d*", k):
                    total += sum(v.numel() * v.element_size() for v in sd[k].values() if torch.is_tensor(v))
            del sd
        return total

    def check_shapes(self, shape: M.ModelShape) -> None:
        if self.num_layers_found != shape.num_layers:
            raise ConversionError(
                f"the checkpoint holds {self.num_layers_found} layers but its args say num_layers={shape.num_layers}"
            )


def _count_local_layers(model: dict) -> int:
    indices = set()
    for name in model:
        m = re.match(r"decoder\.layers\.(\d+)\.", name)
        if m:
            indices.add(int(m.group(1)))
    if indices and indices != set(range(len(indices))):
        raise ConversionError(f"non-contiguous local layer indices {sorted(indices)}")
    return len(indices)
