"""Fixed token batches from real text: a text file, or the shipped Austen corpus.

  corpus_tokens(text_file=None, tokenizer=None)   the token stream (np.int64), documents separated
        by the EOD token. Without a text file and with the shipped tokenizer it is read from the
        Megatron indexed dataset that mixln_megatron.data.prepare_austen_dataset builds (cached by
        content under cache_dir); otherwise the file is read as paragraphs (blank-line separated,
        hard wrapping undone, the preprocessing rule) and tokenized here.
  split_train_valid(tokens)   every k-th block of the stream is held out (validation spread over
        the whole corpus rather than the tail of the last novel).
  windows(tokens, seq_len)    non-overlapping windows of seq_len + 1 tokens; ids = w[:, :-1],
        labels = w[:, 1:].
  batches(...)                lists of (ids, labels) LongTensors [b, seq_len], fixed by a data seed
        that does not depend on the model seed, so every variant sees the same tokens in the same
        order.
"""

from __future__ import annotations

import os
import tempfile
from typing import List, Optional, Tuple

import numpy as np
import torch

def default_cache_dir() -> str:
    from ..model.settings import analysis_cache_dir  # MIXLN_ANALYSIS_CACHE

    return analysis_cache_dir() or os.path.join(tempfile.gettempdir(), "mixln_megatron_data")


def _read_indexed(prefix: str) -> np.ndarray:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix, mmap=True)
    parts = [np.asarray(ds[i]) for i in range(len(ds))]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def corpus_tokens(
    text_file: Optional[str] = None,
    tokenizer=None,
    cache_dir: Optional[str] = None,
    max_chars: Optional[int] = None,
) -> np.ndarray:
    """The token stream of `text_file` (default: the shipped corpus), EOD after every paragraph.

    `tokenizer`: a mixln_megatron.data.TokenizerSpec (default: the shipped byte-level BPE).
    """
    from ..data import load_tokenizer, prepare_austen_dataset
    from ..data.corpus import split_paragraphs

    if text_file is None and tokenizer is None:
        prefix = prepare_austen_dataset(cache_dir or default_cache_dir(), max_chars=max_chars)
        return _read_indexed(prefix)
    tok = load_tokenizer(tokenizer)
    if text_file is None:
        from ..data import austen_paragraphs

        paragraphs = austen_paragraphs(max_chars=max_chars)
    else:
        with open(text_file, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if max_chars is not None:
            text = text[:max_chars]
        paragraphs = split_paragraphs(text)
    if not paragraphs:
        raise ValueError(f"{text_file or 'the corpus'}: no text found")
    eod = tok.eod_id
    out: List[int] = []
    step = 512
    for i in range(0, len(paragraphs), step):
        for ids in tok.encode_batch(paragraphs[i:i + step]):
            out.extend(ids)
            if eod is not None:
                out.append(eod)
    return np.asarray(out, dtype=np.int64)


def split_train_valid(tokens: np.ndarray, valid_every: int = 20, block: int = 8192) -> Tuple[np.ndarray, np.ndarray]:
    """Blocks of `block` tokens; block i is validation when i % valid_every == valid_every - 1."""
    n_blocks = (len(tokens) + block - 1) // block
    train, valid = [], []
    for i in range(n_blocks):
        (valid if i % valid_every == valid_every - 1 else train).append(tokens[i * block:(i + 1) * block])
    if not valid:
        raise ValueError(f"too few tokens ({len(tokens)}) for a validation split of 1/{valid_every} of {block}-token blocks")
    return np.concatenate(train), np.concatenate(valid)


def windows(tokens: np.ndarray, seq_len: int) -> torch.Tensor:
    """All non-overlapping windows of seq_len + 1 tokens, in order: LongTensor [n, seq_len + 1]."""
    w = seq_len + 1
    n = len(tokens) // w
    if n == 0:
        raise ValueError(f"need at least {w} tokens, got {len(tokens)}")
    return torch.from_numpy(np.ascontiguousarray(tokens[: n * w].reshape(n, w)))


def batches(
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    num_batches: Optional[int] = None,
    seed: Optional[int] = None,
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(ids, labels) batches of non-overlapping windows.

    seed None: windows in corpus order, spread evenly over the stream when fewer than all are
    asked for; otherwise a permutation drawn from `seed` (cycled if more batches are asked for
    than the stream holds).
    """
    all_w = windows(tokens, seq_len)
    n = all_w.shape[0]
    if num_batches is None:
        num_batches = n // batch_size
        if num_batches == 0:
            raise ValueError(f"{n} windows of {seq_len + 1} tokens do not fill one batch of {batch_size}")
    need = num_batches * batch_size
    if seed is None:
        if need <= n:
            idx = torch.linspace(0, n - 1, need).round().long() if need < n else torch.arange(n)
        else:
            idx = torch.arange(need) % n
    else:
        g = torch.Generator().manual_seed(int(seed))
        perms = [torch.randperm(n, generator=g) for _ in range((need + n - 1) // n)]
        idx = torch.cat(perms)[:need]
    chosen = all_w[idx]
    out = []
    for i in range(num_batches):
        w = chosen[i * batch_size:(i + 1) * batch_size]
        out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    return out


def eval_batches(
    tokens: np.ndarray, num_tokens: int, seq_len: int, batch_size: int = 8
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Windows spread evenly over the stream covering `num_tokens` predicted tokens (fewer if the
    text is shorter), grouped into batches of `batch_size` sequences."""
    n_windows = min(max(1, -(-int(num_tokens) // seq_len)), len(tokens) // (seq_len + 1))
    single = batches(tokens, seq_len, 1, num_batches=n_windows)
    return [(torch.cat([w[0] for w in single[i:i + batch_size]]),
             torch.cat([w[1] for w in single[i:i + batch_size]]))
            for i in range(0, len(single), batch_size)]


def check_vocab(batch_list, vocab_size: int, what: str = "the model") -> None:
    top = max(int(ids.max()) for ids, _ in batch_list)
    top = max(top, max(int(lab.max()) for _, lab in batch_list))
    if top >= vocab_size:
        raise ValueError(f"token id {top} is outside the vocabulary of {what} ({vocab_size}); "
                         "pass the tokenizer the model was trained with (--tokenizer-model)")
