"""Locating one saved iteration of a Megatron-LM checkpoint and telling its format.

The --load folder is untrusted input (mixln_megatron.input_root): the folder is resolved once,
every directory stepped into (iter_XXXXXXX, release) stays inside it, the tracker and
metadata.json are read as bounded regular files, and `--ckpt-step` is a number or 'release',
never a path (`../../etc`, `1/../../x` are refused with one line).
"""

from __future__ import annotations

import os
import re
from typing import Optional, Tuple

from ..errors import ConversionError, UnsupportedModelError
from ..input_root import InputRoot

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
