"""Malicious and damaged checkpoint files, planted into copies of real checkpoints.

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


# ------------------------------------------------------------------------------ reads outside the input, costs
# Helpers for tests/test_untrusted_reads.py and tests/test_unpickler_hardening.py: damage planted into
# copies of real checkpoints (storage entries moved, files swapped for FIFOs / links, crafted pickles).

def read_metadata(ckpt, iteration: str = "release"):
    """The real DCP Metadata of our own fixture copy (plain pickle: it is our file, before planting)."""
    with open(os.path.join(str(ckpt), iteration, ".metadata"), "rb") as f:
        return pickle.load(f)


def write_metadata(ckpt, md, iteration: str = "release") -> None:
    with open(os.path.join(str(ckpt), iteration, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def storage_index(md, key: str):
    """The storage key of the byte item / first chunk of `key` in metadata `md`."""
    return next(k for k in md.storage_data if k.fqn == key)


def move_storage(ckpt, key: str, iteration: str = "release", **changes) -> None:
    """Change the storage entry of `key` (relative_path=, offset=, length=) in the copy's .metadata."""
    md = read_metadata(ckpt, iteration)
    index = storage_index(md, key)
    md.storage_data[index] = dataclasses.replace(md.storage_data[index], **changes)
    write_metadata(ckpt, md, iteration)


def overlap_two_items(ckpt, iteration: str = "release"):
    """Make the second stored item of the first .distcp start inside the first one; returns their keys."""
    md = read_metadata(ckpt, iteration)
    items = sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset))
    (k1, a), (k2, b) = items[0], items[1]
    md.storage_data[k2] = dataclasses.replace(b, offset=a.offset + max(1, a.length // 2))
    write_metadata(ckpt, md, iteration)
    return k1.fqn, k2.fqn


def extra_state_key(ckpt, iteration: str = "release") -> str:
    """A byte item the GPT <-> hybrid converters copy as stored bytes (an `_extra_state`)."""
    md = read_metadata(ckpt, iteration)
    return next(k.fqn for k in md.storage_data if "_extra_state" in k.fqn)


MEMO_PREFIX = bytes.fromhex("80024e720000000830")  # PROTO 2, NONE, LONG_BINPUT 2**27, POP


def torch_bytes(obj, protocol: int = 2) -> bytes:
    """torch.save(obj) as bytes (the format of common.pt and of a ShardedObject item)."""
    return _torch_bytes(obj, protocol)


def deflate_bomb(real_common: str, out: str, megabytes: int = 256) -> int:
    """Write to `out` the torch.save of the real common state `real_common` plus a `megabytes` MiB
    zero tensor, with that tensor's archive entry deflated (torch.save stores; a zip bomb does not):
    ~1000:1, so 256 MiB take ~260 KB. Returns the size of `out`. Only our own fixture is unpickled."""
    import zipfile

    common = _trusted_load(real_common)
    common["pad"] = torch.zeros(megabytes << 18, dtype=torch.float32)  # megabytes MiB
    plain = out + ".stored"
    torch.save(common, plain)
    del common
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            big = info.file_size > (1 << 20)
            target = zipfile.ZipInfo(info.filename, info.date_time)
            target.compress_type = zipfile.ZIP_DEFLATED if big else zipfile.ZIP_STORED
            with src.open(info) as r, dst.open(target, "w", force_zip64=big) as w:
                while True:
                    block = r.read(1 << 22)
                    if not block:
                        break
                    w.write(block)
    os.remove(plain)
    return os.path.getsize(out)


def build_on_class_pickle(cls_module: str = "argparse", cls_name: str = "Namespace",
                          attribute: str = "mixln_t27_planted") -> bytes:
    """A protocol-2 pickle whose BUILD targets the class `cls_module.cls_name` itself (state
    (None, {attribute: 1})): an unpickler that allows it sets the attribute on the class, process-wide."""
    name = attribute.encode()
    return (b"\x80\x02c" + cls_module.encode() + b"\n" + cls_name.encode() + b"\n"
            + b"N}X" + len(name).to_bytes(4, "little") + name + b"K\x01s\x86b.")


def setitems_on_class_pickle() -> bytes:
    """SETITEMS applied to the class collections.OrderedDict itself (not an instance the file made)."""
    return b"\x80\x02ccollections\nOrderedDict\n(X\x01\x00\x00\x00aK\x01u."


def global_pickle(module: str, name: str, protocol: int = 2) -> bytes:
    """A pickle that only names the global `module name` (GLOBAL at protocol 2, STACK_GLOBAL at 4)."""
    if protocol < 4:
        return b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n."
    m, n = module.encode(), name.encode()
    return (b"\x80\x04\x8c" + bytes([len(m)]) + m + b"\x94\x8c" + bytes([len(n)]) + n + b"\x94\x93\x94.")


def tree_hash(path) -> str:
    """A hash of a folder's names, types, link targets and regular files' bytes (never opens a FIFO)."""
    import hashlib
    import stat as st

    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(str(path)):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            mode = os.lstat(full).st_mode
            h.update(f"{os.path.relpath(full, str(path))}\0{st.S_IFMT(mode)}\0".encode())
            if st.S_ISLNK(mode):
                h.update(os.readlink(full).encode())
            elif st.S_ISREG(mode):
                with open(full, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
    return h.hexdigest()


def archive_with_pickle(real_archive: str, pickle_bytes: bytes, out: str) -> None:
    """A copy of the torch.save archive `real_archive` (entries stored, as torch writes them) whose
    data.pkl is `pickle_bytes`."""
    import zipfile

    with zipfile.ZipFile(real_archive) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = pickle_bytes if info.filename.endswith("data.pkl") else src.read(info)
            dst.writestr(zipfile.ZipInfo(info.filename, info.date_time), data)
