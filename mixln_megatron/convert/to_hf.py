"""Megatron-LM checkpoint -> Hugging Face folder, streamed tensor by tensor (what is written:
docs/conversion.md).

config.json names a stock class (LlamaForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM) only
where it is the same network (hf.export_code decides), else the Mix-LN class with its code files;
a Mix-LN HybridModel exports as the GPT model its blocks are. The model shape and settings come
from the checkpoint only (the true vocabulary size aside). One way through: the facts are read once
(convert.inspect.read_checkpoint_facts), the roles mapped once (convert.mapping.map_roles), then
everything is written from those two objects (tests/test_conversion_walk.py). Memory: each tensor
is read, converted and appended to its shard before the next; the shard headers are written first
from the known shapes, so no shard is held in memory.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Iterator, List, Optional, Tuple

import torch

from packaging.version import Version

from ..errors import ConversionError, UnsupportedModelError
from ..hf.export_code import export_config_fields, moe_export_config_fields, placement_export_fields, write_model_code
from ..model import moe_fields
from ..progress import bar as progress_bar
from ..safe_output import HF_FOLDER, prepare_output, staged_dir
from . import mapping as M
from .inspect import TOKENIZER_FILES, CheckpointInfo, read_checkpoint_facts
from .mapping import DTYPES
from .shape import ModelShape, MoEShape

TRANSFORMERS_RANGE = ("4.56", "6")  # >= 4.56, < 6, as setup.py's extras require
_ST_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def transformers_version() -> str:
    try:
        return version("transformers")
    except PackageNotFoundError:
        raise ConversionError("transformers is not installed (pip install 'mixln-megatron[hf]')") from None


def check_transformers_version() -> str:
    """The installed transformers must be in TRANSFORMERS_RANGE (checked without importing it)."""
    text = transformers_version()
    low, high = TRANSFORMERS_RANGE
    if not (Version(low) <= Version(text) < Version(high)):
        raise ConversionError(
            f"transformers {text} is outside the supported range >={low},<{high} "
            "(the exported config and model code are written for it)"
        )
    return text


def parse_size(text) -> int:
    if isinstance(text, int):
        return text
    t = str(text).strip().upper()
    for suffix, mult in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10**9), ("MB", 10**6),
                         ("KB", 10**3), ("B", 1)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


# --------------------------------------------------------------------------- safetensors writer
class StreamingSafetensorsWriter:
    """Writes safetensors shards whose tensors arrive one after another (in pieces of rows if need
    be), in plan order: each shard's header is written first from the plan, so no shard is assembled
    in memory."""

    def __init__(self, out_dir: str, plan: List[Tuple[str, Tuple[int, ...], torch.dtype]], max_shard_bytes: int):
        self.out_dir = out_dir
        shards: List[list] = [[]]
        size = 0
        for name, shape, dtype in plan:
            nbytes = math.prod(shape) * dtype.itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(shape), dtype, nbytes))
            size += nbytes
        n = len(shards)
        self.files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.shards = shards
        self.weight_map = {name: self.files[i] for i, shard in enumerate(shards) for name, *_ in shard}
        self.total_bytes = sum(nb for shard in shards for *_, nb in shard)
        self._shard = -1
        self._pos = 0  # index in the current shard
        self._done = 0  # bytes of the current tensor written
        self._f = None
        self._next_shard()

    def _next_shard(self):
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())  # durable before the output directory is renamed into place
            self._f.close()
            self._f = None
        self._shard += 1
        self._pos = 0
        self._done = 0
        if self._shard >= len(self.shards):
            return
        header = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype, nbytes in self.shards[self._shard]:
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._f = open(os.path.join(self.out_dir, self.files[self._shard]), "wb")
        self._f.write(len(raw).to_bytes(8, "little"))
        self._f.write(raw)

    @property
    def expected(self):
        if self._shard >= len(self.shards):
            return None
        return self.shards[self._shard][self._pos]

    def write(self, name: str, tensor: torch.Tensor) -> int:
        """Append `tensor` (the whole tensor, or its next block of rows) to the tensor `name`."""
        exp = self.expected
        if exp is None or exp[0] != name:
            raise RuntimeError(f"safetensors writer expected {exp[0] if exp else 'nothing'}, got {name}")
        _, shape, dtype, nbytes = exp
        if tensor.dtype != dtype:
            raise RuntimeError(f"{name}: dtype {tensor.dtype}, planned {dtype}")
        if tuple(tensor.shape[1:]) != tuple(shape[1:]) and tuple(tensor.shape) != tuple(shape):
            raise RuntimeError(f"{name}: shape {tuple(tensor.shape)} does not fit planned {shape}")
        data = tensor.detach().contiguous()
        piece = data.numel() * data.element_size()
        if self._done + piece > nbytes:
            raise RuntimeError(f"{name}: more data than planned ({self._done + piece} > {nbytes})")
        if piece:
            self._f.write(memoryview(data.view(-1).view(torch.uint8).numpy()))
        self._done += piece
        if self._done == nbytes:
            self._pos += 1
            self._done = 0
            if self._pos == len(self.shards[self._shard]):
                self._next_shard()
        return piece

    def close(self) -> None:
        if self.expected is not None:
            raise RuntimeError(f"safetensors writer closed before {self.expected[0]} was written")
        _write_json(os.path.join(self.out_dir, "model.safetensors.index.json"),
                    {"metadata": {"total_size": self.total_bytes}, "weight_map": self.weight_map})

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


# --------------------------------------------------------------------------- config files
def hf_config_dict(shape: ModelShape, post_ln: int, scheme: str, alpha, dtype_name: str, token_ids: dict,
                   layer_kinds=None, deepnorm_alpha=None, deepnorm_beta=None) -> dict:
    """The one builder of an export's config.json, written without importing transformers: the
    LlamaConfig fields of the shape, the architecture fields of hf.export_code, and the rope settings
    in both transformers 5 (rope_parameters) and 4 spellings."""
    cfg = {
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.ffn_hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_query_groups,
        "head_dim": shape.kv_channels,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.norm_epsilon,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "attention_bias": shape.add_bias_linear,
        "attention_dropout": 0.0,
        "mlp_bias": shape.add_bias_linear,
        "tie_word_embeddings": shape.tie_embeddings,
        "bos_token_id": token_ids.get("bos_token_id"),
        "eos_token_id": token_ids.get("eos_token_id"),
        "pad_token_id": token_ids.get("pad_token_id"),
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
        "transformers_version": transformers_version(),
    }
    rope = {"rope_type": "default", "rope_theta": shape.rotary_base}
    if shape.rope_scaling is not None:
        rope.update(shape.rope_scaling)
    cfg["rope_parameters"] = rope
    cfg.update(v4_rope_keys(shape))
    try:
        if shape.moe is None:
            cfg.update(export_config_fields(int(post_ln), scheme, alpha, layer_kinds, deepnorm_alpha, deepnorm_beta,
                                            shape.forward_fields()))
        else:  # Mixtral, Qwen2-MoE or the Mix-LN MoE class: hf.export_code decides (stock_moe_model_type)
            cfg.update(moe_config_fields(shape, post_ln, scheme, alpha, layer_kinds, deepnorm_alpha, deepnorm_beta,
                                         dtype_name))
    except ValueError as e:  # MixLNConfigValueError: settings the HF model cannot express
        raise ConversionError(f"the checkpoint's Mix-LN settings cannot be exported: {e}") from None
    return cfg


def moe_config_fields(shape: ModelShape, post_ln, scheme, alpha, layer_kinds=None, deepnorm_alpha=None,
                      deepnorm_beta=None, dtype_name: Optional[str] = None) -> dict:
    """The MoE export's class keys and fields (hf.export_code.moe_export_config_fields) of this shape,
    exported in `dtype_name` (an fp32 router makes a stock class exact only in float32)."""
    moe = shape.moe
    # the top-k scaling factor needs no field: it is folded into the experts' fc2 (hf_layer_tensors)
    return moe_export_config_fields(
        int(post_ln), scheme, alpha, layer_kinds, deepnorm_alpha, deepnorm_beta, num_experts=moe.num_experts,
        num_experts_per_tok=moe.topk, moe_intermediate_size=moe.expert_ffn, norm_topk_prob=moe.norm_topk_prob,
        shared_expert_intermediate_size=moe.shared_ffn, shared_expert_gate=moe.shared_gate,
        mlp_only_layers=list(moe.dense_layers), attention_bias=shape.add_bias_linear, mlp_bias=shape.add_bias_linear,
        qkv_bias=shape.add_qkv_bias and not shape.add_bias_linear, num_hidden_layers=shape.num_layers,
        router_dtype=moe_fields.HF_ROUTER_DTYPE["fp32"] if moe.router_fp32 else None, dtype=dtype_name,
        forward=shape.forward_fields())


def v4_rope_keys(shape: ModelShape) -> dict:
    """rope_theta / rope_scaling as transformers 4.x reads them (5.x reads rope_parameters)."""
    out = {"rope_theta": shape.rotary_base, "rope_scaling": None}
    if shape.rope_scaling is not None:
        out["rope_scaling"] = dict(shape.rope_scaling)
        out["rope_scaling"].setdefault("type", shape.rope_scaling.get("rope_type"))
    return out


def generation_config_dict(token_ids: dict) -> dict:
    out = {"_from_model_config": True, "transformers_version": transformers_version()}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if token_ids.get(key) is not None:
            out[key] = token_ids[key]
    return out


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


# --------------------------------------------------------------------------- conversion
def convert_to_hf(
    load: str,
    save: str,
    *,
    iteration=None,
    dtype: str = "auto",
    tokenizer: Optional[str] = None,
    vocab_size: Optional[int] = None,
    overwrite: bool = False,
    max_shard_size="5GB",
    progress: bool = True,
) -> dict:
    """Convert the Megatron-LM checkpoint in `load` to a Hugging Face folder `save`; returns a summary dict."""
    t0 = time.time()
    prepare_output([load], save, HF_FOLDER, overwrite, ConversionError)  # before any work: never lose the input or a foreign folder
    tf_version = check_transformers_version()
    if dtype not in (None, "auto") and dtype not in DTYPES:
        raise ConversionError(f"--dtype must be auto, bfloat16, float16 or float32, got {dtype!r}")
    facts = read_checkpoint_facts(load, iteration, vocab_size=vocab_size, tokenizer=tokenizer)  # 1. read
    shape = facts.model_shape
    check_glu_interleave_saved_layout(shape.moe, facts.args)
    out_dtype = facts.reader.dtype if dtype in (None, "auto") else DTYPES[dtype]
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise UnsupportedModelError(f"the checkpoint's weights are {out_dtype}; pass --dtype bfloat16/float32")
    record = facts.record  # its fields, not CheckpointInfo's properties: the writing never calls back into inspect
    post_ln, scheme, alpha = int(record["post_ln_layers"]), record["scheme"], record.get("alpha")
    fields = placement_export_fields(facts.placement)  # layer_kinds only off Mix-LN's first-P layout
    dtype_name = str(out_dtype).replace("torch.", "")
    config = hf_config_dict(shape, post_ln, scheme, alpha, dtype_name, facts.token_ids,
                            fields["layer_kinds"], fields["deepnorm_alpha"], fields["deepnorm_beta"])
    model_type = config["model_type"]  # llama / mixln_llama; MoE: mixtral / qwen2_moe / mixln_moe
    stock = model_type in ("llama", "mixtral", "qwen2_moe")  # hf.export_code decided: no code files
    roles = M.map_roles(shape, facts.placement.kinds,  # 2. map (3. write below)
                        "mixtral" if model_type == "mixtral" else "qwen2_moe")
    plan = [(name, shp, out_dtype) for name, shp in roles.plan]
    with staged_dir(save, HF_FOLDER, overwrite, ConversionError) as tmp:
        _write_json(os.path.join(tmp, "config.json"), config)
        _write_json(os.path.join(tmp, "generation_config.json"), generation_config_dict(facts.token_ids))
        if not stock:
            write_model_code(tmp, model_type)
        writer = StreamingSafetensorsWriter(tmp, plan, parse_size(max_shard_size))
        bar = progress_bar(writer.total_bytes, f"to-hf {os.path.basename(os.path.abspath(save))}", enabled=progress)
        try:
            _write_tensors(facts, roles, out_dtype, writer, bar)
            writer.close()
        finally:
            writer.abort()
            bar.close()
        if tokenizer:
            _copy_tokenizer(tokenizer, tmp)
        files = sorted(f for f in os.listdir(tmp) if not f.startswith("."))  # not the owner file
    return {
        "format": facts.format, "checkpoint": facts.path, "iteration": facts.iteration,
        "model_kind": facts.model_kind, "hybrid_pattern": facts.hybrid_pattern,
        "post_ln_layers": post_ln, "scheme": scheme, "alpha": alpha, "layout": None if facts.placement.is_first_p else facts.placement.layout,
        "deepnorm_alpha": facts.placement.deepnorm_alpha, "settings_source": facts.record_source,
        "architecture": config["architectures"][0], "remote_code": not stock,
        "vocab_size": facts.vocab_size, "vocab_source": facts.vocab_source,
        "padded_vocab_size": facts.reader.padded_vocab_size,
        "dtype": dtype_name, "bytes": writer.total_bytes, "files": files, "save": os.path.abspath(save),
        "transformers": tf_version, "seconds": round(time.time() - t0, 2),
    }


def check_glu_interleave_saved_layout(moe: Optional[MoEShape], args) -> None:
    """GLU-interleaved fc1 rows are read as blocks of the whole tensor: refused unless saved as such
    (model.moe_fields.interleave_rank_problem)."""
    if moe is None:
        return
    problem = moe_fields.interleave_rank_problem(moe_fields.getter(args))
    if problem:
        raise UnsupportedModelError(f"this checkpoint's MoE layers cannot be converted: {problem}")


def _expert_of(role: str) -> int:
    """The routed expert a role belongs to, -1 for the layer's own."""
    expert = M.EXPERT_ROLE.fullmatch(role)
    return -1 if expert is None else int(expert.group(1))


def hf_tensors(facts: CheckpointInfo, roles: M.RoleMap) -> Iterator[Tuple[str, torch.Tensor]]:
    """(HF name, tensor or block of its rows) in the order of roles.plan: the reader's tensors, mapped."""
    reader, shape = facts.reader, facts.model_shape

    def vocab(which, name):
        for start, stop in reader.vocab_blocks(which, shape.vocab_size):
            yield name, reader.read_vocab_rows(which, start, stop)

    yield from vocab("embedding", roles.embedding[0])
    for layer, entries in enumerate(roles.layers):
        # one read for the layer's own tensors (a sandwich layer's has norm_c / _d), then one per
        # routed expert: an MoE layer is never in memory whole, only one expert of it
        for _, group in itertools.groupby(entries, key=lambda entry: _expert_of(entry[0])):
            group = list(group)
            tensors = reader.read_layer(layer, [role for role, _ in group])
            for role, names in group:
                for (name, _), tensor in zip(names, M.hf_layer_tensors(role, tensors.pop(role), shape)):
                    yield name, tensor
    norm = reader.read_final_norm()
    yield roles.final_norm[0], norm.float() + 1 if shape.layernorm_1p else norm
    if roles.output is not None:
        yield from vocab("output", roles.output[0])


def _write_tensors(facts: CheckpointInfo, roles: M.RoleMap, out_dtype, writer, bar) -> None:
    for name, tensor in hf_tensors(facts, roles):
        bar.update(writer.write(name, tensor.to(out_dtype)))
        del tensor


def _copy_tokenizer(src: str, dst: str) -> None:
    copied = 0
    for name in TOKENIZER_FILES:
        path = os.path.join(src, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(dst, name))
            copied += 1
    if not copied:
        raise ConversionError(f"--tokenizer-model {src}: no tokenizer files found ({', '.join(TOKENIZER_FILES[:4])}, ...)")
