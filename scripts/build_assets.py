#!/usr/bin/env python
"""Regenerate the data assets shipped in mixln_megatron/assets/ (deterministically).

    .venv/bin/python scripts/build_assets.py            # (re)write mixln_megatron/assets
    .venv/bin/python scripts/build_assets.py --check    # rebuild in a temp dir, compare, exit 1 on a difference

What it does:
  1. austen.txt.gz: the UTF-8 text of --austen (.txt or .txt.gz; default: $MIXLN_SOURCE_DATA, else
     the shared data folder next to the checkout (../shared/data), else the shipped copy itself),
     gzip-compressed with a fixed header (no name, mtime 0,
     level 9) so equal text gives equal bytes.
  2. nltk_data/tokenizers/punkt_tab/english/: the four files of NLTK's English punkt_tab model,
     copied from --punkt.
  3. tokenizer/: a byte-level BPE (vocab 4096, min frequency 2, `<|endoftext|>` = id 0) trained
     with the `tokenizers` library on the paragraphs of the corpus written in step 1 (hard
     wrapping undone: mixln_megatron.data.corpus.split_paragraphs(unwrap=True)), written as GPT-2
     vocab.json + merges.txt, tokenizer.json and tokenizer_config.json
     (mixln_megatron.data.tokenizer.train_bpe).
  4. SHA256SUMS: the checksums of all of the above plus of the unpacked corpus text.
It then checks the result: the Punkt model splits "My dear Mr. Bennet, said his lady. Mrs. Long
came." into two sentences; the GPT-2 files, tokenizer.json and the Hugging Face directory give the
same ids and decode back on a corpus sample. README.md in the assets is written by hand.
"""

from __future__ import annotations

import argparse
import filecmp
import gzip
import hashlib
import io
import os
import shutil
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from mixln_megatron.data.corpus import split_paragraphs  # noqa: E402
from mixln_megatron.data.tokenizer import (
    DEFAULT_MIN_FREQUENCY,
    DEFAULT_VOCAB_SIZE,
    EOD_TOKEN,
    TextTokenizer,
    TokenizerSpec,
    train_bpe,
)

DEFAULT_OUT = os.path.join(REPO, "mixln_megatron", "assets")


def _source_dir() -> str:
    """Where the raw inputs live: $MIXLN_SOURCE_DATA, ../shared/data beside the checkout, or the
    shipped assets (then a rebuild checks determinism from the shipped copies)."""
    for candidate in (os.environ.get("MIXLN_SOURCE_DATA"), os.path.join(REPO, "..", "shared", "data")):
        if candidate and os.path.isfile(os.path.join(candidate, "austen.txt.gz")):
            return os.path.abspath(candidate)
    return DEFAULT_OUT


SOURCE = _source_dir()
DEFAULT_AUSTEN = os.path.join(SOURCE, "austen.txt.gz")
DEFAULT_PUNKT = os.path.join(SOURCE, "nltk_data", "tokenizers", "punkt_tab", "english")
PUNKT_FILES = ("abbrev_types.txt", "collocations.tab", "ortho_context.tab", "sent_starters.txt")
GENERATED = (
    "austen.txt.gz",
    *(f"nltk_data/tokenizers/punkt_tab/english/{n}" for n in PUNKT_FILES),
    "tokenizer/vocab.json",
    "tokenizer/merges.txt",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
    "SHA256SUMS",
)
CHECK_SENTENCE = "My dear Mr. Bennet, said his lady. Mrs. Long came."


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_text(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return f.read().decode("utf-8")


def write_gzip(text: str, path: str) -> None:
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as g:
        g.write(text.encode("utf-8"))
    with open(path, "wb") as f:
        f.write(buf.getvalue())


def build(out: str, austen: str, punkt: str, vocab_size: int, min_frequency: int) -> None:
    os.makedirs(out, exist_ok=True)
    # 1. corpus
    text = read_text(austen)
    write_gzip(text, os.path.join(out, "austen.txt.gz"))
    # 2. punkt_tab
    dst = os.path.join(out, "nltk_data", "tokenizers", "punkt_tab", "english")
    os.makedirs(dst, exist_ok=True)
    for name in PUNKT_FILES:
        src = os.path.join(punkt, name)
        if not os.path.isfile(src):
            raise SystemExit(f"missing punkt_tab file {src}")
        shutil.copyfile(src, os.path.join(dst, name))
    # 3. tokenizer, trained on what was just written (so the shipped corpus reproduces it)
    shipped_text = read_text(os.path.join(out, "austen.txt.gz"))
    assert shipped_text == text
    train_bpe(split_paragraphs(shipped_text, unwrap=True), os.path.join(out, "tokenizer"),
              vocab_size=vocab_size, min_frequency=min_frequency)
    # 4. checksums
    lines = [f"{_sha256(text.encode('utf-8'))}  austen.txt (unpacked)"]
    for rel in GENERATED[:-1]:
        with open(os.path.join(out, rel), "rb") as f:
            lines.append(f"{_sha256(f.read())}  {rel}")
    with open(os.path.join(out, "SHA256SUMS"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def verify(out: str) -> None:
    import nltk

    nl = os.path.join(out, "nltk_data")
    if nl not in nltk.data.path:
        nltk.data.path.insert(0, nl)
    found = nltk.data.find("tokenizers/punkt_tab/english/")
    assert os.path.abspath(str(found)).startswith(os.path.abspath(nl)), found
    sents = nltk.sent_tokenize(CHECK_SENTENCE)
    assert len(sents) == 2, sents
    d = os.path.join(out, "tokenizer")
    toks = [
        TextTokenizer(TokenizerSpec.gpt2(os.path.join(d, "vocab.json"), os.path.join(d, "merges.txt"))),
        TextTokenizer(TokenizerSpec.json(os.path.join(d, "tokenizer.json"))),
    ]
    try:
        import transformers  # noqa: F401

        toks.append(TextTokenizer(TokenizerSpec.hf_dir(d)))
    except ImportError:
        print("transformers not installed: Hugging Face directory not checked")
    sample = read_text(os.path.join(out, "austen.txt.gz"))[:200_000] + " héllo ☃ " + EOD_TOKEN
    ref = toks[0].encode(sample)
    for t in toks:
        assert t.vocab_size == toks[0].vocab_size and t.eod_id == 0, (t.spec, t.vocab_size, t.eod_id)
        assert t.encode(sample) == ref, f"{t.spec.describe()} encodes differently"
        assert t.decode(ref) == sample, f"{t.spec.describe()} does not decode back"
    print(f"verified: punkt splits into {len(sents)} sentences; {len(toks)} tokenizer loaders agree "
          f"on {len(sample)} characters ({len(ref)} tokens, vocab {toks[0].vocab_size})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--austen", default=DEFAULT_AUSTEN, help="corpus text (.txt or .txt.gz)")
    p.add_argument("--punkt", default=DEFAULT_PUNKT, help="punkt_tab/english directory")
    p.add_argument("--out", default=DEFAULT_OUT, help="assets directory to write")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument("--min-frequency", type=int, default=DEFAULT_MIN_FREQUENCY)
    p.add_argument("--check", action="store_true",
                   help="build into a temporary directory and compare with --out (nothing written)")
    a = p.parse_args(argv)
    if not a.check:
        build(a.out, a.austen, a.punkt, a.vocab_size, a.min_frequency)
        verify(a.out)
        print(f"wrote {a.out}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        build(tmp, a.austen, a.punkt, a.vocab_size, a.min_frequency)
        verify(tmp)
        diff = [rel for rel in GENERATED
                if not os.path.isfile(os.path.join(a.out, rel))
                or not filecmp.cmp(os.path.join(tmp, rel), os.path.join(a.out, rel), shallow=False)]
    if diff:
        print("differ from a fresh build: " + ", ".join(diff))
        return 1
    print(f"{a.out}: all {len(GENERATED)} generated files identical to a fresh build")
    return 0


if __name__ == "__main__":
    sys.exit(main())
