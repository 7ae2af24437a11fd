"""Malicious and damaged checkpoint files, planted into copies of real checkpoints (issue 19).

A payload is an object whose pickle makes the unpickler call a global: `Reduce(os.system,
("touch MARKER",))` pickles (protocol 2, as torch.save writes) as `GLOBAL posix system`, the
argument tuple and `REDUCE`. Every payload here only creates its marker file (under the test's
tmp_path): if it ever runs, the test sees the marker and fails, and nothing else happens.

    PAYLOADS              name -> Payload: the global a reader must refuse, and how to build it
    FILE_KINDS            the checkpoint files a payload or damage can be planted in
    plant_payload(kind, ckpt, obj)       write `obj` (a payload, or a container holding one)
    plant_damage(kind, ckpt, damage)     garbage / truncated / empty versions of the same files
    target_file(kind, ckpt)              the file the error message must name

Byte items inside a .distcp (the Mix-LN settings record, megatron-core 0.19's `common_state`)
are replaced by appending the new bytes (torch.save of a one-element list, as megatron-core and
the converter write ShardedObjects) at the end of the .distcp and pointing that item's storage
entry in `.metadata` at them; the old bytes stay where they were, unreferenced. The .metadata is
re-pickled from the real torch.distributed.checkpoint Metadata (read here with plain pickle: it is
our own fixture file), so it is exactly what torch's FileSystemWriter writes, with one entry moved.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import os
import pickle
import random
import shlex
import subprocess
from typing import Callable, Dict

import torch

TRACKER = "latest_checkpointed_iteration.txt"
RECORD_KEY = "decoder.layers.mixln_settings/shard_0_1"  # convert.mapping.TD_SETTINGS_RECORD + /shard_0_1
COMMON_STATE_KEY = "common_state/shard_0_1"  # what megatron-core 0.19 writes instead of common.pt


class Reduce:
    """Pickles as `func(*args)`: the unpickler calls `func` (the attack a checkpoint can carry)."""

    def __init__(self, func, args):
        self.func, self.args = func, tuple(args)

    def __reduce__(self):
        return self.func, self.args


def pickled_global_name(func) -> str:
    """`module.name` of a global exactly as pickle writes it (os.system -> posix.system on Linux)."""
    return f"{pickle.whichmodule(func, func.__name__)}.{func.__qualname__}"


@dataclasses.dataclass(frozen=True)
class Payload:
    name: str
    global_name: str  # what the refusal must name
    build: Callable[[str, str], object]  # (marker path, scratch dir) -> the object to pickle
    nested: bool = False  # plant it inside allowed containers of a real file's content
    # 2: GLOBAL opcodes, as torch.save writes by default; 4: STACK_GLOBAL. Protocols < 3 rename
    # modules for Python 2 (subprocess -> commands, builtins -> __builtin__), so globals whose
    # module Python 2 called otherwise are written at 4, where the pickle spells the real name.
    protocol: int = 4


def _touch_code(marker: str) -> str:
    return f"open({marker!r}, 'a').close()"


def _import_module_payload(marker: str, scratch: str):
    """import_module of a module that touches the marker when imported; `scratch` must be on
    sys.path (in-process: monkeypatch.syspath_prepend; subprocess: PYTHONPATH)."""
    import importlib

    name = "mixln_payload_" + os.urandom(6).hex()  # fresh name: never already in sys.modules
    with open(os.path.join(scratch, name + ".py"), "w") as f:
        f.write(_touch_code(marker) + "\n")
    return Reduce(importlib.import_module, (name,))


def _system(marker: str, scratch: str):
    return Reduce(os.system, (f"touch {shlex.quote(marker)}",))


PAYLOADS: Dict[str, Payload] = {p.name: p for p in (
    Payload("os.system", pickled_global_name(os.system), _system, protocol=2),
    Payload("subprocess.Popen", "subprocess.Popen",
            lambda marker, scratch: Reduce(subprocess.Popen, (["touch", marker],))),
    Payload("builtins.exec", "builtins.exec", lambda marker, scratch: Reduce(exec, (_touch_code(marker),))),
    Payload("builtins.eval", "builtins.eval", lambda marker, scratch: Reduce(eval, (_touch_code(marker),))),
    Payload("importlib.import_module", "importlib.import_module", _import_module_payload),
    Payload("nested-os.system", pickled_global_name(os.system), _system, nested=True, protocol=2),
)}


# ------------------------------------------------------------------------------ file kinds
# name -> (checkpoint format of the base copy, relative path of the file or item's .distcp)
FILE_KINDS = {
    "torch_dist-.metadata": ("torch_dist", "release/.metadata"),
    "torch_dist-common.pt": ("torch_dist", "release/common.pt"),
    "torch_dist-mixln_settings-item": ("torch_dist", "release/__0_0.distcp"),
    "torch_dist-common_state-item": ("torch_dist", "release/__0_0.distcp"),
    "torch_dist-metadata.json": ("torch_dist", "release/metadata.json"),
    "torch_dist-tracker": ("torch_dist", TRACKER),
    "legacy-model_optim_rng.pt": ("torch", "release/mp_rank_00/model_optim_rng.pt"),
    "legacy-tracker": ("torch", TRACKER),
}
PICKLE_KINDS = [k for k in FILE_KINDS if not k.endswith(("metadata.json", "tracker"))]
TEXT_KINDS = [k for k in FILE_KINDS if k not in PICKLE_KINDS]
DAMAGES = ("garbage", "truncated", "empty")
ITEM_KEYS = {"torch_dist-mixln_settings-item": RECORD_KEY, "torch_dist-common_state-item": COMMON_STATE_KEY}


def target_file(kind: str, ckpt) -> str:
    return os.path.join(str(ckpt), FILE_KINDS[kind][1])


def _torch_bytes(obj, protocol: int = 2) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_protocol=protocol)
    return buf.getvalue()


def _trusted_load(path):
    """Our own fixture files (never a test's planted ones): plain unpickling is fine here."""
    return torch.load(path, map_location="cpu", weights_only=False)


def _read_metadata(ckpt):
    with open(os.path.join(str(ckpt), "release", ".metadata"), "rb") as f:
        return pickle.load(f)


def _write_metadata(ckpt, md) -> None:
    with open(os.path.join(str(ckpt), "release", ".metadata"), "wb") as f:
        pickle.dump(md, f)


def item_bytes(ckpt, key: str) -> bytes:
    """The bytes of one byte item of a torch_dist checkpoint (where .metadata says they lie)."""
    md = _read_metadata(ckpt)
    info = next(v for k, v in md.storage_data.items() if k.fqn == key and k.offset is None)
    with open(os.path.join(str(ckpt), "release", info.relative_path), "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def replace_item(ckpt, key: str, data: bytes) -> None:
    """Point the byte item `key` at `data`, appended to the end of its .distcp."""
    md = _read_metadata(ckpt)
    index = next(k for k in md.storage_data if k.fqn == key and k.offset is None)
    info = md.storage_data[index]
    path = os.path.join(str(ckpt), "release", info.relative_path)
    offset = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(data)
    md.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(data))
    _write_metadata(ckpt, md)


def _nest(payload):
    """The payload deep inside containers a reader must allow (dict, list, OrderedDict)."""
    return {"mixln": [collections.OrderedDict(inner=payload)]}


def _content_with_payload(kind: str, ckpt, payload, nested: bool):
    """What to write into the file / item `kind`: the payload itself, or real content holding it."""
    if kind == "torch_dist-.metadata":
        if not nested:
            return payload
        md = _read_metadata(ckpt)
        md.planner_data = _nest(payload)
        return md
    if kind == "torch_dist-common.pt":
        if not nested:
            return payload
        common = _trusted_load(target_file(kind, ckpt))
        setattr(common["args"], "mixln_extra", _nest(payload))  # inside the argparse.Namespace
        return common
    if kind == "torch_dist-mixln_settings-item":
        if not nested:
            return [payload]
        record = torch.load(io.BytesIO(item_bytes(ckpt, RECORD_KEY)), weights_only=False)[0]
        return [{**record, "extra": _nest(payload)}]
    if kind == "torch_dist-common_state-item":
        if not nested:
            return [payload]
        common = torch.load(io.BytesIO(item_bytes(ckpt, COMMON_STATE_KEY)), weights_only=False)[0]
        setattr(common["args"], "mixln_extra", _nest(payload))
        return [common]
    if kind == "legacy-model_optim_rng.pt":
        if not nested:
            return payload
        state = _trusted_load(target_file(kind, ckpt))
        state["model"]["decoder.layers.0.mixln_settings"]["extra"] = _nest(payload)
        return state
    raise ValueError(f"{kind} holds no pickle")


def plant_payload(kind: str, ckpt, payload, nested: bool = False, protocol: int = 2) -> str:
    """Write the payload into the file kind `kind` of the checkpoint copy `ckpt` (pickled at
    `protocol`); returns that file."""
    target = target_file(kind, ckpt)
    if kind in TEXT_KINDS:  # JSON / text files: a pickle there is just bytes that are not the format
        data = pickle.dumps(payload, protocol=protocol)
        with open(target, "wb") as f:
            f.write(data)
        return target
    content = _content_with_payload(kind, ckpt, payload, nested)
    if kind == "torch_dist-.metadata":
        with open(target, "wb") as f:
            pickle.dump(content, f, protocol=protocol)  # a real Metadata (nested) or the bare payload
    elif kind in ITEM_KEYS:
        if kind == "torch_dist-common_state-item":
            os.remove(target_file("torch_dist-common.pt", ckpt))  # megatron-core 0.19's layout: no common.pt
        replace_item(ckpt, ITEM_KEYS[kind], _torch_bytes(content, protocol))
    else:
        torch.save(content, target, pickle_protocol=protocol)
    return target


def garbage(n: int = 4096) -> bytes:
    rng = random.Random(19)
    return bytes(rng.randrange(256) for _ in range(n))


def plant_damage(kind: str, ckpt, damage: str) -> str:
    """A garbage, truncated (first half) or empty version of the file / item `kind`; returns the file."""
    target = target_file(kind, ckpt)
    if kind in ITEM_KEYS:
        if kind == "torch_dist-common_state-item":
            os.remove(target_file("torch_dist-common.pt", ckpt))
        good = item_bytes(ckpt, ITEM_KEYS[kind])
        replace_item(ckpt, ITEM_KEYS[kind], {"garbage": garbage(), "truncated": good[:len(good) // 2],
                                             "empty": b""}[damage])
        return target
    good = open(target, "rb").read()
    if kind.endswith("tracker") and damage == "truncated":
        data = good[:3]  # "release" -> "rel"
    else:
        data = {"garbage": garbage(), "truncated": good[:len(good) // 2], "empty": b""}[damage]
    with open(target, "wb") as f:
        f.write(data)
    return target
