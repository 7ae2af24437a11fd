"""An HF model folder read lazily: config.json, and tensors (or row ranges) on demand.

The folder is untrusted input: every file is opened through one `InputRoot` of the folder (no
absolute names, `..` or links out; regular files only, small ones within input_root.LIMITS), and
everything it says is validated where it is read, before any tensor data is touched, one
ConversionError naming the file: config.json a JSON object (its fields: convert.shape); the
index's `weight_map` plain shard names of the folder; every safetensors header checked against the
file size and tiling the data area exactly, as the safetensors library requires; a .bin through
the allow-listed unpickler, memory-mapped. All headers are read when the folder is opened, so a
missing, truncated or damaged shard is reported before any work.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from ..errors import ConversionError, UnsupportedModelError
from ..input_root import LIMITS, InputRoot
from ..safe_unpickle import load_torch

INDEXES = (("model.safetensors.index.json", "safetensors"), ("pytorch_model.bin.index.json", "bin"))
SINGLE_FILES = (("model.safetensors", "safetensors"), ("pytorch_model.bin", "bin"))
SHARD_SUFFIX = {"safetensors": ".safetensors", "bin": ".bin"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")

# Bits per element of every safetensors dtype (the library's own table).
SAFETENSORS_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
                    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64,
                    "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
LAYER_NAME = re.compile(r"^model\.layers\.(0|[1-9][0-9]{0,8})\.")


def _shown(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class HFCheckpoint:
    """Lazy access to the tensors of an HF folder (safetensors, or pytorch_model*.bin), confined to it."""

    def __init__(self, path: str):
        self.root = InputRoot(path, "Hugging Face folder")
        self.path = self.root.given
        if not self.root.exists("config.json"):
            raise ConversionError(f"not a Hugging Face model folder: {os.path.join(self.path, 'config.json')} "
                                  "does not exist")
        self.config: dict = self.root.read_json("config.json", "config.json", dict)
        self.weight_map: Dict[str, str] = {}
        self._headers: Dict[str, Dict[str, Tuple[tuple, str]]] = {}
        self.kind: Optional[str] = None
        for index_name, kind in INDEXES:
            if self.root.exists(index_name):
                self.kind = kind
                self.weight_map = self._read_index(index_name, kind)
                break
        else:
            for single, kind in SINGLE_FILES:
                if self.root.exists(single):
                    self.kind = kind
                    self.weight_map = {name: single for name in self._header(single)}
                    if not self.weight_map:
                        raise ConversionError(f"weight file {self._file(single)} holds no tensors")
                    break
        if not self.kind:
            raise ConversionError(
                f"{self.path} has no weights (model.safetensors[.index.json] or pytorch_model.bin[.index.json])"
            )
        shards = sorted(set(self.weight_map.values()))
        for f in shards:
            if not self.root.exists(f):
                raise ConversionError(f"weight shard {self._file(f)} is missing (named by the index)")
            self._header(f)  # confined, regular, validated: before any work
        for name, f in self.weight_map.items():
            if name not in self._headers[f]:
                raise ConversionError(f"{self._file(f)} has no tensor {_shown(name)} (the index names it there)")

    # ------------------------------------------------------------------ files
    def _file(self, rel: str) -> str:
        return os.path.join(self.path, rel)

    def _read_index(self, index_name: str, kind: str) -> Dict[str, str]:
        index = self.root.read_json(index_name, "index", dict)
        shown = self._file(index_name)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            got = "missing" if "weight_map" not in index else f"a JSON {_json_kind(weight_map)}"
            if isinstance(weight_map, dict):
                got = "empty"
            raise ConversionError(f"{shown}: `weight_map` must be a non-empty object of tensor name -> shard file, "
                                  f"got {got}")
        suffix = SHARD_SUFFIX[kind]
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard:
                raise ConversionError(f"{shown}: weight_map[{_shown(name)}] must be a shard file name, got "
                                      f"{_shown(shard)}")
            if "/" in shard or "\\" in shard or shard in (".", "..") or "\x00" in shard:
                raise ConversionError(f"{shown}: weight_map[{_shown(name)}] names {_shown(shard, 240)}; shards are plain "
                                      "file names inside the folder (no directories, no '..', no absolute paths)")
            if not shard.endswith(suffix):
                raise ConversionError(f"{shown}: weight_map[{_shown(name)}] names {_shown(shard)}, not a {suffix} "
                                      f"file (a {kind} index)")
            self.root.path(shard)  # a symlink out of the folder: refused here, by name
        return dict(weight_map)

    def _header(self, filename: str) -> Dict[str, Tuple[tuple, str]]:
        """name -> (shape, dtype string) of one weight file, without reading tensor data."""
        if filename not in self._headers:
            if filename.endswith(".safetensors"):
                self._headers[filename] = self._safetensors_header(filename)
            else:
                sd = self._load_bin(filename)
                self._headers[filename] = {k: (tuple(v.shape), str(v.dtype)) for k, v in sd.items()}
                del sd
        return self._headers[filename]

    def _safetensors_header(self, filename: str) -> Dict[str, Tuple[tuple, str]]:
        shown = self._file(filename)
        bad = f"weight shard {shown}"
        with self.root.open(filename) as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ConversionError(f"{bad} is unreadable: truncated ({size} bytes, not even the 8-byte header length)")
            n = int.from_bytes(f.read(8), "little")
            limit = LIMITS["safetensors header"]
            if n > limit:
                raise ConversionError(f"{bad}: its header length field says {n} bytes, more than safetensors allows "
                                      f"({limit}); a damaged or crafted file")
            if 8 + n > size:
                raise ConversionError(f"{bad} is truncated: its header length field says {n} bytes, the file holds "
                                      f"{size - 8} after it")
            raw = f.read(n)
        if len(raw) != n:
            raise ConversionError(f"{bad} is truncated (it changed while it was read)")
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ConversionError(f"{bad}: the header is not valid JSON: {' '.join(str(e).split())[:120]}") from None
        if not isinstance(header, dict):
            raise ConversionError(f"{bad}: the header is a JSON {_json_kind(header)}, expected a JSON object")
        data_size = size - 8 - n
        out: Dict[str, Tuple[tuple, str]] = {}
        spans = []
        for name, entry in header.items():
            if name == "__metadata__":
                if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                    raise ConversionError(f"{bad}: `__metadata__` must be an object of strings, got {_shown(entry)}")
                continue
            where = f"{bad}: tensor {_shown(name)}"
            if not isinstance(entry, dict):
                raise ConversionError(f"{where} is described by {_shown(entry)}, expected an object with dtype, "
                                      "shape and data_offsets")
            dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
            if not isinstance(dtype, str) or dtype not in SAFETENSORS_BITS:
                raise ConversionError(f"{where} has dtype {_shown(dtype)}, not a safetensors dtype")
            if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
                raise ConversionError(f"{where}: `shape` must be a list of non-negative integers, got {_shown(shape)}")
            if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
                    or not 0 <= offsets[0] <= offsets[1]):
                raise ConversionError(f"{where}: `data_offsets` must be [begin, end] integers with 0 <= begin <= "
                                      f"end, got {_shown(offsets)}")
            begin, end = offsets
            bits = 1
            for d in shape:
                bits *= d
            bits *= SAFETENSORS_BITS[dtype]
            if bits % 8 or end - begin != bits // 8:
                raise ConversionError(f"{where}: data_offsets {offsets} hold {end - begin} bytes, its dtype {dtype} "
                                      f"and shape {shape} need {bits / 8:g}")
            spans.append((begin, end, name))
            out[name] = (tuple(shape), dtype)
        spans.sort()
        at = 0
        for begin, end, name in spans:  # safetensors' own rule: the tensors tile the data area exactly
            if begin < at:
                raise ConversionError(f"{bad}: tensor {_shown(name)} (data_offsets [{begin}, {end}]) overlaps the "
                                      f"tensor before it (which ends at {at})")
            if begin > at:
                raise ConversionError(f"{bad}: tensor {_shown(name)} starts at {begin}, leaving a gap after {at}")
            at = end
        if at > data_size:
            raise ConversionError(f"{bad} is truncated ({size} bytes, needs {8 + n + at})")
        if at < data_size:
            raise ConversionError(f"{bad} holds {data_size - at} bytes after its last tensor (its header covers "
                                  f"{at} of {data_size})")
        return out

    def _load_bin(self, filename: str):
        real = self.root.check_file(filename)
        shown = self._file(filename)
        sd = load_torch(real, what=f"weight file {shown}", mmap=True)  # through the allow-list, like checkpoints
        if not isinstance(sd, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in sd.items()):
            raise ConversionError(f"weight file {shown} does not hold a dict of tensor name -> tensor")
        return sd

    # ------------------------------------------------------------------ tensors
    def has(self, name: str) -> bool:
        return name in self.weight_map

    def _where(self, name: str) -> str:
        if name not in self.weight_map:
            raise ConversionError(f"{self.path} has no tensor {_shown(name)}")
        return self.weight_map[name]

    def shape(self, name: str) -> tuple:
        return self._header(self._where(name))[name][0]

    def layer_indices(self) -> List[int]:
        """The decoder layers the weight names show (model.layers.<i>.), sorted."""
        found = set()
        for name in self.weight_map:
            m = LAYER_NAME.match(name)
            if m:
                found.add(int(m.group(1)))
        return sorted(found)

    def get(self, name: str, start: Optional[int] = None, stop: Optional[int] = None) -> torch.Tensor:
        """Tensor `name` (rows start:stop if given), read on demand; the file is closed afterwards."""
        filename = self._where(name)
        if self.kind == "safetensors":
            from safetensors import SafetensorError, safe_open  # optional

            real = self.root.check_file(filename)
            try:
                with safe_open(real, framework="pt") as f:
                    if start is None:
                        return f.get_tensor(name)
                    return f.get_slice(name)[start:stop].contiguous()
            except SafetensorError as e:  # changed since it was validated
                raise ConversionError(f"weight shard {self._file(filename)} is unreadable: "
                                      f"{' '.join(str(e).split())[:160]}") from None
        sd = self._load_bin(filename)
        t = sd[name] if start is None else sd[name][start:stop]
        t = t.clone()
        del sd
        return t

    def dtype(self, name: str) -> torch.dtype:
        if self.kind == "safetensors":
            code = self._header(self._where(name))[name][1]
            if code not in FLOAT_DTYPES:
                raise UnsupportedModelError(f"{name} is stored as {code}; convert a float32/bfloat16/float16 folder")
            return FLOAT_DTYPES[code]
        return self.get(name).dtype

    def check_listing(self) -> None:
        """Every entry of the folder stays inside it (no symlink out) and every non-directory is a
        regular file: for readers that open files of the folder by themselves (transformers'
        tokenizer loader), which cannot be confined file by file."""
        for name in self.root.listdir():
            real = self.root.path(name)
            if not os.path.isdir(real):
                self.root.check_file(name)

    def tokenizer_files(self) -> bool:
        """Whether the folder holds tokenizer files (each must be a regular file inside the folder:
        whoever loads the tokenizer later reads them)."""
        present = False
        for n in TOKENIZER_FILES:
            if self.root.exists(n):
                self.root.check_file(n)
                present = True
        return present


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_kind(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")
