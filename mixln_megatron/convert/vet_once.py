"""One vetting per node: the local ranks of a job share one verdict on a checkpoint.

Vetting a 405B run's checkpoint reads a `.metadata` of ~160 MB and stats every `.distcp`; done by
every rank of a node it costs the node's memory and the file system that many times over. So the
first local rank to arrive claims the vetting (an O_EXCL file in the node's temp directory, keyed
like mixln_megatron.errors' claims: the launcher process, the rendezvous and the run, plus the
checkpoint's identity), vets, and writes the verdict; the other local ranks wait for it and take it:

    once_per_node(subject, vet)     vet() here, or the claimer's verdict: None when clean, else the
                                    claimer's refusal raised again here (same class, same line), so a
                                    refusal still ends every rank with exit 2 and one line

If the claimer dies without a verdict (or leaves one saying it failed otherwise), a waiting rank
vets for itself: a lost verdict costs time, never safety. A process without a launcher (or one
rank per node) vets alone, as does any process that cannot use the temp directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from typing import Callable, Optional

from .. import errors

POLL_S = 0.05
_REFUSALS = {cls.__name__: cls for cls in (errors.MixLNError, errors.ConversionError, errors.UnsupportedModelError,
                                            errors.UnsafeCheckpointError, errors.UnsafeInputError)}


def _paths(subject: str):
    key = "\0".join([errors._launcher_identity(), os.environ.get("MASTER_ADDR", ""),
                     os.environ.get("MASTER_PORT", ""), os.environ.get("TORCHELASTIC_RUN_ID", ""),
                     os.environ.get("TORCHELASTIC_RESTART_COUNT", ""), subject])
    name = hashlib.sha256(key.encode()).hexdigest()[:32]
    folder = os.path.join(tempfile.gettempdir(), f"mixln_megatron-vet-{os.getuid()}")
    return folder, os.path.join(folder, name + ".claim"), os.path.join(folder, name + ".verdict")


def _write(path: str, verdict: dict) -> None:
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as f:
        json.dump(verdict, f)
    os.replace(partial, path)  # a waiter sees the whole verdict or none


def once_per_node(subject: str, vet: Callable[[], Optional[object]]):
    """vet() on one local rank of the node; the others take its verdict (module docstring). Returns
    what vet() returned where it ran here, else the claimer's JSON-able summary of it."""
    if errors._local_ranks() <= 1:
        return vet()
    try:
        folder, claim, verdict = _paths(subject)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return _take_verdict(claim, verdict, vet)
    except OSError:
        return vet()
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    errors._prune(folder)
    try:
        result = vet()
    except errors.MixLNError as error:
        _write(verdict, {"refused": type(error).__name__, "line": str(error)})
        raise
    except BaseException:
        _write(verdict, {"failed": True})  # the others vet for themselves
        raise
    _write(verdict, {"clean": True, "summary": _summary(result)})
    return result


def _summary(result):
    try:
        json.dumps(result)
        return result
    except (TypeError, ValueError):
        return None


def _take_verdict(claim: str, verdict: str, vet: Callable[[], Optional[object]]):
    while True:
        if os.path.exists(verdict):
            with open(verdict) as f:
                given = json.load(f)
            if given.get("clean"):
                return given.get("summary")
            if given.get("refused"):
                raise _REFUSALS.get(given["refused"], errors.MixLNError)(given["line"])
            return vet()
        try:
            with open(claim) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        if text.isdigit() and not errors._alive(int(text)) and not os.path.exists(verdict):
            return vet()  # the claimer is gone without a verdict
        time.sleep(POLL_S)
