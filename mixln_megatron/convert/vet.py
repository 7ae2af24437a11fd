"""Vetting a Megatron-LM checkpoint before anything unpickles it without an allow-list.

Megatron-LM's own load path unpickles with plain pickle (`.metadata`, common.pt, every byte item,
legacy rank files, TE's `_extra_state`); a checkpoint is untrusted input, so before Megatron-LM
sees a folder every pickle its load will touch is read here through mixln_megatron.safe_unpickle's
allow-list, confined by mixln_megatron.input_root (what is read: docs/untrusted-input.md):

    vet_checkpoint(load, iteration=None)   one saved iteration: VetReport
    vet_load_args(args)                    what Megatron-LM's load would read for these args
                                           (--load, --ckpt-step, --pretrained-checkpoint)
    check_byte_item(raw, key, where)       one byte item, as the readers and the converters check it
    check_load_dir(load)                   the --spec edge's release check, reading no pickle

A refusal is a MixLNError: one line, exit 2. Tensors are not read (DCP loads them weights-only).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import time
import types
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

from .. import errors
from ..errors import (ConversionError, MixLNError, UnsafeCheckpointError, UnsafeInputError,
                      UnsupportedModelError)
from ..input_root import InputRoot
from ..safe_unpickle import load_pickle, load_torch
from .dcp_files import DCPFiles
from .megatron_reader import LEGACY_DIR, TRACKER, announce_checkpoint_read, resolve_checkpoint_dir

EXTRA_STATE = "_extra_state"
NON_PERSISTENT_SUBDIR = "non_persistent"  # Megatron-LM's default global non-persistent folder under --load
MAX_NESTED = 100_000  # values walked inside one unpickled item (a real one holds a few hundred)


# ------------------------------------------------------------------------------ one byte item
def is_extra_state(key: str) -> bool:
    """Whether the byte item `key` (`<name>/shard_...`) is a module's `_extra_state` (TE unpickles it again)."""
    return key.split("/", 1)[0].endswith(EXTRA_STATE)


def check_byte_item(raw: bytes, key: str, where: str):
    """The value of one .distcp byte item (a torch.save archive) read through the allow-list, and
    what Megatron-LM / TE would unpickle again from it checked the same way; returns the value.
    `where` names the .distcp file (or the checkpoint) in the refusal line."""
    what = f"{where} (item {key})"
    value = load_torch(bytes(raw), what=what)
    check_nested(value, what, extra_state=is_extra_state(key))
    return value


def check_nested(value, what: str, extra_state: bool = False) -> None:
    """Pickles inside an unpickled value that a later load unpickles again: an io.BytesIO (TE's old
    extra state, loaded with torch.load) through load_torch; in an `_extra_state` item or under a
    `*_extra_state` key (legacy files), a uint8 tensor's bytes (TE 2.x: `pickle.loads(
    tensor.numpy().tobytes())`) through load_pickle."""
    stack, seen = [(value, extra_state)], 0
    while stack:
        item, extra = stack.pop()
        seen += 1
        if seen > MAX_NESTED:
            raise UnsafeCheckpointError(f"{what} holds more than {MAX_NESTED} nested values; refused as a "
                                        "safety bound (a crafted file?)")
        if isinstance(item, io.BytesIO):
            stack.append((load_torch(item.getvalue(), what=f"{what}, its io.BytesIO"), extra))
        elif isinstance(item, torch.Tensor):
            if extra and item.dtype == torch.uint8 and item.dim() == 1 and item.numel():
                load_pickle(item.detach().cpu().numpy().tobytes(),
                            what=f"{what}, TransformerEngine's pickled extra state")
        elif isinstance(item, dict):
            stack.extend((v, extra or (isinstance(k, str) and k.endswith(EXTRA_STATE))) for k, v in item.items())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend((v, extra) for v in item)
        elif isinstance(item, (argparse.Namespace, types.SimpleNamespace)):
            stack.extend((v, extra) for v in vars(item).values())


# ------------------------------------------------------------------------------ one iteration
@dataclass
class VetReport:
    """What vet_checkpoint read: the iteration directory and how many pickles of each kind."""

    path: str
    format: str
    pickles: dict = field(default_factory=dict)
    seconds: float = 0.0

    def count(self, kind: str, n: int = 1) -> None:
        self.pickles[kind] = self.pickles.get(kind, 0) + n

    def line(self) -> str:
        what = ", ".join(f"{n} {kind}" for kind, n in self.pickles.items()) or "no pickles"
        return (f"{self.path}: clean ({self.format}; read through the allow-list: {what}; "
                f"{self.seconds:.2f} s)")


def vet_checkpoint(load: str, iteration=None) -> VetReport:
    """Vet one saved iteration of `load` (the tracker's, `iteration`'s, or `load` itself when it is
    an iter_* / release directory); a refusal raises a MixLNError naming the file."""
    path, _ = resolve_checkpoint_dir(load, iteration)
    return vet_iteration_dir(path)


def vet_iteration_dir(path: str) -> VetReport:
    """Vet one iteration directory: torch_dist / torch DCP (.metadata) or legacy (mp_rank_*)."""
    t0 = time.time()
    root = InputRoot(path, "checkpoint")
    entries = root.listdir()
    legacy = [e for e in entries if LEGACY_DIR.match(e)]
    if ".metadata" in entries or "metadata.json" in entries:
        report = VetReport(path, "torch_dist" if "metadata.json" in entries else "torch_dcp")
        _vet_dcp(root, entries, report)
    elif legacy:
        report = VetReport(path, "torch (legacy)")
    else:
        raise ConversionError(f"{path} holds no Megatron-LM checkpoint (no .metadata, metadata.json or "
                              "mp_rank_* directories): nothing to load")
    for name in legacy:
        sub = root.sub(name)
        for rel in sub.listdir():
            if rel.endswith(".pt"):
                shown = os.path.join(path, name, rel)
                check_nested(load_torch(sub.check_file(rel), what=shown, mmap=True), shown)
                report.count("legacy .pt files")
    report.seconds = time.time() - t0
    return report


def _vet_dcp(root: InputRoot, entries: List[str], report: VetReport) -> None:
    if "metadata.json" in entries:
        root.read_json("metadata.json", "metadata.json")
    if ".metadata" not in entries:
        raise ConversionError(f"{root.given} has metadata.json but no .metadata (incomplete torch_dist checkpoint)")
    files = DCPFiles(root.given)  # .metadata through the allow-list, confined
    report.count(".metadata")
    for rel in entries:
        if rel.endswith(".pt"):  # common.pt, and any other torch.save file megatron may read here
            shown = os.path.join(root.given, rel)
            check_nested(load_torch(root.read_bytes(rel, "common.pt"), what=shown), shown)
            report.count(rel if rel == "common.pt" else "other .pt files")
    for key in sorted(files.objects):
        check_byte_item(files.read_raw(key), key, item_file(files, key))
        report.count("byte items")


def item_file(files, key: str) -> str:
    """The .distcp file a byte item lies in (for the refusal line), else the checkpoint directory."""
    return files._item_file(key)


# ------------------------------------------------------------------------------ Megatron-LM's load
def megatron_iteration_dir(load: Optional[str], ckpt_step=None) -> Optional[str]:
    """The iteration directory Megatron-LM's load_checkpoint reads for --load `load` (its tracker,
    --ckpt-step overriding the iteration), or None where it loads nothing (no --load, no tracker)."""
    if not load or not os.path.isdir(load):
        return None
    has_tracker = os.path.lexists(os.path.join(load, TRACKER))
    if not has_tracker and not ckpt_step:
        return None  # Megatron-LM starts from scratch
    release = False
    if has_tracker:
        path, label = resolve_checkpoint_dir(load)  # the tracker read as Megatron does, or one line
        release = label == "release"
        if not ckpt_step:
            return path
    return resolve_checkpoint_dir(load, "release" if release else int(ckpt_step))[0]


def vet_load_args(args) -> List[VetReport]:
    """Vet what Megatron-LM's load would read for parsed Megatron-LM `args`, before it reads it:
    --load (and the release check of check_load_dir), --pretrained-checkpoint, and a global
    non-persistent checkpoint. Returns one VetReport per vetted iteration.

    Once per node (once_per_node): one local rank vets, the others take its verdict (a refusal
    is raised on each of them with the same line)."""
    step = getattr(args, "ckpt_step", None)
    strict = getattr(args, "dist_ckpt_strictness", None)  # whether Megatron's load reads the tensor metadata
    paths, done = [], set()
    targets = [(getattr(args, "load", None), step), (getattr(args, "pretrained_checkpoint", None), None)]
    if getattr(args, "non_persistent_ckpt_type", None) == "global":
        folder = getattr(args, "non_persistent_global_ckpt_dir", None) or (
            os.path.join(args.load, NON_PERSISTENT_SUBDIR) if getattr(args, "load", None) else None)
        targets.append((folder, None))
    for load, ckpt_step in targets:
        path = megatron_iteration_dir(load, ckpt_step)
        if path is None or os.path.realpath(path) in done:
            continue
        done.add(os.path.realpath(path))
        paths.append(path)

    def vet() -> list:
        reports = []
        for path in paths:
            announce_checkpoint_read(path)  # a large .metadata takes a while: say so first (this rank only)
            reports.append(dataclasses.asdict(vet_iteration_dir(path)))  # first: a payload is named as such
            _check_release(path, strict)
        # A --load folder that is itself one saved iteration (no tracker: Megatron-LM would silently start
        # from scratch) of a newer release is refused too, as the --spec edge does.
        check_load_dir(getattr(args, "load", None), strict)
        return reports

    return [VetReport(**r) for r in once_per_node(_identity(paths, getattr(args, "load", None)), vet) or []]


def _identity(paths: List[str], load: Optional[str]) -> str:
    """What the verdict is about: each iteration directory and its `.metadata` / `common.pt` as they are now."""
    def stamp(path):
        try:
            st = os.stat(path)
            return [st.st_ino, st.st_size, st.st_mtime_ns]
        except OSError:
            return None
    return json.dumps([[os.path.realpath(p), stamp(p), stamp(os.path.join(p, ".metadata")),
                        stamp(os.path.join(p, "common.pt"))] for p in paths] + [os.path.realpath(load or "")])


# ------------------------------------------------------------------------------ the --spec edge
def check_load_dir(load: Optional[str], strict=None) -> None:
    """compat.check_readable for the iteration a Megatron-LM --load directory would resume from
    (a megatron-core 0.19+ checkpoint on 0.17 / 0.18, or a load at `strict` whose metadata read fails
    on this torch: one line before Megatron reads it). Reads no pickle; what the checkpoint holds is
    vet_load_args' part."""
    if not load:
        return
    try:
        directory, _ = resolve_checkpoint_dir(load)
    except (OSError, ValueError, MixLNError):
        return  # nothing to load yet, or not a layout we know: Megatron decides
    _check_release(directory, strict)


def _check_release(directory: str, strict=None) -> None:
    from .. import compat  # imports megatron.core: only where a release is loading

    compat.check_readable(directory, strict)


# ------------------------------------------------------------------------------ once per node
# Vetting a 405B run's checkpoint reads a `.metadata` of ~160 MB and stats every `.distcp`; done by
# every local rank it costs the node's memory and the file system that many times over.
_REFUSALS = {cls.__name__: cls for cls in (MixLNError, ConversionError, UnsupportedModelError, UnsafeCheckpointError,
                                            UnsafeInputError)}


def once_per_node(subject: str, vet: Callable[[], Optional[object]]):
    """vet() on one local rank of the node (the first to claim `subject`, errors.NodeClaim); the
    others wait for its verdict and take it: its JSON-able summary when clean, its refusal raised
    again here (same class, same line) so every rank still ends with exit 2 and one line. A claimer
    that dies without a verdict (or leaves one saying it failed otherwise) costs time, never
    safety: the waiting rank vets for itself, as does a process alone or without a temp directory."""
    if errors._local_ranks() <= 1:
        return vet()
    try:
        claim = errors.NodeClaim("vet", subject)
        taken = claim.take()
    except OSError:
        return vet()
    verdict = claim.path(".verdict")
    if not taken:
        if claim.wait(lambda: os.path.exists(verdict)):
            with open(verdict) as f:
                given = json.load(f)
            if given.get("clean"):
                return given.get("summary")
            if given.get("refused"):
                raise _REFUSALS.get(given["refused"], MixLNError)(given["line"])
        return vet()
    try:
        result = vet()
    except MixLNError as error:
        _write_verdict(verdict, {"refused": type(error).__name__, "line": str(error)})
        raise
    except BaseException:
        _write_verdict(verdict, {"failed": True})  # the others vet for themselves
        raise
    try:
        json.dumps(result)
        summary = result
    except (TypeError, ValueError):
        summary = None
    _write_verdict(verdict, {"clean": True, "summary": summary})
    return result


def _write_verdict(path: str, verdict: dict) -> None:
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as f:
        json.dump(verdict, f)
    os.replace(partial, path)  # a waiter sees the whole verdict or none
