"""The data assets shipped inside the package (mixln_megatron/assets/, described in its README.md):
Jane Austen's novels, NLTK's English punkt_tab model and the byte-level BPE trained on them.

Paths resolve inside the *installed* package, so a fresh install works without the network.
Nothing here imports megatron, torch or transformers.
"""

from __future__ import annotations

import gzip
import io
import os
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator, List, NamedTuple, Optional, Tuple


class AssetsMissingError(FileNotFoundError):
    """A shipped data file is not where the package expects it (broken install)."""


class TokenizerFiles(NamedTuple):
    directory: str
    vocab_file: str  # GPT-2 format vocab.json (token -> id)
    merge_file: str  # GPT-2 format merges.txt
    tokenizer_json: str  # the same tokenizer as a `tokenizers` tokenizer.json


def _require(path: Path) -> str:
    if not path.exists():
        raise AssetsMissingError(
            f"shipped asset {path} is missing: the package was installed without its data files "
            "(package_data 'assets/**/*'); reinstall mixln-megatron, or regenerate them with "
            "scripts/build_assets.py"
        )
    return str(path)


def assets_dir() -> str:
    """Directory holding the shipped assets (inside the installed package)."""
    return _require(Path(__file__).resolve().parent.parent / "assets")


def austen_text_path() -> str:
    """Path of the gzipped Austen corpus (UTF-8 text, novels separated by blank lines)."""
    return _require(Path(assets_dir()) / "austen.txt.gz")


@lru_cache(maxsize=1)
def _austen_text() -> str:
    with gzip.open(austen_text_path(), "rt", encoding="utf-8", newline="") as f:
        return f.read()


def read_austen(max_chars: Optional[int] = None) -> str:
    """The whole corpus (about 4.0 M characters), or its first `max_chars` characters."""
    text = _austen_text()
    return text if max_chars is None else text[: max(0, int(max_chars))]


def join_paragraph(lines: List[str], unwrap: bool = True) -> str:
    """The text of one paragraph from its lines (line endings already removed or not).

    unwrap=True joins the lines with single spaces, each line stripped (undoing hard wrapping);
    unwrap=False keeps the lines joined by "\\n" and strips the block as a whole.
    """
    if unwrap:
        return " ".join(s for s in (l.strip() for l in lines) if s)
    return "\n".join(l.rstrip("\r\n") for l in lines).strip()


def numbered_paragraphs(lines: Iterable[Tuple[int, str]], unwrap: bool = True) -> Iterator[Tuple[int, str]]:
    """(number of its first line, paragraph) for (line number, line) pairs. Paragraphs = blocks of
    consecutive non-blank lines (a blank line is empty or whitespace only), each joined by
    `join_paragraph`: the plain-text document rule of `mixln_megatron.data.preprocess`
    (--text-unit paragraph)."""
    block: List[str] = []
    start = 0
    for lineno, line in lines:
        if line.strip():
            if not block:
                start = lineno
            block.append(line)
        elif block:
            yield start, join_paragraph(block, unwrap)
            block = []
    if block:
        yield start, join_paragraph(block, unwrap)


def split_paragraphs(text: str, unwrap: bool = True) -> List[str]:
    """The paragraphs of `text` (numbered_paragraphs' rule; lines split on "\\n" only)."""
    lines = enumerate(io.StringIO(text, newline="\n"), 1)
    return [paragraph for _, paragraph in numbered_paragraphs(lines, unwrap)]


def austen_paragraphs(max_chars: Optional[int] = None, unwrap: bool = True) -> List[str]:
    """The corpus as paragraphs; with `max_chars`, whole paragraphs from the start whose unwrapped
    lengths (plus one separator each) add up to at most `max_chars` (always at least one)."""
    paras = split_paragraphs(read_austen(), unwrap=unwrap)
    if max_chars is None:
        return paras
    out, used = [], 0
    for p in paras:
        if out and used + len(p) + 1 > max_chars:
            break
        out.append(p)
        used += len(p) + 1
    return out


def nltk_data_dir() -> str:
    """A minimal NLTK data directory containing only tokenizers/punkt_tab/english."""
    return _require(Path(assets_dir()) / "nltk_data")


def punkt_dir() -> str:
    """The English punkt_tab model directory."""
    return _require(Path(nltk_data_dir()) / "tokenizers" / "punkt_tab" / "english")


def use_shipped_punkt() -> str:
    """Put the shipped nltk_data directory first on `nltk.data.path` (idempotent) and return it.

    First, so that the shipped (known) model wins over whatever else is installed; via
    nltk.data.path rather than the NLTK_DATA variable, which other tools rewrite.
    """
    import nltk

    d = nltk_data_dir()
    punkt_dir()  # fail early and clearly if the model is missing
    paths = nltk.data.path
    if not paths or os.path.abspath(paths[0]) != os.path.abspath(d):
        while d in paths:
            paths.remove(d)
        paths.insert(0, d)
    return d


def sentence_splitter():
    """NLTK's English Punkt tokenizer loaded from the shipped punkt_tab model (offline).

    Returns an object with `.tokenize(text) -> list[str]` and `.span_tokenize(text)`;
    `tokenize` gives what `nltk.sent_tokenize(text)` gives.
    """
    use_shipped_punkt()
    from nltk.tokenize.punkt import PunktTokenizer

    return PunktTokenizer("english")


def tokenizer_dir() -> str:
    """Directory of the shipped tokenizer: vocab.json, merges.txt (GPT-2 format), tokenizer.json
    and tokenizer_config.json (so it is also a local Hugging Face tokenizer directory)."""
    return _require(Path(assets_dir()) / "tokenizer")


def tokenizer_files() -> TokenizerFiles:
    d = Path(tokenizer_dir())
    return TokenizerFiles(
        directory=str(d),
        vocab_file=_require(d / "vocab.json"),
        merge_file=_require(d / "merges.txt"),
        tokenizer_json=_require(d / "tokenizer.json"),
    )
