"""Which elements of a parameter's main_grad are fully reduced on this rank (megatron DDP).

Shared by the gradient-spike scaler and the telemetry, which both read reduced gradients right
after finalize_model_grads.
"""

from __future__ import annotations


def owned_range(chunk, param) -> tuple:
    """(lo, hi) of param's elements whose main_grad is fully reduced on this rank.

    All of them under DDP all-reduce; under the distributed optimizer, this rank's shard of the
    bucket (megatron's DDP bucket metadata), possibly empty.
    """
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
    """The process group over which param's owned ranges split its elements: under the
    distributed optimizer, the ranks of one optimizer instance (with several instances,
    --num-distributed-optimizer-instances, each instance holds every element once, so summing
    over the whole data-parallel group would count each element once per instance); None under
    DDP all-reduce, where every rank holds every element."""
    ddp_config = getattr(chunk, "ddp_config", None)
    if ddp_config is None or not ddp_config.use_distributed_optimizer:
        return None
    return chunk.param_to_bucket_group[param].intra_distributed_optimizer_instance_group
