"""Hugging Face folder -> Megatron-LM checkpoint that Megatron-LM (and `mixln-megatron pretrain`)
loads to continue training or fine-tune.

Input: a Mix-LN / LNS folder (model_type mixln_llama, e.g. from `convert to-hf`) or a stock Llama
folder (model_type llama). A stock folder becomes a Pre-LN model (P = 0) unless the user asks
for Mix-LN explicitly (--post-ln-layers / --mixln-alpha): then layers 1..P become Post-LN layers
with N1 := post_attention_layernorm and N2 := input_layernorm of the Llama weights (a different
network; meant as an initialisation for Mix-LN fine-tuning, and announced as such).

Output (written into a temporary directory renamed to --save at the end):
  latest_checkpointed_iteration.txt   "release"
  release/                            Megatron-LM's name for a converted (not trained) checkpoint:
                                      loaded as iteration 0, without optimizer / RNG state
                                      (there is none), so training continues with a fresh
                                      optimizer and its first save is iter_<N>.
  torch_dist (default): release/{.metadata, __0_0.distcp, metadata.json} with the common state
      (args, iteration 0, content metadata with the Mix-LN record) inside, and the Mix-LN
      settings record `decoder.layers.mixln_settings` when P > 0 or scheme != mixln.
      torch_dist is layout-free: Megatron reshards it to any TP / PP / VPP at load time. --tp
      only decides the vocabulary padding (make_vocab_size_divisible_by x TP, which the loading
      run must reproduce) and, like --pp, is recorded in the args.
  torch (legacy, --ckpt-format torch): release/mp_rank_TT[_PPP]/model_optim_rng.pt, one file per
      TP x PP rank; the loading run must use exactly this --tp / --pp (Megatron checks both), and
      the module names follow --transformer-impl (TE fused-norm names or local names).

The args carried (argparse.Namespace, as Megatron-LM saves them): the model shape and flavour
(RMSNorm, SwiGLU, RoPE base / scaling, biases, tied embeddings, GQA), vocab_size /
padded_vocab_size / make_vocab_size_divisible_by, the tokenizer (HuggingFaceTokenizer on the HF
folder when it holds tokenizer files), params dtype, TP / PP, the --spec of the Mix-LN layer when
the model is not stock, and the integer P as mixln_post_ln_layers (alpha is only informational).

Memory: torch_dist output is written chunk by chunk (one layer's tensor of one key at a time,
vocabulary in row blocks) straight from the safetensors files; the legacy format holds one rank's
file (1 / (TP x PP) of the model) at a time, since each is a single torch.save.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import time
import warnings
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import ConversionError, UnsupportedModelError, prepare_output, staged_output_dir
from . import mapping as M
from .megatron_reader import PIECE_BYTES, TRACKER

RELEASE = "release"
CONTENT_METADATA_BASE = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


# --------------------------------------------------------------------------- HF folder reader
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
        try:
            return torch.load(full, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001
            raise ConversionError(f"weight file {full} is unreadable: {e}") from None

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


# --------------------------------------------------------------------------- settings
def resolve_settings(config: dict, num_layers: int, post_ln_layers=None, alpha=None, scheme=None) -> Tuple[dict, str, bool]:
    """(placement record, description, whether a stock folder is turned into Mix-LN)."""
    from ..model.placement import MixLNConfigError, MixLNSettings, Placement, resolve_placement

    explicit = post_ln_layers is not None or alpha is not None or scheme is not None
    try:
        asked = resolve_placement(num_layers, MixLNSettings(alpha=alpha, post_ln_layers=post_ln_layers,
                                                            scheme=scheme)) if (
            post_ln_layers is not None or alpha is not None) else None
    except MixLNConfigError as e:
        raise ConversionError(str(e)) from None
    if config.get("model_type") == "mixln_llama":
        try:
            folder = Placement(num_layers, int(config.get("post_ln_layers", 0)), config.get("mixln_scheme", "mixln"),
                               config.get("mixln_alpha"))
        except MixLNConfigError as e:
            raise ConversionError(f"invalid Mix-LN fields in config.json: {e}") from None
        if explicit:
            want_p = asked.post_ln_layers if asked is not None else folder.post_ln_layers
            want_scheme = scheme or folder.scheme
            if (want_p, want_scheme) != (folder.post_ln_layers, folder.scheme):
                raise ConversionError(
                    f"the folder is a Mix-LN model with scheme={folder.scheme} P={folder.post_ln_layers}; the "
                    f"settings given (scheme={want_scheme} P={want_p}) would change the network. Drop them."
                )
        return folder.record(), f"config.json (scheme={folder.scheme}, P={folder.post_ln_layers})", False
    # stock Llama
    if not explicit:
        return Placement(num_layers, 0, "mixln").record(), "stock Llama folder: Pre-LN, P = 0", False
    try:
        p = asked.post_ln_layers if asked is not None else 0
        placement = Placement(num_layers, p, scheme or "mixln", asked.alpha if asked is not None else None)
    except MixLNConfigError as e:
        raise ConversionError(str(e)) from None
    changed = placement.post_ln_layers > 0 or placement.scheme != "mixln"
    return placement.record(), (f"stock Llama folder converted as scheme={placement.scheme} "
                                f"P={placement.post_ln_layers} (asked explicitly)"), changed


# --------------------------------------------------------------------------- role production
class _Source:
    """Megatron role tensors (global layout) computed from the HF tensors, on demand."""

    def __init__(self, hf: HFCheckpoint, shape: M.ModelShape, post_ln: int, stock_source: bool, dtype):
        self.hf, self.shape, self.post_ln, self.stock_source, self.dtype = hf, shape, post_ln, stock_source, dtype

    def _get(self, name, start=None, stop=None):
        return self.hf.get(name, start, stop).to(self.dtype)

    def role(self, layer: int, role: str) -> torch.Tensor:
        """The whole tensor of `role` in layer `layer` (Megatron's global layout)."""
        if role.startswith("fc1."):
            f = self.shape.ffn_hidden_size
            return torch.cat([self.role_rows(layer, role, 0, f), self.role_rows(layer, role, f, 2 * f)], dim=0)
        return self.role_rows(layer, role, 0, self.shape.megatron_layer_shapes()[role][0])

    def role_rows(self, layer: int, role: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of that tensor, reading only the HF rows they come from.

        QKV ranges must be whole query groups and fc1 ranges must lie inside one half
        (mapping.megatron_row_chunks makes them so).
        """
        p = M.hf_layer_prefix(layer)
        kind = role.split(".")[1] if "." in role else None
        if role.startswith("qkv."):
            d, qpg = self.shape.kv_channels, self.shape.q_per_group
            group = (qpg + 2) * d
            if start % group or stop % group:
                raise ValueError(f"QKV rows {start}:{stop} are not whole query groups")
            g0, g1 = start // group, stop // group
            q = self._get(f"{p}self_attn.q_proj.{kind}", g0 * qpg * d, g1 * qpg * d)
            k = self._get(f"{p}self_attn.k_proj.{kind}", g0 * d, g1 * d)
            v = self._get(f"{p}self_attn.v_proj.{kind}", g0 * d, g1 * d)
            part = dataclasses.replace(self.shape, num_attention_heads=(g1 - g0) * qpg, num_query_groups=g1 - g0)
            return M.merge_qkv(q, k, v, part)
        if role.startswith("fc1."):
            f = self.shape.ffn_hidden_size
            if start < f < stop:
                raise ValueError(f"fc1 rows {start}:{stop} straddle gate and up")
            if start < f:
                return self._get(f"{p}mlp.gate_proj.{kind}", start, stop)
            return self._get(f"{p}mlp.up_proj.{kind}", start - f, stop - f)
        if role.startswith("proj."):
            name = f"{p}self_attn.o_proj.{kind}"
        elif role.startswith("fc2."):
            name = f"{p}mlp.down_proj.{kind}"
        else:
            name = p + self.norm_source(layer)[role]
        return self._get(name, start, stop)

    def norm_source(self, layer: int) -> Dict[str, str]:
        is_post = layer < self.post_ln
        if is_post and self.stock_source:
            return {"norm_a": "input_layernorm.weight", "norm_b": "post_attention_layernorm.weight"}
        return M.hf_norm_names(is_post)

    def vocab_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the padded vocabulary: real rows from HF, zeros past the true vocab."""
        v = self.shape.vocab_size
        out = torch.zeros(stop - start, self.shape.hidden_size, dtype=self.dtype)
        if start < v:
            out[: min(stop, v) - start] = self._get(name, start, min(stop, v))
        return out

    def expected_names(self) -> Dict[str, tuple]:
        s, out = self.shape, {}
        out[M.HF_EMBEDDING] = (s.vocab_size, s.hidden_size)
        out[M.HF_FINAL_NORM] = (s.hidden_size,)
        if not s.tie_embeddings:
            out[M.HF_OUTPUT] = (s.vocab_size, s.hidden_size)
        for layer in range(s.num_layers):
            p = M.hf_layer_prefix(layer)
            for role in s.roles():
                if role in ("norm_a", "norm_b"):
                    out[p + self.norm_source(layer)[role]] = (s.hidden_size,)
                else:
                    for name, shp in s.hf_role_tensors(role, False):
                        out[p + name] = shp
        return out

    def check(self) -> None:
        problems = []
        expected = self.expected_names()
        ignored = [n for n in self.hf.weight_map if n not in expected and not n.endswith("rotary_emb.inv_freq")
                   and not (n == M.HF_OUTPUT and self.shape.tie_embeddings)]
        if ignored:
            print(f"[mixln-megatron convert] WARNING: {len(ignored)} tensor(s) of {self.hf.path} have no place in "
                  f"the Megatron model and are not converted: {', '.join(sorted(ignored)[:6])}"
                  + (" ..." if len(ignored) > 6 else ""), flush=True)
        for name, want in expected.items():
            if not self.hf.has(name):
                problems.append(f"missing {name}")
            elif tuple(self.hf.shape(name)) != tuple(want):
                problems.append(f"{name} has shape {tuple(self.hf.shape(name))}, config.json implies {tuple(want)}")
            if len(problems) > 8:
                break
        if problems:
            raise ConversionError(f"{self.hf.path} does not match its config.json: " + "; ".join(problems))


# --------------------------------------------------------------------------- torch_dist writer
def _lazy_planner_class():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class LazySavePlanner(DefaultSavePlanner):
        """Save planner whose tensors are produced only when the storage writer asks for them."""

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


def _torch_save_bytes(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def write_torch_dist(out_dir: str, src: _Source, shape: M.ModelShape, padded_vocab: int, record: dict,
                     common: dict, stock: bool, bar) -> None:
    """A megatron-core torch_dist checkpoint in `out_dir`, one chunk in memory at a time."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    dtype = src.dtype
    items: List = []
    producers: Dict[tuple, Callable] = {}

    def tensor(key, global_shape, offsets, sizes, produce):
        items.append(WriteItem(
            index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                properties=TensorProperties(dtype=dtype), size=torch.Size(global_shape)),
        ))
        producers[(key, tuple(offsets))] = lambda: produce().contiguous()

    def obj(unique_key, value):
        items.append(WriteItem(index=MetadataIndex(unique_key), type=WriteItemType.BYTE_IO))
        producers[(unique_key, None)] = lambda: _torch_save_bytes([value])

    h, L = shape.hidden_size, shape.num_layers
    block = max(1, PIECE_BYTES // (h * dtype.itemsize))

    def vocab(key, hf_name):
        for start in range(0, padded_vocab, block):
            stop = min(padded_vocab, start + block)
            tensor(key, (padded_vocab, h), (start, 0), (stop - start, h),
                   lambda a=start, b=stop: src.vocab_rows(hf_name, a, b))

    vocab(M.TD_EMBEDDING, M.HF_EMBEDDING)
    layer_shapes = shape.megatron_layer_shapes()
    for layer in range(L):
        for role in shape.roles():
            shp = layer_shapes[role]
            row_bytes = dtype.itemsize * (shp[1] if len(shp) > 1 else 1)
            # Chunks of <= PIECE_BYTES: megatron-core reshards them at load like any other layout.
            for a, b in M.megatron_row_chunks(role, shape, row_bytes, PIECE_BYTES):
                tensor(M.TD_LAYER_PREFIX + M.td_layer_name(role, not stock), (L, *shp), (layer, a) + (0,) * (len(shp) - 1),
                       (1, b - a, *shp[1:]), lambda l=layer, r=role, a=a, b=b: src.role_rows(l, r, a, b).unsqueeze(0))
        for module in M.EXTRA_STATE_MODULES:
            obj(f"{M.TD_LAYER_PREFIX}{module}._extra_state/shard_{layer}_{L}", None)
    tensor(M.TD_FINAL_NORM, (h,), (0,), (h,), lambda: src._get(M.HF_FINAL_NORM))
    obj("decoder.final_layernorm._extra_state/shard_0_1", None)
    if not shape.tie_embeddings:
        vocab(M.TD_OUTPUT, M.HF_OUTPUT)
    if not stock:
        obj(f"{M.TD_SETTINGS_RECORD}/shard_0_1", record)
    obj("common_state/shard_0_1", common)

    def on_write(data):
        if isinstance(data, torch.Tensor):
            bar.update(data.numel() * data.element_size())

    planner = _lazy_planner_class()(items, producers, on_write)
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
                raise inner from None  # e.g. an unreadable HF shard: the message says which
        raise ConversionError(f"writing the torch_dist checkpoint failed: {e}") from None
    with open(os.path.join(out_dir, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)


# --------------------------------------------------------------------------- legacy writer
def write_legacy(out_dir: str, src: _Source, shape: M.ModelShape, padded_vocab: int, record: dict, common: dict,
                 stock: bool, tp: int, pp: int, transformer_impl: str, bar) -> None:
    """release/mp_rank_TT[_PPP]/model_optim_rng.pt files (one rank's state dict in memory at a time)."""
    L = shape.num_layers
    per_stage = L // pp
    for p in range(pp):
        layers = range(p * per_stage, (p + 1) * per_stage)
        for t in range(tp):
            model = OrderedDict()
            rows = padded_vocab // tp
            if p == 0:
                model[M.TD_EMBEDDING] = src.vocab_rows(M.HF_EMBEDDING, t * rows, (t + 1) * rows)
            for local, layer in enumerate(layers):
                is_post = layer < src.post_ln
                names = M.LEGACY_WRITE_NAMES[(transformer_impl, is_post)]
                prefix = f"decoder.layers.{local}."
                for role in shape.roles():
                    full = src.role(layer, role)
                    model[prefix + names.get(role, M.LAYER_ROLE_NAMES[role])] = M.split_tp_shard(role, full, tp, t)
                    del full
                for module in M.EXTRA_STATE_MODULES:
                    model[f"{prefix}{module}._extra_state"] = None
                if layer == 0 and not stock:
                    model[prefix + "mixln_settings"] = dict(record)
            if p == pp - 1:
                model[M.TD_FINAL_NORM] = src._get(M.HF_FINAL_NORM)
                if not shape.tie_embeddings:
                    model[M.TD_OUTPUT] = src.vocab_rows(M.HF_OUTPUT, t * rows, (t + 1) * rows)
                elif pp > 1:
                    # Tied weights: the last stage keeps its own copy of the embedding for the output.
                    model[M.TD_OUTPUT] = src.vocab_rows(M.HF_EMBEDDING, t * rows, (t + 1) * rows)
                model["output_layer._extra_state"] = None
            state = {"args": common["args"], "checkpoint_version": 3.0, "iteration": 0, "model": model,
                     "num_floating_point_operations_so_far": 0}
            name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
            os.makedirs(os.path.join(out_dir, name))
            torch.save(state, os.path.join(out_dir, name, "model_optim_rng.pt"))
            bar.update(sum(v.numel() * v.element_size() for v in model.values() if torch.is_tensor(v)))
            del model, state


# --------------------------------------------------------------------------- conversion
def convert_from_hf(
    load: str,
    save: str,
    *,
    tp: int = 1,
    pp: int = 1,
    ckpt_format: str = "torch_dist",
    dtype: str = "auto",
    transformer_impl: str = "transformer_engine",
    make_vocab_size_divisible_by: int = 128,
    post_ln_layers: Optional[int] = None,
    alpha=None,
    scheme: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Convert the HF folder `load` into a Megatron-LM checkpoint directory `save` (see module doc)."""
    t0 = time.time()
    from ..safe_output import MEGATRON_FOLDER

    prepare_output(load, save, MEGATRON_FOLDER, overwrite)  # before any work: never lose the input or a foreign folder
    if ckpt_format not in ("torch_dist", "torch"):
        raise ConversionError(f"--ckpt-format must be torch_dist or torch, got {ckpt_format!r}")
    if transformer_impl not in ("transformer_engine", "local"):
        raise ConversionError(f"--transformer-impl must be transformer_engine or local, got {transformer_impl!r}")
    if tp < 1 or pp < 1:
        raise ConversionError("--tp and --pp must be >= 1")
    hf = HFCheckpoint(load)
    shape = M.shape_from_hf_config(hf.config)
    M.check_tp_divisibility(shape, tp)
    if ckpt_format == "torch" and shape.num_layers % pp:
        raise ConversionError(
            f"--pp {pp} does not divide num_layers {shape.num_layers}; legacy files need equal stages "
            "(torch_dist has no such constraint)"
        )
    if pp > shape.num_layers:
        raise ConversionError(f"--pp {pp} exceeds num_layers {shape.num_layers}")
    record, settings_source, changed = resolve_settings(hf.config, shape.num_layers, post_ln_layers, alpha, scheme)
    post_ln = int(record["post_ln_layers"])
    stock = post_ln == 0 and record["scheme"] == "mixln"
    if changed:
        print(f"[mixln-megatron convert] WARNING: {settings_source}: the Post-LN layers reuse the Llama norm "
              "weights (N1 := post_attention_layernorm, N2 := input_layernorm); this is a different network, "
              "meant as an initialisation for Mix-LN training.", flush=True)
    if dtype in (None, "auto"):
        out_dtype = hf.dtype(M.HF_EMBEDDING)
    elif dtype in DTYPES:
        out_dtype = DTYPES[dtype]
    else:
        raise ConversionError(f"--dtype must be auto, bfloat16, float16 or float32, got {dtype!r}")
    src = _Source(hf, shape, post_ln, hf.config.get("model_type") == "llama", out_dtype)
    src.check()
    padded = M.padded_vocab_size(shape.vocab_size, make_vocab_size_divisible_by, tp)
    if tokenizer_model is None and hf.tokenizer_files():
        tokenizer_model = hf.path
    ns = M.megatron_args_namespace(
        shape, tp=tp, pp=pp, ckpt_format=ckpt_format, params_dtype=out_dtype, padded_vocab=padded,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, placement_record=record,
        transformer_impl=transformer_impl, tokenizer_type="HuggingFaceTokenizer" if tokenizer_model else None,
        tokenizer_model=tokenizer_model, source=hf.path,
    )
    common = {"args": ns, "checkpoint_version": 3.0, "iteration": 0, "num_floating_point_operations_so_far": 0,
              "content_metadata": {**CONTENT_METADATA_BASE, "mixln": dict(record)}}
    total = _total_bytes(shape, padded, out_dtype, ckpt_format, pp)
    with staged_output_dir(save, overwrite, MEGATRON_FOLDER) as tmp:
        release = os.path.join(tmp, RELEASE)
        os.makedirs(release)
        from .to_hf import _progress

        bar = _progress(progress, total, f"from-hf {os.path.basename(os.path.abspath(save))}")
        try:
            if ckpt_format == "torch_dist":
                write_torch_dist(release, src, shape, padded, record, common, stock, bar)
            else:
                write_legacy(release, src, shape, padded, record, common, stock, tp, pp, transformer_impl, bar)
        finally:
            bar.close()
        with open(os.path.join(tmp, TRACKER), "w") as f:
            f.write(RELEASE)
    return {
        "format": ckpt_format, "save": os.path.abspath(save), "iteration": RELEASE, "tp": tp, "pp": pp,
        "post_ln_layers": post_ln, "scheme": record["scheme"], "settings_source": settings_source,
        "vocab_size": shape.vocab_size, "padded_vocab_size": padded, "dtype": str(out_dtype).replace("torch.", ""),
        "transformer_impl": transformer_impl, "launch_flags": M.launch_flags(ns),
        "seconds": round(time.time() - t0, 2),
    }


def _total_bytes(shape: M.ModelShape, padded: int, dtype, ckpt_format: str, pp: int) -> int:
    n = padded * shape.hidden_size * (1 if shape.tie_embeddings else 2) + shape.hidden_size
    if shape.tie_embeddings and ckpt_format == "torch" and pp > 1:
        n += padded * shape.hidden_size
    for shp in shape.megatron_layer_shapes().values():
        k = 1
        for s in shp:
            k *= s
        n += k * shape.num_layers
    return n * dtype.itemsize
