"""Output that never costs the user data: checks before work, staged writes, clean interrupts.

Used by `convert to-hf | from-hf` (output folders) and `preprocess` (a .bin/.idx pair); the
behaviour a user sees is docs/commands.md#output-safety. `prepare_output` runs the checks
(`check_separate`, `check_replaceable`) and `sweep_stale` before any work; `staged_dir` writes
beside the output and renames it in; `signals_as_interrupt` turns SIGTERM / SIGHUP (what
`timeout`, SLURM and Kubernetes send) into `Interrupted`, so the cleanup runs as for Ctrl-C.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import secrets
import shutil
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Type

from .errors import process_alive, process_start

OWNER_FILE = ".mixln-owner"


class Interrupted(BaseException):
    """SIGTERM / SIGHUP / SIGINT arrived; a BaseException so that `except Exception` does not eat it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


# ----------------------------------------------------------------------------- what may be replaced
@dataclass(frozen=True)
class OutputKind:
    """What a previous export of one direction leaves in its folder."""

    description: str
    required: Tuple[str, ...]  # glob patterns that must each match an entry
    allowed: Tuple[str, ...]  # glob patterns every entry must match


HF_FOLDER = OutputKind(
    "Hugging Face export (config.json + *.safetensors)",
    required=("config.json", "*.safetensors"),
    allowed=("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
             "configuration_*.py", "modeling_*.py", "tokenizer*", "special_tokens_map.json", "vocab.*",
             "merges.txt", "added_tokens.json", "*.model", "chat_template.*"),
)
MEGATRON_FOLDER = OutputKind(
    "Megatron-LM checkpoint (latest_checkpointed_iteration.txt + iter_* / release)",
    required=("latest_checkpointed_iteration.txt",),
    allowed=("latest_checkpointed_iteration.txt", "iter_[0-9]*", "release"),
)


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def output_path(save: str) -> str:
    """Where an output really goes: `save` itself, or the folder a `save` symlink points to (a link
    to a scratch disk is the user's way of putting the output there). Staging then happens next to
    that folder, so the link stays a link and nothing is left beside it."""
    save = os.path.abspath(os.fspath(save))
    return os.path.realpath(save) if os.path.islink(save) else save


def _inside(child: str, parent: str) -> bool:
    return os.path.commonpath([child, parent]) == parent


def check_separate(inputs: Sequence[str], outputs: Sequence[str], error: Type[Exception]) -> None:
    """Refuse when an output equals, contains or lies inside an input (after resolving links and ..)."""
    for src in inputs:
        rs = _real(src)
        for dst in outputs:
            rd = _real(dst)
            if rd == rs:
                how = "is the same path as"
            elif _inside(rs, rd):
                how = "contains"
            elif _inside(rd, rs):
                how = "lies inside"
            else:
                continue
            raise error(
                f"output {dst} ({rd}) {how} the input {src} ({rs}); writing it would delete the input: "
                "choose an output outside the input"
            )


def check_replaceable(save: str, kind: OutputKind, overwrite: bool, error: Type[Exception]) -> None:
    """Refuse an existing output folder unless it is empty, or overwrite is set and it holds only
    what a previous export of `kind` writes."""
    if not os.path.lexists(save):
        return
    if not os.path.isdir(save):
        raise error(f"output path {save} exists and is not a directory")
    entries = sorted(os.listdir(save))
    if not entries:
        return
    if not overwrite:
        raise error(f"output directory {save} exists and is not empty; choose another --save or pass "
                    "--overwrite to replace a previous export")
    unknown = [e for e in entries if not any(fnmatch.fnmatchcase(e, p) for p in kind.allowed)]
    missing = [p for p in kind.required if not any(fnmatch.fnmatchcase(e, p) for e in entries)]
    if unknown or missing:
        what = (f"it holds {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}" if unknown
                else f"it has no {', '.join(missing)}")
        raise error(f"--overwrite replaces only a previous {kind.description}, but {save} is not one: {what}; "
                    "choose another --save")


def prepare_output(inputs: Sequence[str], save: str, kind: OutputKind, overwrite: bool, error: Type[Exception]) -> None:
    """Before any work: refuse an output that overlaps an input or is not ours to replace, and clean
    up what interrupted runs into the same output left behind."""
    check_separate(inputs, [save], error)
    sweep_stale(save)
    check_replaceable(os.path.abspath(save), kind, overwrite, error)


# ----------------------------------------------------------------------------- owners and stale temporaries
def _owner_record() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": process_start(os.getpid())}


def _temp_pattern(base: str, suffix: str = "") -> re.Pattern:
    return re.compile(rf"^\.{re.escape(base)}\.(tmp|old)-?(\d+)-[0-9a-f]+{re.escape(suffix)}$")


def _stale(path: str, pid: int) -> Tuple[bool, str]:
    """(stale?, why): stale when the recorded process is not running on this host."""
    owner = {}
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            owner = json.load(f)
    except (OSError, ValueError, NotADirectoryError):
        pass
    host = owner.get("host")
    if host and host != socket.gethostname():
        return False, f"owned by pid {pid} on host {host}"
    if process_alive(int(owner.get("pid", pid)), owner.get("start")):
        return False, f"pid {pid} is running"
    return True, f"pid {pid} is not running"


def sweep_stale(save: str, suffixes: Sequence[str] = ("",), log: Callable[[str], None] = None) -> List[str]:
    """Remove `.<name>.tmp-*` / `.<name>.old-*` entries next to `save` whose process is gone; put an
    orphaned `.old-` output back when `save` is missing. Returns the entries handled."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    save = output_path(save)
    parent, base = os.path.dirname(save), os.path.basename(save)
    if not os.path.isdir(parent):
        return []
    removed, restored, kept = [], [], []
    for suffix in suffixes:
        pattern = _temp_pattern(base, suffix)
        for name in sorted(os.listdir(parent)):
            m = pattern.match(name)
            if not m:
                continue
            path = os.path.join(parent, name)
            stale, why = _stale(path, int(m.group(2)))
            if not stale:
                kept.append(f"{name} ({why})")
                continue
            target = save + suffix
            if m.group(1) == "old" and not os.path.lexists(target):
                os.rename(path, target)  # its replacement never arrived: the old output is the output
                restored.append(name)
            elif os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(name)
            else:
                os.remove(path)
                removed.append(name)
    if removed or restored:
        parts = []
        if removed:
            parts.append(f"removed {len(removed)} stale temporary entr{'y' if len(removed) == 1 else 'ies'} of an "
                         f"interrupted run ({', '.join(removed)})")
        if restored:
            parts.append(f"restored the previous output from {', '.join(restored)}")
        log(f"[mixln_megatron] {base}: {'; '.join(parts)} in {parent}")
    if kept:
        log(f"[mixln_megatron] {base}: left {', '.join(kept)} in {parent}")
    return removed + restored


def new_temp_name(save: str, suffix: str = "", kind: str = "tmp") -> str:
    """A fresh hidden sibling of `save` whose name records this process (found by sweep_stale)."""
    save = os.path.abspath(save)
    return os.path.join(os.path.dirname(save),
                        f".{os.path.basename(save)}.{kind}-{os.getpid()}-{secrets.token_hex(4)}{suffix}")


# ----------------------------------------------------------------------------- staged folder output
@contextlib.contextmanager
def staged_dir(save: str, kind: Optional[OutputKind], overwrite: bool, error: Type[Exception]):
    """Yield a fresh temporary folder next to `save`; on success it becomes `save`, the previous
    output (checked again, it may have changed meanwhile) being deleted only after the rename. A
    `save` that is a symlink to a folder is written through: the folder it names is replaced."""
    save = output_path(save)
    parent = os.path.dirname(save)
    created = None  # the topmost parent directory this call creates (removed again on failure)
    probe = parent
    while not os.path.exists(probe):
        created, probe = probe, os.path.dirname(probe)
    os.makedirs(parent, exist_ok=True)
    tmp = new_temp_name(save)
    os.mkdir(tmp)
    old = None
    try:
        with open(os.path.join(tmp, OWNER_FILE), "w") as f:
            json.dump(_owner_record(), f)
        yield tmp
        if kind is not None:
            check_replaceable(save, kind, overwrite, error)
        os.remove(os.path.join(tmp, OWNER_FILE))
        if os.path.lexists(save):
            old = new_temp_name(save, kind="old")
            os.rename(save, old)
        os.rename(tmp, save)
        if old is not None:
            done, old = old, None
            shutil.rmtree(done, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not os.path.lexists(save):
            os.rename(old, save)
        if created is not None and not any(files for _, _, files in os.walk(created)):
            shutil.rmtree(created, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------- signals
def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_as_interrupt(signals=(signal.SIGTERM, signal.SIGHUP)):
    """Within the block, the given signals raise Interrupted (main thread only; elsewhere a no-op)."""
    previous = {}
    try:
        for s in signals:
            previous[s] = signal.signal(s, _raise_interrupted)
    except ValueError:  # not the main thread: leave the handlers alone
        pass
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
