"""Unpickling checkpoint files as untrusted input: one allow-list of real classes, no fallback.

A checkpoint somebody hands you can hold a pickle that reduces to `os.system(...)`. Every pickle
this project reads from a checkpoint (torch_dist `.metadata`, `common.pt`, the byte items inside
`*.distcp`, legacy `model_optim_rng.pt`) goes through this module:

  load_torch(src, what)    a torch.save archive: torch.load(weights_only=True), with the
                           allow-listed classes the file names (and only those) made loadable
  load_pickle(src, what)   a plain pickle (DCP's `.metadata`): pickle.Unpickler whose find_class
                           answers only for the allow-list

ALLOWED is the allow-list: the classes Megatron-LM and torch.distributed.checkpoint really put in
checkpoints (argparse args with megatron enums, numpy RNG state, DCP metadata dataclasses), named
as pickle names them and imported from their trusted, installed modules only when a file needs
them. Anything else is refused before it is called, with one line naming the file and the global
(UnsafeCheckpointError, exit 2 from the commands); garbage, truncated and empty files are refused
the same way. The pattern is megatron-core's `safe_globals.py`; torch's own weights-only
unpickler does the work for torch.save archives.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import pickletools
import re
import struct
import zipfile
from typing import Iterable, Union

from .errors import UnsafeCheckpointError

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
)
_ALLOWED = frozenset(ALLOWED)
_NOT_ALLOWED = re.compile(r"GLOBAL (\S+) was not an allowed global")
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
    """torch dtypes and layouts pickle as globals of the torch module (`torch float32`)."""
    import torch

    return module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout))


def _refusal(what: str, names: Iterable[str]) -> UnsafeCheckpointError:
    names = sorted(set(names))
    return UnsafeCheckpointError(f"{what}: refused to unpickle: it needs {', '.join(repr(n) for n in names)}, "
                                 f"which {'is' if len(names) == 1 else 'are'} not on the allow-list of checkpoint "
                                 f"classes ({_HINT})")


def _unreadable(what: str, error: BaseException) -> UnsafeCheckpointError:
    detail = " ".join(str(error).split())[:200] or type(error).__name__
    return UnsafeCheckpointError(f"{what} is unreadable (empty, truncated or not a checkpoint file?): {detail}")


Source = Union[str, os.PathLike, bytes, bytearray]


def load_torch(source: Source, what: str, *, mmap: bool = False):
    """A torch.save archive (a path or its bytes), loaded with torch's weights-only unpickler.

    The globals the file needs beyond torch's own safe set are read first without running
    anything (torch.serialization.get_unsafe_globals_in_checkpoint); any not in ALLOWED refuses
    the file; the allowed ones are made loadable for this call only.
    """
    import torch

    def opened():
        return io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source

    try:
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(opened())
    except (ValueError, RuntimeError, OSError, EOFError, KeyError, zipfile.BadZipFile, pickle.UnpicklingError,
            IndexError, struct.error) as e:
        # torch's scan reads the protocol torch.save writes; name what another protocol asks for
        forbidden = [n for n in _archive_globals(opened()) if n not in _ALLOWED and not n.startswith("torch.")]
        raise (_refusal(what, forbidden) if forbidden else _unreadable(what, e)) from None
    forbidden = [n for n in needed if n not in _ALLOWED]
    classes = [_resolve(n) for n in needed]
    forbidden += [n for n, c in zip(needed, classes) if c is None and n not in forbidden]
    if forbidden:
        raise _refusal(what, forbidden)
    try:
        with torch.serialization.safe_globals(classes):
            return torch.load(opened(), map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        match = _NOT_ALLOWED.search(str(e))  # a global the static scan could not see
        if match:
            raise _refusal(what, [match.group(1)]) from None
        raise _unreadable(what, e) from None
    except (RuntimeError, ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile, IndexError, TypeError,
            AttributeError, struct.error) as e:
        raise _unreadable(what, e) from None


def _archive_globals(source) -> list:
    """The globals the data.pkl of a torch.save zip names, by a static scan (nothing is run); [] if unreadable."""
    try:
        with zipfile.ZipFile(source) as archive:
            name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
            data = archive.read(name)
        names, strings, memo = [], [], {}
        for op, arg, _ in pickletools.genops(data):
            if isinstance(arg, str) and "UNICODE" in op.name or op.name == "STRING":
                strings.append(arg)
            elif op.name in ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE") and strings:
                memo[len(memo) if op.name == "MEMOIZE" else arg] = strings[-1]
            elif op.name in ("BINGET", "LONG_BINGET", "GET") and arg in memo:
                strings.append(memo[arg])
            elif op.name == "GLOBAL":
                names.append(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
        return names
    except Exception:  # noqa: BLE001 - only used to word a refusal
        return []


class _AllowListUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only allow-listed globals; nothing else can be called."""

    what = "pickle"

    def find_class(self, module: str, name: str):
        full = f"{module}.{name}"
        if full in _ALLOWED:
            found = _resolve(full)
            if found is not None:
                return found
        elif _is_torch_constant(module, name):
            import torch

            return getattr(torch, name)
        raise _refusal(self.what, [full])

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not used by plain checkpoint pickles")


def load_pickle(source: Source, what: str):
    """A plain pickle (a path or its bytes), e.g. a torch_dist `.metadata`, through the allow-list."""
    try:
        if isinstance(source, (bytes, bytearray)):
            data = bytes(source)
        else:
            with open(source, "rb") as f:
                data = f.read()
    except OSError as e:
        raise _unreadable(what, e) from None
    unpickler = _AllowListUnpickler(io.BytesIO(data))
    unpickler.what = what
    try:
        return unpickler.load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any other failure of a damaged pickle is "unreadable"
        raise _unreadable(what, e) from None
