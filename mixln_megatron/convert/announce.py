"""Saying, before it starts, that a command is about to read a large checkpoint.

Reading and vetting the `.metadata` of a large torch_dist checkpoint, or vetting every pickle of
one (`convert inspect --check`), can take minutes with nothing else printed; one stderr line
first (progress.announce: only for many bytes) tells a user, or a batch log, what is going on.

Best effort, and reads nothing: it only locates the iteration and stats its files. A folder it
cannot locate is left to the read itself, which refuses it with its own one line.
"""

from __future__ import annotations

import os
import stat
from typing import Optional

from ..errors import MixLNError
from ..progress import announce
from .locate import resolve_checkpoint_dir


def announce_checkpoint_read(load: str, iteration=None, *, every_pickle: bool = False,
                             min_bytes: Optional[int] = None) -> bool:
    """`reading and vetting <dir>/.metadata (N MB) ...`, or with `every_pickle`
    `vetting every pickle in <dir>: K files (N MB) ...`, on stderr when the bytes are many.
    Returns whether a line was printed."""
    try:
        path, _ = resolve_checkpoint_dir(load, iteration)
        if every_pickle:
            count, nbytes = _regular_files(path)
            return announce(f"vetting every pickle in {path}: {count} files", nbytes, min_bytes=min_bytes)
        metadata = os.path.join(path, ".metadata")
        info = os.lstat(metadata)
        if not stat.S_ISREG(info.st_mode):
            return False
        return announce(f"reading and vetting {metadata}", info.st_size, min_bytes=min_bytes)
    except (MixLNError, OSError):
        return False


def _regular_files(path: str):
    """(count, total bytes) of the regular files under `path`, links not followed."""
    count = nbytes = 0
    for folder, _, names in os.walk(path):
        for name in names:
            info = os.lstat(os.path.join(folder, name))
            if stat.S_ISREG(info.st_mode):
                count, nbytes = count + 1, nbytes + info.st_size
    return count, nbytes
