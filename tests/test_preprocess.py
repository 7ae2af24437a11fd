"""Offline data preparation: shipped assets, text -> Megatron indexed dataset, tokenizer checks.

Everything is read back with megatron-core's own IndexedDataset. Fast (CPU, small slices).
"""

import json
import os
import sys
import types

import numpy as np
import pytest

from harness.testing import run_python
from mixln_megatron.data import corpus
from mixln_megatron.data import preprocess as pp
from mixln_megatron.data.preprocess import prepare_austen_dataset
from mixln_megatron.data.tokenizer import EOD_TOKEN, TokenizerSpec, load_tokenizer

BENNET = "My dear Mr. Bennet, said his lady. Mrs. Long came."


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(prefix)


def _documents(prefix):
    """[[sequence ids, ...] per document] from the dataset at prefix."""
    ds = _read(prefix)
    di = ds.document_indices
    # copies: megatron closes the mmap when the dataset object goes away
    return [[np.array(ds[i], copy=True) for i in range(di[d], di[d + 1])] for d in range(len(di) - 1)]


def _decode_docs(prefix, tok):
    return ["".join(tok.decode(s) for s in doc) for doc in _documents(prefix)]


def _listing(d):
    return sorted(os.listdir(d))


# ------------------------------------------------------------------------------------ assets


def test_shipped_assets_resolve_inside_the_package():
    import nltk

    pkg = os.path.dirname(os.path.dirname(os.path.abspath(corpus.__file__)))
    for p in (corpus.austen_text_path(), corpus.punkt_dir(), *corpus.tokenizer_files()):
        assert os.path.exists(p) and os.path.abspath(p).startswith(pkg), p
    text = corpus.read_austen()
    assert len(text) > 4_000_000 and text.startswith("EMMA")
    assert corpus.read_austen(max_chars=100) == text[:100]
    corpus.use_shipped_punkt()
    corpus.use_shipped_punkt()  # idempotent
    assert nltk.data.path.count(corpus.nltk_data_dir()) == 1
    found = os.path.abspath(str(nltk.data.find("tokenizers/punkt_tab/english/")))
    assert found == os.path.abspath(corpus.punkt_dir())
    assert nltk.sent_tokenize(BENNET) == ["My dear Mr. Bennet, said his lady.", "Mrs. Long came."]


def test_tokenizer_forms_agree(tok):
    d = corpus.tokenizer_files()
    sample = corpus.read_austen(max_chars=30_000) + " naïve café ☃\n\t" + EOD_TOKEN + " end"
    ref = tok.encode(sample)
    assert tok.vocab_size == 4096 and tok.eod_id == 0
    assert tok.decode(ref) == sample
    assert ref[-2] == 0  # <|endoftext|> is one special token
    for spec in (TokenizerSpec.json(d.tokenizer_json), TokenizerSpec.hf_dir(d.directory)):
        other = load_tokenizer(spec)
        assert other.vocab_size == 4096 and other.eod_id == 0
        assert other.encode(sample) == ref, spec


# ------------------------------------------------------------------------------ round trips


def test_plain_text_paragraph_round_trip(tmp_path, tok):
    src = tmp_path / "book.txt"
    text = corpus.read_austen(max_chars=40_000) + "\n\n  Unicode: naïve — “quoted” ☃  \n"
    src.write_text(text, encoding="utf-8")
    for unwrap in (False, True):
        prefix = str(tmp_path / f"book_{unwrap}")
        stats = pp.preprocess_files([str(src)], prefix, unwrap=unwrap, progress=False)
        expected = corpus.split_paragraphs(text, unwrap=unwrap)
        assert stats.documents == len(expected) == stats.sequences > 50
        assert stats.dtype == "uint16" and stats.bad_lines == 0
        assert _decode_docs(prefix, tok) == expected
    # the hard wrapping is kept without --unwrap, undone with it
    assert "\n" in _decode_docs(str(tmp_path / "book_False"), tok)[10]
    assert "\n" not in "".join(_decode_docs(str(tmp_path / "book_True"), tok))


def test_line_and_file_units_and_gzip(tmp_path, tok):
    import gzip

    src = tmp_path / "lines.txt.gz"
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.write("first line\n\n  second line  \r\nthird\n")
    pp.preprocess_files([str(src)], str(tmp_path / "l"), text_unit="line", progress=False)
    assert _decode_docs(str(tmp_path / "l"), tok) == ["first line", "second line", "third"]
    assert pp.main(["-i", str(src), "-o", str(tmp_path / "l2"), "--text-unit", "line",
                    "--max-documents", "2", "--no-progress"]) == 0
    assert _decode_docs(str(tmp_path / "l2"), tok) == ["first line", "second line"]
    pp.preprocess_files([str(src)], str(tmp_path / "f"), text_unit="file", append_eod=True, progress=False)
    # the same tokenizer given as a tokenizer.json file writes the same bytes
    pp.preprocess_files([str(src)], str(tmp_path / "j"), text_unit="file", append_eod=True, progress=False,
                        tokenizer=TokenizerSpec.json(corpus.tokenizer_files().tokenizer_json))
    for ext in (".bin", ".idx"):
        assert open(tmp_path / f"f{ext}", "rb").read() == open(tmp_path / f"j{ext}", "rb").read()
    assert _decode_docs(str(tmp_path / "f"), tok) == ["first line\n\n  second line  \r\nthird" + EOD_TOKEN]


def test_jsonl_split_sentences_round_trip(tmp_path, tok):
    texts = [BENNET, "One sentence only", "  Leading space. And\ntrailing newline.\n",
             *corpus.austen_paragraphs(max_chars=20_000)[5:40]]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    prefix = str(tmp_path / "docs")
    stats = pp.preprocess_files([str(src)], prefix, split_sentences=True, append_eod=True, progress=False)
    docs = _documents(prefix)
    assert stats.documents == len(docs) == len(texts)
    assert stats.sequences == sum(len(d) for d in docs) > len(texts)
    assert stats.tokens == sum(len(s) for d in docs for s in d)
    for doc, text in zip(docs, texts):
        assert doc[-1][-1] == tok.eod_id and all(s[-1] != tok.eod_id for s in doc[:-1])
        assert "".join(tok.decode(s) for s in doc) == text + EOD_TOKEN
    # "Mr." does not end a sentence; the space before "Mrs." goes with the second sentence
    assert [tok.decode(s) for s in docs[0]] == ["My dear Mr. Bennet, said his lady.", " Mrs. Long came." + EOD_TOKEN]
    assert len(docs[1]) == 1
    # splitting changes sequence boundaries, not the tokens (boundaries are at whitespace here)
    pp.preprocess_files([str(src)], prefix + "_nosplit", append_eod=True, progress=False)
    flat = lambda docs: [np.concatenate(d).tolist() for d in docs]  # noqa: E731
    assert flat(_documents(prefix + "_nosplit")) == flat(docs)


def test_bad_jsonl_lines_are_skipped_and_counted(tmp_path, tok, capsys):
    src = tmp_path / "mixed.jsonl"
    lines = [
        b'\xef\xbb\xbf{"text": "Good one."}',  # a byte order mark is dropped
        b'{"text": "broken',  # malformed JSON
        b'{"body": "no text key"}',  # missing key
        b'["a", "list"]',  # not an object
        b'{"text": 42}',  # not a string
        b'{"text": "bad utf8 \xff"}',  # invalid UTF-8
        b"   ",  # blank: ignored, not counted as bad
        b'{"text": ""}',  # empty document: skipped, counted separately
        b'{"text": "Good two."}',
    ]
    src.write_bytes(b"\n".join(lines) + b"\n")
    stats = pp.preprocess_files([str(src)], str(tmp_path / "m"), progress=False)
    assert stats.documents == 2 and stats.bad_lines == 5 and stats.empty == 1 and stats.blank_lines == 1
    assert stats.skipped == {"malformed_json": 1, "missing_key": 2, "not_string": 1, "invalid_utf8": 1}
    assert stats.examples[0] == f"{src}:2: malformed JSON"
    assert _decode_docs(str(tmp_path / "m"), tok) == ["Good one.", "Good two."]
    # the CLI reports the count at the end
    assert pp.main(["--input", str(src), "-o", str(tmp_path / "cli"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "2 documents" in out and "skipped 5 bad lines" in out and "malformed JSON: 1" in out


def test_workers_give_identical_output(tmp_path):
    src = tmp_path / "w.jsonl"
    paras = corpus.austen_paragraphs(max_chars=60_000)
    src.write_text("".join(json.dumps({"text": p}) + "\n" for p in paras) + "{oops\n")
    outs = {}
    for workers in (1, 2):
        prefix = str(tmp_path / f"w{workers}")
        stats = pp.preprocess_files([str(src)], prefix, split_sentences=True, append_eod=True,
                                    workers=workers, chunk_size=16, progress=False)
        assert stats.documents == len(paras) and stats.bad_lines == 1
        outs[workers] = [open(prefix + ext, "rb").read() for ext in (".bin", ".idx")]
    assert outs[1] == outs[2]


# ------------------------------------------------------------------------ atomicity, errors


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_interrupted_run_leaves_no_pair_and_no_temporaries(tmp_path, monkeypatch, exc):
    src = tmp_path / "in.txt"
    src.write_text("\n\n".join(f"Paragraph number {i}." for i in range(50)))
    out = tmp_path / "out"
    real, calls = pp._add_document, []

    def failing(builder, seqs):
        calls.append(1)
        if len(calls) == 20:
            raise exc("injected")
        real(builder, seqs)

    monkeypatch.setattr(pp, "_add_document", failing)
    with pytest.raises(exc):
        pp.preprocess_files([str(src)], str(out / "data"), chunk_size=8, progress=False)
    assert len(calls) == 20
    assert _listing(out) == []  # no .bin/.idx, no hidden temporaries

    # with --overwrite, a failed run keeps the previous complete pair untouched
    monkeypatch.setattr(pp, "_add_document", real)
    pp.preprocess_files([str(src)], str(out / "data"), progress=False)
    before = [open(out / f"data{e}", "rb").read() for e in (".bin", ".idx")]
    calls.clear()
    monkeypatch.setattr(pp, "_add_document", failing)
    with pytest.raises(exc):
        pp.preprocess_files([str(src)], str(out / "data"), chunk_size=8, overwrite=True, progress=False)
    assert _listing(out) == ["data.bin", "data.idx"]
    assert [open(out / f"data{e}", "rb").read() for e in (".bin", ".idx")] == before


def test_failure_between_renames_leaves_no_pair(tmp_path, monkeypatch):
    src = tmp_path / "in.txt"
    src.write_text("One.\n\nTwo.")
    real = os.replace

    def replace(a, b):
        if str(b).endswith(".idx"):
            raise OSError("disk gone")
        return real(a, b)

    monkeypatch.setattr(pp.os, "replace", replace)
    with pytest.raises(OSError):
        pp.preprocess_files([str(src)], str(tmp_path / "o" / "d"), progress=False)
    assert _listing(tmp_path / "o") == []


def test_existing_output_is_refused_without_overwrite(tmp_path, tok, capsys):
    src = tmp_path / "in.txt"
    src.write_text("Old text.")
    prefix = str(tmp_path / "d")
    pp.preprocess_files([str(src)], prefix, progress=False)
    src.write_text("New text.")
    with pytest.raises(pp.PreprocessError, match="already exists"):
        pp.preprocess_files([str(src)], prefix, progress=False)
    assert pp.main(["-i", str(src), "-o", prefix, "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert _decode_docs(prefix, tok) == ["Old text."]
    assert pp.main(["-i", str(src), "-o", prefix, "--no-progress", "--overwrite"]) == 0
    assert _decode_docs(prefix, tok) == ["New text."]
    assert _listing(tmp_path) == ["d.bin", "d.idx", "in.txt"]


def test_clear_errors(tmp_path, capsys):
    assert pp.main(["-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "x"), "--no-progress"]) == 2
    assert "input file not found" in capsys.readouterr().err
    (tmp_path / "in.txt").write_bytes(b"fine\nbad \xff byte\n")
    assert pp.main(["-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "x"), "--no-progress"]) == 2
    assert "in.txt:2: not valid UTF-8" in capsys.readouterr().err
    # the same error raised while worker processes run
    assert pp.main(["-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "x"), "--no-progress",
                    "--workers", "2", "--text-unit", "line"]) == 2
    assert "in.txt:2: not valid UTF-8" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n{"nope": 1}\n')
    assert pp.main(["-i", str(tmp_path / "empty.jsonl"), "-o", str(tmp_path / "x"), "--no-progress"]) == 2
    assert "no documents to write (1 bad lines, 1 empty documents" in capsys.readouterr().err
    assert _listing(tmp_path) == ["empty.jsonl", "in.txt"]
    assert pp.main(["-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "x.bin")]) == 2
    assert pp.main(["-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "x"),
                    "--tokenizer-model", str(tmp_path / "nope")]) == 2
    assert "tokenizer directory not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pp.main(["-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "x"), "--vocab-file", "v.json"])


def test_module_entry_point_help():
    r = run_python([sys.executable, "-m", "mixln_megatron.data.preprocess", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--output-prefix" in r.stdout and "--split-sentences" in r.stdout


# --------------------------------------------------------------------------------- the demo


def test_prepare_austen_dataset_is_cached(tmp_path, tok):
    prefix = prepare_austen_dataset(str(tmp_path), max_chars=30_000)
    mtime = os.path.getmtime(prefix + ".bin")
    assert prepare_austen_dataset(str(tmp_path), max_chars=30_000) == prefix
    assert os.path.getmtime(prefix + ".bin") == mtime
    paras = corpus.austen_paragraphs(max_chars=30_000)
    assert sum(len(p) + 1 for p in paras) <= 30_000
    assert _decode_docs(prefix, tok) == [p + EOD_TOKEN for p in paras]
    meta = json.load(open(prefix + ".json"))
    assert meta["documents"] == len(paras) and meta["tokens"] == int(_read(prefix).sequence_lengths.sum())
    other = prepare_austen_dataset(str(tmp_path), max_chars=20_000)
    assert other != prefix


# ---------------------------------------------------------------------- Megatron's tokenizers


def _megatron_args(**kw):
    base = dict(special_tokens=None, tokenizer_hf_no_use_fast=False, trust_remote_code=False,
                tokenizer_hf_no_include_special_tokens=False, metadata_path=None,
                pad_vocab_size=False, chat_template=None, vocab_file=None, merge_file=None,
                tokenizer_model=None)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_megatron_tokenizers_read_the_shipped_files(tmp_path, monkeypatch, tok):
    """Megatron-core 0.19's tokenizer builder, offline:
    * HuggingFaceTokenizer on the shipped directory (the way to use it for training);
    * GPT2BPETokenizer with --vocab-file/--merge-file. That path is AutoTokenizer.from_pretrained(
      "gpt2", vocab_file=..., merges_file=...), which needs the hub's "gpt2" config; a local
      stand-in "gpt2" directory holding only that config (no vocabulary) plays its part here."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = corpus.tokenizer_files()
    sample = corpus.read_austen(max_chars=20_000)[-5_000:] + " naïve ☃"
    ref = tok.encode(sample)

    hf = build_tokenizer(_megatron_args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=files.directory))
    assert hf.vocab_size == 4096 and hf.eod == 0
    assert hf.tokenize(sample) == ref and hf.detokenize(ref) == sample

    stand_in = tmp_path / "gpt2"
    stand_in.mkdir()
    (stand_in / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (stand_in / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    monkeypatch.chdir(tmp_path)
    g = build_tokenizer(_megatron_args(tokenizer_type="GPT2BPETokenizer",
                                       vocab_file=files.vocab_file, merge_file=files.merge_file))
    assert g.vocab_size == 4096 and g.eod == 0
    assert g.tokenize(sample) == ref and g.detokenize(ref) == sample
