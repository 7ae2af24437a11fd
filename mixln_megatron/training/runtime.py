"""Megatron-LM's runtime, as this package reads it: global args, the current iteration, the
TensorBoard / W&B writers, and rank-0 / last-rank printing.

Every read goes through sys.modules and never imports megatron.training: a megatron-core user
(or a test) without a Megatron-LM run gets None, and pays no import. Megatron-LM keeps its
writers on the last rank, so reports that go to them are written there.
"""

from __future__ import annotations

import sys
from typing import Optional, Tuple

import torch

_GLOBAL_VARS = "megatron.training.global_vars"


def _global_vars():
    return sys.modules.get(_GLOBAL_VARS)


def megatron_args():
    """Megatron-LM's parsed args when a training run has set them, else None."""
    return getattr(_global_vars(), "_GLOBAL_ARGS", None)


def arg(name: str, default=None):
    """One of Megatron-LM's args (`default` when there is no run, or the value is None)."""
    value = getattr(megatron_args(), name, None)
    return default if value is None else value


def schedule() -> Tuple[Optional[int], Optional[int]]:
    """(train_iters, warmup_iters) of the Megatron-LM run, or (None, None) without one."""
    args = megatron_args()
    if args is None:  # no Megatron-LM training run (megatron-core users, tests)
        return None, None
    train_iters = getattr(args, "train_iters", None)
    warmup = getattr(args, "lr_warmup_iters", None) or 0
    fraction = getattr(args, "lr_warmup_fraction", None)
    if fraction is not None and train_iters:
        warmup = int(fraction * train_iters)
    return train_iters, warmup


def current_iteration() -> Optional[int]:
    """The 1-based iteration being trained (args.curr_iteration is 0-based), or None."""
    iteration = getattr(megatron_args(), "curr_iteration", None)
    return None if iteration is None else int(iteration) + 1


def writers() -> Tuple[Optional[object], Optional[object]]:
    """(TensorBoard writer, W&B writer) of the run; None where not configured (or not on this rank)."""
    module = _global_vars()
    if module is None:
        return None, None
    return module.get_tensorboard_writer(), module.get_wandb_writer()


def _rank_and_size() -> Tuple[int, int]:
    if not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def is_rank_0() -> bool:
    return _rank_and_size()[0] == 0


def is_last_rank() -> bool:
    rank, size = _rank_and_size()
    return rank == size - 1


def print_rank_0(text: str) -> None:
    """Print once per job (rank 0), flushed so that it lands before Megatron-LM's own lines."""
    if is_rank_0():
        print(text, flush=True)
