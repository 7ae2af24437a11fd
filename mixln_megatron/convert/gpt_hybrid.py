"""GPTModel <-> HybridModel torch_dist checkpoints of one Mix-LN network, every norm kept.

A GPTModel of L Mix-LN blocks and a HybridModel of the pattern `*-` * L with the same weights are
the same network (mixln_megatron.model.hybrid), so converting is renaming keys: GPT's stacked
`decoder.layers.<name>` [L, ...] <-> the hybrid's `decoder.layers.<j>.<name>` (model.checkpoint
says which of a block's two layers holds each tensor; Megatron's own mapping keeps only the stock
attention / MLP keys). Tensors are read as global boxes (any saved TP / PP); the model's objects
and the common state are carried with the args adjusted; optimizer and RNG state are not.
Objects copied from the input (e.g. `_extra_state`) are copied as stored bytes only after they
passed the allow-list (convert.vet.check_byte_item), all before anything is written: the next
Megatron-LM --load unpickles them with plain pickle, so a payload is refused here, never passed on.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from typing import Dict, List, Optional, Tuple

import torch

from ..errors import ConversionError, UnsupportedModelError
from ..progress import bar as progress_bar
from ..safe_output import MEGATRON_FOLDER, prepare_output, staged_dir
from ..model import checkpoint as CK, hybrid_pattern
from ..model.layout import POST_LN_KINDS, sandwich_rows
from .dcp_files import LazyTorchDistWriter
from .megatron_reader import GPT, HYBRID, OBJECT_SHARD, TRACKER, detect_format, pattern_problem, resolve_checkpoint_dir
from .inspect import _model_kind, mixln_placement
from .shape import args_hybrid_pattern
from .torch_dist_reader import TorchDistCheckpoint
from .vet import check_byte_item, item_file

PIECE_BYTES = 64 << 20  # largest tensor piece read and written at once
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
COMMON_STATE = CK.COMMON_STATE_KEY
OUTPUT_EXTRA_STATE = "output_layer._extra_state/shard_0_1"  # HybridModel saves it, GPTModel drops it
# Megatron-LM --spec objects of the two model kinds (mixln_megatron.spec), TE and local.
SPEC_OF_KIND = {
    GPT: {"transformer_engine": "mixln_layer_spec", "local": "mixln_local_layer_spec"},
    HYBRID: {"transformer_engine": "mixln_hybrid_stack_spec", "local": "mixln_hybrid_local_stack_spec"},
}
# Pipeline layout arguments that count GPT layers or contradict a `|`-free pattern: the run that
# loads the checkpoint sets its own layout (torch_dist is layout-free).
LAYOUT_ARGS = ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
               "num_virtual_stages_per_pipeline_rank", "pipeline_model_parallel_layout",
               "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
KIND_NAME = {GPT: "GPTModel", HYBRID: "HybridModel"}


def convert_gpt_to_hybrid(load: str, save: str, **kwargs) -> dict:
    """A GPTModel Mix-LN torch_dist checkpoint -> the HybridModel (`*-` * L) checkpoint of the same network."""
    return convert_model_kind(load, save, HYBRID, **kwargs)


def convert_hybrid_to_gpt(load: str, save: str, **kwargs) -> dict:
    """A HybridModel Mix-LN (`*-` pairs) torch_dist checkpoint -> the GPTModel checkpoint of the same network."""
    return convert_model_kind(load, save, GPT, **kwargs)


def convert_model_kind(load: str, save: str, target: str, *, iteration=None, overwrite: bool = False,
                       progress: bool = False) -> dict:
    """Write `save` as the `target` kind's checkpoint of the model in `load`; returns a summary."""
    t0 = time.time()
    prepare_output([load], save, MEGATRON_FOLDER, overwrite, ConversionError)  # before any work: never lose the input
    path, label = resolve_checkpoint_dir(load, iteration)
    fmt = detect_format(path)
    if fmt != "torch_dist":
        raise UnsupportedModelError(
            f"{path} is {'a legacy (torch)' if fmt else 'not a'} Megatron-LM checkpoint: GPT <-> hybrid conversion "
            "reads torch_dist checkpoints (--ckpt-format torch_dist)")
    reader = TorchDistCheckpoint(path)
    reader.refuse_unconvertible()
    source = _model_kind(reader)
    if source == target:
        raise ConversionError(f"{path} already is a {KIND_NAME[target]} checkpoint: nothing to convert")
    if source == HYBRID:
        problem = pattern_problem(args_hybrid_pattern(reader.args), reader.hybrid_pattern)
        if problem:
            raise UnsupportedModelError(f"{path} is not a Mix-LN HybridModel checkpoint: {problem}")
    blocks = reader.num_blocks()
    if not blocks:
        raise ConversionError(f"{path} holds no transformer layers (decoder.layers.*)")
    record, record_source, placement = mixln_placement(reader, blocks)
    post_ln = int(record["post_ln_layers"])

    plan = LazyTorchDistWriter()
    mapper = _KeyMap(reader, source, blocks, placement.kinds)
    not_converted = mapper.plan(plan)
    common = dict(reader.common)
    notes = []
    if common.get("args") is not None:
        common["args"], notes = converted_args(common["args"], target, blocks)
    plan.object(COMMON_STATE, common)

    total = sum(math.prod(i.tensor_data.chunk.sizes) * i.tensor_data.properties.dtype.itemsize
                for i in plan.items if i.tensor_data is not None)
    bar = progress_bar(total, f"{source}-to-{target} {os.path.basename(os.path.abspath(save))}", enabled=progress)

    def on_write(data):
        if isinstance(data, torch.Tensor):
            bar.update(data.numel() * data.element_size())

    label = _output_label(label, reader.iteration)
    with staged_dir(save, MEGATRON_FOLDER, overwrite, ConversionError) as tmp:
        out_dir = os.path.join(tmp, label)
        os.makedirs(out_dir)
        try:
            plan.save(out_dir, on_write, metadata=_source_metadata(path))
        finally:
            bar.close()
        # Megatron-core 0.19 reads the common_state object, 0.17 / 0.18 only common.pt: both.
        torch.save(common, os.path.join(out_dir, "common.pt"))
        with open(os.path.join(tmp, TRACKER), "w") as f:
            f.write("release" if label == "release" else str(int(label[len("iter_"):])))
    return {
        "source_kind": KIND_NAME[source], "target_kind": KIND_NAME[target], "checkpoint": path,
        "save": os.path.abspath(save), "iteration": label, "blocks": blocks, "post_ln_layers": post_ln,
        "scheme": record["scheme"], "layout": record.get("layout"), "settings_source": record_source,
        "hybrid_pattern": hybrid_pattern.pattern_for(blocks) if target == HYBRID else reader.hybrid_pattern,
        "tensors": len(mapper.tensor_keys), "objects": len(mapper.object_keys), "bytes": total,
        "not_converted": not_converted, "args": common.get("args") is not None, "notes": notes,
        "seconds": round(time.time() - t0, 2),
    }


# ------------------------------------------------------------------------------------ args
def converted_args(args, target: str, blocks: int) -> Tuple[object, List[str]]:
    """A copy of Megatron-LM's saved args for the `target` model kind, and notes on what changed."""
    ns = copy.copy(args)
    notes = []
    if target == HYBRID:
        ns.num_layers = 2 * blocks
        ns.hybrid_layer_pattern = hybrid_pattern.pattern_for(blocks)
    else:
        ns.num_layers = blocks
        ns.hybrid_layer_pattern = None
    if hasattr(ns, "hybrid_override_pattern"):
        ns.hybrid_override_pattern = None
    for name in LAYOUT_ARGS:
        if getattr(ns, name, None) is not None:
            notes.append(f"{name}={getattr(ns, name)!r} cleared (set the layout when loading)")
            setattr(ns, name, None)
    spec = getattr(ns, "spec", None)
    if spec:
        source_specs = {v: impl for kind, names in SPEC_OF_KIND.items() if kind != target for impl, v in names.items()}
        module, name = (list(spec) + [None, None])[:2]
        if module == "mixln_megatron.spec" and name in source_specs:
            ns.spec = [module, SPEC_OF_KIND[target][source_specs[name]]]
        elif not (module == "mixln_megatron.spec" and name in SPEC_OF_KIND[target].values()):
            notes.append(f"--spec {' '.join(map(str, spec))} kept: pass the {KIND_NAME[target]} spec when loading")
    # Honest about what the output holds: no optimizer or RNG state.
    ns.no_save_optim, ns.no_save_rng = True, True
    return ns, notes


def _output_label(label: str, iteration) -> str:
    """The iteration directory to write: the source's iter_XXXXXXX / release, else one named after the
    saved iteration (a bare checkpoint directory), else release."""
    if label == "release" or (label.startswith("iter_") and label[len("iter_"):].isdigit()):
        return label
    return f"iter_{int(iteration):07d}" if isinstance(iteration, int) else "release"


def _source_metadata(path: str) -> Optional[dict]:
    try:
        with open(os.path.join(path, "metadata.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("sharded_backend") == "torch_dist" else None


# ------------------------------------------------------------------------------------ keys
class _KeyMap:
    """Plans every model tensor and object of the source under its key in the other model kind."""

    def __init__(self, reader, source: str, blocks: int, kinds):
        self.reader, self.source, self.blocks, self.kinds = reader, source, blocks, tuple(kinds)
        self.post_ln_blocks = frozenset(i for i, kind in enumerate(self.kinds) if kind in POST_LN_KINDS)
        # GPTModel stacks a sandwich layer's output norms over the sandwich layers alone (their rows' order)
        self.sandwich_blocks = tuple(sandwich_rows(self.kinds))
        self.tensor_keys: List[str] = []
        self.object_keys: List[str] = []

    def is_post_ln(self, block: int) -> bool:
        """Whether 0-based block `block` is a post layer (which half holds each Mix-LN norm)."""
        return block in self.post_ln_blocks

    def plan(self, out: LazyTorchDistWriter) -> Dict[str, int]:
        """Add every converted tensor and object to `out`; {what: count} of what is not converted."""
        tensors = self.reader.files.tensors
        dropped_tensors = [k for k in tensors if not k.startswith(MODEL_PREFIXES)]
        model = [k for k in tensors if k.startswith(MODEL_PREFIXES)]
        if self.source == GPT:
            self._gpt_tensors(out, model)
        else:
            self._hybrid_tensors(out, model)
        dropped_objects = self._objects(out)
        return {"training state tensors (optimizer, ...)": len(dropped_tensors),
                "training state objects (RNG, ...)": dropped_objects}

    # ---------------------------------------------------------------- tensors
    def _copy(self, out, dst: str, src: str, dst_lead=(), src_lead=()):
        """Plan `dst` from `src` in row pieces; `*_lead` are leading indices (the GPT layer axis)
        that one side has and the other does not."""
        md = self.reader.files.tensors[src]
        shape = tuple(int(s) for s in md.size)[len(src_lead):]
        dtype = md.properties.dtype
        rows = shape[0] if shape else 1
        row_bytes = max(1, math.prod(shape[1:]) * dtype.itemsize)
        step = max(1, PIECE_BYTES // row_bytes)
        dst_shape = self._dst_shape(dst, shape, dst_lead)
        for a in range(0, rows, step):
            b = min(rows, a + step)
            inner_off = (a,) + (0,) * (len(shape) - 1) if shape else ()
            inner_size = (b - a,) + shape[1:] if shape else ()
            src_off = tuple(src_lead) + inner_off
            src_size = (1,) * len(src_lead) + inner_size
            dst_size = (1,) * len(dst_lead) + inner_size
            out.tensor(dst, dst_shape, tuple(dst_lead) + inner_off, dst_size, dtype,
                       lambda k=src, o=src_off, s=src_size, d=dst_size: self.reader.read(k, o, s).reshape(d))
        self.tensor_keys.append(dst)

    def _dst_shape(self, dst, shape, dst_lead):
        return ((len(self._stacked_blocks(dst)),) if dst_lead else ()) + tuple(shape)

    def _stacked_blocks(self, gpt_key: str):
        """The 0-based blocks a GPTModel layer key stacks, in the order of its rows: every block, or
        the sandwich blocks for a sandwich output norm."""
        name = gpt_key[len(CK.LAYERS):]
        return self.sandwich_blocks if name.startswith((CK.MIXLN_NORM_C, CK.MIXLN_NORM_D)) else range(self.blocks)

    def _gpt_tensors(self, out, keys):
        for key in keys:
            if key.startswith(CK.GPT_FINAL_NORM):
                self._copy(out, CK.HYBRID_FINAL_NORM + key[len(CK.GPT_FINAL_NORM):], key)
                continue
            if not key.startswith(CK.LAYERS):
                self._copy(out, key, key)  # embedding, output layer
                continue
            name = key[len(CK.LAYERS):]
            spike = CK.SPIKE.match(name)
            if spike:  # per block, no layer axis
                block = int(spike.group(1)) - 1
                self._copy(out, f"{CK.LAYERS}{CK.hybrid_index(block, self._part(name, block, key))}.{name}", key)
                continue
            layers, blocks = int(self.reader.files.tensors[key].size[0]), self._stacked_blocks(key)
            if layers != len(blocks):
                raise ConversionError(f"{key} stacks {layers} layers, the checkpoint's Mix-LN settings give it "
                                      f"{len(blocks)}")
            for row, block in enumerate(blocks):
                self._copy(out, f"{CK.LAYERS}{CK.hybrid_index(block, self._part(name, block, key))}.{name}", key,
                           src_lead=(row,))

    def _hybrid_tensors(self, out, keys):
        stacked: Dict[str, Dict[int, str]] = {}
        for key in keys:
            if key.startswith(CK.HYBRID_FINAL_NORM):
                self._copy(out, CK.GPT_FINAL_NORM + key[len(CK.HYBRID_FINAL_NORM):], key)
                continue
            m = CK.HYBRID_LAYER.match(key)
            if not m:
                self._copy(out, key, key)
                continue
            index, name = int(m.group(1)), m.group(2)
            block = CK.block_of_hybrid_index(index)
            if CK.hybrid_index(block, self._part(name, block, key)) != index:
                raise ConversionError(
                    f"{key} sits in hybrid layer {index + 1}, but block {block + 1}'s "
                    f"{'Post' if self.is_post_ln(block) else 'Pre'}-LN layers keep it in layer "
                    f"{CK.hybrid_index(block, self._part(name, block, key)) + 1}: the checkpoint's Mix-LN "
                    "settings do not match its tensors")
            if CK.SPIKE.match(name):
                self._copy(out, CK.LAYERS + name, key)
                continue
            stacked.setdefault(name, {})[block] = key
        for name, by_block in sorted(stacked.items()):
            blocks = self._stacked_blocks(CK.LAYERS + name)
            extra = sorted(b + 1 for b in set(by_block) - set(blocks))
            if extra:  # only a sandwich norm can be where its settings have no such layer
                raise ConversionError(f"decoder.layers.*.{name} (a sandwich norm) is in block(s) {extra[:8]}, which the "
                                      "checkpoint's Mix-LN settings do not make sandwich layers: the settings do not "
                                      "match the tensors")
            missing = [b + 1 for b in blocks if b not in by_block]
            if missing:
                raise ConversionError(f"decoder.layers.*.{name} is missing in block(s) {missing[:8]} of "
                                      f"{self.blocks}: the checkpoint is incomplete")
            shapes = {tuple(self.reader.global_shape(k)) for k in by_block.values()}
            dtypes = {self.reader.files.tensors[k].properties.dtype for k in by_block.values()}
            if len(shapes) > 1 or len(dtypes) > 1:
                raise ConversionError(f"decoder.layers.*.{name} differs between blocks ({shapes}, {dtypes}): "
                                      "cannot stack it into a GPTModel checkpoint")
            for row, block in enumerate(blocks):
                self._copy(out, CK.LAYERS + name, by_block[block], dst_lead=(row,))

    def _part(self, name: str, block: int, key: str) -> str:
        part = CK.part_of_name(name, self.is_post_ln(block))
        if part is None:
            raise ConversionError(
                f"{key}: a layer tensor that is neither attention's nor the MLP's; GPT <-> hybrid conversion "
                "knows the Mix-LN layer's tensors only")
        return part

    # ---------------------------------------------------------------- objects
    def _objects(self, out) -> int:
        dropped = 0
        have_output_extra = False
        for unique in sorted(self.reader.files.objects):
            if unique == COMMON_STATE:
                continue  # rewritten with the converted args
            m = OBJECT_SHARD.match(unique)
            if not m or not m.group(1).startswith(MODEL_PREFIXES):
                dropped += 1
                continue
            base, offsets, shape = m.group(1), m.group(2), m.group(3)
            dst = self._object_key(unique, base, offsets, shape)
            if dst is None:
                continue
            have_output_extra |= dst == OUTPUT_EXTRA_STATE
            raw = self.reader.files.read_raw(unique)
            check_byte_item(raw, unique, item_file(self.reader.files, unique))  # a payload is refused, never passed on
            out.raw_object(dst, lambda r=raw: r)  # the bytes as stored, checked
            self.object_keys.append(dst)
        if self.source == GPT and not have_output_extra:
            out.object(OUTPUT_EXTRA_STATE, None)  # HybridModel asks for it (empty, as GPTModel checks)
            self.object_keys.append(OUTPUT_EXTRA_STATE)
        return dropped

    def _object_key(self, unique: str, base: str, offsets: str, shape: str) -> Optional[str]:
        if self.source == GPT:
            if base == CK.GPT_RECORD_KEY:
                return f"{CK.HYBRID_RECORD_KEY}/shard_0_1"
            if base.startswith(CK.GPT_FINAL_NORM):
                return f"{CK.HYBRID_FINAL_NORM}{base[len(CK.GPT_FINAL_NORM):]}/shard_{offsets}_{shape}"
            if not base.startswith(CK.LAYERS):
                return unique
            name = base[len(CK.LAYERS):]
            if name.startswith(CK.SPIKE_SCALER):
                raise UnsupportedModelError(
                    f"{unique}: spike-scaler state in the old object format; load and save the checkpoint once "
                    "with this mixln_megatron (it writes tensors), then convert")
            if not (offsets.isdigit() and shape == str(self.blocks)):
                raise ConversionError(f"{unique}: a layer object that is not one per layer of {self.blocks}")
            block = int(offsets)
            return f"{CK.LAYERS}{CK.hybrid_index(block, self._part(name, block, unique))}.{name}/shard_0_1"
        if base == OUTPUT_EXTRA_STATE.split("/")[0]:
            return None  # GPTModel does not save the output layer's (empty) extra state
        if base.startswith(CK.HYBRID_FINAL_NORM):
            return f"{CK.GPT_FINAL_NORM}{base[len(CK.HYBRID_FINAL_NORM):]}/shard_{offsets}_{shape}"
        m = CK.HYBRID_LAYER.match(base)
        if not m:
            return unique
        index, name = int(m.group(1)), m.group(2)
        if name == CK.RECORD:
            return f"{CK.GPT_RECORD_KEY}/shard_0_1"
        return f"{CK.LAYERS}{name}/shard_{CK.block_of_hybrid_index(index)}_{self.blocks}"
