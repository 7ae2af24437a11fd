"""torch_dist checkpoints read without process groups and without megatron.

<iter>/.metadata + *.distcp + metadata.json (megatron-core dist_checkpointing over
torch.distributed.checkpoint). Per-layer tensors are stacked under one key with a leading layer
axis ([L, ...]); every rank saved its own chunks (one per layer and TP slice). Reads ask for a
sub-box (one layer of one key, or a block of vocabulary rows) and touch only the chunks that
intersect it. Common state (args, iteration, content metadata) lives in common.pt (older
megatron-core) or in the files as the object `common_state` (0.19+).

Reading a chunk: the fast path (zip_chunk) reads exactly the bytes of the requested rows; any
chunk it does not recognise goes through torch.distributed.checkpoint's FileSystemReader instead
(which loads whole chunks). Both give identical tensors. The .metadata is read by dcp_metadata.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch

from . import ConversionError, UnsupportedModelError
from . import mapping as M
from . import zip_chunk
from .dcp_metadata import MetadataUnpickler, TensorMeta, light_metadata
from .reader_base import ReaderBase, RowSource
from .safe_unpickle import safe_load
from .shape import ModelShape

COMMON_PT = "common.pt"
COMMON_STATE_KEY = "common_state/shard_0_1"
PIECE_BYTES = 8 << 20  # largest piece read / converted / written at once (torch_dist)


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


class TorchDistCheckpoint(ReaderBase):
    format = "torch_dist"

    def __init__(self, path: str, fast_reads: bool = True):
        self.path = path
        self.fast_reads = fast_reads
        self._dcp_state = None
        meta_path = os.path.join(path, ".metadata")
        try:
            with open(meta_path, "rb") as f:
                md = MetadataUnpickler(f).load()
            self._sd_md, self._storage = light_metadata(md)
        except (pickle.UnpicklingError, AttributeError, EOFError, TypeError, ValueError, KeyError, ImportError):
            # Anything unexpected: torch's own reader (imports torch.distributed.checkpoint).
            reader, md = self._dcp()
            self._sd_md, self._storage = light_metadata(md)
        except OSError as e:
            raise ConversionError(f"{meta_path} is unreadable: {e}") from None
        self._layouts: Dict[Tuple[str, int], Optional[zip_chunk.ChunkLayout]] = {}
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
        if not isinstance(md, TensorMeta):
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

    def _chunk_layout(self, key, c_off, c_size) -> Optional[zip_chunk.ChunkLayout]:
        info = self._storage.get((key, tuple(c_off)))
        if info is None:
            raise ConversionError(f"{key}: chunk at {tuple(c_off)} has no storage entry in .metadata")
        cache_key = (info.relative_path, info.offset)
        if cache_key not in self._layouts:
            layout = None
            if not info.transformed:
                path = os.path.join(self.path, info.relative_path)
                try:
                    layout = zip_chunk.locate(path, info.offset, info.length, c_size)
                except OSError as e:
                    raise ConversionError(f"cannot read checkpoint shard {path}: {e}") from None
            self._layouts[cache_key] = layout
        return self._layouts[cache_key]

    def _read_chunk_fast(self, key, c_off, c_size, lo, hi, offsets, dest) -> bool:
        layout = self._chunk_layout(key, c_off, c_size)
        if layout is None or layout.dtype != dest.dtype or not layout.shape:
            return False
        zip_chunk.read_region(layout, key, c_off, lo, hi, offsets, dest)
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
            if isinstance(md, TensorMeta) and (key.startswith("decoder.") or key.startswith("embedding.")
                                                or key.startswith("output_layer.")):
                n = 1
                for s in md.size:
                    n *= s
                total += n * md.dtype.itemsize
        return total

    def check_shapes(self, shape: ModelShape) -> None:
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
