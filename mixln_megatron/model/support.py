"""Which configurations Mix-LN does not support, and why (a view of model.config_fields.TABLE); and
which it supports but were not reported stable (launch-time advice).

Each refusal names a TransformerConfig field followed by its Megatron-LM argument aliases (a
config and an argparse Namespace are both checked by name), the reason, and who rejects it:

    layer     the Mix-LN layer and the decoder spec, at model build (`post_ln_only` rows only for
              Post-LN layers, which are the ones that cannot honour them)
    pretrain  the `mixln-megatron pretrain` entry point, on the parsed arguments, before building
    stock     the stock `--spec mixln_megatron.spec ...` objects, on Megatron-LM's parsed arguments,
              when Megatron-LM builds the spec (before the model)
    convert   the Megatron -> Hugging Face converter (every refused row of config_fields.TABLE)
    analysis  the checkpoint loader of the analysis tools

A refusal with `backend` applies only with that backend ("te" or "local"); callers that do not
know the backend (converter, analysis) skip such rows. The rows are written once, in
config_fields.TABLE (with the field's export handling); this module only reads them.

Launch-time advice (advise, announce): one warning from rank 0 at model build for a configuration
outside what the Mix-LN paper and its authors report stable; no setting is changed.
"""

from __future__ import annotations

from typing import List, Optional

from ..errors import MixLNError
from . import config_fields
from .config_fields import ANALYSIS, CONVERT, DEEPNORM_INIT, LAYER, PRETRAIN, STOCK  # noqa: F401  (callers' names)

Unsupported = config_fields.Refusal  # the row type, for callers that name it


class MixLNUnsupportedError(MixLNError, NotImplementedError):
    """A configuration the Mix-LN layer does not support (yet); the message says why."""


# Every refusal of the model build, the entry point, the stock spec, the converter and the analysis
# loader; DeepNorm's init refusals apart (check_kind_supported).
TABLE: tuple = tuple(r for row in config_fields.TABLE for r in row.refusals if r.where - {DEEPNORM_INIT})


def problems(obj, where: str, backend: Optional[str] = None, post_ln: bool = False) -> list:
    """`<feature> is not supported...: <why> [name=value]` for every row of `where` that `obj` (config or arguments) turns on."""
    found = []
    for row in TABLE:
        if where not in row.where or (row.post_ln_only and not post_ln):
            continue
        if row.backend is not None and row.backend != backend:
            continue
        on = config_fields.refusal_on(row, obj)
        if on is not None:
            found.append(row.message(*on))
    return found


def message_of(name: str, value=True) -> str:
    """The message of the TABLE row that has `name` (a field or alias), for `name=value`: what a
    check raises, for code that meets the feature elsewhere (the spike scaler's targets)."""
    row = next(r for r in TABLE if name in r.names)
    return row.message(name, value)


def check(obj, where: str, backend: Optional[str] = None, post_ln: bool = False,
          error=MixLNUnsupportedError) -> None:
    """Raise `error` naming every unsupported feature of `obj`, in one line."""
    found = problems(obj, where, backend=backend, post_ln=post_ln)
    if found:
        raise error("; ".join(found))


def check_supported(config, backend: Optional[str] = None, post_ln: bool = False) -> None:
    """The model-build check (layer and decoder spec); see TABLE."""
    check(getattr(config, "transformer", config), LAYER, backend=backend, post_ln=post_ln)


# What a deepnorm layer cannot honour when megatron initialises the weights (perform_initialization):
# DeepNet's init multiplies the weights megatron's init methods made, and the value rows of the
# fused linear_qkv, per TP shard (model.layer). Off when the weights come from a checkpoint.
DEEPNORM_INIT_TABLE: tuple = config_fields.refusals(DEEPNORM_INIT)


def check_kind_supported(config, kind: str) -> None:
    """The model-build check of one layer kind (layout.py) beyond TABLE: DeepNorm's init."""
    config = getattr(config, "transformer", config)
    if kind != "deepnorm" or not getattr(config, "perform_initialization", True):
        return
    found = []
    for row in DEEPNORM_INIT_TABLE:
        on = config_fields.refusal_on(row, config)
        if on is not None:
            found.append(f"{row.what} is not supported in deepnorm layers: {row.why} [{on[0]}={on[1]!r}]")
    groups, tp = getattr(config, "num_query_groups", None), getattr(config, "tensor_model_parallel_size", 1) or 1
    if groups and groups % tp:
        found.append(f"{groups} query groups over tensor parallelism {tp} is not supported in deepnorm layers: "
                     "DeepNorm's init scales the value rows of each TP shard of linear_qkv, which needs whole "
                     f"query groups per shard; use num_query_groups a multiple of {tp} [num_query_groups={groups}]")
    if found:
        raise MixLNUnsupportedError("; ".join(found))


# ------------------------------------------------------------------------------ launch-time advice
_announced = set()

PAPER = "Mix-LN paper (arXiv 2412.13795)"
AUTHORS_REPLY = (
    "the Mix-LN authors' reply to a 7B-class instability report in their reference repository's "
    "issue tracker"
)
STABLE_WARMUP_FRACTION = 0.10


def findings(
    placement,
    train_iters: Optional[int] = None,
    warmup_iters: Optional[int] = None,
) -> List[str]:
    """Each finding is one sentence: setting, stable choice, source."""
    out = []
    L, P = placement.num_layers, placement.post_ln_layers
    if L >= 32 and P > 2:
        out.append(
            f"{P} Post-LN layers at {L} layers: the stable 7B setting reported is 2 Post-LN layers "
            f"of 32 (alpha = 0.0625) ({PAPER}, LLaMA-7B; {AUTHORS_REPLY}, where 3 Post-LN layers "
            "at 51 layers trained unstably)"
        )
    if L >= 24 and P == L:
        out.append(
            f"all {L} layers Post-LN (alpha = 1): the paper reports Post-LN diverging at 24 "
            f"layers; Mix-LN used alpha = 0.25 up to 1B ({PAPER})"
        )
    if P > 0 and train_iters and warmup_iters is not None:
        fraction = warmup_iters / train_iters
        if fraction < STABLE_WARMUP_FRACTION:
            out.append(
                f"learning-rate warm-up of {warmup_iters} of {train_iters} iterations "
                f"({fraction:.1%}): the authors recommend warming up over 10% of training with "
                f"Post-LN layers ({AUTHORS_REPLY})"
            )
    return out


def advise(placement, train_iters: Optional[int] = None, warmup_iters: Optional[int] = None) -> Optional[str]:
    """Warning text for this run (the schedule, when known, from the caller: an edge)."""
    items = findings(placement, train_iters, warmup_iters)
    if not items:
        return None
    body = "\n".join(f"  - {item}" for item in items)
    return (
        "[mixln_megatron] WARNING: this configuration is outside what was reported stable "
        f"(advice only; settings unchanged):\n{body}"
    )


def _rank() -> int:
    import torch  # heavy

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def announce(placement, train_iters: Optional[int] = None, warmup_iters: Optional[int] = None) -> None:
    """Rank 0 prints the placement line (users look for it) and any advice, once per placement.
    Called at the edges (training.hooks.install_training_hooks), never by a layer."""
    if placement in _announced:
        return
    _announced.add(placement)
    if _rank() != 0:
        return
    print(placement.describe(), flush=True)
    text = advise(placement, train_iters, warmup_iters)
    if text:
        print(text, flush=True)
