"""Legacy (per-rank torch) Megatron-LM checkpoints.

<iter>/mp_rank_TT[_PPP]/model_optim_rng.pt: one torch.save per TP x PP rank, state_dict['model']
(or model0, model1, ... with virtual pipelining) with layer-local module names
(decoder.layers.<local>.*). Each file is opened once, memory-mapped (its pickle checked and
unpickled once through the allow-list, its tensors left on disk), so only the tensors being
read are resident. The Mix-LN record is `decoder.layers.0.mixln_settings` in the first stage's
state dict.

The folder is untrusted input: every rank file is a regular file inside it (InputRoot.check_file;
no size bound, its pickle bounded by safe_unpickle), and what it holds is checked for shape (a
dict of state dicts of tensors, args, an int iteration, the record) before use.
"""

from __future__ import annotations

import os
import re
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from ..errors import ConversionError, UnsupportedModelError
from ..input_root import InputRoot
from . import mapping as M
from .layouts import merge_tp_shards
from .locate import LEGACY_DIR
from ..safe_unpickle import load_torch
from .reader_base import ReaderBase
from .shape import ModelShape

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
                    keys = sorted((k for k in sd if re.fullmatch(r"model\d*", k)), key=lambda k: int(k[5:] or 0))
                    if not keys:
                        raise ConversionError(f"{self._files[(t, p)]} has no 'model' state dict")
                    per_stage[p] = [(k, _count_local_layers(sd[k])) for k in keys]
                    if p == 0:
                        from .saved_values import check_common_state, check_record

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

    def _model(self, sd: dict, key: str) -> dict:
        return sd[key]

    def check_layer_kinds(self, kinds) -> None:
        """Each layer's norm modules are those of its kind in the settings: Post-LN N1 / N2 for post
        and deepnorm (which the names cannot tell apart), the output norms for sandwich, neither for pre."""
        from ..model.layout import POST_LN_KINDS, SANDWICH, layout_text, leading_post_count

        if len(kinds) != len(self._layer_index):
            return  # check_shapes names the layer count
        for t in range(1):
            for p in range(self.pp):
                sd = self._load(t, p)
                for layer, (pp, key, local) in enumerate(self._layer_index):
                    if pp != p:
                        continue
                    prefix = f"decoder.layers.{local}."
                    names = [k[len(prefix):] for k in sd[key] if k.startswith(prefix)]
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
                    shards[role].append(self._tensor(value, t, p, name).detach().clone())
            missing = [r for r in roles if r not in found]
            if missing:
                raise ConversionError(
                    f"{self._files[(t, p)]}: layer {local} lacks {missing} (saved with add_bias_linear / "
                    "another model type?)"
                )
            del model, sd
        return {r: merge_tp_shards(r, shards[r]) for r in roles}

    def _stage_tensor(self, p: int, key_index: int, name: str, dim: Optional[int]) -> torch.Tensor:
        parts = []
        for t in range(self.tp if dim is not None else 1):
            sd = self._load(t, p)
            keys = sorted((k for k in sd if re.fullmatch(r"model\d*", k)), key=lambda k: int(k[5:] or 0))
            model = sd[keys[key_index]]
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
            for k in sd:
                if re.fullmatch(r"model\d*", k):
                    total += sum(v.numel() * v.element_size() for v in sd[k].values() if torch.is_tensor(v))
            del sd
        return total

    def check_shapes(self, shape: ModelShape, layer_shapes=None) -> None:
        """The rank files hold as many layers as the args describe."""
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
