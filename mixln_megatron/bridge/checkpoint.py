"""A Megatron-LM torch_dist checkpoint of a model Megatron-Bridge built: what `convert to-hf`,
`convert inspect` and `pretrain --load` read.

    models = provider.provide_distributed_model(wrap_with_ddp=False)   # any TP / PP
    save_megatron_checkpoint(models, "ckpt/")                          # collective: every rank

Bridge's own `AutoBridge.save_megatron_model` writes a Bridge training checkpoint: no Megatron-LM
`args` (the model shape) in its common state, no Mix-LN settings record, and `iter_0000000`, for
which Megatron-LM would look for optimizer and RNG state. This writes what `convert from-hf` writes
instead: a `release` checkpoint (a fresh start, no optimizer / RNG state looked for) with
model.sharded_state_dict() (the tensors and the record `pretrain` writes) and the args `convert
from-hf` writes, through megatron-core's dist_checkpointing. An existing non-empty `path` is
refused; every rank writes into one hidden temporary folder beside `path`, renamed once all ranks
are done, so a failed or killed save leaves no half-written checkpoint.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch

from ..convert.from_hf import CONTENT_METADATA_BASE, megatron_args_namespace
from ..convert.shape import padded_vocab_size, shape_from_hf_config
from ..errors import ConversionError
from ..model.placement import Placement
from ..safe_output import MEGATRON_FOLDER, output_path, staged_dir, sweep_stale
from .llama import MixLNLlamaBridge
from .moe import MixLNMoeBridge
from .provider import MixLNModelProvider

RELEASE = "release"
TRACKER = "latest_checkpointed_iteration.txt"


def _provider_of(models):
    from megatron.core.utils import get_model_config  # heavy

    return get_model_config(models[0])


def hf_config_of(provider) -> dict:
    """The HF config dict of a provider, by the bridge of its kind (ours for a MixLNModelProvider,
    the MoE one when it has experts; Bridge's Llama otherwise)."""
    from megatron.bridge.models.llama.llama_bridge import LlamaBridge  # optional

    bridge = LlamaBridge
    if isinstance(provider, MixLNModelProvider):
        bridge = MixLNMoeBridge if getattr(provider, "num_moe_experts", None) else MixLNLlamaBridge
    return bridge.megatron_to_hf_config(provider)


def _vocab_padding(provider, tp: int):
    """(padded vocabulary rows, make_vocab_size_divisible_by to record): the rows the model has, and
    a divisor under which Megatron-LM's padding rule gives those rows back."""
    vocab = int(provider.vocab_size)
    divisible = int(getattr(provider, "make_vocab_size_divisible_by", 128) or 1)
    rows = padded_vocab_size(vocab, divisible, tp) if getattr(provider, "should_pad_vocab", False) else vocab
    for candidate in (divisible, 1):
        if padded_vocab_size(vocab, candidate, tp) == rows:
            return rows, candidate
    raise ConversionError(f"the model's vocabulary of {rows} rows is not a multiple of TP {tp}: Megatron-LM "
                          "cannot load it")


def checkpoint_args(models, record: dict, tokenizer_model: Optional[str] = None, source: str = "megatron-bridge"):
    """The Megatron-LM args (argparse.Namespace) of a Bridge-built model, as `convert from-hf` writes them."""
    from megatron.core import parallel_state as ps  # heavy

    provider = _provider_of(models)
    shape = shape_from_hf_config(hf_config_of(provider), "the Bridge provider's config")
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    rows, divisible = _vocab_padding(provider, tp)
    backend = getattr(provider, "mixln_backend", None) or (
        "local" if getattr(provider, "transformer_impl", None) == "local" else "te")
    ns = megatron_args_namespace(
        shape, tp=tp, pp=pp, ckpt_format="torch_dist", params_dtype=provider.params_dtype, padded_vocab=rows,
        make_vocab_size_divisible_by=divisible, placement_record=record,
        transformer_impl="local" if backend == "local" else "transformer_engine",
        tokenizer_type="HuggingFaceTokenizer" if tokenizer_model else None, tokenizer_model=tokenizer_model,
        source=source,
    )
    ns.virtual_pipeline_model_parallel_size = getattr(provider, "virtual_pipeline_model_parallel_size", None)
    return ns


def save_megatron_checkpoint(models, path: str, *, tokenizer_model: Optional[str] = None,
                             source: str = "megatron-bridge") -> str:
    """Save Bridge-built model chunks (this rank's) as a Megatron-LM torch_dist `release` checkpoint
    in `path` (see the module doc). Collective: every rank of the model's process groups calls it.
    `tokenizer_model`: recorded as a HuggingFaceTokenizer (e.g. the HF folder the model came from).
    Returns the iteration directory."""
    from megatron.core import dist_checkpointing  # heavy

    models = list(models) if isinstance(models, (list, tuple)) else [models]
    # The content metadata Megatron-LM saves: the model adds its Mix-LN entry while it describes
    # itself (model.checkpoint.add_settings_record), for every chunk the same.
    metadata = dict(CONTENT_METADATA_BASE)
    if len(models) == 1:
        state = {"model": models[0].sharded_state_dict(metadata=metadata)}
    else:
        state = {f"model{i}": m.sharded_state_dict(metadata=metadata) for i, m in enumerate(models)}
    record = metadata.get("mixln")
    if record is None:  # Bridge's own Llama spec (a P = 0 folder on the TE backend): a stock model
        record = Placement(int(_provider_of(models).num_layers), 0, "mixln").record()
    state.update(args=checkpoint_args(models, record, tokenizer_model, source), checkpoint_version=3.0,
                 iteration=0, num_floating_point_operations_so_far=0)
    with _staged_on_rank_0(path) as (tmp, rank):
        dist_checkpointing.save(state, os.path.join(tmp, RELEASE), content_metadata=metadata)
        _barrier()  # every rank's files are in before the tracker
        if rank == 0:
            with open(os.path.join(tmp, TRACKER), "w") as f:
                f.write(RELEASE)
    _barrier()  # no rank returns before `path` is there
    return os.path.join(path, RELEASE)


@contextlib.contextmanager
def _staged_on_rank_0(path: str) -> Iterator[tuple]:
    """(temporary folder, rank) for every rank: rank 0 refuses a `path` that is not an empty folder
    (on every rank), removes what killed saves to it left, and stages the folder with
    safe_output.staged_dir; its name goes to the other ranks. Rank 0 renames it to `path` when the
    block ends on rank 0 without an error, and removes it when it does not."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    with contextlib.ExitStack() as stack:
        found = None
        if rank == 0:
            try:
                sweep_stale(path)
                target = output_path(path)
                if os.path.lexists(target) and (not os.path.isdir(target) or os.listdir(target)):
                    raise ConversionError(f"{path} exists and is not an empty folder: nothing is overwritten; "
                                          "save to a new path")
                tmp = stack.enter_context(staged_dir(path, MEGATRON_FOLDER, False, ConversionError))
                os.mkdir(os.path.join(tmp, RELEASE))
                found = ("ok", tmp)
            except (ConversionError, OSError) as error:
                found = ("refused", str(error))
        what, text = _from_rank_0(found)
        if what == "refused":
            raise ConversionError(text)
        yield text, rank


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _from_rank_0(value):
    """Rank 0's value, on every rank (so every rank raises or none does)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
