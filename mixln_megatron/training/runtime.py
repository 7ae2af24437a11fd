"""Megatron as the training hooks meet it at run time: Megatron-LM's run (global args, the current
iteration, the TensorBoard / W&B writers, rank printing), the config's gradient finalize function
that the hooks wrap, and which gradient elements DDP has reduced on this rank.

The run is read through sys.modules, never importing megatron.training: without a Megatron-LM run
(megatron-core users, tests) it is None, at no import cost. The spike scaler and the telemetry
both wrap the finalize function; each wrapper keeps the one before as `.original`, a chain that
starts at the config. megatron deep-copies the config for some submodules (attention with fewer
query groups than TP ranks, SequentialMLP, shared experts); a copy of what the hooks put there
(process groups, running state) would fail or fork the state, so it refers to the same objects.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional, Tuple

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


# --------------------------------------------------------------------------------------- the finalize function and config copies
class SharedByConfigCopies:
    """Mixin: `copy.deepcopy` returns the object itself (also for a bound method of it)."""

    def __deepcopy__(self, memo):
        return self


class FinalizeWrapper(SharedByConfigCopies):
    """A `config.finalize_model_grads_func` that runs what it wraps, then `after_finalize`, with
    its call signature; `original` None stands for megatron's finalize_model_grads (Megatron-LM
    sets that one only inside train(), after the hooks are on)."""

    def __init__(self, original: Optional[Callable] = None):
        self.original = original

    def __call__(self, model, *args, **kwargs):
        original = self.original
        if original is None:
            from megatron.core.distributed import finalize_model_grads as original  # heavy
        result = original(model, *args, **kwargs)
        self.after_finalize(model, args, kwargs)
        return result

    def after_finalize(self, model, args: tuple, kwargs: dict) -> None:
        """The hook's own work, on the finalized gradients; the call's arguments as given."""
        raise NotImplementedError


def unwrap_finalize(config, kind) -> Optional[object]:
    """Take the first wrapper of type `kind` out of the chain of `.original` links that starts at
    `config.finalize_model_grads_func`, leaving the rest as it was; the wrapper, or None."""
    from .. import compat  # heavy: imports megatron, which the run's readers above must not

    config = getattr(config, "transformer", config)  # Megatron-LM's GPTModelConfig wraps it
    above, hook = None, compat.finalize_chain_head(config)  # 0.17/0.18: under train()'s dispatcher
    while hook is not None and not isinstance(hook, kind):
        above, hook = hook, getattr(hook, "original", None)
    if hook is None:
        return None
    if above is None:
        compat.set_finalize_chain_head(config, hook.original)
    else:
        above.original = hook.original
    return hook


# --------------------------------------------------------------------------------------- DDP's reduced shards
def owned_range(chunk, param) -> tuple:
    """(lo, hi) of param's elements whose main_grad is fully reduced on this rank: all of them
    under DDP all-reduce, this rank's (possibly empty) shard of the bucket under the distributed
    optimizer."""
    ddp_config = getattr(chunk, "ddp_config", None)
    if ddp_config is None or not ddp_config.use_distributed_optimizer:
        return 0, param.numel()
    bucket_group = chunk.param_to_bucket_group[param]
    bucket = bucket_group.param_to_bucket[param]
    start, end = bucket.param_to_index[param]
    size = bucket_group.intra_distributed_optimizer_instance_size
    rank = bucket_group.intra_distributed_optimizer_instance_rank
    shard = bucket.grad_data.numel() // size
    lo = min(max(rank * shard, start), end) - start
    hi = max(min((rank + 1) * shard, end), start) - start
    return lo, max(lo, hi)


def shard_group(chunk, param):
    """The process group over which param's owned ranges split its elements: the ranks of one
    distributed-optimizer instance (each instance holds every element once); None under DDP."""
    ddp_config = getattr(chunk, "ddp_config", None)
    if ddp_config is None or not ddp_config.use_distributed_optimizer:
        return None
    return chunk.param_to_bucket_group[param].intra_distributed_optimizer_instance_group
