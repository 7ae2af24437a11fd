"""Offline data preparation: text -> Megatron indexed dataset (`<prefix>.bin` + `<prefix>.idx`).

    mixln-megatron preprocess --input corpus.jsonl --output-prefix data/corpus --append-eod
    python -m mixln_megatron.data.preprocess --input book.txt.gz --output-prefix data/book \\
        --text-unit paragraph --unwrap --split-sentences --workers 2

The result is read by megatron.core.datasets.indexed_dataset.IndexedDataset(prefix) and is what
Megatron's `--data-path prefix` expects (no `_text_document` suffix is added: the prefix you give
is the prefix written).

Input (several --input files are concatenated in order; `.gz` files are read transparently; a UTF-8
byte order mark at the start of a file is dropped):
  * JSONL (`--input-format jsonl`, or auto for *.jsonl / *.json / *.ndjson[.gz]): one document per
    line, the text under --json-key (default "text"). Lines that are not valid UTF-8 / JSON, that
    are not an object holding the key, or whose value is not a string are skipped and counted
    ("bad lines", reported at the end with the first few locations). Blank lines are ignored. The
    text is used exactly as it is.
  * plain text (anything else), split into documents by --text-unit:
      paragraph (default)  blocks of consecutive non-blank lines (a blank line is empty or only
                           whitespace); the block is stripped; with --unwrap its lines are stripped
                           and joined by single spaces (undoes hard wrapping, e.g. Gutenberg texts)
      line                 every non-blank line, stripped
      file                 the whole file, stripped
    Invalid UTF-8 in a plain-text file is an error (with the line number).
Documents that are empty (or only whitespace) are skipped and counted separately.

Tokenization: the shipped byte-level BPE by default (mixln_megatron/assets/tokenizer), or GPT-2
format --vocab-file/--merge-file, a `tokenizers` --tokenizer-file tokenizer.json, or a local Hugging
Face --tokenizer-dir; all offline. No special tokens are added by the encoding; --append-eod appends
the tokenizer's end-of-document id (EOS, else `<|endoftext|>`) to the last sequence of every
document. The .bin dtype is chosen from the vocabulary size the way Megatron does
(DType.optimal_dtype: uint16 below 65500 ids, else int32).

--split-sentences: every document is split with NLTK's English Punkt model (the copy shipped in
mixln_megatron/assets/nltk_data, offline) and every sentence is a separate sequence of the document,
as with Megatron's own --split-sentences. Unlike Megatron's, no text is lost: a sentence's sequence
starts with the whitespace that preceded it (" Mrs. Long came."), so the sequences of a document
decoded and concatenated give back the document text exactly. With a byte-level BPE the tokens are
then those of the unsplit text except where Punkt puts a boundary inside a run of non-space
characters (e.g. `days."--Harriet`: 36 of 33,288 boundaries in the Austen corpus), where a token
that would span the boundary is split in two.

Round trip: decoding all sequences of a document and concatenating them gives the document text
as defined above (plus the EOD token's text with --append-eod).

Output is atomic: the data is written to hidden temporary files in the output directory
(`.<name>.tmp-<pid>-<random>.bin/.idx`) which are renamed to `<prefix>.bin` and `<prefix>.idx`
only after everything was written. An exception or Ctrl-C (or SIGTERM / SIGHUP, from the command
line) removes the temporaries and leaves no new .bin/.idx pair; with --overwrite the old .idx is
removed before the renames, so no mixed old/new pair can exist either. A run killed with SIGKILL
leaves only temporaries, never a pair; the next run into the same prefix removes those whose
process is gone (mixln_megatron.safe_output) and says so. An existing prefix (either file) is
refused without --overwrite, and an output file that is one of the inputs always.

--workers N tokenizes in N processes (multiprocessing "spawn" Pool, imap over chunks of
--chunk-size documents, order preserved: the output is byte-identical to --workers 1).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import multiprocessing
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from ..safe_output import (
    Interrupted,
    check_separate,
    new_temp_name,
    signals_as_interrupt,
    sweep_stale,
)
from .corpus import join_paragraph
from .tokenizer import TokenizerSpec, load_tokenizer, shipped_tokenizer_spec

__all__ = [
    "FORMAT_VERSION",
    "PreprocessError",
    "PreprocessStats",
    "build_from_documents",
    "build_parser",
    "main",
    "prepare_austen_dataset",
    "preprocess_files",
]

# Bump when the bytes written for the same input and options change (part of the demo cache key).
FORMAT_VERSION = 1

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_UNITS = ("paragraph", "line", "file")
BAD_LINE_REASONS = {
    "invalid_utf8": "not valid UTF-8",
    "malformed_json": "malformed JSON",
    "missing_key": "no such key (or not a JSON object)",
    "not_string": "value is not a string",
    "invalid_text": "string with unpaired surrogates",
}
_MAX_EXAMPLES = 5


from ..errors import MixLNError  # noqa: E402  (cli.main prints it in one line, exit 2)


class PreprocessError(MixLNError):
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


# ------------------------------------------------------------------------------- worker side
# One task = (kind, items, nbytes). kind "json": items = [(location, raw line bytes)];
# kind "text": items = [(location, document str)]. nbytes is only passed through for the progress
# bar. A result per item: ("ok", [np.ndarray per sequence]) | ("bad", reason, loc) | ("empty", loc)


@dataclass(frozen=True)
class _WorkerConfig:
    tokenizer: TokenizerSpec
    split_sentences: bool
    json_key: str
    append_eod: bool
    eod_id: Optional[int]
    dtype: str


_STATE: Dict[str, object] = {}


def _init_worker(cfg: _WorkerConfig, in_pool: bool, tokenizer=None) -> None:
    if in_pool:
        # Ctrl-C is the parent's business (it terminates the pool); one tokenizer thread pool per
        # process is enough when several processes already run side by side.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _STATE.clear()
    _STATE["cfg"] = cfg
    _STATE["tok"] = tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer)
    _STATE["split"] = _load_sentence_splitter() if cfg.split_sentences else None


def _load_sentence_splitter():
    try:
        from .corpus import sentence_splitter
    except ImportError as e:  # pragma: no cover - nltk is an extra
        raise PreprocessError("--split-sentences needs nltk (pip install 'mixln-megatron[data]')") from e
    return sentence_splitter()


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


def _encode_chunk(task):
    import numpy as np

    kind, items, nbytes = task
    cfg: _WorkerConfig = _STATE["cfg"]  # type: ignore[assignment]
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


# ------------------------------------------------------------------------------- reading input


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


def _iter_tasks(
    inputs: Sequence[str],
    input_format: str,
    text_unit: str,
    unwrap: bool,
    chunk_size: int,
    max_documents: Optional[int],
    stats: PreprocessStats,
) -> Iterator[tuple]:
    """Yield tasks for _encode_chunk. Runs in the parent (in the Pool's task thread)."""
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


# ---------------------------------------------------------------------------------- writing


def _paths(prefix: str) -> Tuple[str, str]:
    return prefix + ".bin", prefix + ".idx"


def _check_output(prefix: str, overwrite: bool) -> None:
    if prefix.endswith((".bin", ".idx")):
        raise PreprocessError(
            f"--output-prefix {prefix!r} ends in .bin/.idx: give the prefix only (it gets both)"
        )
    if os.path.isdir(prefix):
        raise PreprocessError(f"--output-prefix {prefix!r} is a directory; give a prefix such as {prefix}/data")
    if not overwrite:
        existing = [p for p in _paths(prefix) if os.path.lexists(p)]
        if existing:
            raise PreprocessError(
                f"output {' and '.join(existing)} already exists; use --overwrite to replace it"
            )


def _sweep_stale(prefix: str) -> None:
    """Remove what killed runs into `prefix` left; a run killed between its two renames left its
    .idx temporary and a lone <prefix>.bin, which goes too (a .bin without .idx is unusable)."""
    handled = sweep_stale(prefix, suffixes=(".bin", ".idx"))
    bin_path, idx_path = _paths(prefix)
    half = [n for n in handled if n.endswith(".idx") and n[:-4] + ".bin" not in handled]
    if half and os.path.exists(bin_path) and not os.path.lexists(idx_path):
        os.remove(bin_path)
        print(f"[mixln_megatron] removed {bin_path}: the run that wrote it was killed before its .idx", file=sys.stderr)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _publish(tmp_bin: str, tmp_idx: str, prefix: str, overwrite: bool) -> None:
    """Rename the finished temporaries to <prefix>.bin/.idx. The .idx goes last, so a failure
    in between leaves at most a lone .bin; with overwrite the old .idx goes first."""
    bin_path, idx_path = _paths(prefix)
    _check_output(prefix, overwrite)
    if overwrite:
        _remove(idx_path)
    os.replace(tmp_bin, bin_path)
    try:
        os.replace(tmp_idx, idx_path)
    except BaseException:
        _remove(bin_path)
        raise


def _add_document(builder, sequences) -> None:
    """Append one document (a list of 1-D integer arrays, one per sequence)."""
    import torch

    for seq in sequences:
        builder.add_item(torch.from_numpy(seq))
    builder.end_document()


def _import_megatron():
    """megatron-core's indexed dataset writer, without its import-time notes on a CPU machine
    (no Transformer Engine / Apex / CUDA runtime), which say nothing about preprocessing."""
    import logging
    import warnings

    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    finally:
        log.setLevel(level)
    return DType, IndexedDatasetBuilder


def _run(
    tasks: Iterable[tuple],
    output_prefix: str,
    spec: TokenizerSpec,
    *,
    split_sentences: bool,
    json_key: str,
    append_eod: bool,
    workers: int,
    overwrite: bool,
    progress: bool,
    total_bytes: Optional[int],
    stats: PreprocessStats,
) -> PreprocessStats:
    t0 = time.perf_counter()
    tok = load_tokenizer(spec)  # fail early (and learn the vocabulary size / EOD id)
    eod = tok.eod_id
    if append_eod and eod is None:
        raise PreprocessError(
            f"--append-eod: the tokenizer ({spec.describe()}) has no EOS and no {json.dumps('<|endoftext|>')} token"
        )
    if split_sentences:
        _load_sentence_splitter()  # fail early if the model is missing

    DType, IndexedDatasetBuilder = _import_megatron()
    from tqdm import tqdm

    dtype = DType.optimal_dtype(tok.vocab_size)
    stats.dtype, stats.vocab_size, stats.eod_id = dtype.__name__, tok.vocab_size, eod
    stats.tokenizer = spec.describe()
    cfg = _WorkerConfig(spec, split_sentences, json_key, append_eod, eod, dtype.__name__)

    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.basename(output_prefix)
    stem = new_temp_name(output_prefix)  # records our pid, for the stale sweep of a later run
    tmp_bin, tmp_idx = stem + ".bin", stem + ".idx"

    builder = None
    bar = tqdm(
        total=total_bytes, unit="B" if total_bytes is not None else " docs",
        unit_scale=total_bytes is not None, desc=f"preprocess {base}",
        disable=not progress, file=sys.stderr, dynamic_ncols=True,
    )

    def consume(nbytes: int, results: list) -> None:
        for r in results:
            if r[0] == "ok":
                _add_document(builder, r[1])
                stats.documents += 1
                stats.sequences += len(r[1])
                stats.tokens += int(sum(len(s) for s in r[1]))
            elif r[0] == "bad":
                stats.skipped[r[1]] += 1
                if len(stats.examples) < _MAX_EXAMPLES:
                    stats.examples.append(f"{r[2]}: {BAD_LINE_REASONS[r[1]]}")
            else:
                stats.empty += 1
        bar.update(nbytes)

    try:
        builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
        if workers > 1:
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(workers, initializer=_init_worker, initargs=(cfg, True)) as pool:
                for nbytes, results in pool.imap(_encode_chunk, tasks):
                    consume(nbytes, results)
                pool.close()
                pool.join()
        else:
            _init_worker(cfg, False, tok)
            for task in tasks:
                consume(*_encode_chunk(task))
        if stats.documents == 0:
            detail = "; ".join(stats.examples[:2])
            raise PreprocessError(
                f"no documents to write ({stats.bad_lines} bad lines, {stats.empty} empty documents"
                f"{': ' + detail if detail else ''}); nothing written"
            )
        builder.finalize(tmp_idx)
        _publish(tmp_bin, tmp_idx, output_prefix, overwrite)
    except BaseException:
        if builder is not None:
            try:
                builder.data_file.close()
            except Exception:
                pass
        _remove(tmp_bin)
        _remove(tmp_idx)
        raise
    finally:
        bar.close()
        _STATE.clear()
    stats.seconds = time.perf_counter() - t0
    return stats


def _resolve_tokenizer(tokenizer: Optional[TokenizerSpec]) -> TokenizerSpec:
    spec = tokenizer if tokenizer is not None else shipped_tokenizer_spec()
    try:
        spec.check()
    except (FileNotFoundError, ValueError) as e:
        raise PreprocessError(str(e)) from None
    return spec


def preprocess_files(
    inputs: Sequence[str],
    output_prefix: str,
    *,
    input_format: str = "auto",
    json_key: str = "text",
    text_unit: str = "paragraph",
    unwrap: bool = False,
    split_sentences: bool = False,
    append_eod: bool = False,
    tokenizer: Optional[TokenizerSpec] = None,
    workers: int = 1,
    chunk_size: int = 128,
    max_documents: Optional[int] = None,
    overwrite: bool = False,
    progress: bool = True,
) -> PreprocessStats:
    """Files -> `<output_prefix>.bin/.idx` (see the module docstring). Returns the statistics."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    inputs = [os.fspath(p) for p in inputs]
    if not inputs:
        raise PreprocessError("no input files given")
    for p in inputs:
        if not os.path.exists(p):
            raise PreprocessError(f"input file not found: {p}")
        if os.path.isdir(p):
            raise PreprocessError(f"input is a directory, not a file: {p}")
    if input_format not in ("auto", "jsonl", "text"):
        raise PreprocessError(f"unknown input format {input_format!r}")
    if text_unit not in TEXT_UNITS:
        raise PreprocessError(f"unknown text unit {text_unit!r} (one of {', '.join(TEXT_UNITS)})")
    if workers < 1 or chunk_size < 1:
        raise PreprocessError("workers and chunk size must be at least 1")
    output_prefix = os.fspath(output_prefix)
    check_separate(inputs, _paths(output_prefix), PreprocessError)  # never write over an input file
    _sweep_stale(output_prefix)
    _check_output(output_prefix, overwrite)
    spec = _resolve_tokenizer(tokenizer)
    stats = PreprocessStats(output_prefix=output_prefix)
    total = sum(os.path.getsize(p) for p in inputs)
    tasks = _iter_tasks(inputs, input_format, text_unit, unwrap, chunk_size, max_documents, stats)
    return _run(
        tasks, output_prefix, spec, split_sentences=split_sentences, json_key=json_key,
        append_eod=append_eod, workers=workers, overwrite=overwrite, progress=progress,
        total_bytes=total, stats=stats,
    )


def build_from_documents(
    documents: Iterable[str],
    output_prefix: str,
    *,
    split_sentences: bool = False,
    append_eod: bool = False,
    tokenizer: Optional[TokenizerSpec] = None,
    workers: int = 1,
    chunk_size: int = 128,
    overwrite: bool = False,
    progress: bool = False,
) -> PreprocessStats:
    """In-memory documents (one str each, used as they are) -> `<output_prefix>.bin/.idx`."""
    output_prefix = os.fspath(output_prefix)
    _sweep_stale(output_prefix)
    _check_output(output_prefix, overwrite)
    spec = _resolve_tokenizer(tokenizer)
    stats = PreprocessStats(output_prefix=output_prefix)

    def tasks():
        items: List[tuple] = []
        for i, doc in enumerate(documents):
            if not isinstance(doc, str):
                raise PreprocessError(f"document {i} is a {type(doc).__name__}, not a str")
            items.append((f"document {i}", doc))
            if len(items) >= chunk_size:
                yield "text", items, len(items)
                items = []
        if items:
            yield "text", items, len(items)

    return _run(
        tasks(), output_prefix, spec, split_sentences=split_sentences, json_key="text",
        append_eod=append_eod, workers=workers, overwrite=overwrite, progress=progress,
        total_bytes=None, stats=stats,
    )


# ----------------------------------------------------------------------------- the demo corpus


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def prepare_austen_dataset(
    out_dir: str,
    *,
    max_chars: Optional[int] = None,
    split_sentences: bool = False,
    append_eod: bool = True,
    workers: int = 1,
    progress: bool = False,
    tokenizer: Optional[TokenizerSpec] = None,
) -> str:
    """Build (once; cached by content) the shipped Austen corpus as a train indexed dataset.

    Documents are the corpus paragraphs with hard wrapping undone (corpus.austen_paragraphs);
    `max_chars` keeps only the leading whole paragraphs totalling at most that many characters.
    Tokenizer: the shipped byte-level BPE unless given. Returns the path prefix for
    IndexedDataset / --data-path. The prefix name carries a hash of the corpus, tokenizer files
    and options, so a changed input never reuses a stale cache; concurrent callers on one host
    (e.g. several ranks) build it once (file lock) and the write is atomic.
    """
    from .corpus import austen_paragraphs, austen_text_path

    spec = _resolve_tokenizer(tokenizer)
    key_src = {
        "format": FORMAT_VERSION,
        "corpus": _sha256_file(austen_text_path()),
        "tokenizer": [spec.kind] + [_sha256_file(p) if os.path.isfile(p) else p for p in (spec.path, spec.merges) if p],
        "max_chars": max_chars,
        "split_sentences": bool(split_sentences),
        "append_eod": bool(append_eod),
        "unwrap": True,
    }
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:12]
    os.makedirs(out_dir, exist_ok=True)
    prefix = os.path.join(out_dir, f"austen_{key}")

    def ready() -> bool:
        return all(os.path.exists(p) for p in _paths(prefix))

    if ready():
        return prefix
    import fcntl

    with open(os.path.join(out_dir, ".austen.lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if ready():
                return prefix
            stats = build_from_documents(
                austen_paragraphs(max_chars=max_chars, unwrap=True), prefix,
                split_sentences=split_sentences, append_eod=append_eod, tokenizer=spec,
                workers=workers, overwrite=True, progress=progress,
            )
            meta = dict(key_src, prefix=prefix, documents=stats.documents, sequences=stats.sequences,
                        tokens=stats.tokens, dtype=stats.dtype, vocab_size=stats.vocab_size,
                        eod_id=stats.eod_id, seconds=round(stats.seconds, 2))
            tmp = prefix + f".json.tmp{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=2, sort_keys=True)
            os.replace(tmp, prefix + ".json")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return prefix


# ------------------------------------------------------------------------------------------ CLI


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog or "mixln-megatron preprocess",
        description="Tokenize text (JSONL or plain text) into a Megatron indexed dataset "
        "(<prefix>.bin + <prefix>.idx), offline.",
        epilog="Defaults: the byte-level BPE and the NLTK Punkt model shipped in the package. "
        "See `python -m mixln_megatron.data.preprocess` module documentation for the exact rules.",
    )
    io_ = p.add_argument_group("input / output")
    io_.add_argument("--input", "-i", nargs="+", required=True, metavar="FILE",
                     help="input file(s), read in order into one dataset; .gz is decompressed")
    io_.add_argument("--output-prefix", "-o", required=True, metavar="PREFIX",
                     help="write PREFIX.bin and PREFIX.idx (the value for Megatron's --data-path)")
    io_.add_argument("--input-format", choices=("auto", "jsonl", "text"), default="auto",
                     help="auto (default): *.jsonl/*.json/*.ndjson[.gz] are JSONL, the rest plain text")
    io_.add_argument("--json-key", default="text", help="JSONL: the key holding the text (default: text)")
    io_.add_argument("--text-unit", choices=TEXT_UNITS, default="paragraph",
                     help="plain text: one document per blank-line separated paragraph (default), "
                     "per non-blank line, or per file")
    io_.add_argument("--unwrap", action="store_true",
                     help="plain text paragraphs: join hard-wrapped lines with single spaces")
    io_.add_argument("--max-documents", type=int, default=None, metavar="N",
                     help="stop after N input records (documents or JSONL lines)")
    io_.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.bin/.idx")

    tk = p.add_argument_group("tokenizer (default: the shipped 4096-token byte-level BPE)")
    g = tk.add_mutually_exclusive_group()
    g.add_argument("--vocab-file", metavar="VOCAB_JSON", help="GPT-2 format vocab.json (with --merge-file)")
    g.add_argument("--tokenizer-file", metavar="TOKENIZER_JSON", help="a `tokenizers` tokenizer.json")
    g.add_argument("--tokenizer-dir", metavar="DIR",
                   help="a local Hugging Face tokenizer directory (AutoTokenizer, no network)")
    tk.add_argument("--merge-file", metavar="MERGES_TXT", help="GPT-2 format merges.txt (with --vocab-file)")

    pr = p.add_argument_group("processing")
    pr.add_argument("--split-sentences", action="store_true",
                    help="one sequence per sentence (NLTK Punkt, English, shipped model)")
    pr.add_argument("--append-eod", action="store_true",
                    help="append the end-of-document token to every document")
    pr.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    pr.add_argument("--chunk-size", type=int, default=128, help="documents per worker task (default 128)")
    pr.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _spec_from_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> Optional[TokenizerSpec]:
    if (a.vocab_file is None) != (a.merge_file is None):
        p.error("--vocab-file and --merge-file go together")
    if a.vocab_file:
        return TokenizerSpec.gpt2(a.vocab_file, a.merge_file)
    if a.tokenizer_file:
        return TokenizerSpec.json(a.tokenizer_file)
    if a.tokenizer_dir:
        return TokenizerSpec.hf_dir(a.tokenizer_dir)
    return None


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    p = build_parser(prog)
    a = p.parse_args(argv)
    if a.workers < 1:
        p.error("--workers must be at least 1")
    if a.chunk_size < 1:
        p.error("--chunk-size must be at least 1")
    spec = _spec_from_args(p, a)
    try:
        with signals_as_interrupt():  # from the command line, SIGTERM / SIGHUP clean up like Ctrl-C
            stats = preprocess_files(
                a.input, a.output_prefix, input_format=a.input_format, json_key=a.json_key,
                text_unit=a.text_unit, unwrap=a.unwrap, split_sentences=a.split_sentences,
                append_eod=a.append_eod, tokenizer=spec, workers=a.workers, chunk_size=a.chunk_size,
                max_documents=a.max_documents, overwrite=a.overwrite, progress=not a.no_progress,
            )
    except PreprocessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: nothing written", file=sys.stderr)
        return 130
    except Interrupted as e:
        print(f"stopped by {e}: nothing written", file=sys.stderr)
        return e.exit_code
    print(stats.summary())
    return 0


if __name__ == "__main__":
    # Run through the package module, so worker processes unpickle the same functions.
    import importlib

    _self = importlib.import_module("mixln_megatron.data.preprocess")
    sys.exit(_self.main(prog="python -m mixln_megatron.data.preprocess"))
