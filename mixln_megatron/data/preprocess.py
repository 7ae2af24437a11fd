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
Face tokenizer directory --tokenizer-model (Megatron-LM's name; the old --tokenizer-dir still
works); all offline. No special tokens are added by the encoding; --append-eod appends
the tokenizer's end-of-document id (EOS, else `<|endoftext|>`) to the last sequence of every
document. The .bin dtype is chosen from the vocabulary size the way Megatron does
(DType.optimal_dtype: uint16 below 65500 ids, else int32).

--split-sentences: one sequence per sentence, losing no text (see data.encode).

Output is atomic (see data.indexed_output): an exception, Ctrl-C, SIGTERM or SIGHUP leaves no new
.bin/.idx pair, a SIGKILLed run's leftovers are removed by the next run into the same prefix, an
existing prefix is refused without --overwrite, and an output that is one of the inputs always.
A refusal (a bad input or option) is one stderr line and exit status 2.

--workers N tokenizes in N processes (multiprocessing "spawn" Pool, imap over chunks of
--chunk-size documents, order preserved: the output is byte-identical to --workers 1).

Modules: read_input (files -> records), encode (records -> token ids, in workers), indexed_output
(temporaries and publishing), report (errors, statistics), austen_dataset (the demo's cached set).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from typing import Iterable, List, Optional, Sequence

from ..cli_parsing import CommandParser, add_flag, refused
from ..errors import MixLNError
from ..known_warnings import quiet_known_warnings
from ..progress import bar as progress_bar
from ..safe_output import Interrupted, check_separate, new_temp_name, signals_as_interrupt
from .encode import WorkerConfig, encode_chunk, init_worker, load_sentence_splitter, reset_worker
from .indexed_output import check_output, import_indexed_dataset, output_paths, publish, remove_if_present, sweep_stale_output
from .read_input import iter_tasks
from .report import BAD_LINE_REASONS, MAX_EXAMPLES, TEXT_UNITS, PreprocessError, PreprocessStats
from .tokenizer import TokenizerSpec, load_tokenizer, shipped_tokenizer_spec

__all__ = [
    "FORMAT_VERSION",
    "PreprocessError",
    "PreprocessStats",
    "build_from_documents",
    "build_parser",
    "main",
    "preprocess_files",
]

# Bump when the bytes written for the same input and options change (part of the demo cache key).
FORMAT_VERSION = 1

def _add_document(builder, sequences) -> None:
    """Append one document (a list of 1-D integer arrays, one per sequence)."""
    import torch

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
        load_sentence_splitter()  # fail early if the model is missing

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
    sweep_stale_output(output_prefix)
    check_output(output_prefix, overwrite)
    spec = resolve_tokenizer(tokenizer)
    stats = PreprocessStats(output_prefix=output_prefix)
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
    sweep_stale_output(output_prefix)
    check_output(output_prefix, overwrite)
    spec = resolve_tokenizer(tokenizer)
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
