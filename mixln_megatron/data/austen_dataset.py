"""The demo's dataset: the shipped Austen corpus as a Megatron indexed dataset, built once and cached."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from .preprocess import FORMAT_VERSION, build_from_documents, resolve_tokenizer
from .indexed_output import output_paths
from .tokenizer import TokenizerSpec

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
