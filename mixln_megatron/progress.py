"""Progress of the commands' long steps, readable in a terminal and in a batch log alike
(docs/commands.md#progress-in-logs): `bar` is a tqdm bar on a terminal, otherwise periodic plain
lines (a bar's carriage returns make a log file one unreadable line); `announce` says what a long
step over a large file is about to do, so a quiet minute reads as work, not as a hang.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

from tqdm import tqdm

# Steps over fewer bytes than this finish in seconds: announcing them would only add noise (and a
# second stderr line to a one-line refusal).
ANNOUNCE_BYTES = 64 * 2**20
LINE_INTERVAL_S = 30.0


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class PeriodicLines:
    """The non-terminal stand-in for a tqdm bar: `desc: 1.5 of 4.0 GiB (37%), 60 s` lines."""

    def __init__(self, total: Optional[int], desc: str, unit: str, file, interval_s: float):
        self.total, self.desc, self.unit, self.file, self.interval_s = total, desc, unit, file, interval_s
        self.done = 0
        self.started = self.last_line = time.monotonic()
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last_line >= self.interval_s:
            self.last_line = now
            self._line()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._line(" done")

    def _line(self, suffix: str = "") -> None:
        divisor, label = self._scale()
        amount = f"{self.done / divisor:.{1 if divisor > 1 else 0}f}"
        if self.total:
            amount += f" of {self.total / divisor:.{1 if divisor > 1 else 0}f} {label} ({100 * self.done // self.total}%)"
        else:
            amount += f" {label}"
        elapsed = time.monotonic() - self.started
        print(f"{self.desc}: {amount}, {elapsed:.0f} s{suffix}", file=self.file, flush=True)

    def _scale(self):
        if self.unit != "B":
            return 1, self.unit.strip()
        return (2**30, "GiB") if max(self.total or 0, self.done) >= 2**30 else (2**20, "MiB")


def bar(total: Optional[int], desc: str, *, enabled: bool = True, unit: str = "B", file=None,
        interval_s: float = LINE_INTERVAL_S):
    """A progress reporter with update(n) / close(): nothing when not `enabled`, a tqdm bar on a
    terminal, PeriodicLines otherwise. `unit="B"` counts bytes."""
    if not enabled:
        return _NoProgress()
    file = file or sys.stderr
    if not _is_terminal(file):
        return PeriodicLines(total, desc, unit, file, interval_s)
    byte_units = unit == "B"
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=byte_units, unit_divisor=1024 if byte_units else 1000,
                file=file, dynamic_ncols=True)


def _is_terminal(file) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def announce(what: str, nbytes: int, *, file=None, min_bytes: Optional[int] = None) -> bool:
    """`<what> (N MB) ...` on stderr before a step over `nbytes` bytes, when they are many.
    Returns whether it printed."""
    if nbytes < (ANNOUNCE_BYTES if min_bytes is None else min_bytes):
        return False
    print(f"{what} ({nbytes / 1e6:.0f} MB) ...", file=file or sys.stderr, flush=True)
    return True
