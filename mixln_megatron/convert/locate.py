"""Locating one saved iteration of a Megatron-LM checkpoint and telling its format."""

from __future__ import annotations

import os
import re
from typing import Optional, Tuple

from ..errors import ConversionError, UnsupportedModelError

TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def resolve_checkpoint_dir(load: str, iteration: Optional[int] = None) -> Tuple[str, str]:
    """(directory of one saved iteration, its label) for a Megatron-LM --save directory.

    `load` is the --save/--load directory (with latest_checkpointed_iteration.txt), or one of its
    iter_XXXXXXX / release directories directly.
    """
    load = os.path.abspath(load)
    if not os.path.isdir(load):
        raise ConversionError(f"not a Megatron-LM checkpoint: {load} does not exist or is not a directory")
    if iteration is not None:
        name = "release" if str(iteration) == "release" else f"iter_{int(iteration):07d}"
        path = os.path.join(load, name)
        if not os.path.isdir(path):
            found = sorted(d for d in os.listdir(load) if d.startswith("iter_") or d == "release")
            raise ConversionError(
                f"{load} has no {name}/ directory for --iteration {iteration}"
                + (f" (found: {', '.join(found[-8:])})" if found else "")
            )
        return path, name
    tracker = os.path.join(load, TRACKER)
    if os.path.isfile(tracker):
        try:
            with open(tracker, "rb") as f:
                text = f.read(64).decode("ascii").strip()  # an iteration number or "release", nothing more
        except (OSError, UnicodeDecodeError) as e:
            raise ConversionError(f"{tracker} is unreadable (it should hold an iteration number): {e}") from None
        if text == "release":
            name = "release"
        else:
            try:
                name = f"iter_{int(text):07d}"
            except ValueError:
                raise ConversionError(f"{tracker} does not hold an iteration number: {text!r}") from None
        path = os.path.join(load, name)
        if not os.path.isdir(path):
            raise ConversionError(f"{tracker} names {name}, but {path} does not exist (incomplete checkpoint?)")
        return path, name
    if detect_format(load, quiet=True) is not None:
        return load, os.path.basename(load)
    found = sorted(d for d in os.listdir(load) if d.startswith("iter_"))
    if found:
        raise ConversionError(
            f"{load} has no {TRACKER}; pass --iteration N (found: {', '.join(found[-8:])})"
        )
    raise ConversionError(
        f"not a Megatron-LM checkpoint: {load} has no {TRACKER}, no iter_*/release directory, and no "
        "torch_dist (.metadata, metadata.json) or legacy (mp_rank_*/model_optim_rng.pt) files"
    )


def detect_format(path: str, quiet: bool = False) -> Optional[str]:
    entries = os.listdir(path)
    if "metadata.json" in entries:
        import json

        try:
            config = json.load(open(os.path.join(path, "metadata.json")))
        except (OSError, ValueError) as e:
            raise ConversionError(f"{path}/metadata.json is unreadable: {e}") from None
        backend = config.get("sharded_backend")
        if backend != "torch_dist":
            raise UnsupportedModelError(
                f"{path} is a distributed checkpoint with sharded_backend {backend!r}; only torch_dist is supported"
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
