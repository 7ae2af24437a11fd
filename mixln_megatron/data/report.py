"""What a preprocessing run reports: its one-line errors and its statistics (bad lines by reason)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import List, Optional

from ..errors import MixLNError

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
