"""Files read from a folder somebody handed us, confined to that folder and bounded in cost.

A checkpoint or model folder is untrusted input (docs/untrusted-input.md): the names its metadata
gives may be absolute, climb out with `..` or be symlinks elsewhere; a file may be a FIFO that
blocks forever or a link to /dev/zero. Every file a command opens from its input goes through
one `InputRoot` (`path`, `check_file`, `open`, `read_bytes`, `read_json`); a refusal is an
UnsafeInputError naming the file and the rule. Large weight files (safetensors shards, .distcp,
legacy rank files) have no size bound: their own libraries read them in pieces; `check_file`
confines them all the same.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Optional

from .errors import UnsafeInputError

MiB = 1 << 20
# The most bytes a file of each kind may hold: far above what a real 1B-405B checkpoint writes
# (a 70B TP8 PP8 .metadata is tens of MiB), far below what would exhaust a machine.
LIMITS = {
    "tracker": 64,  # latest_checkpointed_iteration.txt: an iteration number or "release"
    "metadata.json": 1 * MiB,  # megatron's sharded-backend description
    "config.json": 4 * MiB,
    "generation_config.json": 4 * MiB,
    "index": 64 * MiB,  # model.safetensors.index.json / pytorch_model.bin.index.json
    ".metadata": 512 * MiB,  # DCP's pickled metadata
    "common.pt": 256 * MiB,  # megatron's common state (args, iteration, content metadata)
    "byte item": 256 * MiB,  # one ShardedObject inside a .distcp
    "pickle": 256 * MiB,  # the data.pkl of any torch.save archive
    "safetensors header": 100 * MiB,  # the bound safetensors itself enforces
}


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class InputRoot:
    """One input folder: every path is resolved inside it, every file is regular and bounded."""

    def __init__(self, folder: str, what: str = "input folder"):
        given = os.path.abspath(os.fspath(folder))
        if not os.path.isdir(given):
            raise UnsafeInputError(f"{given}: the {what} does not exist or is not a directory")
        # The user's own path may go through symlinks (a scratch disk): that is their choice. What
        # the folder's files name is not: it must stay under the folder's real location.
        self.given = given
        self.root = os.path.realpath(given)
        self.what = what

    def __repr__(self) -> str:
        return f"InputRoot({self.given!r})"

    # ------------------------------------------------------------------ paths
    def _shown(self, rel: str) -> str:
        return os.path.join(self.given, rel) if isinstance(rel, str) and rel else self.given

    def path(self, rel: str) -> str:
        """The real absolute path of `rel` inside the folder; refused when `rel` is absolute, climbs
        out with `..`, or resolves (through any symlink) outside the folder."""
        if not isinstance(rel, str) or not rel or "\x00" in rel:
            raise UnsafeInputError(f"{self.given}: a file name in the {self.what} is not a usable name: {rel!r}")
        if os.path.isabs(rel) or rel.startswith(("/", "\\")):
            raise UnsafeInputError(f"{self.given}: the {self.what} names an absolute path {rel!r}; only files "
                                   "inside the folder are read")
        parts = rel.replace("\\", "/").split("/")
        if ".." in parts:
            raise UnsafeInputError(f"{self.given}: the {self.what} names {rel!r}, which climbs out of the folder "
                                   "with '..'; only files inside the folder are read")
        real = os.path.realpath(os.path.join(self.root, rel))
        if not _within(real, self.root):
            raise UnsafeInputError(f"{self._shown(rel)} is a symlink (or under one) to {real}, outside the "
                                   f"{self.what}; only files inside the folder are read")
        return real

    def sub(self, rel: str, what: Optional[str] = None) -> "InputRoot":
        """A folder inside this one (e.g. one saved iteration), confined to itself from now on."""
        real = self.path(rel)
        if not os.path.isdir(real):
            raise UnsafeInputError(f"{self._shown(rel)} is not a directory")
        inner = InputRoot.__new__(InputRoot)
        inner.given, inner.root, inner.what = os.path.join(self.given, rel), real, what or self.what
        return inner

    def exists(self, rel: str) -> bool:
        """Whether `rel` names anything at all (a file, folder or link) inside the folder."""
        return os.path.lexists(os.path.join(self.root, rel))

    def is_file(self, rel: str) -> bool:
        """Whether `rel` is a regular file inside the folder (links that stay inside count)."""
        try:
            return stat.S_ISREG(os.stat(self.path(rel)).st_mode)
        except (OSError, UnsafeInputError):
            return False

    def listdir(self, rel: str = "") -> list:
        return sorted(os.listdir(self.path(rel) if rel else self.root))

    # ------------------------------------------------------------------ files
    def check_file(self, rel: str, kind: Optional[str] = None, limit: Optional[int] = None) -> str:
        """The real path of `rel`, refused unless it is a regular file inside the folder (and, with
        a `kind` in LIMITS, at most that many bytes). Opens nothing that could block."""
        real = self.path(rel)
        try:
            st = os.stat(real)
        except OSError as e:
            raise UnsafeInputError(f"{self._shown(rel)} is missing or unreadable: {e.strerror or e}") from None
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeInputError(f"{self._shown(rel)} is not a regular file ({_file_type(st.st_mode)}); a "
                                   f"{self.what} holds regular files only")
        _check_size(self._shown(rel), st.st_size, kind, limit)
        return real

    def open(self, rel: str, kind: Optional[str] = None, limit: Optional[int] = None):
        """`rel` opened for binary reading: a regular file inside the folder (never a FIFO or device:
        the open itself cannot block), at most LIMITS[kind] bytes."""
        real = self.check_file(rel, kind, limit)
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            if e.errno == errno.ELOOP:  # swapped for a link after the check
                raise UnsafeInputError(f"{self._shown(rel)} became a symlink while it was read") from None
            raise UnsafeInputError(f"{self._shown(rel)} is unreadable: {e.strerror or e}") from None
        try:
            st = os.fstat(fd)  # what was opened, not what was checked: no swap in between counts
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeInputError(f"{self._shown(rel)} is not a regular file ({_file_type(st.st_mode)})")
            _check_size(self._shown(rel), st.st_size, kind, limit)
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def read_bytes(self, rel: str, kind: str, limit: Optional[int] = None) -> bytes:
        """The whole of a small file `rel` (kind in LIMITS, bounded by LIMITS[kind] or `limit`); never
        more than the bound is read, even if the file grows while it is read."""
        limit = LIMITS[kind] if limit is None else limit
        with self.open(rel, kind, limit) as f:
            # read(n) allocates n bytes first: ask for what the file holds, not for the bound
            data = f.read(min(limit, os.fstat(f.fileno()).st_size) + 1)
            while len(data) <= limit:  # a file that grew since: the rest in pieces, never past the bound
                more = f.read(min(1 << 20, limit + 1 - len(data)))
                if not more:
                    break
                data += more
        _check_size(self._shown(rel), len(data), kind, limit)
        return data

    def read_json(self, rel: str, kind: str, expect: type = dict):
        """A JSON file `rel` (kind in LIMITS), parsed, of type `expect`; one UnsafeInputError otherwise."""
        data = self.read_bytes(rel, kind)
        try:
            value = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            detail = " ".join(str(e).split())[:160]
            raise UnsafeInputError(f"{self._shown(rel)} is not valid JSON: {detail}") from None
        if expect is not None and not isinstance(value, expect):
            raise UnsafeInputError(f"{self._shown(rel)} holds a JSON {_json_type(value)}, expected a JSON "
                                   f"{_json_type(expect())}")
        return value


def _check_size(shown: str, size: int, kind: Optional[str], limit: Optional[int] = None) -> None:
    if kind is None:
        return
    limit = LIMITS[kind] if limit is None else limit
    if size > limit:
        raise UnsafeInputError(f"{shown} holds {size} bytes, more than any real {kind} file ({limit} bytes); "
                               "refused as a safety bound (a damaged or crafted file?)")


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")
