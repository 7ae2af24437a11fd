"""Tokenizers for offline preprocessing: training the shipped byte-level BPE, and loading one.

`train_bpe` writes GPT-2's model (byte-level, no prefix space, no normalizer; `<|endoftext|>`, id 0,
the only special token and the end-of-document token) as GPT-2 vocab.json / merges.txt, a
tokenizer.json, and a tokenizer_config.json that makes the directory a local Hugging Face tokenizer.

`load_tokenizer(TokenizerSpec)` gives one interface, `TextTokenizer`, over GPT-2 files, a
tokenizer.json or a local Hugging Face directory, all offline. Encoding never adds special tokens
(--append-eod appends EOD explicitly). A TokenizerSpec is a picklable value from which worker
processes rebuild the tokenizer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

from .corpus import TokenizerFiles, tokenizer_files

EOD_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_MIN_FREQUENCY = 2


# --------------------------------------------------------------------------------------- training


def _byte_level_bpe_trainer_parts(vocab_size: int, min_frequency: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # optional

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return tok, trainer


def train_bpe(
    texts: Iterable[str],
    out_dir: str,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    min_frequency: int = DEFAULT_MIN_FREQUENCY,
):
    """Train a GPT-2 style byte-level BPE on `texts` and write it to `out_dir` (see module doc).

    `texts` are independent training units (e.g. paragraphs). Deterministic for a given input
    sequence and `tokenizers` version. Returns corpus.TokenizerFiles for the written files.
    """
    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size must exceed the 256 byte symbols + {EOD_TOKEN}, got {vocab_size}")
    os.makedirs(out_dir, exist_ok=True)
    tok, trainer = _byte_level_bpe_trainer_parts(vocab_size, min_frequency)
    tok.train_from_iterator(texts, trainer=trainer)
    # GPT-2 format files. model.save writes "<prefix>-vocab.json" style names only with a prefix;
    # without one it writes vocab.json and merges.txt ("#version: 0.2" header, one merge a line).
    tok.model.save(out_dir)
    tok.save(os.path.join(out_dir, "tokenizer.json"), pretty=True)
    config = {
        # transformers maps this to its (fast) GPT-2 tokenizer; the files above are all it needs.
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": EOD_TOKEN,
        "eos_token": EOD_TOKEN,
        "unk_token": EOD_TOKEN,
        "add_prefix_space": False,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    return TokenizerFiles(
        directory=out_dir,
        vocab_file=os.path.join(out_dir, "vocab.json"),
        merge_file=os.path.join(out_dir, "merges.txt"),
        tokenizer_json=os.path.join(out_dir, "tokenizer.json"),
    )


# ---------------------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class TokenizerSpec:
    """Where to load a tokenizer from (picklable). Use the constructors below."""

    kind: str  # "gpt2" | "json" | "hf"
    path: str  # vocab.json (gpt2), tokenizer.json (json) or the directory (hf)
    merges: Optional[str] = None  # merges.txt (gpt2 only)

    @classmethod
    def gpt2(cls, vocab_file: str, merge_file: str) -> "TokenizerSpec":
        return cls("gpt2", os.path.abspath(vocab_file), os.path.abspath(merge_file))

    @classmethod
    def json(cls, tokenizer_json: str) -> "TokenizerSpec":
        return cls("json", os.path.abspath(tokenizer_json))

    @classmethod
    def hf_dir(cls, directory: str) -> "TokenizerSpec":
        return cls("hf", os.path.abspath(directory))

    def describe(self) -> str:
        if self.kind == "gpt2":
            return f"GPT-2 BPE files {self.path} + {self.merges}"
        if self.kind == "json":
            return f"tokenizers file {self.path}"
        return f"Hugging Face tokenizer directory {self.path}"

    def check(self) -> None:
        """Raise FileNotFoundError/ValueError with a clear message if the files are not there."""
        if self.kind not in ("gpt2", "json", "hf"):
            raise ValueError(f"unknown tokenizer kind {self.kind!r}")
        need = [self.path] + ([self.merges] if self.kind == "gpt2" else [])
        for p in need:
            if p is None:
                raise ValueError("a GPT-2 BPE tokenizer needs both a vocab file and a merge file")
            if self.kind == "hf":
                if not os.path.isdir(p):
                    raise FileNotFoundError(f"tokenizer directory not found: {p}")
            elif not os.path.isfile(p):
                raise FileNotFoundError(f"tokenizer file not found: {p}")


def shipped_tokenizer_spec() -> TokenizerSpec:
    """The byte-level BPE shipped in mixln_megatron/assets/tokenizer (GPT-2 format files)."""
    files = tokenizer_files()
    return TokenizerSpec.gpt2(files.vocab_file, files.merge_file)


class TextTokenizer:
    """Uniform interface: encode(text) -> ids (no special tokens added), decode(ids) -> text."""

    def __init__(self, spec: TokenizerSpec):
        spec.check()
        self.spec = spec
        self._hf = None
        self._tok = None
        if spec.kind == "gpt2":
            self._tok = _gpt2_from_files(spec.path, spec.merges)
        elif spec.kind == "json":
            from tokenizers import Tokenizer  # optional

            self._tok = Tokenizer.from_file(spec.path)
        else:
            from transformers import AutoTokenizer  # optional

            try:
                self._hf = AutoTokenizer.from_pretrained(
                    spec.path, local_files_only=True, trust_remote_code=False
                )
            except Exception as e:  # transformers raises OSError/ValueError/... here
                raise ValueError(f"cannot load a tokenizer from {spec.path}: {e}") from e

    # -- properties
    @property
    def vocab_size(self) -> int:
        """Number of ids, added/special tokens included (what picks the .bin dtype)."""
        if self._hf is not None:
            return len(self._hf)
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod_id(self) -> Optional[int]:
        """Id of the end-of-document token: the tokenizer's EOS if it has one, else
        `<|endoftext|>` if it is in the vocabulary, else None."""
        if self._hf is not None:
            if self._hf.eos_token_id is not None:
                return int(self._hf.eos_token_id)
            tid = self._hf.convert_tokens_to_ids(EOD_TOKEN)
            return None if tid is None or tid == self._hf.unk_token_id else int(tid)
        tid = self._tok.token_to_id(EOD_TOKEN)
        return None if tid is None else int(tid)

    # -- encoding
    def encode(self, text: str) -> List[int]:
        if self._hf is not None:
            return list(self._hf(text, add_special_tokens=False, verbose=False)["input_ids"])
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        if not texts:
            return []
        if self._hf is not None:
            return [list(x) for x in self._hf(list(texts), add_special_tokens=False, verbose=False)["input_ids"]]
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return self._tok.decode(ids, skip_special_tokens=False)


def _gpt2_from_files(vocab_file: str, merge_file: str):
    """A `tokenizers.Tokenizer` equivalent to GPT-2's tokenizer for the given vocab/merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # optional

    try:
        bpe = models.BPE.from_file(vocab_file, merge_file)
    except Exception as e:
        raise ValueError(f"cannot read GPT-2 BPE files {vocab_file} / {merge_file}: {e}") from e
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Register <|endoftext|> as a special token (as GPT-2's Hugging Face tokenizer does) only if
    # the vocabulary already has it: registering an unknown token would append a new id.
    if tok.token_to_id(EOD_TOKEN) is not None:
        tok.add_special_tokens([EOD_TOKEN])
    return tok


def load_tokenizer(spec: Optional[TokenizerSpec] = None) -> TextTokenizer:
    """Load `spec` (default: the shipped tokenizer)."""
    return TextTokenizer(spec if spec is not None else shipped_tokenizer_spec())
