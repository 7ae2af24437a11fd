"""An HF model folder read lazily: config.json, and tensors (or row ranges) on demand.

Safetensors headers are parsed without reading tensor data, so a missing or truncated shard is
reported before any work; pytorch_model*.bin folders are memory-mapped instead.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

import torch

from ..errors import ConversionError, UnsupportedModelError
from ..safe_unpickle import load_torch


class HFCheckpoint:
    """Lazy access to the tensors of an HF folder (safetensors, or pytorch_model*.bin)."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        cfg_path = os.path.join(self.path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ConversionError(f"not a Hugging Face model folder: {cfg_path} does not exist")
        try:
            self.config = json.load(open(cfg_path))
        except ValueError as e:
            raise ConversionError(f"{cfg_path} is not valid JSON: {e}") from None
        self.weight_map: Dict[str, str] = {}
        self._headers: Dict[str, Dict[str, Tuple[tuple, str]]] = {}
        self.kind = None
        for index_name, kind in (("model.safetensors.index.json", "safetensors"),
                                 ("pytorch_model.bin.index.json", "bin")):
            index = os.path.join(self.path, index_name)
            if os.path.isfile(index):
                self.weight_map = dict(json.load(open(index))["weight_map"])
                self.kind = kind
                break
        else:
            for single, kind in (("model.safetensors", "safetensors"), ("pytorch_model.bin", "bin")):
                if os.path.isfile(os.path.join(self.path, single)):
                    self.kind = kind
                    self.weight_map = {name: single for name in self._file_names(single)}
                    break
        if not self.kind:
            raise ConversionError(
                f"{self.path} has no weights (model.safetensors[.index.json] or pytorch_model.bin[.index.json])"
            )
        for f in sorted(set(self.weight_map.values())):
            if not os.path.isfile(os.path.join(self.path, f)):
                raise ConversionError(f"weight shard {os.path.join(self.path, f)} is missing (named by the index)")

    def _file_names(self, filename: str) -> List[str]:
        return list(self._header(filename))

    def _header(self, filename: str) -> Dict[str, Tuple[tuple, str]]:
        """name -> (shape, dtype string) of one weight file, without reading tensor data."""
        if filename not in self._headers:
            full = os.path.join(self.path, filename)
            if filename.endswith(".safetensors"):
                try:
                    with open(full, "rb") as f:
                        n = int.from_bytes(f.read(8), "little")
                        header = json.loads(f.read(n))
                    size = os.path.getsize(full)
                except (OSError, ValueError) as e:
                    raise ConversionError(f"weight shard {full} is unreadable: {e}") from None
                end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
                if size < 8 + n + end:
                    raise ConversionError(f"weight shard {full} is truncated ({size} bytes, needs {8 + n + end})")
                self._headers[filename] = {k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items()
                                           if k != "__metadata__"}
            else:
                sd = self._load_bin(filename)
                self._headers[filename] = {k: (tuple(v.shape), str(v.dtype)) for k, v in sd.items()}
                del sd
        return self._headers[filename]

    def _load_bin(self, filename: str):
        full = os.path.join(self.path, filename)
        return load_torch(full, what=f"weight file {full}", mmap=True)  # through the allow-list, like checkpoints

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def shape(self, name: str) -> tuple:
        return self._header(self.weight_map[name])[name][0]

    def get(self, name: str, start: Optional[int] = None, stop: Optional[int] = None) -> torch.Tensor:
        """Tensor `name` (rows start:stop if given), read on demand; the file is closed afterwards."""
        if name not in self.weight_map:
            raise ConversionError(f"{self.path} has no tensor {name}")
        filename = self.weight_map[name]
        if self.kind == "safetensors":
            from safetensors import safe_open

            with safe_open(os.path.join(self.path, filename), framework="pt") as f:
                if start is None:
                    return f.get_tensor(name)
                return f.get_slice(name)[start:stop].contiguous()
        sd = self._load_bin(filename)
        t = sd[name] if start is None else sd[name][start:stop]
        t = t.clone()
        del sd
        return t

    def dtype(self, name: str) -> torch.dtype:
        if self.kind == "safetensors":
            code = self._header(self.weight_map[name])[name][1]
            known = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
            if code not in known:
                raise UnsupportedModelError(f"{name} is stored as {code}; convert a float32/bfloat16/float16 folder")
            return known[code]
        return self.get(name).dtype

    def tokenizer_files(self) -> bool:
        return any(os.path.isfile(os.path.join(self.path, n))
                   for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
