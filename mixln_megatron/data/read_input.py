"""Reading preprocessing input: JSONL or plain-text files (.gz too) -> tasks of raw records.

Runs in the parent process; bad JSONL lines travel as raw bytes and are judged by the worker,
so the parent only splits files and counts blank lines. A UTF-8 byte order mark is dropped.
"""

from __future__ import annotations

import gzip
from typing import Iterator, List, Optional, Sequence, Tuple

from .corpus import join_paragraph
from .report import JSONL_SUFFIXES, PreprocessError, PreprocessStats

def _detect_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    name = path[:-3] if path.endswith(".gz") else path
    return "jsonl" if name.lower().endswith(JSONL_SUFFIXES) else "text"


class _Input:
    """A binary line reader over a plain or gzipped file that knows how far it got on disk."""

    def __init__(self, path: str):
        self.path = path
        self.raw = open(path, "rb")
        self.f = gzip.GzipFile(fileobj=self.raw, mode="rb") if path.endswith(".gz") else self.raw
        self._last = 0

    def consumed(self) -> int:
        """Bytes of the file on disk read since the last call."""
        pos = self.raw.tell()
        n, self._last = pos - self._last, pos
        return n

    def close(self) -> None:
        if self.f is not self.raw:
            self.f.close()
        self.raw.close()


def _decode_text(raw: bytes, path: str, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PreprocessError(f"{path}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start})") from None


def iter_tasks(
    inputs: Sequence[str],
    input_format: str,
    text_unit: str,
    unwrap: bool,
    chunk_size: int,
    max_documents: Optional[int],
    stats: PreprocessStats,
) -> Iterator[tuple]:
    """Yield tasks for encode_chunk. Runs in the parent (in the Pool's task thread)."""
    budget = max_documents if max_documents is not None else -1
    for path in inputs:
        fmt = _detect_format(path, input_format)
        src = _Input(path)
        try:
            kind = "json" if fmt == "jsonl" else "text"
            items: List[tuple] = []
            for loc, payload in _iter_records(src, fmt, text_unit, unwrap, stats):
                if budget == 0:
                    break
                budget -= 1
                items.append((loc, payload))
                if len(items) >= chunk_size:
                    yield kind, items, src.consumed()
                    items = []
            if items:
                yield kind, items, src.consumed()
            else:
                src.consumed()
        finally:
            src.close()
        if budget == 0:
            return


_BOM = b"\xef\xbb\xbf"


def _lines(src: _Input) -> Iterator[Tuple[int, bytes]]:
    """(line number, raw line) with a leading UTF-8 byte order mark dropped."""
    for lineno, raw in enumerate(src.f, 1):
        if lineno == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM):]
        yield lineno, raw


def _iter_records(src: _Input, fmt: str, text_unit: str, unwrap: bool, stats: PreprocessStats):
    path = src.path
    if fmt == "jsonl":
        for lineno, raw in _lines(src):
            if not raw.strip():
                stats.blank_lines += 1
                continue
            yield f"{path}:{lineno}", raw
    elif text_unit == "file":
        data = src.f.read()
        if data.startswith(_BOM):
            data = data[len(_BOM):]
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            raise PreprocessError(f"{path}:{line}: not valid UTF-8 ({e.reason})") from None
        yield path, text.strip()
    elif text_unit == "line":
        for lineno, raw in _lines(src):
            line = _decode_text(raw, path, lineno).strip()
            if line:
                yield f"{path}:{lineno}", line
    else:  # paragraph
        block: List[str] = []
        start = 0
        for lineno, raw in _lines(src):
            line = _decode_text(raw, path, lineno)
            if line.strip():
                if not block:
                    start = lineno
                block.append(line)
            elif block:
                yield f"{path}:{start}", join_paragraph(block, unwrap)
                block = []
        if block:
            yield f"{path}:{start}", join_paragraph(block, unwrap)
