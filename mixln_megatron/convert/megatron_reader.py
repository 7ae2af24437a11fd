"""Reading a Megatron-LM checkpoint, before and beside its tensors: what both formats share.

Locating the iteration directory and its format; the values saved beside the tensors (the Mix-LN
settings record, Megatron-LM's args, the common state), each checked for type and range before any
reader uses it; the model kind (GPTModel's stacked keys or a Mix-LN HybridModel's per-layer keys,
model.checkpoint's); the ReaderBase every reader offers, and LegacyCheckpoint, the legacy format's
reader (torch_dist's is convert.torch_dist_reader); the announcement before a large read. The
--load folder is untrusted input (mixln_megatron.input_root, docs/untrusted-input.md).

Legacy checkpoints: <iter>/mp_rank_TT[_PPP]/model_optim_rng.pt, one per TP x PP rank, layer-local
module names; each file is opened once, memory-mapped (its pickle checked once through the
allow-list, its tensors left on disk), so only the tensors being read are resident.
"""

from __future__ import annotations

import argparse
import numbers
import os
import re
import stat
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from ..errors import ConversionError, MixLNConfigError, MixLNError, UnsupportedModelError
from ..input_root import InputRoot
from ..model import hybrid_pattern
from ..model.checkpoint import FOREIGN_NAMES, GPT_FINAL_NORM, HYBRID_FINAL_NORM, HYBRID_LAYER
from ..model.layout import POST_LN_KINDS, SANDWICH, layout_text, leading_post_count, parse_layout
from ..progress import announce
from ..safe_unpickle import load_torch
from . import mapping as M
from .shape import ModelShape

TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
MAX_ITERATION = 10 ** 9  # iter_XXXXXXX: Megatron-LM pads to 7 digits; far beyond any real run
_ITERATION = re.compile(r"[0-9]{1,10}")


def iteration_name(iteration, source: str = "--ckpt-step") -> str:
    """`iter_0000010` / `release` for an iteration given as an int, a digits string or 'release';
    one ConversionError for anything else (a path, a negative or huge number)."""
    if isinstance(iteration, str) and iteration.strip() == "release":
        return "release"
    number = None
    if isinstance(iteration, int) and not isinstance(iteration, bool):
        number = iteration
    elif isinstance(iteration, str) and _ITERATION.fullmatch(iteration.strip()):
        number = int(iteration.strip())
    if number is None or not 0 <= number <= MAX_ITERATION:
        shown = repr(iteration)[:60]
        raise ConversionError(f"{source} must be an iteration number (0 to {MAX_ITERATION}) or 'release', "
                              f"not {shown}")
    return f"iter_{number:07d}"


def resolve_checkpoint_dir(load: str, iteration: Optional[int] = None) -> Tuple[str, str]:
    """(directory of one saved iteration, its label) for a Megatron-LM --save directory.

    `load` is the --save/--load directory (with latest_checkpointed_iteration.txt), or one of its
    iter_XXXXXXX / release directories directly. The directory returned lies inside `load`.
    """
    load = os.path.abspath(load)
    if not os.path.isdir(load):
        raise ConversionError(f"not a Megatron-LM checkpoint: {load} does not exist or is not a directory")
    root = InputRoot(load, "checkpoint")
    if iteration is not None:
        name = iteration_name(iteration)
        if not root.exists(name):
            found = _iteration_dirs(root)
            raise ConversionError(
                f"{load} has no {name}/ directory for --ckpt-step {iteration}"
                + (f" (found: {', '.join(found[-8:])})" if found else "")
            )
        root.sub(name)  # a directory inside the folder (not a link out of it)
        return os.path.join(load, name), name
    if root.exists(TRACKER):
        tracker = os.path.join(load, TRACKER)
        data = root.read_bytes(TRACKER, "tracker")  # a regular file of a few bytes, never a FIFO / device
        try:
            text = data.decode("ascii").strip()
        except UnicodeDecodeError:
            raise ConversionError(f"{tracker} does not hold an iteration number (it is not text)") from None
        if text != "release" and not _ITERATION.fullmatch(text):
            raise ConversionError(f"{tracker} does not hold an iteration number: {text[:40]!r}")
        name = iteration_name(text, source=tracker)
        if not root.exists(name):
            raise ConversionError(f"{tracker} names {name}, but {os.path.join(load, name)} does not exist "
                                  "(incomplete checkpoint?)")
        root.sub(name)
        return os.path.join(load, name), name
    if detect_format(load, quiet=True) is not None:
        return load, os.path.basename(load)
    found = [d for d in _iteration_dirs(root) if d.startswith("iter_")]
    if found:
        raise ConversionError(
            f"{load} has no {TRACKER}; pass --ckpt-step N (found: {', '.join(found[-8:])})"
        )
    raise ConversionError(
        f"not a Megatron-LM checkpoint: {load} has no {TRACKER}, no iter_*/release directory, and no "
        "torch_dist (.metadata, metadata.json) or legacy (mp_rank_*/model_optim_rng.pt) files"
    )


def _iteration_dirs(root: InputRoot) -> list:
    return [d for d in root.listdir() if d.startswith("iter_") or d == "release"]


def detect_format(path: str, quiet: bool = False) -> Optional[str]:
    root = InputRoot(path, "checkpoint")
    entries = root.listdir()
    if "metadata.json" in entries:
        config = root.read_json("metadata.json", "metadata.json", expect=dict)
        backend = config.get("sharded_backend")
        if not isinstance(backend, str):
            raise ConversionError(f"{os.path.join(path, 'metadata.json')} has no sharded_backend string "
                                  f"(found {type(backend).__name__}): not megatron's checkpoint description")
        if backend != "torch_dist":
            raise UnsupportedModelError(
                f"{path} is a distributed checkpoint with sharded_backend {backend[:40]!r}; only torch_dist is "
                "supported"
            )
        if ".metadata" not in entries:
            raise ConversionError(f"{path} has metadata.json but no .metadata (incomplete torch_dist checkpoint)")
        return "torch_dist"
    if any(LEGACY_DIR.match(e) for e in entries):
        return "torch"
    if ".metadata" in entries:
        if quiet:
            return None
        raise UnsupportedModelError(
            f"{path} is a plain torch.distributed.checkpoint (torch_dcp / fsdp_dtensor) checkpoint without "
            "megatron's metadata.json; save with --ckpt-format torch_dist or torch"
        )
    return None


# ------------------------------------------------------------------------------- saved values
_RECORD_INTS = ("format", "num_layers", "post_ln_layers")
# args fields convert and analysis read: (name, allowed types); None is allowed for every one
_ARGS_FIELDS = (
    (("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
      "max_position_embeddings", "seq_length", "padded_vocab_size", "vocab_size", "mixln_post_ln_layers",
      "make_vocab_size_divisible_by", "tensor_model_parallel_size", "pipeline_model_parallel_size"), "int"),
    (("norm_epsilon", "layernorm_epsilon", "rotary_base", "rotary_percent", "rope_scaling_factor",
      "rotary_seq_len_interpolation_factor"), "number"),
    (("normalization", "position_embedding_type", "hybrid_layer_pattern", "mixln_scheme", "mixln_layout",
      "mixln_deepnorm_alpha", "mixln_deepnorm_beta"), "str"),
    (("swiglu", "add_bias_linear", "untie_embeddings_and_output_weights", "group_query_attention",
      "layernorm_zero_centered_gamma", "use_rope_scaling", "add_qkv_bias"), "bool"),
)
_MAX_COUNT = 1 << 40


def _is(value, kind: str) -> bool:
    if value is None:
        return True
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_COUNT
    if kind == "number":
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    return isinstance(value, bool)


def check_record(record, where: str) -> dict:
    """The Mix-LN settings record read from `where`: a dict with int format / num_layers /
    post_ln_layers, a string scheme and an alpha (number or text); one ConversionError otherwise."""
    if not isinstance(record, dict) or not all(isinstance(k, str) for k in record):
        raise ConversionError(f"{where}: the Mix-LN settings record is a {type(record).__name__}, not the "
                              "record's dict (a damaged or crafted checkpoint?)")
    for key in _RECORD_INTS:
        if not _is(record.get(key), "int"):
            raise ConversionError(f"{where}: the Mix-LN settings record's {key} is {record[key]!r:.60}, not a "
                                  "non-negative integer (a damaged or crafted checkpoint?)")
    if not _is(record.get("scheme"), "str") or not (record.get("alpha") is None or _is(record["alpha"], "str")
                                                     or _is(record["alpha"], "number")):
        raise ConversionError(f"{where}: the Mix-LN settings record's scheme / alpha are not text / a number "
                              "(a damaged or crafted checkpoint?)")
    layout = record.get("layout")
    if not _is(layout, "str") or not all(_is(record.get(k), "number") for k in ("deepnorm_alpha", "deepnorm_beta")):
        raise ConversionError(f"{where}: the Mix-LN settings record's layout / deepnorm_alpha / deepnorm_beta are "
                              "not text / numbers (a damaged or crafted checkpoint?)")
    if layout is not None:
        try:  # bounded: parse_layout refuses text over 4 KiB, and L is checked above
            if record.get("num_layers") is None or record["num_layers"] > 1 << 16:
                raise MixLNConfigError("the record's num_layers is missing or over 65536")
            parse_layout(layout, record["num_layers"], "the record")
        except MixLNConfigError as e:
            raise ConversionError(f"{where}: the Mix-LN settings record's layout is not one this project "
                                  f"writes ({e}); a damaged or crafted checkpoint?") from None
    return record


def check_args(args, where: str):
    """The saved args: an argparse.Namespace (or None) whose model fields have their types."""
    if args is None:
        return None
    if not isinstance(args, argparse.Namespace):
        raise ConversionError(f"{where}: the saved args are a {type(args).__name__}, not Megatron-LM's "
                              "argparse.Namespace (a damaged or crafted checkpoint?)")
    for names, kind in _ARGS_FIELDS:
        for name in names:
            value = getattr(args, name, None)
            if not _is(value, kind):
                want = {"int": "a non-negative integer", "number": "a number", "str": "text",
                        "bool": "true or false"}[kind]
                raise ConversionError(f"{where}: the saved args have {name} = {value!r:.60}, not {want} "
                                      "(a damaged or crafted checkpoint?)")
    return args


def check_common_state(common, where: str) -> dict:
    """Megatron-LM's common state (common.pt, the common_state item, a legacy rank file): a dict
    whose `args` are checked (check_args), `iteration` an int, `content_metadata` a dict or None
    (its `mixln` entry a record)."""
    if not isinstance(common, dict):
        raise ConversionError(f"{where}: the checkpoint's common state is a {type(common).__name__}, not a dict "
                              "(a damaged or crafted checkpoint?)")
    check_args(common.get("args"), where)
    iteration = common.get("iteration")
    if iteration is not None and not _is(iteration, "int"):
        raise ConversionError(f"{where}: the saved iteration is {iteration!r:.60}, not a non-negative integer "
                              "(a damaged or crafted checkpoint?)")
    meta = common.get("content_metadata")
    if meta is not None:
        if not isinstance(meta, dict):
            raise ConversionError(f"{where}: the content metadata is a {type(meta).__name__}, not a dict "
                                  "(a damaged or crafted checkpoint?)")
        if meta.get("mixln") is not None:
            check_record(meta["mixln"], f"{where} (content metadata)")
    return common


# ------------------------------------------------------------------------------- model kind
GPT, HYBRID = "gpt", "hybrid"
OBJECT_SHARD = re.compile(r"^(.+)/shard_([0-9.]*)_([0-9.]*)$")


def model_kind(tensor_keys: Iterable[str]) -> str:
    """GPT (stacked layer keys, decoder.final_layernorm) or HYBRID (per-layer keys, decoder.final_norm).
    A GPTModel with per-layer keys (which Megatron-LM never writes; a megatron-core caller can) is refused."""
    keys = list(tensor_keys)
    per_layer = any(HYBRID_LAYER.match(k) for k in keys)
    if any(k.startswith(GPT_FINAL_NORM) for k in keys) and per_layer:
        raise UnsupportedModelError(
            "this GPTModel checkpoint keeps one key per layer (decoder.layers.<n>.*, saved with the "
            "non_homogeneous_layers or singleton_local_shards metadata); only the stacked layout "
            "Megatron-LM saves (decoder.layers.* with a layer axis) is read")
    if per_layer or any(k.startswith(HYBRID_FINAL_NORM) for k in keys):
        return HYBRID
    return GPT


def layer_names(tensor_keys: Iterable[str]) -> dict:
    """{global 0-based hybrid layer: [layer-local names]} of a hybrid checkpoint's tensors."""
    layers: dict = {}
    for key in tensor_keys:
        m = HYBRID_LAYER.match(key)
        if m:
            layers.setdefault(int(m.group(1)), []).append(m.group(2))
    return layers


def layer_symbol(names: Iterable[str]) -> str:
    """The pattern symbol a hybrid layer's tensors say it is: `*`, `-`, or what else it is."""
    names = list(names)
    for prefix, what in FOREIGN_NAMES.items():
        if any(n.startswith(prefix) for n in names):
            return what.split()[0]
    attention = any(n.startswith("self_attention.") for n in names)
    mlp = any(n.startswith("mlp.") for n in names)
    if attention and not mlp:
        return hybrid_pattern.SYMBOL[hybrid_pattern.ATTENTION]
    if mlp and not attention:
        return hybrid_pattern.SYMBOL[hybrid_pattern.MLP]
    return "?"


def pattern_of_keys(tensor_keys: Iterable[str]) -> str:
    """The hybrid layer pattern (no `|`) a hybrid checkpoint's tensor keys describe."""
    layers = layer_names(tensor_keys)
    if not layers:
        return ""
    return "".join(layer_symbol(layers.get(j, ())) for j in range(max(layers) + 1))


def pattern_problem(args_pattern: Optional[str], keys_pattern: str) -> Optional[str]:
    """Why a hybrid checkpoint is not a Mix-LN `*-` model a conversion carries (from its args'
    pattern, else its keys): `E` (MoE) layers are refused here though the model builds them."""
    if args_pattern:
        problem = hybrid_pattern.pattern_problem(args_pattern, moe=False)
        if problem:
            return problem
        if args_pattern.replace(hybrid_pattern.PIPE, "") != keys_pattern:
            return (f"the args' hybrid layer pattern {args_pattern!r} does not match the layers the "
                    f"checkpoint holds ({keys_pattern!r}): the checkpoint is incomplete or was edited")
        return None
    problem = hybrid_pattern.pattern_problem(keys_pattern, moe=False)
    return f"{problem} (read from the checkpoint's layers)" if problem else None


# ------------------------------------------------------------------------------- announcing
def announce_checkpoint_read(load: str, iteration=None, *, every_pickle: bool = False,
                             min_bytes: Optional[int] = None) -> bool:
    """`reading and vetting <dir>/.metadata (N MB) ...`, or with `every_pickle`
    `vetting every pickle in <dir>: K files (N MB) ...`, on stderr when the bytes are many.
    Returns whether a line was printed."""
    try:
        path, _ = resolve_checkpoint_dir(load, iteration)
        if every_pickle:
            count, nbytes = _regular_files(path)
            return announce(f"vetting every pickle in {path}: {count} files", nbytes, min_bytes=min_bytes)
        metadata = os.path.join(path, ".metadata")
        info = os.lstat(metadata)
        if not stat.S_ISREG(info.st_mode):
            return False
        return announce(f"reading and vetting {metadata}", info.st_size, min_bytes=min_bytes)
    except (MixLNError, OSError):
        return False


def _regular_files(path: str):
    """(count, total bytes) of the regular files under `path`, links not followed."""
    count = nbytes = 0
    for folder, _, names in os.walk(path):
        for name in names:
            info = os.lstat(os.path.join(folder, name))
            if stat.S_ISREG(info.st_mode):
                count, nbytes = count + 1, nbytes + info.st_size
    return count, nbytes


# ------------------------------------------------------------------------------- readers
class ReaderBase:
    format = "?"
    label = ""
    path = ""
    args = None
    iteration = None
    content_metadata: Optional[dict] = None
    settings_record: Optional[dict] = None  # the sharded / legacy record
    # torch_dist: "mixln" when the norms are stored under the Mix-LN keys, "stock" otherwise;
    # legacy files name modules, not keys (None).
    norm_layout: Optional[str] = None
    dtype = torch.float32
    padded_vocab_size = 0
    has_output_layer = True

    def refuse_unconvertible(self, moe: bool = False) -> None:
        """UnsupportedModelError when the layers hold what a conversion cannot carry (MLA, MTP; MoE
        unless `moe`: to-hf and inspect carry experts); reading the settings and metadata of such a
        checkpoint still works."""

    def _require_args(self):
        if self.args is None:
            raise ConversionError(
                f"{self.path} carries no Megatron args (saved without them?): the model shape cannot be read"
            )

    def check_layer_kinds(self, kinds) -> None:
        """The tensors agree with the settings' layer kinds (model.layout: one per layer), as far as
        the format can tell: legacy files name each layer's norm modules, torch_dist stacks the
        sandwich norms over the sandwich layers."""

    def vocab_blocks(self, which: str, rows: int):
        """Row blocks in which the embedding / output layer is read (default: all rows at once)."""
        return [(0, rows)]


LEGACY_FILE = "model_optim_rng.pt"


class LegacyCheckpoint(ReaderBase):
    format = "torch"

    def __init__(self, path: str):
        self.path = path
        self.root = InputRoot(path, "checkpoint folder")
        self._states: Dict[Tuple[int, int], dict] = {}
        ranks = {}
        for entry in self.root.listdir():
            m = LEGACY_DIR.match(entry)
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
                if f is None or not self.root.exists(os.path.relpath(f, path)):
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
                    keys = _model_keys(sd)
                    if not keys:
                        raise ConversionError(f"{self._files[(t, p)]} has no 'model' state dict")
                    per_stage[p] = [(k, _count_local_layers(sd[k])) for k in keys]
                    if p == 0:
                        check_common_state({k: sd.get(k) for k in ("args", "iteration")}, self._files[(t, p)])
                        self.args = sd.get("args")
                        self.iteration = sd.get("iteration")
                        first = sd[keys[0]]
                        record = first.get("decoder.layers.0.mixln_settings")
                        self.settings_record = None if record is None else check_record(record, self._files[(t, p)])
                        emb = first.get(M.TD_EMBEDDING)
                        if not isinstance(emb, torch.Tensor) or emb.dim() != 2:
                            raise ConversionError(f"{self._files[(0, 0)]} has no {M.TD_EMBEDDING}")
                        self.dtype = emb.dtype
                        self.padded_vocab_size = int(emb.shape[0]) * self.tp
                    if p == self.pp - 1:
                        last = sd[keys[-1]]
                        self.has_output_layer = M.TD_OUTPUT in last
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
        """The state dict of rank (t, p): read once (memory-mapped), checked, then kept."""
        sd = self._states.get((t, p))
        if sd is None:
            path = self._files[(t, p)]
            real = self.root.check_file(os.path.relpath(path, self.path))  # inside the folder, a regular file
            sd = load_torch(real, what=f"checkpoint shard {path}", mmap=True)
            if not isinstance(sd, dict):
                raise ConversionError(f"checkpoint shard {path} holds a {type(sd).__name__}, not a state dict "
                                      "(a damaged or crafted checkpoint?)")
            for key, model in sd.items():
                if isinstance(key, str) and re.fullmatch(r"model\d*", key) and (
                        not isinstance(model, dict) or not all(isinstance(k, str) for k in model)):
                    raise ConversionError(f"checkpoint shard {path}: its {key} is a {type(model).__name__}, not a "
                                          "state dict of named tensors (a damaged or crafted checkpoint?)")
            self._states[(t, p)] = sd
        return sd

    def check_layer_kinds(self, kinds) -> None:
        """Each layer's norm modules are those of its kind in the settings: Post-LN N1 / N2 for post
        and deepnorm (which the names cannot tell apart), the output norms for sandwich, neither for pre."""
        if len(kinds) != len(self._layer_index):
            return  # check_shapes names the layer count
        by_stage = sorted(enumerate(self._layer_index), key=lambda item: item[1][0])
        for layer, (p, key, local) in by_stage:  # TP rank 0's files name every module
            prefix = f"decoder.layers.{local}."
            names = [k[len(prefix):] for k in self._load(0, p)[key] if k.startswith(prefix)]
            has_post = any(n in M.LEGACY_POST_LN_NAMES for n in names)
            has_sandwich = any(n in M.LEGACY_SANDWICH_NAMES for n in names)
            want_post, want_sandwich = kinds[layer] in POST_LN_KINDS, kinds[layer] == SANDWICH
            if (has_post, has_sandwich) != (want_post, want_sandwich):
                stored = "a Post-LN" if has_post else ("a sandwich" if has_sandwich else "a Pre-LN")
                if has_post and has_sandwich:
                    stored = "both a Post-LN and a sandwich"
                p_count = leading_post_count(kinds)
                settings = f"P={p_count}" if p_count is not None else f"layout {layout_text(kinds)}"
                raise ConversionError(
                    f"layer {layer + 1} is stored as {stored} layer but the Mix-LN settings ({settings}) "
                    f"make it {kinds[layer]}"
                )

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
                    shards[role].append(self._tensor(value, t, p, name).detach().clone())
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
            model = sd[_model_keys(sd)[key_index]]
            if name not in model:
                raise ConversionError(f"{self._files[(t, p)]} has no {name}")
            parts.append(self._tensor(model[name], t, p, name).detach().clone())
            del model, sd
        return parts[0] if dim is None else torch.cat(parts, dim=dim)

    def _tensor(self, value, t: int, p: int, name: str) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise ConversionError(f"checkpoint shard {self._files[(t, p)]}: {name} is a {type(value).__name__}, not "
                                  "a tensor (a damaged or crafted checkpoint?)")
        return value

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
            for k in _model_keys(sd):
                total += sum(v.numel() * v.element_size() for v in sd[k].values() if torch.is_tensor(v))
            del sd
        return total

    def check_shapes(self, shape: ModelShape, layer_shapes=None) -> None:
        """The rank files hold as many layers as the args describe."""
        if self.num_layers_found != shape.num_layers:
            raise ConversionError(
                f"the checkpoint holds {self.num_layers_found} layers but its args say num_layers={shape.num_layers}"
            )


def _model_keys(sd: dict) -> List[str]:
    """A rank file's model state dicts in order: model, or model0, model1, ... (virtual pipelining)."""
    return sorted((k for k in sd if isinstance(k, str) and re.fullmatch(r"model\d*", k)), key=lambda k: int(k[5:] or 0))


def _count_local_layers(model: dict) -> int:
    indices = set()
    for name in model:
        m = re.match(r"decoder\.layers\.(\d+)\.", name)
        if m:
            indices.add(int(m.group(1)))
    if indices and indices != set(range(len(indices))):
        raise ConversionError(f"non-contiguous local layer indices {sorted(indices)}")
    return len(indices)
