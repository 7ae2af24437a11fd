"""Unpickling checkpoint files as untrusted input: one allow-list of real classes, no fallback.

Every pickle this project reads from a checkpoint goes through this module (what is covered:
docs/untrusted-input.md): `load_torch` for torch.save archives (torch's weights-only unpickler,
with the allow-listed classes the file names made loadable), `load_pickle` for plain pickles
(DCP's `.metadata`: the C unpickler under guards, else a pure-Python unpickler). ALLOWED names,
as pickle writes them, the classes Megatron-LM and torch.distributed.checkpoint really put in
checkpoints; they are imported from their installed modules only when a file needs them. Anything
else is refused before it is called, in one line naming the file and the global
(UnsafeCheckpointError); garbage, truncated and empty files are refused the same way. Costs are
bounded before anything is unpickled (LIMITS, the archive check, the memo rules below).

torch's weights-only unpickler is not used for plain pickles: it reads protocol 2 only (DCP
writes 4), lets a file BUILD on an allow-listed enum's member and takes memo indices the file
never wrote (CONTRIBUTING.md, "Two unpicklers of our own"). Refusals name the globals a static
scan finds (`_archive_globals`), never text parsed out of another library's error message.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import importlib
import io
import os
import pickle
import pickletools
import sys
import struct
import warnings
import zipfile
from typing import Iterable, Optional, Union

from .errors import UnsafeCheckpointError
from .input_root import LIMITS, InputRoot

_DCP = "torch.distributed.checkpoint"
# `module.qualname` as pickle writes it -> importable (module, attribute path).
ALLOWED = (
    # Megatron-LM's saved args and training state
    "argparse.Namespace",
    "types.SimpleNamespace",
    "pathlib.PosixPath",
    "pathlib.PurePosixPath",
    "pathlib._local.PosixPath",  # Python 3.13's spelling
    "_io.BytesIO",  # how io.BytesIO pickles (TE extra state in older checkpoints)
    "signal.Signals",
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    # numpy RNG state (legacy rng_state)
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.dtypes.UInt32DType",
    # torch.distributed.checkpoint's .metadata
    f"{_DCP}.metadata.Metadata",
    f"{_DCP}.metadata.TensorStorageMetadata",
    f"{_DCP}.metadata.BytesStorageMetadata",
    f"{_DCP}.metadata.ChunkStorageMetadata",
    f"{_DCP}.metadata.TensorProperties",
    f"{_DCP}.metadata.MetadataIndex",
    f"{_DCP}.metadata.StorageMeta",
    f"{_DCP}.metadata._MEM_FORMAT_ENCODING",
    f"{_DCP}.filesystem._StorageInfo",
    # megatron-core keeps DCP's save plans in the metadata (cached global plans)
    f"{_DCP}.planner.SavePlan",
    f"{_DCP}.planner.WriteItem",
    f"{_DCP}.planner.WriteItemType",
    f"{_DCP}.planner.TensorWriteData",
    f"{_DCP}.planner.BytesIOWriteData",
    "torch.Size",
    "torch.serialization._get_layout",
    "collections.OrderedDict",
    # TransformerEngine's FP8 recipes inside the pickled `_extra_state` of its modules (TE 2.x:
    # a uint8 tensor holding a plain pickle of {"recipe": ..., "extra_fp8_variables": {...}})
    "transformer_engine.common.recipe.DelayedScaling",
    "transformer_engine.common.recipe.Float8CurrentScaling",
    "transformer_engine.common.recipe.MXFP8BlockScaling",
    "transformer_engine.common.recipe.Float8BlockScaling",
    "transformer_engine.common.recipe.NVFP4BlockScaling",
    "transformer_engine.common.recipe.Format",
    "transformer_engine.common.recipe._FormatHelper",
    "transformer_engine.common.recipe.QParams",
    "transformer_engine.common.recipe.MMParams",
)
_ALLOWED = frozenset(ALLOWED)
_HINT = ("a checkpoint holds data only; this file names code to run, so it may have been crafted to run "
         "it: do not load it with plain torch.load / pickle either")


def _resolve(name: str):
    """The real object behind an allow-listed pickle name (imported from its installed module)."""
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None  # this environment lacks it (e.g. an older megatron-core): refused below


def _is_torch_constant(module: str, name: str) -> bool:
    """torch dtypes and layouts pickle as globals of the torch module (`torch float32`).

    Looked up in `vars(torch)` only: `getattr(torch, name)` would run torch's lazy submodule
    import (`torch _dynamo` imports torch._dynamo), which a file must never trigger. torch is not
    imported here either: a file read before torch is imported names no torch constant we need."""
    torch = sys.modules.get("torch")
    if module != "torch" or torch is None or not isinstance(name, str):
        return False
    return isinstance(vars(torch).get(name), (torch.dtype, torch.layout))


def _torch_safe_names() -> frozenset:
    """The globals torch's weights-only unpickler allows by itself (tensor rebuilders, storages, dtypes)."""
    try:
        from torch import _weights_only_unpickler as w

        return frozenset(w._get_allowed_globals())
    except Exception:  # noqa: BLE001 - a torch without it: only our allow-list and torch constants count
        return frozenset()


def _refusal(what: str, names: Iterable[str]) -> UnsafeCheckpointError:
    names = sorted(set(names))
    return UnsafeCheckpointError(f"{what}: refused to unpickle: it needs {', '.join(repr(n) for n in names)}, "
                                 f"which {'is' if len(names) == 1 else 'are'} not on the allow-list of checkpoint "
                                 f"classes ({_HINT})")


def _unreadable(what: str, error) -> UnsafeCheckpointError:
    detail = " ".join(str(error).split())[:200] or type(error).__name__
    return UnsafeCheckpointError(f"{what} is unreadable (empty, truncated or not a checkpoint file?): {detail}")


def _unsafe(what: str, why: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"{what}: refused to unpickle: {why} (a damaged or crafted file?)")


Source = Union[str, os.PathLike, bytes, bytearray]


# ------------------------------------------------------------------------------ torch.save archives
def check_archive(stream, size: int, what: str):
    """Check an open torch.save zip of `size` bytes without inflating anything; returns
    (ZipFile, ZipInfo of its data.pkl). torch.save writes every entry stored (uncompressed), each
    once, inside the file: anything else (a deflate bomb, sizes beyond the file, a pickle larger
    than LIMITS["pickle"]) is refused here, before torch reads it."""
    try:
        archive = zipfile.ZipFile(stream)
        entries = archive.infolist()
        total = 0
        pkl = [i for i in entries if i.filename.endswith("data.pkl")]
        if len(pkl) != 1:
            raise _unreadable(what, f"a torch.save archive holds one data.pkl, this one {len(pkl)}")
        for info in entries:
            if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                raise _unsafe(what, f"its archive entry {info.filename[:80]!r} is compressed ({info.file_size} "
                                    f"bytes stored in {info.compress_size}); torch.save never compresses")
            total += info.file_size
            if info.header_offset < 0 or info.header_offset + info.file_size > size or total > size:
                raise _unsafe(what, f"its archive entry {info.filename[:80]!r} claims more bytes than the "
                                    f"file holds ({size})")
        if pkl[0].file_size > LIMITS["pickle"]:
            raise _unsafe(what, f"its pickle holds {pkl[0].file_size} bytes, more than any real checkpoint "
                                f"pickle ({LIMITS['pickle']} bytes)")
        return archive, pkl[0]
    except UnsafeCheckpointError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, KeyError, IndexError,
            struct.error, NotImplementedError, RuntimeError, OverflowError, UnicodeDecodeError) as e:
        raise _unreadable(what, e) from None


def _check_archive(source: Source, what: str) -> bytes:
    """check_archive of a path or bytes; returns its data.pkl (at most LIMITS["pickle"] bytes)."""
    try:
        size = len(source) if isinstance(source, (bytes, bytearray)) else os.path.getsize(source)
        stream = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else open(source, "rb")
    except OSError as e:
        raise _unreadable(what, e) from None
    with stream:
        archive, pkl = check_archive(stream, size, what)
        try:
            with archive:
                data = archive.read(pkl)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError, struct.error, RuntimeError) as e:
            raise _unreadable(what, e) from None
    if len(data) > LIMITS["pickle"]:
        raise _unsafe(what, "its pickle is larger than its archive entry says")
    return data


def _head(source: Source, what: str) -> bytes:
    """The first four bytes of a torch.save file: its zip format starts b"PK\\x03\\x04" (torch decides
    by the same bytes), its pre-1.6 format with a pickle PROTO opcode."""
    if isinstance(source, (bytes, bytearray)):
        head = bytes(source[:4])
    else:
        try:
            with open(source, "rb") as f:
                head = f.read(4)
        except OSError as e:
            raise _unreadable(what, e) from None
    return head


def load_torch(source: Source, what: str, *, mmap: bool = False):
    """A torch.save archive (a path or its bytes), loaded with torch's weights-only unpickler after
    the archive check; a global the static scan finds that neither ALLOWED nor torch's own safe set
    holds refuses the file, and the allowed ones are made loadable for this call only."""
    import torch  # heavy

    def opened():
        return io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source

    head = _head(source, what)
    if head[:1] != b"\x80" and head != b"PK\x03\x04":
        raise _unreadable(what, "not a torch.save file (neither its zip format nor its older pickle format)")
    torch_safe = _torch_safe_names()
    if head != b"PK\x03\x04":
        # torch's pre-1.6 (non-zip) format holds no compressed data: torch's weights-only
        # unpickler reads it with its own safe set only (nothing of ours is made loadable), after
        # the same static scan as an archive's, so that a refusal names what the file holds.
        names, newer = _legacy_findings(source, what)
        forbidden = [n for n in names if not _allowed_name(n, torch_safe)]
        if forbidden:
            raise _refusal(what, forbidden)
        return _weights_only_load(lambda: torch.load(opened(), map_location="cpu", weights_only=True),
                                  what, names, newer, torch_safe)
    data = _check_archive(source, what)
    names = _archive_globals(data)
    forbidden = [n for n in names if not _allowed_name(n, torch_safe)]
    if forbidden:
        raise _refusal(what, forbidden)
    needed = sorted({n for n in names if n in _ALLOWED and n not in torch_safe})
    classes = [_resolve(n) for n in needed]
    missing = [n for n, c in zip(needed, classes) if c is None]
    if missing:
        raise _refusal(what, missing)

    with _loadable(classes):
        return _weights_only_load(lambda: torch.load(opened(), map_location="cpu", weights_only=True, mmap=mmap),
                                  what, names, _newer_opcodes(data), torch_safe)


def _allowed_name(name: str, torch_safe: frozenset) -> bool:
    return (name in _ALLOWED or name in torch_safe
            or _is_torch_constant(*name.rsplit(".", 1) if "." in name else ("", name)))


def _weights_only_load(load, what: str, names: list, newer: list, torch_safe: frozenset):
    """`load()` (a torch.load with weights_only=True) where the scan saw nothing forbidden.

    A refusal is one line of ours: torch's warnings (e.g. about the pickle protocol) are silenced
    for the call, and torch's UnpicklingError, whose text advises loading the file with
    weights_only=False, is never passed on: the line names what the scan found instead."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load()
    except pickle.UnpicklingError:
        if newer:
            why = (f"its pickle uses opcodes that protocol 2 (what torch.save writes and torch's weights-only "
                   f"unpickler reads) does not have: {', '.join(newer)}")
        else:
            unknown = sorted({n for n in names if n not in torch_safe})
            why = "torch's weights-only unpickler refused its content" + (
                f" (it names {', '.join(repr(n) for n in unknown)})" if unknown else "")
        raise _unsafe(what, why) from None
    except (RuntimeError, ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile, IndexError, TypeError,
            AttributeError, struct.error, MemoryError, OverflowError) as e:
        # torch failed where the scan saw nothing forbidden: unreadable, in its own words
        raise _unreadable(what, e) from None


def _newer_opcodes(data) -> list:
    """The opcodes of one pickle (bytes, or a stream at its start) that protocol 2 lacks, in order of
    first use, by a static scan; a damaged stream is scanned up to the damage."""
    seen = []
    try:
        for op, _, _ in pickletools.genops(data):
            if op.proto > 2 and op.name not in seen:
                seen.append(op.name)
    except Exception:  # noqa: BLE001 - damaged or truncated: what was seen so far
        pass
    return seen


# torch's pre-1.6 format: pickles of its magic number, protocol version, system info, the object
# and its storage keys, then raw storage bytes.
_LEGACY_PICKLES = 5


def _legacy_findings(source: Source, what: str):
    """(globals named, opcodes beyond protocol 2) of the pickles a pre-1.6 torch.save file starts
    with, by static scans (nothing is run; the storage bytes after them are not read)."""
    try:
        stream = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else open(source, "rb")
    except OSError as e:
        raise _unreadable(what, e) from None
    names, newer = [], []
    with stream:
        for _ in range(_LEGACY_PICKLES):
            start = stream.tell()
            newer += [op for op in _newer_opcodes(stream) if op not in newer]
            end = stream.tell()
            stream.seek(start)
            names += _archive_globals(stream.read(end - start))
            if end == start or stream.read(1) != b"\x80":  # no further pickle (damage, or the storage bytes)
                break
            stream.seek(end)
    return names, newer


@contextlib.contextmanager
def _loadable(classes):
    """`classes` loadable by torch's weights-only unpickler for one load, then torch's registry
    exactly as it was. (torch.serialization.safe_globals removes its classes on exit even when
    they were registered before: it would undo megatron-core's own registration of
    argparse.Namespace, and Megatron-LM's later load of common.pt would fail.)"""
    import torch  # heavy

    before = list(torch.serialization.get_safe_globals())
    torch.serialization.add_safe_globals(list(classes))
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


_STRING_OPS = frozenset(("UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "STRING", "BINSTRING",
                         "SHORT_BINSTRING"))


def _archive_globals(data: bytes) -> list:
    """The globals a pickle names (`module.name`, in order), by a static scan: nothing is run.

    A small model of the unpickler's stack (strings and "something else") and memo is enough to
    name STACK_GLOBAL's operands: every memo write (PUT/BINPUT/LONG_BINPUT at their index,
    MEMOIZE at the next one) stores whatever is on top, string or not; GET/BINGET/LONG_BINGET push
    it back. A damaged stream is scanned up to the damage."""
    names, stack, marks, memo = [], [], [], {}

    def pop(n: int):
        for _ in range(n):
            if stack:
                stack.pop()

    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1] if stack else None
                continue
            if name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo.get(arg))
                continue
            if name == "MARK":
                marks.append(len(stack))
                continue
            if name == "DUP":
                stack.append(stack[-1] if stack else None)
                continue
            if name == "GLOBAL":
                names.append(str(arg).replace(" ", "."))
                stack.append(None)
                continue
            if name == "STACK_GLOBAL":
                module, attr = (stack[-2], stack[-1]) if len(stack) >= 2 else (None, None)
                names.append(f"{module if isinstance(module, str) else '?'}.{attr if isinstance(attr, str) else '?'}")
                pop(2)
                stack.append(None)
                continue
            before = op.stack_before
            if pickletools.stackslice in before:  # pops to the last MARK, then what lies under it
                del stack[marks.pop() if marks else 0:]
                pop(len(before) - 2)
            else:
                pop(len(before))
            if name in _STRING_OPS:
                stack.append(arg if isinstance(arg, str) else None)
            else:
                stack.extend([None] * len(op.stack_after))
    except Exception:  # noqa: BLE001 - damaged or truncated: what was seen so far
        pass
    return names


# ------------------------------------------------------------------------------ plain pickles
_SHARED = (type, type(sys), type(len), type(_resolve), type(str.join), type("".join), staticmethod, classmethod,
           property)


class _AllowListUnpickler(pickle._Unpickler):
    """The pure-Python unpickler, resolving only allow-listed globals, whose state-changing opcodes
    touch only objects this file created (a BUILD on the class argparse.Namespace would change it
    process-wide), and whose memo indices follow the memo writes made so far."""

    what = "pickle"
    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, what: str):
        super().__init__(file)
        self.what = what
        self._globals = set()  # ids of what find_class returned (callable by REDUCE / NEWOBJ)
        self._created = {}  # id -> object this file built (kept alive, so no id is reused)
        self._memo_writes = 0
        torch = sys.modules.get("torch")
        # never "created by the file": classes, modules, functions, enum members, torch dtypes / layouts
        self._shared = _SHARED + (enum.Enum,) + ((torch.dtype, torch.layout) if torch is not None else ())

    # ---------------------------------------------------------------- globals
    def find_class(self, module: str, name: str):
        full = f"{module}.{name}"
        found = None
        if full in _ALLOWED:
            found = _resolve(full)
        elif _is_torch_constant(module, name):
            found = vars(sys.modules["torch"])[name]
        if found is None:
            raise _refusal(self.what, [full])
        self._globals.add(id(found))
        return found

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not used by plain checkpoint pickles")

    # ---------------------------------------------------------------- what the file created
    def _mark_created(self) -> None:
        obj = self.stack[-1]
        if not isinstance(obj, self._shared) and id(obj) not in self._globals:
            self._created[id(obj)] = obj

    def _target(self, op: str, under=None):
        target = (self.stack[-1] if self.stack else None) if under is None else (under[-1] if under else None)
        if id(target) not in self._created:
            kind = type(target).__name__ if not isinstance(target, type) else f"the class {target.__qualname__}"
            raise _unsafe(self.what, f"its {op} opcode would change {kind}, which the file did not create "
                                     "(only objects built by the pickle itself may be filled in)")
        return target

    def _creating(op):  # noqa: N805 - a decorator used in the class body
        base = pickle._Unpickler.dispatch[op[0]]

        def load(self):
            base(self)
            self._mark_created()
        return load

    def _refusing(name):  # noqa: N805
        def load(self):
            raise _unsafe(self.what, f"it uses the {name} opcode, which checkpoint pickles never need")
        return load

    def _checked_callable(self, func, op: str):
        if id(func) not in self._globals:
            raise _unsafe(self.what, f"its {op} opcode calls {type(func).__name__}, not an allow-listed class")

    def load_reduce(self):
        self._checked_callable(self.stack[-2] if len(self.stack) >= 2 else None, "REDUCE")
        pickle._Unpickler.load_reduce(self)
        self._mark_created()

    def load_newobj(self):
        self._checked_callable(self.stack[-2] if len(self.stack) >= 2 else None, "NEWOBJ")
        pickle._Unpickler.load_newobj(self)
        self._mark_created()

    def load_newobj_ex(self):
        self._checked_callable(self.stack[-3] if len(self.stack) >= 3 else None, "NEWOBJ_EX")
        pickle._Unpickler.load_newobj_ex(self)
        self._mark_created()

    def _check_below(self, depth: int, op: str) -> None:
        """The object `depth` items under the stack's top is what `op` changes: one the file built."""
        if len(self.stack) <= depth:
            raise pickle.UnpicklingError(f"{op} with a short stack")
        self._target(op, under=(self.stack[-1 - depth],))

    def load_build(self):
        self._check_below(1, "BUILD")
        pickle._Unpickler.load_build(self)

    def load_setitem(self):
        self._check_below(2, "SETITEM")
        pickle._Unpickler.load_setitem(self)

    def load_append(self):
        self._check_below(1, "APPEND")
        pickle._Unpickler.load_append(self)

    def _marked(name, base):  # noqa: N805
        """SETITEMS / APPENDS / ADDITEMS: check the object under the mark, then let the base fill it."""
        def load(self):
            self._target(name, under=self.metastack[-1] if self.metastack else [])
            base(self)
        return load

    # ---------------------------------------------------------------- memo
    def _memo_index(self, i: int, op: str) -> None:
        if i > self._memo_writes:
            raise _unsafe(self.what, f"its {op} opcode numbers memo slot {i} after {self._memo_writes} memo "
                                     "writes (a real pickler numbers them 0, 1, 2, ...)")
        self._memo_writes += 1

    def load_put(self):
        line = self.readline()
        try:
            i = int(line[:-1])
        except ValueError:
            raise pickle.UnpicklingError("PUT with a bad index") from None
        self._memo_index(i, "PUT")
        if i < 0 or not self.stack:
            raise pickle.UnpicklingError("bad PUT")
        self.memo[i] = self.stack[-1]

    def load_binput(self):
        i = self.read(1)[0]
        self._memo_index(i, "BINPUT")
        self.memo[i] = self.stack[-1]

    def load_long_binput(self):
        i, = struct.unpack("<I", self.read(4))
        self._memo_index(i, "LONG_BINPUT")
        self.memo[i] = self.stack[-1]

    def load_memoize(self):
        self._memo_index(len(self.memo), "MEMOIZE")
        self.memo[len(self.memo)] = self.stack[-1]


for _code, _fn in (
        (pickle.REDUCE, _AllowListUnpickler.load_reduce), (pickle.NEWOBJ, _AllowListUnpickler.load_newobj),
        (pickle.NEWOBJ_EX, _AllowListUnpickler.load_newobj_ex), (pickle.BUILD, _AllowListUnpickler.load_build),
        (pickle.SETITEM, _AllowListUnpickler.load_setitem), (pickle.APPEND, _AllowListUnpickler.load_append),
        (pickle.SETITEMS, _AllowListUnpickler._marked("SETITEMS", pickle._Unpickler.load_setitems)),
        (pickle.APPENDS, _AllowListUnpickler._marked("APPENDS", pickle._Unpickler.load_appends)),
        (pickle.ADDITEMS, _AllowListUnpickler._marked("ADDITEMS", pickle._Unpickler.load_additems)),
        (pickle.PUT, _AllowListUnpickler.load_put), (pickle.BINPUT, _AllowListUnpickler.load_binput),
        (pickle.LONG_BINPUT, _AllowListUnpickler.load_long_binput),
        (pickle.MEMOIZE, _AllowListUnpickler.load_memoize),
        (pickle.INST, _AllowListUnpickler._refusing("INST")), (pickle.OBJ, _AllowListUnpickler._refusing("OBJ")),
        (pickle.EXT1, _AllowListUnpickler._refusing("EXT1")), (pickle.EXT2, _AllowListUnpickler._refusing("EXT2")),
        (pickle.EXT4, _AllowListUnpickler._refusing("EXT4")),
        (pickle.PERSID, _AllowListUnpickler._refusing("PERSID")),
        (pickle.BINPERSID, _AllowListUnpickler._refusing("BINPERSID"))):
    _AllowListUnpickler.dispatch[_code[0]] = _fn
for _code in (pickle.EMPTY_DICT, pickle.DICT, pickle.EMPTY_LIST, pickle.LIST, pickle.EMPTY_SET):
    _AllowListUnpickler.dispatch[_code[0]] = _AllowListUnpickler._creating(_code)
del _code, _fn


def load_pickle(source: Source, what: str, kind: str = ".metadata", limit: Optional[int] = None):
    """A plain pickle (a path or its bytes, at most `limit` bytes, by default LIMITS[kind]), e.g. a
    torch_dist `.metadata`, through the allow-list.

    DCP metadata (only the globals of _FAST) is read by the C unpickler under the guards of
    _fast_load; a refusal there, or a pickle that names other allowed globals, goes through the
    pure-Python unpickler, whose verdict and words are the rule (for a refused file larger than
    PURE_RETRY_BYTES the fast path's own line stands: the pure-Python reading of it would take minutes)."""
    limit = LIMITS[kind] if limit is None else limit
    try:
        if isinstance(source, (bytes, bytearray)):
            data = bytes(source)
        else:
            folder, name = os.path.split(os.path.abspath(os.fspath(source)))
            data = InputRoot(folder, "checkpoint").read_bytes(name, kind)
    except OSError as e:
        raise _unreadable(what, e) from None
    if len(data) > limit:
        raise _unsafe(what, f"it holds {len(data)} bytes, more than any real {kind} ({limit} bytes)")
    try:
        return _fast_load(data, what)
    except _NotFast:
        pass
    except UnsafeCheckpointError:
        if len(data) > PURE_RETRY_BYTES:
            raise
    return _pure_load(data, what)


def _pure_load(data: bytes, what: str):
    unpickler = _AllowListUnpickler(io.BytesIO(data), what)
    try:
        return unpickler.load()
    except UnsafeCheckpointError:
        raise
    except RecursionError:
        raise _unsafe(what, "it nests deeper than any real checkpoint pickle") from None
    except Exception as e:  # noqa: BLE001 - any other failure of a damaged pickle is "unreadable"
        raise _unreadable(what, e) from None


# ------------------------------------------------------------------------------ DCP metadata, at C speed
# A 405B run's `.metadata` holds over a million chunks (~160 MB of pickle), where any Python work per
# opcode costs more than DCP's own read. So DCP metadata is read by CPython's C unpickler, with what
# the pure-Python one enforces per opcode made to hold another way:
#   - globals: find_class answers for _FAST only (classes whose construction touches nothing but the
#     new object), and only what it returned is callable, so REDUCE / NEWOBJ / OBJ / INST construct
#     _FAST classes; persistent ids are refused; another allow-listed global sends the file to the
#     pure-Python unpickler (_NotFast), anything else is refused by name;
#   - BUILD on something the file did not create: the only shared objects a file can reach are the
#     _FAST classes, their enum members and torch.serialization._get_layout (torch.Size /
#     OrderedDict are immutable types, torch dtypes / layouts take no attributes). Their state is
#     compared after the load; a change is undone and refused. During the load only _FAST callables
#     can be reached, so the window can do no more than fail the load (its unraisable exceptions
#     are kept off stderr);
#   - memo: checked on the final memo (_memo_problem); an index that would grow the memo array (a
#     9-byte file asking for 2**27 slots) fails against the memory bound before it is filled;
#   - memory: the data segment may grow by at most fast_load_allowance(len(data)) (RLIMIT_DATA,
#     restored after); where the limit cannot be set the pure-Python unpickler reads the file.
_FAST = frozenset(n for n in ALLOWED if n.startswith(f"{_DCP}.") and ".planner." not in n) | frozenset(
    (f"{_DCP}.planner.SavePlan", f"{_DCP}.planner.WriteItem", f"{_DCP}.planner.WriteItemType",
     f"{_DCP}.planner.TensorWriteData", f"{_DCP}.planner.BytesIOWriteData", "torch.Size",
     "torch.serialization._get_layout", "collections.OrderedDict"))
PURE_RETRY_BYTES = 16 << 20  # a refused file up to this size is re-read by the pure-Python unpickler for its words
FAST_ALLOWANCE_BASE = 256 << 20
FAST_ALLOWANCE_PER_BYTE = 24  # a real .metadata grows the heap by ~10x its size when unpickled


def fast_load_allowance(size: int) -> int:
    """The most bytes the data segment may grow while the C unpickler reads `size` bytes of pickle."""
    return FAST_ALLOWANCE_BASE + FAST_ALLOWANCE_PER_BYTE * size


class _NotFast(Exception):
    """The file needs the pure-Python unpickler (another allowed global, or no memory limit here)."""


_fast_globals: Optional[dict] = None


def _fast_objects() -> dict:
    """The _FAST names resolved once (DCP's modules are imported with torch)."""
    global _fast_globals
    if _fast_globals is None:
        resolved = {n: _resolve(n) for n in _FAST}
        _fast_globals = {n: v for n, v in resolved.items() if v is not None}
    return _fast_globals


def _shared_state() -> list:
    """(object, its attributes) for every shared object a fast-path file can reach and change."""
    found = []
    for obj in _fast_objects().values():
        if isinstance(obj, type) and issubclass(obj, enum.Enum):
            found += [(m, dict(vars(m))) for m in obj]
        if hasattr(obj, "__dict__"):
            found.append((obj, dict(vars(obj))))
    return found


def _changed(state: list) -> list:
    """The objects of _shared_state whose attributes differ now; their attributes are put back."""
    changed = []
    for obj, before in state:
        now = vars(obj)
        if len(now) == len(before) and all(now.get(k, _changed) is v for k, v in before.items()):
            continue
        changed.append(obj)
        for key in [k for k in now if k not in before]:
            with contextlib.suppress(AttributeError, TypeError):
                delattr(obj, key) if isinstance(obj, type) or callable(obj) else now.pop(key)
        for key, value in before.items():
            if now.get(key, _changed) is not value:
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(obj, key, value) if isinstance(obj, type) or callable(obj) else now.__setitem__(key, value)
    return changed


class _FastUnpickler(pickle.Unpickler):
    def __init__(self, file, what: str):
        super().__init__(file)
        self.what = what
        self._fast = _fast_objects()

    def find_class(self, module: str, name: str):
        full = f"{module}.{name}"
        found = self._fast.get(full)
        if found is not None:
            return found
        if _is_torch_constant(module, name):
            return vars(sys.modules["torch"])[name]
        if full in _ALLOWED:
            raise _NotFast(full)
        raise _refusal(self.what, [full])

    def persistent_load(self, pid):
        raise _unsafe(self.what, "it uses a persistent id, which checkpoint pickles never need")


@contextlib.contextmanager
def _data_limit(allowance: int):
    """RLIMIT_DATA at the current data segment + `allowance` for the block, then as it was."""
    try:
        import resource  # optional: Unix only

        with open("/proc/self/status") as f:
            vm_data = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        new = vm_data + allowance
        if hard != resource.RLIM_INFINITY:
            new = min(new, hard)
        if soft != resource.RLIM_INFINITY:
            new = min(new, soft)
        resource.setrlimit(resource.RLIMIT_DATA, (new, hard))
    except (ImportError, OSError, ValueError, StopIteration):
        raise _NotFast("no data-segment limit on this system") from None
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


_EXACT_MEMO_SLOTS = 1 << 16


def _memo_slots(unpickler) -> int:
    """The length of the C unpickler's memo array (its __sizeof__ counts 8 bytes a slot over a fixed part;
    marks and line buffers add a little, so this is an upper bound)."""
    fresh = pickle.Unpickler(io.BytesIO(b""))
    return 32 + (unpickler.__sizeof__() - fresh.__sizeof__()) // 8


def _memo_problem(unpickler, size: int) -> Optional[str]:
    """Why the memo is not what a pickler writes, or None. Each memo write costs at least one byte,
    so a memo array beyond twice the file's length (it grows by doubling) numbered a slot the file
    never reached; a memo of up to _EXACT_MEMO_SLOTS slots is read whole: indices 0, 1, 2, ... without
    a hole (reading a million-slot memo whole would cost half the load)."""
    slots = _memo_slots(unpickler)
    if slots > 2 * max(size, 32) + 64:
        return f"its memo writes number slots beyond the {size} memo writes a file of {size} bytes can make"
    if slots <= _EXACT_MEMO_SLOTS:
        memo = unpickler.memo.copy()
        if memo and max(memo) >= len(memo):
            return (f"its memo writes reach slot {max(memo)} with {len(memo)} slots written (a real pickler "
                    "numbers them 0, 1, 2, ...)")
    return None


def _fast_load(data: bytes, what: str):
    """DCP metadata through the C unpickler, under the guards described above _FAST."""
    if "torch" not in sys.modules:
        raise _NotFast("torch is not imported")  # no DCP metadata can be read without it anyway
    state = _shared_state()
    unpickler = _FastUnpickler(io.BufferedReader(io.BytesIO(data)), what)
    unraisable, hook = [], sys.unraisablehook
    gc_was_on = gc.isenabled()
    result = failure = None
    try:
        sys.unraisablehook = unraisable.append
        gc.disable()  # the load makes millions of objects and no cycles: collecting in between only costs
        with _data_limit(fast_load_allowance(len(data))):
            try:
                result = unpickler.load()
            except (UnsafeCheckpointError, _NotFast) as e:
                failure = e
            except MemoryError:
                failure = _unsafe(what, f"unpickling it needs more memory than a real pickle of {len(data)} bytes")
            except RecursionError:
                failure = _unsafe(what, "it nests deeper than any real checkpoint pickle")
            except Exception as e:  # noqa: BLE001 - any other failure of a damaged pickle is "unreadable"
                failure = _unreadable(what, e)
    finally:
        changed = _changed(state)
        if gc_was_on:
            gc.enable()
        sys.unraisablehook = hook
    if changed:
        shown = ", ".join(sorted({(o.__qualname__ if isinstance(o, type) else getattr(o, "__qualname__", None))
                                  or f"{type(o).__name__} {o!s}"[:80] for o in changed}))
        raise _unsafe(what, f"its BUILD opcode would change {shown}, which the file did not create (only "
                            "objects built by the pickle itself may be filled in)")
    if failure is not None:
        raise failure
    problem = _memo_problem(unpickler, len(data))
    if problem:
        raise _unsafe(what, problem)
    return result
