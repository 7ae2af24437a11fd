"""The project's user-facing errors, and how they reach the user: one line.

`MixLNError` is the base of every error that means "the user asked for something wrong or
unsupported" (a bad setting, an unsupported configuration, a refused conversion). Such an error
needs no traceback: the project's own commands print its message as one line and exit 2
(cli.main), and under stock Megatron-LM, whose traceback we cannot suppress, the `--spec` edge
prints the line once on rank 0 before the traceback (`report_once`), so it is the first thing the
user reads instead of ~70 lines of `[rank0]:` frames.

Pure Python: importing this module imports nothing heavy.
"""

from __future__ import annotations

import sys

PREFIX = "[mixln_megatron] ERROR:"


class MixLNError(Exception):
    """Base of the project's user-facing errors; the message says what was wrong and what to do."""


class MixLNConfigError(MixLNError, ValueError):
    """A Mix-LN setting is invalid; the message says which, where it came from and what to do."""


_reported = False


def one_line(error: BaseException) -> str:
    """The error's message on one line (a multi-line message is joined with ' | ')."""
    text = " | ".join(part.strip() for part in str(error).splitlines() if part.strip())
    return text or type(error).__name__


def _rank() -> int:
    torch = sys.modules.get("torch")  # never import torch just to print an error
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def report_once(error: BaseException, file=None) -> bool:
    """Print `[mixln_megatron] ERROR: <message>` on rank 0, the first time only. Returns whether it printed."""
    global _reported
    if _reported:
        return False
    _reported = True
    if _rank() != 0:
        return False
    print(f"{PREFIX} {one_line(error)}", file=file or sys.stderr, flush=True)
    return True


class ConversionError(MixLNError, RuntimeError):
    """A checkpoint or model folder cannot be read or converted; the message says why and what to do."""


class UnsupportedModelError(ConversionError):
    """The checkpoint's model uses a feature the conversion (or Llama) cannot express."""


class UnsafeCheckpointError(ConversionError):
    """A checkpoint file names a global that is not on the allow-list, or is not a readable pickle."""


class UnsafeInputError(ConversionError):
    """A file an input names lies outside the input, is not a regular file, or exceeds its size bound."""
