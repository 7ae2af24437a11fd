"""Offline data preparation: text -> Megatron indexed dataset (`<prefix>.bin` + `<prefix>.idx`).

The usage is in docs/commands.md (`preprocess`); the exact rules are here. The prefix given is the
prefix written (no `_text_document` suffix), read by megatron-core's IndexedDataset(prefix).

Input (several --input files concatenated in order; `.gz` read transparently; a leading UTF-8 byte
order mark dropped):
  * JSONL (`--input-format jsonl`, or auto for *.jsonl / *.json / *.ndjson[.gz]): one document per
    line, the text under --json-key, used exactly as it is. Lines that are not valid UTF-8 / JSON,
    not an object holding the key, or whose value is not a string are skipped and counted ("bad
    lines", reported with the first few locations). Blank lines are ignored.
  * plain text (anything else), split into documents by --text-unit:
      paragraph (default)  blocks of consecutive non-blank lines, stripped; with --unwrap its lines
                           are stripped and joined by single spaces (undoes hard wrapping)
      line                 every non-blank line, stripped
      file                 the whole file, stripped
    Invalid UTF-8 in a plain-text file is an error (with the line number).
Empty (or whitespace-only) documents are skipped and counted separately.

Encoding adds no special tokens; --append-eod appends the tokenizer's end-of-document id (EOS, else
`<|endoftext|>`) to every document's last sequence. The .bin dtype is Megatron's
DType.optimal_dtype(vocabulary size). --split-sentences: see data.encode.

Output is atomic: an exception, Ctrl-C, SIGTERM or SIGHUP leaves no new .bin/.idx pair; a SIGKILLed
run's leftovers are removed by the next run into the same prefix; an existing prefix is refused
without --overwrite, an output that is one of the inputs always. --workers N tokenizes in a "spawn"
Pool over chunks of --chunk-size documents, order preserved (byte-identical to --workers 1).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import multiprocessing
import os
import sys
import time
import warnings
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

from ..cli_parsing import CommandParser, add_flag, refused
from ..errors import MixLNError
from ..known_warnings import quiet_known_warnings
from ..progress import bar as progress_bar
from ..safe_output import Interrupted, check_separate, new_temp_name, signals_as_interrupt, sweep_stale
from .corpus import austen_paragraphs, austen_text_path, numbered_paragraphs, sentence_splitter
from .encode import (BAD_LINE_REASONS, JSONL_SUFFIXES, MAX_EXAMPLES, TEXT_UNITS, PreprocessError, PreprocessStats,
                     WorkerConfig, encode_chunk, init_worker, reset_worker)
from .tokenizer import TokenizerSpec, load_tokenizer, shipped_tokenizer_spec

# Bump when the bytes written for the same input and options change (part of the demo cache key).
FORMAT_VERSION = 1

# ------------------------------------------------------------------------------------------ reading input
# In the parent: files -> tasks of raw records. Bad JSONL lines travel as raw bytes and are judged
# by the worker, so the parent only splits files and counts blank lines.
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
        lines = ((lineno, _decode_text(raw, path, lineno)) for lineno, raw in _lines(src))
        for start, paragraph in numbered_paragraphs(lines, unwrap):
            yield f"{path}:{start}", paragraph


# ------------------------------------------------------------------------------------------ writing output
# Hidden temporaries in the output directory, renamed when complete (see publish), so no new or
# mixed old/new pair exists early; what a SIGKILLed run left, the next run into the prefix removes.
def output_paths(prefix: str) -> Tuple[str, str]:
    return prefix + ".bin", prefix + ".idx"


def check_output(prefix: str, overwrite: bool) -> None:
    if prefix.endswith((".bin", ".idx")):
        raise PreprocessError(
            f"--output-prefix {prefix!r} ends in .bin/.idx: give the prefix only (it gets both)"
        )
    if os.path.isdir(prefix):
        raise PreprocessError(f"--output-prefix {prefix!r} is a directory; give a prefix such as {prefix}/data")
    if not overwrite:
        existing = [p for p in output_paths(prefix) if os.path.lexists(p)]
        if existing:
            raise PreprocessError(
                f"output {' and '.join(existing)} already exists; use --overwrite to replace it"
            )


def sweep_stale_output(prefix: str) -> None:
    """Remove what killed runs into `prefix` left; a run killed between its two renames left its
    .idx temporary and a lone <prefix>.bin, which goes too (a .bin without .idx is unusable)."""
    handled = sweep_stale(prefix, suffixes=(".bin", ".idx"))
    bin_path, idx_path = output_paths(prefix)
    half = [n for n in handled if n.endswith(".idx") and n[:-4] + ".bin" not in handled]
    if half and os.path.exists(bin_path) and not os.path.lexists(idx_path):
        os.remove(bin_path)
        print(f"[mixln_megatron] removed {bin_path}: the run that wrote it was killed before its .idx", file=sys.stderr)


def remove_if_present(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def publish(tmp_bin: str, tmp_idx: str, prefix: str, overwrite: bool) -> None:
    """Rename the finished temporaries to <prefix>.bin/.idx. The .idx goes last, so a failure
    in between leaves at most a lone .bin; with overwrite the old .idx goes first."""
    bin_path, idx_path = output_paths(prefix)
    check_output(prefix, overwrite)
    if overwrite:
        remove_if_present(idx_path)
    os.replace(tmp_bin, bin_path)
    try:
        os.replace(tmp_idx, idx_path)
    except BaseException:
        remove_if_present(bin_path)
        raise


def import_indexed_dataset():
    """megatron-core's indexed dataset writer, without its import-time notes on a CPU machine
    (no Transformer Engine / Apex / CUDA runtime), which say nothing about preprocessing."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # heavy
    finally:
        log.setLevel(level)
    return DType, IndexedDatasetBuilder


# ------------------------------------------------------------------------------------------ the run
def _add_document(builder, sequences) -> None:
    """Append one document (a list of 1-D integer arrays, one per sequence)."""
    import torch  # heavy

    for seq in sequences:
        builder.add_item(torch.from_numpy(seq))
    builder.end_document()


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
        sentence_splitter()  # fail early if the model is missing

    DType, IndexedDatasetBuilder = import_indexed_dataset()

    dtype = DType.optimal_dtype(tok.vocab_size)
    stats.dtype, stats.vocab_size, stats.eod_id = dtype.__name__, tok.vocab_size, eod
    stats.tokenizer = spec.describe()
    cfg = WorkerConfig(spec, split_sentences, json_key, append_eod, eod, dtype.__name__)

    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.basename(output_prefix)
    stem = new_temp_name(output_prefix)  # records our pid, for the stale sweep of a later run
    tmp_bin, tmp_idx = stem + ".bin", stem + ".idx"

    builder = None
    bar = progress_bar(total_bytes, f"preprocess {base}", enabled=progress,
                       unit="B" if total_bytes is not None else "docs")

    def consume(nbytes: int, results: list) -> None:
        for r in results:
            if r[0] == "ok":
                _add_document(builder, r[1])
                stats.documents += 1
                stats.sequences += len(r[1])
                stats.tokens += int(sum(len(s) for s in r[1]))
            elif r[0] == "bad":
                stats.skipped[r[1]] += 1
                if len(stats.examples) < MAX_EXAMPLES:
                    stats.examples.append(f"{r[2]}: {BAD_LINE_REASONS[r[1]]}")
            else:
                stats.empty += 1
        bar.update(nbytes)

    try:
        builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
        if workers > 1:
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(workers, initializer=init_worker, initargs=(cfg, True)) as pool:
                for nbytes, results in pool.imap(encode_chunk, tasks):
                    consume(nbytes, results)
                pool.close()
                pool.join()
        else:
            init_worker(cfg, False, tok)
            for task in tasks:
                consume(*encode_chunk(task))
        if stats.documents == 0:
            detail = "; ".join(stats.examples[:2])
            raise PreprocessError(
                f"no documents to write ({stats.bad_lines} bad lines, {stats.empty} empty documents"
                f"{': ' + detail if detail else ''}); nothing written"
            )
        builder.finalize(tmp_idx)
        publish(tmp_bin, tmp_idx, output_prefix, overwrite)
    except BaseException:
        if builder is not None:
            try:
                builder.data_file.close()
            except Exception:
                pass
        remove_if_present(tmp_bin)
        remove_if_present(tmp_idx)
        raise
    finally:
        bar.close()
        reset_worker()
    stats.seconds = time.perf_counter() - t0
    return stats


def resolve_tokenizer(tokenizer: Optional[TokenizerSpec]) -> TokenizerSpec:
    spec = tokenizer if tokenizer is not None else shipped_tokenizer_spec()
    try:
        spec.check()
    except (FileNotFoundError, ValueError) as e:
        raise PreprocessError(str(e)) from None
    return spec


def _prepare_output(output_prefix: str, overwrite: bool,
                    tokenizer: Optional[TokenizerSpec]) -> Tuple[TokenizerSpec, PreprocessStats]:
    """Before a run: sweep what killed runs left, refuse an existing output, check the tokenizer."""
    sweep_stale_output(output_prefix)
    check_output(output_prefix, overwrite)
    return resolve_tokenizer(tokenizer), PreprocessStats(output_prefix=output_prefix)


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
    check_separate(inputs, output_paths(output_prefix), PreprocessError)  # never write over an input file
    spec, stats = _prepare_output(output_prefix, overwrite, tokenizer)
    total = sum(os.path.getsize(p) for p in inputs)
    tasks = iter_tasks(inputs, input_format, text_unit, unwrap, chunk_size, max_documents, stats)
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
    spec, stats = _prepare_output(output_prefix, overwrite, tokenizer)

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


# ------------------------------------------------------------------------------------------ the demo's dataset
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
    """Build (once) the shipped Austen corpus as a train indexed dataset; return its prefix.

    Documents: corpus.austen_paragraphs(max_chars, unwrap=True). The prefix name carries a hash of
    the corpus, tokenizer files and options, so a changed input never reuses a stale cache;
    concurrent callers on one host (e.g. several ranks) build it once (file lock).
    """
    spec = resolve_tokenizer(tokenizer)
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
        return all(os.path.exists(p) for p in output_paths(prefix))

    if ready():
        return prefix
    import fcntl  # optional: POSIX only

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
    p = CommandParser(
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
    add_flag(g, "--tokenizer-model", "--tokenizer-dir", metavar="DIR",
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
    if a.tokenizer_model:
        return TokenizerSpec.hf_dir(a.tokenizer_model)
    return None


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    quiet_known_warnings()  # the dataset writer imports megatron-core (python -m runs skip cli.main)
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
    except (MixLNError, OSError) as e:  # PreprocessError, or a file the system will not let us read or write
        return refused(p.prog, e)
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
