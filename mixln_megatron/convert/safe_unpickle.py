"""Unpickling checkpoint files without running code from them.

Always `torch.load(weights_only=True)`. Classes the args refer to that are not plain data
(megatron enums, numpy RNG state) are replaced by inert stand-ins, so neither megatron nor any
code from the checkpoint is imported or run.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import pickle
import re
import types
import zipfile
from typing import Dict

import torch

from . import ConversionError

_ALLOWED_REAL = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, pathlib.PurePosixPath]
_KNOWN_STUBS = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.enums.ModelType",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "signal.Signals",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.dtypes.UInt32DType",
)
_stub_cache: Dict[str, type] = {}


def _stub(name: str) -> type:
    """An inert stand-in for a class a checkpoint pickled (enum, config, numpy array...)."""
    if name not in _stub_cache:
        module, _, qual = name.rpartition(".")

        def __init__(self, *args, **kwargs):
            self._args, self._kwargs = args, kwargs

        def __setstate__(self, state):
            self._state = state

        def __repr__(self):
            return f"<{name} {getattr(self, '_args', ())!r} (not loaded)>"

        _stub_cache[name] = type(qual.split(".")[-1], (), {
            "__init__": __init__, "__setstate__": __setstate__, "__repr__": __repr__, "__module__": module,
        })
    return _stub_cache[name]


_UNSUPPORTED_GLOBAL = re.compile(r"GLOBAL ([\w\.]+) was not an allowed global")


def safe_load(source, *, mmap: bool = False, what: str = "checkpoint file"):
    """torch.load(weights_only=True) of a path or a bytes buffer, stubbing non-data classes."""
    registered = set()
    for entry in torch.serialization.get_safe_globals():
        if isinstance(entry, tuple):
            registered.add(entry[1])
        else:
            registered.add(f"{getattr(entry, '__module__', '')}.{getattr(entry, '__qualname__', '')}")
    # Names registered by the process (e.g. by megatron.core when it is imported) keep their real class.
    # Entries added here are removed again on exit, so none may duplicate an existing registration.
    extra = [c for c in _ALLOWED_REAL if f"{c.__module__}.{c.__qualname__}" not in registered]
    extra += [(_stub(n), n) for n in _KNOWN_STUBS if n not in registered]
    for _ in range(100):
        if isinstance(source, (bytes, bytearray)):
            src = io.BytesIO(source)
        else:
            src = source
        try:
            with torch.serialization.safe_globals(extra):
                return torch.load(src, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as e:
            match = _UNSUPPORTED_GLOBAL.search(str(e))
            if not match:
                raise ConversionError(f"cannot unpickle {what} safely: {e}") from None
            extra.append((_stub(match.group(1)), match.group(1)))
        except (RuntimeError, EOFError, OSError, zipfile.BadZipFile) as e:
            raise ConversionError(f"{what} is unreadable (truncated or corrupt?): {e}") from None
    raise ConversionError(f"cannot unpickle {what}: too many unknown classes")
