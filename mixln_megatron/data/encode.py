"""The worker side of preprocessing (documents -> token id sequences, in a Pool worker or inline),
and what a run reports: its one-line errors and its statistics (bad lines by the reason the
worker found).

--split-sentences splits with NLTK's English Punkt model (shipped, offline), one sequence per
sentence as in Megatron's own --split-sentences, but no text is lost: each sentence keeps the
whitespace before it, so a document's decoded sequences concatenate to its exact text. With a
byte-level BPE the tokens then equal those of the unsplit text except where Punkt cuts inside a
run of non-space characters (`days."--Harriet`: 36 of 33,288 boundaries in the Austen corpus).
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..errors import MixLNError
from .corpus import sentence_splitter
from .tokenizer import TokenizerSpec, load_tokenizer


JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_UNITS = ("paragraph", "line", "file")
BAD_LINE_REASONS = {
    "invalid_utf8": "not valid UTF-8",
    "malformed_json": "malformed JSON",
    "missing_key": "no such key (or not a JSON object)",
    "not_string": "value is not a string",
    "invalid_text": "string with unpaired surrogates",
}
MAX_EXAMPLES = 5  # bad-line locations kept for the summary


class PreprocessError(MixLNError):  # cli.main prints it in one line
    """A user-facing error (missing input, existing output, bad option...)."""


@dataclass
class PreprocessStats:
    output_prefix: str
    documents: int = 0  # documents written
    sequences: int = 0  # sequences written (sentences with --split-sentences, else = documents)
    tokens: int = 0  # tokens written (EOD included)
    empty: int = 0  # empty documents skipped
    blank_lines: int = 0  # blank JSONL lines ignored
    skipped: Counter = field(default_factory=Counter)  # bad JSONL lines by reason
    examples: List[str] = field(default_factory=list)  # "path:line: reason" for the first few
    seconds: float = 0.0
    dtype: str = ""
    vocab_size: int = 0
    eod_id: Optional[int] = None
    tokenizer: str = ""

    @property
    def bad_lines(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        lines = [
            f"wrote {self.output_prefix}.bin/.idx: {self.documents} documents, {self.sequences} "
            f"sequences, {self.tokens} tokens ({self.dtype}, vocab {self.vocab_size}) in "
            f"{self.seconds:.1f} s"
        ]
        if self.bad_lines:
            parts = ", ".join(f"{BAD_LINE_REASONS[k]}: {v}" for k, v in sorted(self.skipped.items()))
            lines.append(f"skipped {self.bad_lines} bad lines ({parts})")
            lines.extend(f"  e.g. {e}" for e in self.examples)
        else:
            lines.append("skipped 0 bad lines")
        if self.empty:
            lines.append(f"skipped {self.empty} empty documents")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------ the worker
# One task = (kind, items, nbytes). kind "json": items = [(location, raw line bytes)];
# kind "text": items = [(location, document str)]. nbytes is only passed through for the progress
# bar. A result per item: ("ok", [np.ndarray per sequence]) | ("bad", reason, loc) | ("empty", loc)


@dataclass(frozen=True)
class WorkerConfig:
    tokenizer: TokenizerSpec
    split_sentences: bool
    json_key: str
    append_eod: bool
    eod_id: Optional[int]
    dtype: str


_STATE: Dict[str, object] = {}


def init_worker(cfg: WorkerConfig, in_pool: bool, tokenizer=None) -> None:
    if in_pool:
        # Ctrl-C is the parent's business (it terminates the pool); one tokenizer thread pool per
        # process is enough when several processes already run side by side.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _STATE.clear()
    _STATE["cfg"] = cfg
    _STATE["tok"] = tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer)
    _STATE["split"] = sentence_splitter() if cfg.split_sentences else None


def _segments(text: str, splitter) -> List[str]:
    """Split `text` at sentence ends; each piece after the first starts with the whitespace that
    preceded its sentence, so "".join(pieces) == text."""
    if splitter is None:
        return [text]
    cuts = [end for _, end in splitter.span_tokenize(text)][:-1]
    pieces, start = [], 0
    for c in cuts:
        if c > start:
            pieces.append(text[start:c])
            start = c
    pieces.append(text[start:])
    return [p for p in pieces if p]


def _parse_json_line(raw: bytes, key: str):
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "invalid_utf8"
    try:
        obj = json.loads(line)
    except ValueError:
        return None, "malformed_json"
    if not isinstance(obj, dict) or key not in obj:
        return None, "missing_key"
    text = obj[key]
    if not isinstance(text, str):
        return None, "not_string"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return None, "invalid_text"
    return text, None


def encode_chunk(task):
    kind, items, nbytes = task
    cfg: WorkerConfig = _STATE["cfg"]  # type: ignore[assignment]
    tok = _STATE["tok"]
    splitter = _STATE["split"]
    results: List[tuple] = [None] * len(items)  # type: ignore[list-item]
    flat: List[str] = []
    owners: List[Tuple[int, int]] = []  # (item index, number of segments)
    for i, (loc, payload) in enumerate(items):
        if kind == "json":
            text, reason = _parse_json_line(payload, cfg.json_key)
            if reason is not None:
                results[i] = ("bad", reason, loc)
                continue
        else:
            text = payload
        if not text.strip():
            results[i] = ("empty", loc)
            continue
        segs = _segments(text, splitter)
        owners.append((i, len(segs)))
        flat.extend(segs)
    ids = tok.encode_batch(flat)
    pos = 0
    for i, n in owners:
        seqs = [s for s in ids[pos : pos + n] if len(s) > 0]
        pos += n
        if not seqs:
            results[i] = ("empty", items[i][0])
            continue
        if cfg.append_eod:
            seqs[-1] = list(seqs[-1]) + [cfg.eod_id]
        results[i] = ("ok", [np.asarray(s, dtype=cfg.dtype) for s in seqs])
    return nbytes, results


def reset_worker() -> None:
    """Drop the inline worker's tokenizer and splitter once a run is over."""
    _STATE.clear()
