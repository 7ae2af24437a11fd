"""A Megatron-LM checkpoint's facts for an export, read once into one frozen object.

An export (convert.to_hf) walks one way: read the facts here (the reader opens the folder and
learns its layout; the vocabulary; convert.inspect reads the model kind, the shape through
convert.shape once, and the Mix-LN record; the reader checks its tensors against them), then map
the roles (convert.mapping.map_roles), then write. Nothing after this module goes back to the
shape or the inspection: what they said is in CheckpointFacts.

    facts = read_checkpoint_facts("runs/ckpt", vocab_size=None, tokenizer=None)
    facts.shape, facts.placement.kinds, facts.vocab_size, facts.token_ids, facts.reader.read_layer(...)
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Mapping, Optional, Tuple

from ..errors import ConversionError, UnsupportedModelError
from .shape import ModelShape

# Tokenizer files an export copies with --tokenizer-model; the first four mark a folder as a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "spiece.model",
                   "chat_template.jinja", "chat_template.json")


@dataclasses.dataclass(frozen=True)
class CheckpointFacts:
    """Everything an export needs to know about a checkpoint, checked for consistency."""

    reader: object  # TorchDistCheckpoint or LegacyCheckpoint: streams the tensors these facts describe
    path: str
    format: str
    iteration: object
    model_kind: str  # convert.hybrid_keys.GPT or HYBRID (exported as the GPT model its blocks are)
    hybrid_pattern: Optional[str]
    norm_layout: Optional[str]  # torch_dist: "mixln" or "stock" norm keys; legacy: None
    shape: ModelShape  # the Llama shape with the true vocabulary
    post_ln_layers: int
    placement: object  # model.placement.Placement: every layer's kind (layout), DeepNorm's alpha / beta
    scheme: str
    alpha: object
    settings_source: str
    vocab_size: int  # the true vocabulary
    vocab_source: str
    padded_vocab_size: int  # the checkpoint's embedding rows
    token_ids: Mapping[str, Optional[int]]  # bos / eos / pad ids of the tokenizer, None without one
    dtype: object  # the checkpoint's weights' torch dtype


def read_checkpoint_facts(load: str, iteration=None, *, vocab_size: Optional[int] = None,
                          tokenizer: Optional[str] = None) -> CheckpointFacts:
    """Open the checkpoint in `load` and read its facts (ConversionError / UnsupportedModelError
    naming the first problem)."""
    from .inspect import inspect_reader
    from .megatron_reader import open_checkpoint

    reader = open_checkpoint(load, iteration)
    reader.refuse_unconvertible(moe=True)  # before the vocabulary: MLA / MTP are refused as such
    reader._require_args()
    true_vocab, vocab_source = resolve_true_vocab(reader, vocab_size, tokenizer)
    info = inspect_reader(reader, true_vocab, moe=True)
    shape, record = info.model_shape, info.record
    if shape.moe is not None and reader.format != "torch_dist":
        raise UnsupportedModelError(f"{reader.path}: MoE models are converted from torch_dist checkpoints only, this is a "
                                    f"legacy ({reader.format}) one; save with --ckpt-format torch_dist")
    if true_vocab > reader.padded_vocab_size:
        raise ConversionError(
            f"true vocabulary {true_vocab} ({vocab_source}) exceeds the checkpoint's embedding rows "
            f"{reader.padded_vocab_size}"
        )
    reader.check_shapes(shape, info.layer_shapes)
    post_ln = int(record["post_ln_layers"])
    reader.check_layer_kinds(info.placement.kinds)
    if not shape.tie_embeddings and not reader.has_output_layer:
        raise ConversionError("the args say the output layer is untied, but the checkpoint has no output_layer.weight")
    return CheckpointFacts(
        reader=reader, path=reader.path, format=reader.format, iteration=reader.iteration,
        model_kind=info.model_kind, hybrid_pattern=info.hybrid_pattern, norm_layout=reader.norm_layout,
        shape=shape, post_ln_layers=post_ln, placement=info.placement, scheme=record["scheme"], alpha=record.get("alpha"),
        settings_source=info.record_source, vocab_size=true_vocab, vocab_source=vocab_source,
        padded_vocab_size=reader.padded_vocab_size, token_ids=_token_ids(reader, tokenizer), dtype=reader.dtype,
    )


# --------------------------------------------------------------------------- vocabulary
def resolve_true_vocab(reader, vocab_size: Optional[int], tokenizer_dir: Optional[str]) -> Tuple[int, str]:
    """The true (unpadded) vocabulary size and where it came from."""
    if vocab_size is not None:
        return int(vocab_size), "--vocab-size"
    args_vocab = getattr(reader.args, "vocab_size", None)
    if args_vocab:
        return int(args_vocab), "the checkpoint's args (vocab_size)"
    for source, path in (("--tokenizer-model", tokenizer_dir), ("the checkpoint's args (tokenizer_model)",
                                                           getattr(reader.args, "tokenizer_model", None))):
        if path and os.path.isdir(str(path)):
            return len(load_tokenizer(str(path))), f"the tokenizer in {path} ({source})"
    raise ConversionError(
        "cannot tell the true vocabulary size: the checkpoint's args record none and no local tokenizer "
        f"is known; pass --vocab-size N or --tokenizer-model DIR (the padded size is {reader.padded_vocab_size})"
    )


def _token_ids(reader, tokenizer: Optional[str]) -> Mapping[str, Optional[int]]:
    """Special token ids only come from a tokenizer (--tokenizer-model, else a local folder the args
    record); without one they stay unset (not Llama's 1 / 2)."""
    tok = None
    if tokenizer:
        tok = load_tokenizer(tokenizer)
    else:
        recorded = getattr(reader.args, "tokenizer_model", None)
        if recorded and os.path.isdir(str(recorded)) and any(
                os.path.isfile(os.path.join(str(recorded), n)) for n in TOKENIZER_FILES[:4]):
            try:
                tok = load_tokenizer(str(recorded))  # only for the special token ids
            except ConversionError:
                tok = None
    return types.MappingProxyType({k: getattr(tok, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any tokenizer loading problem is a user input problem
        raise ConversionError(f"cannot load a tokenizer from {path}: {e}") from None
