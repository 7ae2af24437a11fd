"""torch_dist checkpoints read without process groups and without megatron.

A GPTModel's per-layer tensors are stacked under one key with a leading layer axis ([L, ...]); a
HybridModel's `*-` layers have a key each and are read as the GPT blocks they are
(convert.megatron_reader.model_kind). A layer is read as one box per role, in one pass of DCP's
reader (convert.dcp_files); the vocabulary in blocks of whole saved chunks, each loaded once. The
common state is common.pt (older megatron-core) or the object `common_state` (0.19+); both, and
the Mix-LN record, go through the allow-list and are checked before use.
"""

from __future__ import annotations

import math
import os
import re
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch

from ..errors import ConversionError, UnsupportedModelError
from ..safe_unpickle import load_torch
from ..model import checkpoint as keys
from ..model.layout import sandwich_rows
from . import mapping as M
from .dcp_files import DCPFiles
from .megatron_reader import GPT, HYBRID, ReaderBase, check_common_state, check_record, model_kind, pattern_of_keys

COMMON_PT = "common.pt"
COMMON_STATE_KEY = keys.COMMON_STATE_KEY
# Largest block of embedding / output rows read at once: a block also holds its saved chunk while it
# is read, so blocks much smaller than a chunk only add reads (benchmarks/convert.py).
VOCAB_BLOCK_BYTES = 32 << 20


class TorchDistCheckpoint(ReaderBase):
    format = "torch_dist"

    def __init__(self, path: str):
        self.path = path
        self.files = DCPFiles(path)  # checks the metadata and every file it names (missing, truncated, outside)
        self._tensors = self.files.tensors
        self._check_keys()
        # What Llama cannot express stops a conversion (refuse_unconvertible), not a read of the
        # settings: `pretrain --use-checkpoint-args` reads an MoE checkpoint's record through here.
        self.moe = self._has(keys.MOE)  # carried by to-hf / inspect only (refuse_unconvertible)
        self.unconvertible = self._unconvertible()
        self.common = self._read_common()
        self.args = self.common.get("args")
        self.iteration = self.common.get("iteration")
        self.content_metadata = self.common.get("content_metadata")
        # A HybridModel checkpoint keeps per-layer keys (megatron_reader.model_kind); its `*-` pairs are
        # read as the GPT blocks they are. So does a GPTModel with MoE layers (megatron saves
        # non-homogeneous layers one key each), which only the settings are read of.
        per_layer = any(keys.HYBRID_LAYER.match(k) for k in self._tensors)
        if self.unconvertible and any(k.startswith(keys.GPT_FINAL_NORM) for k in self._tensors):
            self.model_kind = GPT
        else:
            self.model_kind = model_kind(self._tensors)
        self.hybrid_pattern = pattern_of_keys(self._tensors) if self.model_kind == HYBRID \
            else None
        record_key = f"{keys.HYBRID_RECORD_KEY if per_layer else keys.GPT_RECORD_KEY}/shard_0_1"
        if record_key in self.files.objects:
            loaded = self.files.read_object(record_key, "the Mix-LN settings record")
            record = loaded[0] if isinstance(loaded, list) and len(loaded) == 1 else loaded
            self.settings_record = check_record(record, f"{self.files._item_file(record_key)} (item {record_key})")
        emb = self.files.check_tensor(M.TD_EMBEDDING)
        if len(emb.size) != 2:
            raise ConversionError(f"{self.path}: {M.TD_EMBEDDING} has the size {tuple(emb.size)}, not [vocab, hidden]")
        self.padded_vocab_size = int(emb.size[0])
        self.dtype = emb.properties.dtype
        self.has_output_layer = M.TD_OUTPUT in self._tensors
        mixln_norm = M.MIXLN_NORM_NAMES["norm_a"]
        self.norm_layout = "mixln" if any(
            k == M.TD_LAYER_PREFIX + mixln_norm or k.endswith("." + mixln_norm) for k in self._tensors) else "stock"
        # {role: layer-local name}; the sandwich norms have their Mix-LN keys in either layout
        self._role_names = {**M.TD_LAYER_NAMES[self.norm_layout == "mixln"], **M.SANDWICH_NORM_NAMES}
        self._sandwich_rows: Dict[int, int] = {}  # layer -> its row of mixln_norm_c / _d (check_layer_kinds)

    # ---------------------------------------------------------------- validation
    def _check_keys(self) -> None:
        if M.TD_EMBEDDING not in self._tensors:
            raise ConversionError(f"{self.path} has no {M.TD_EMBEDDING}: not a GPT model checkpoint")

    def _has(self, what) -> bool:
        return any("." + name in k for name in keys.foreign_names(what) for k in self._tensors)

    def _unconvertible(self) -> Optional[str]:
        """Why the layers cannot be converted (MLA, MTP, MoE for the commands that do not carry
        experts): one line, or None."""
        if self._has(keys.MLA):
            return "this checkpoint uses multi-latent attention (MLA): Llama cannot express it"
        if any(k.startswith("mtp.") for k in self._tensors):
            return "this checkpoint has multi-token-prediction (mtp.*) layers"
        if self._has(keys.MOE):
            return ("this checkpoint has MoE layers (mlp.experts / mlp.router keys): this command does not carry "
                    "experts (convert to-hf and inspect do)")
        return None

    def refuse_unconvertible(self, moe: bool = False) -> None:
        """`moe`: the caller carries MoE layers (to-hf, inspect); MLA / MTP stay refused."""
        if self.unconvertible and not (moe and self.moe and not self._has(keys.MLA)
                                       and not any(k.startswith("mtp.") for k in self._tensors)):
            raise UnsupportedModelError(self.unconvertible)

    def _read_common(self) -> dict:
        common_pt = os.path.join(self.path, COMMON_PT)
        if self.files.root.exists(COMMON_PT):
            # a bounded regular file of the folder (never a FIFO, a device or a link out), then the allow-list
            common = load_torch(self.files.root.read_bytes(COMMON_PT, "common.pt"), what=common_pt)
            where = common_pt
        elif COMMON_STATE_KEY in self.files.objects:
            loaded = self.files.read_object(COMMON_STATE_KEY, "the checkpoint's common state")
            common = loaded[0] if isinstance(loaded, list) and len(loaded) == 1 else loaded
            where = f"{self.files._item_file(COMMON_STATE_KEY)} (item {COMMON_STATE_KEY})"
        else:
            raise ConversionError(
                f"{self.path} has neither common.pt nor a common_state object: not a Megatron-LM checkpoint "
                "(args and iteration are missing)"
            )
        return check_common_state(common, where)

    # ---------------------------------------------------------------- raw access
    def has(self, key: str) -> bool:
        return key in self._tensors

    def global_shape(self, key: str) -> Tuple[int, ...]:
        return tuple(int(s) for s in self._tensors[key].size)

    def _box(self, key: str, offsets: Sequence[int], sizes: Sequence[int]):
        md = self.files.check_tensor(key)  # its chunks hold all of it: the box costs no more than the files
        shape = self.global_shape(key)
        offsets, sizes = tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)
        if len(offsets) != len(shape) or any(o < 0 or s < 0 or o + s > g for o, s, g in zip(offsets, sizes, shape)):
            raise ConversionError(f"{key}: box {offsets}+{sizes} outside the saved shape {shape}")
        return offsets, torch.empty(sizes, dtype=md.properties.dtype)

    def read(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """The sub-box [offsets, offsets + sizes) of the global tensor `key`, in its saved dtype."""
        box = self._box(key, offsets, sizes)
        self.files.read({key: box})
        return box[1]

    # ---------------------------------------------------------------- model tensors
    def _layer_key(self, layer: int, role: str) -> Tuple[str, bool]:
        """(key, stacked): a GPTModel's stacked key (megatron_reader.model_kind refuses per-layer GPT
        keys), or the HybridModel layer's own key."""
        expert = _expert(role)
        name = self._role_names[expert[1] if expert else role]
        if self.hybrid_pattern is not None:
            return self._hybrid_layer_key(layer, role, name), False
        stacked = keys.LAYERS + name
        if stacked in self._tensors:
            return stacked, True
        # megatron saves mixed dense / MoE stacks (non-homogeneous layers) with one key per layer
        own = f"{keys.LAYERS}{layer}.{name}"
        if self.moe and own in self._tensors:
            return own, False
        raise ConversionError(f"{self.path} has no {own if self.moe else stacked}: the model lacks '{role}'"
                              + (f" in layer {layer + 1}" if self.moe else ""))

    def _hybrid_layer_key(self, block: int, role: str, name: str) -> str:
        """Block `block`'s tensor of `role` in a HybridModel checkpoint: in its `*` or `-` layer
        (model.checkpoint; a Mix-LN norm in either, depending on the block's kind: look in both)."""
        candidates = sorted({keys.hybrid_layer_of(block, name, post_ln) for post_ln in (False, True)} - {None})
        names = [f"{keys.LAYERS}{j}.{name}" for j in candidates]
        found = [k for k in names if k in self._tensors]
        if len(found) != 1:
            raise ConversionError(
                f"{self.path}: block {block + 1}'s '{role}' should be in exactly one of {', '.join(names)}; "
                f"found {len(found)}: the checkpoint is incomplete or was edited")
        return found[0]

    def check_layer_kinds(self, kinds: Sequence[str]) -> None:
        """The sandwich norms exist for exactly the settings' sandwich layers (GPTModel: stacked
        [S, hidden]; per-layer keys: [hidden] each); remembers each sandwich layer's row. Other
        kinds share the keys, which cannot tell them apart (the settings record does)."""
        self._sandwich_rows = sandwich_rows(kinds)
        layers = list(self._sandwich_rows)  # the sandwich layers, in row order
        if self.hybrid_pattern is not None or (self.moe and self.num_stacked_layers() is None):
            self._check_own_sandwich_norms(layers, len(kinds), hybrid=self.hybrid_pattern is not None)
            return
        hidden = self.global_shape(M.TD_EMBEDDING)[1]
        for role, name in M.SANDWICH_NORM_NAMES.items():
            key = keys.LAYERS + name
            if not layers:
                if key in self._tensors:
                    raise ConversionError(f"{self.path} has {key} (sandwich norms) but its Mix-LN settings have no "
                                          "sandwich layer: the checkpoint's settings do not match its tensors")
                continue
            if key not in self._tensors:
                raise ConversionError(f"{self.path} has no {key}, but its Mix-LN settings have {len(layers)} sandwich "
                                      "layer(s): the checkpoint is incomplete or was edited")
            if self.global_shape(key) != (len(layers), hidden):
                raise ConversionError(f"{key} has shape {self.global_shape(key)}, the {len(layers)} sandwich "
                                      f"layer(s) of the Mix-LN settings imply {(len(layers), hidden)}")

    def _check_own_sandwich_norms(self, layers: Sequence[int], count: int, hybrid: bool) -> None:
        """Per-layer keys (GPT's mixed MoE stacks) or HybridModel blocks: each sandwich layer its own [hidden]."""
        hidden = self.global_shape(M.TD_EMBEDDING)[1]
        what = "block" if hybrid else "layer"
        for name in M.SANDWICH_NORM_NAMES.values():
            for layer in range(count):
                key = f"{keys.LAYERS}{keys.hybrid_layer_of(layer, name, False) if hybrid else layer}.{name}"
                if layer not in layers:
                    if key in self._tensors:
                        raise ConversionError(f"{self.path} has {key} (a sandwich norm), but {what} {layer + 1} is not a "
                                              "sandwich layer of its Mix-LN settings: the settings do not match the tensors")
                elif key not in self._tensors:
                    raise ConversionError(f"{self.path} has no {key}, but {what} {layer + 1} is a sandwich layer of its "
                                          "Mix-LN settings: the checkpoint is incomplete or was edited")
                elif self.global_shape(key) != (hidden,):
                    raise ConversionError(f"{key} has shape {self.global_shape(key)}, a sandwich norm of hidden size "
                                          f"{hidden} is {(hidden,)}")

    def read_layer(self, layer: int, roles: Iterable[str]) -> Dict[str, torch.Tensor]:
        """Every role's tensor of one layer (global layout), read in one pass; a sandwich layer's
        norm_c / norm_d from its row of the keys stacked over the sandwich layers."""
        boxes = {}
        for role in roles:
            key, stacked = self._layer_key(layer, role)
            shape = self.global_shape(key)
            if role in M.SANDWICH_NORM_NAMES and layer not in self._sandwich_rows:
                raise ConversionError(f"{self.path}: layer {layer + 1} is not a sandwich layer of the checkpoint's "
                                      f"Mix-LN settings, so it has no {role}")
            expert = _expert(role)
            if expert is not None:  # one expert's row of the layer's [E, ...] (or stacked [L, E, ...]) tensor
                lead = (layer, expert[0]) if stacked else (expert[0],)
                box = self._box(key, lead + (0,) * (len(shape) - len(lead)), (1,) * len(lead) + shape[len(lead):])
                boxes[role] = (key, box, len(lead))
                continue
            if role in M.SANDWICH_NORM_NAMES and stacked:  # GPTModel: its row of the sandwich layers
                row = self._sandwich_rows[layer]
                boxes[role] = (key, self._box(key, (row,) + (0,) * (len(shape) - 1), (1,) + shape[1:]), True)
            elif stacked:
                boxes[role] = (key, self._box(key, (layer,) + (0,) * (len(shape) - 1), (1,) + shape[1:]), True)
            else:
                boxes[role] = (key, self._box(key, (0,) * len(shape), shape), False)
        pending = list(boxes.values())
        while pending:  # one pass per distinct key (two experts' rows of one tensor: two passes)
            batch = {}
            for item in pending:
                batch.setdefault(item[0], item[1])
            self.files.read(batch)
            pending = [item for item in pending if batch[item[0]] is not item[1]]
        return {role: box[1].reshape(box[1].shape[int(lead):]) for role, (_, box, lead) in boxes.items()}

    def num_stacked_layers(self) -> Optional[int]:
        key = M.TD_LAYER_PREFIX + M.LAYER_ROLE_NAMES["qkv.weight"]
        return self.global_shape(key)[0] if key in self._tensors else None

    def num_blocks(self) -> Optional[int]:
        """Transformer blocks the layer tensors hold (GPT: the stacked layer axis; hybrid: pairs)."""
        if self.hybrid_pattern is not None:
            return len(self.hybrid_pattern) // 2
        return self.num_stacked_layers()

    @property
    def final_norm_key(self) -> str:
        return keys.HYBRID_FINAL_NORM + "weight" if self.hybrid_pattern is not None else M.TD_FINAL_NORM

    def vocab_blocks(self, which: str, rows: int):
        """(start, stop) row blocks of the embedding / output layer: none straddles two saved chunks
        (each block loads the chunks it touches whole) and none exceeds VOCAB_BLOCK_BYTES."""
        key = M.TD_EMBEDDING if which == "embedding" else M.TD_OUTPUT
        md = self._tensors[key]
        step = max(1, VOCAB_BLOCK_BYTES // max(1, math.prod(md.size[1:]) * md.properties.dtype.itemsize))
        starts = sorted({int(c.offsets[0]) for c in md.chunks} | {0})
        bounds = [s for s in starts if s < rows] + [rows]
        return [(a, min(b, a + step)) for lo, hi in zip(bounds[:-1], bounds[1:]) for a, b in
                ((a, hi) for a in range(lo, hi, step))]

    def read_vocab_rows(self, which: str, start: int, stop: int) -> torch.Tensor:
        key = M.TD_EMBEDDING if which == "embedding" else M.TD_OUTPUT
        h = self.global_shape(key)[1]
        return self.read(key, (start, 0), (stop - start, h))

    def read_final_norm(self) -> torch.Tensor:
        key = self.final_norm_key
        if key not in self._tensors:
            raise ConversionError(f"{self.path} has no {key}")
        return self.read(key, (0,), self.global_shape(key))

    def read_model_state(self, state: dict, num_layers: int, record) -> dict:
        """`state`, a TP = PP = 1 megatron-core GPTModel's state dict, with every tensor read from
        this checkpoint (the analysis loader's model); layer tensors by role, those without one
        (qk-layernorm) by name. The Mix-LN record becomes `record`, which the layers check."""
        by_layer = {}
        for key, value in state.items():
            if key.endswith(keys.RECORD):
                state[key] = record
                continue
            if key.endswith("_extra_state") or not torch.is_tensor(value):
                continue
            if key.startswith(M.TD_LAYER_PREFIX):
                index, _, name = key[len(M.TD_LAYER_PREFIX):].partition(".")
                by_layer.setdefault(int(index), []).append((key, name))
            elif key == M.TD_EMBEDDING:
                state[key] = self.read_vocab_rows("embedding", 0, value.shape[0])
            elif key == M.TD_OUTPUT:
                state[key] = self.read_vocab_rows("output", 0, value.shape[0])
            elif key == M.TD_FINAL_NORM:
                state[key] = self.read_final_norm()
            else:
                raise UnsupportedModelError(f"the analysis loader does not know the model tensor {key}")
        for layer in range(num_layers):
            named = by_layer.get(layer, [])
            roles = {name: role for _, name in named if (role := model_layer_role(name)) is not None}
            tensors = self.read_layer(layer, sorted(set(roles.values())))
            for key, name in named:
                state[key] = tensors[roles[name]] if name in roles else self._read_unmapped(layer, name)
        return state

    def _read_unmapped(self, layer: int, name: str) -> torch.Tensor:
        """A layer tensor without a role: its row of the key stacked over the layers, or the layer's own key."""
        stacked, own = M.TD_LAYER_PREFIX + name, f"{M.TD_LAYER_PREFIX}{layer}.{name}"
        if self.has(stacked):
            shape = self.global_shape(stacked)
            return self.read(stacked, (layer,) + (0,) * (len(shape) - 1), (1,) + shape[1:])[0]
        if self.has(own):
            return self.read(own, (0,) * len(self.global_shape(own)), self.global_shape(own))
        raise UnsupportedModelError(f"parameters missing from the checkpoint: {stacked}")

    def model_tensor_bytes(self) -> int:
        return sum(math.prod(md.size) * md.properties.dtype.itemsize for key, md in self._tensors.items()
                   if key.startswith(("decoder.", "embedding.", "output_layer.")))

    def _per_layer_indices(self):
        return sorted({int(m.group(1)) for m in map(keys.HYBRID_LAYER.match, self._tensors) if m})

    def _check_moe_layers(self, shape, layer_shapes) -> None:
        """Every layer's tensors against the args: the MoE layers (moe_layer_freq) have the router,
        experts [E, ...] and shared expert, the dense ones fc1 / fc2, each of the implied shape."""
        moe_layers, L = shape.moe.moe_layers, shape.num_layers
        stacked_n = self.num_stacked_layers()
        found = self._per_layer_indices()
        if stacked_n is not None and stacked_n != L or stacked_n is None and found != list(range(L)):
            n = stacked_n if stacked_n is not None else len(found)
            raise ConversionError(f"the checkpoint holds {n} layers but its args describe {L}")
        for layer in range(L):
            moe = moe_layers[layer]
            if stacked_n is None:
                other = M.MOE_ROLE_NAMES["router.weight"] if not moe else M.LAYER_ROLE_NAMES["fc1.weight"]
                if f"{keys.LAYERS}{layer}.{other}" in self._tensors:
                    raise ConversionError(
                        f"{self.path}: layer {layer + 1} has {other}, but the args' moe_layer_freq makes it "
                        f"{'dense' if not moe else 'an MoE layer'}: the settings do not match the tensors")
            for role, want in layer_shapes.items():
                if (role in M.DENSE_MLP_ROLES and moe) or (role in M.MOE_ROLE_NAMES and not moe):
                    continue
                key, stacked = self._layer_key(layer, role)
                got = self.global_shape(key)
                if stacked and got[0] != L:
                    raise ConversionError(f"{key} stacks {got[0]} layers, the args describe {L}")
                if tuple(got[1:] if stacked else got) != tuple(want):
                    raise ConversionError(f"{key} has shape {tuple(got[1:] if stacked else got)}, the args imply "
                                          f"{tuple(want)}" + (" (per expert: [E, rows, columns])"
                                                              if role in M.EXPERT_ROLES else ""))

    def check_shapes(self, shape, layer_shapes) -> None:
        """The stacked tensors have the shapes the args describe (`layer_shapes`:
        shape.megatron_layer_shapes(), read with the shape)."""
        if getattr(shape, "moe", None) is not None and self.hybrid_pattern is None:
            self._check_moe_layers(shape, layer_shapes)
            layer_shapes = {}  # every layer checked above
        n = self.num_blocks()
        if n is not None and n != shape.num_layers:
            what = f"holds {len(self.hybrid_pattern)} hybrid layers ({n} blocks)" if self.hybrid_pattern is not None \
                else f"stacks {n} layers"
            raise ConversionError(f"the checkpoint {what} but its args describe {shape.num_layers} blocks")
        for role, want in layer_shapes.items():
            key, stacked = self._layer_key(0, role)
            got = self.global_shape(key)[1:] if stacked else self.global_shape(key)
            if tuple(got) != tuple(want):
                raise ConversionError(f"{key} has shape {tuple(got)}, the args imply {tuple(want)}")
        if shape.add_bias_linear is False:
            qkv_only = getattr(shape, "add_qkv_bias", False)  # --add-qkv-bias alone (MoE models)
            extra = [r for r in ("fc1.bias",) + (() if qkv_only else ("qkv.bias",)) if any(
                k == M.TD_LAYER_PREFIX + M.LAYER_ROLE_NAMES[r] or k.endswith("." + M.LAYER_ROLE_NAMES[r])
                for k in self._tensors)]
            if extra:
                raise ConversionError(f"the checkpoint has biases ({extra}) but its args say add_bias_linear=False")
        emb = self.global_shape(M.TD_EMBEDDING)
        if emb[1] != shape.hidden_size:
            raise ConversionError(f"{M.TD_EMBEDDING} has shape {emb}, the args imply hidden size {shape.hidden_size}")


def _expert(role: str):
    """(expert index, its layer's whole-tensor role) of a routed expert's role, else None: the role
    table's pattern, matched here (a reader does not call back into the role table: the export walk)."""
    m = M.EXPERT_ROLE.fullmatch(role)
    return None if m is None else (int(m.group(1)), f"experts.{m.group(2)}.weight")


# A sequential expert's tensor in a megatron-core model: mlp.experts.local_experts.<e>.linear_fc<n>.weight
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_(fc[12])\.weight$")


def local_expert(layer_local_name: str) -> Optional[Tuple[int, str]]:
    """(expert index, "fc1" / "fc2") of a local expert's weight (layer-local name), else None; in one
    process the local index is the global one."""
    m = _LOCAL_EXPERT.match(layer_local_name)
    return (int(m.group(1)), m.group(2)) if m else None


def model_layer_role(name: str) -> Optional[str]:
    """The role of a megatron-core model's layer tensor (layer-local name), dense or MoE; None for
    a tensor without one (e.g. qk-layernorm weights)."""
    if name in M.LEGACY_LAYER_NAMES:
        return M.LEGACY_LAYER_NAMES[name]
    expert = local_expert(name)
    if expert is not None:
        return M.expert_role(*expert)
    return {n: role for role, n in M.MOE_ROLE_NAMES.items() if role not in M.EXPERT_ROLES}.get(name)
