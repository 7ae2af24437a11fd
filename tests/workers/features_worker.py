"""torchrun worker: several `mixln-megatron pretrain` runs, one after another, in one process group.

    features_worker.py --workdir DIR        (DIR/plan.json: [[run name, [entry-point flags...]], ...])

Each rank calls the entry point's main() once per run of the plan, in order, resetting
Megatron-LM's process-wide state in between (its global args, timers and micro-batch calculator,
the parallel state, the rerun state machine), so that the start-up (imports, the process group,
the write-results queue) is paid once for the whole plan. Per run, rank 0 writes
DIR/<run>.used.json: what the run really trained with (the model chunks' wrapper classes and
DDP config, the optimizer's class, the recompute and precision fields of the model config, how
often megatron's activation checkpointing ran); the entry point writes DIR/<run>.loss.json
(--loss-log) and the telemetry DIR/<run>.telemetry.jsonl.
"""

import argparse
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # fork_queue


def reset_megatron() -> None:
    """Megatron-LM's process-wide state back to what a fresh process has (the process group stays)."""
    from megatron.core import parallel_state
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine
    from megatron.training import global_vars

    global_vars.unset_global_variables()
    global_vars.destroy_global_vars()
    destroy_rerun_state_machine()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


class Recorder:
    """What one run used, read off the objects Megatron-LM's setup returned and counted while it trained."""

    def __init__(self):
        self.used = {}
        self.checkpoint_calls = 0

    def install(self):
        from megatron.core.tensor_parallel import random as tp_random
        from megatron.training import training

        original_setup = training.setup_model_and_optimizer
        original_apply = tp_random.CheckpointFunction.apply

        def setup(*args, **kwargs):
            model, optimizer, scheduler = original_setup(*args, **kwargs)
            self.used.update(describe(model, optimizer))
            return model, optimizer, scheduler

        def counted_apply(*args, **kwargs):
            self.checkpoint_calls += 1
            return original_apply(*args, **kwargs)

        training.setup_model_and_optimizer = setup
        tp_random.CheckpointFunction.apply = counted_apply


def describe(model, optimizer) -> dict:
    import dataclasses

    chunk = model[0]
    ddp_config = getattr(chunk, "ddp_config", None)
    config = chunk.config if hasattr(chunk, "config") else chunk.module.config
    inner = chunk
    wrappers = []
    while inner is not None and not type(inner).__name__.endswith("GPTModel"):
        wrappers.append(type(inner).__name__)
        inner = getattr(inner, "module", None)
    plain = (bool, int, float, str, type(None))
    return {
        "chunks": len(model),
        "wrappers": wrappers,
        "ddp_config": {f.name: getattr(ddp_config, f.name) for f in dataclasses.fields(ddp_config)
                       if isinstance(getattr(ddp_config, f.name), plain)} if ddp_config is not None else None,
        "optimizer": type(optimizer).__name__,
        "inner_optimizers": [type(o).__name__ for o in getattr(optimizer, "chained_optimizers", [optimizer])],
        "config": {name: _plain(getattr(config, name, None)) for name in (
            "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
            "bf16", "fp16", "params_dtype", "sequence_parallel", "tensor_model_parallel_size",
            "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "fp8")},
    }


# The Megatron-LM arguments a feature comparison checks (after Megatron-LM's own validation).
ARGS = ("use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather", "ckpt_fully_parallel_save",
        "ckpt_fully_parallel_load", "ckpt_format", "bf16", "fp8", "recompute_granularity", "recompute_method",
        "recompute_modules", "sequence_parallel", "tensor_model_parallel_size", "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size", "data_parallel_size", "iteration", "transformer_impl")


def used_args() -> dict:
    from megatron.training import get_args

    args = get_args()
    return {name: _plain(getattr(args, name, None)) for name in ARGS}


def _plain(value):
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    return str(value)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    a = parser.parse_args()
    from fork_queue import fork_started_write_results_queue

    fork_started_write_results_queue()  # before any gloo thread: see fork_queue.py
    with open(os.path.join(a.workdir, "plan.json")) as f:
        plan = json.load(f)
    from mixln_megatron import cpu

    cpu.enable_training()
    from mixln_megatron.training import pretrain

    recorder = Recorder()
    recorder.install()
    rank = int(os.environ.get("RANK", "0"))
    try:
        for name, argv in plan:
            reset_megatron()
            recorder.used, recorder.checkpoint_calls = {}, 0
            out = os.path.join(a.workdir, name)
            code = pretrain.main([*argv, "--loss-log", out + ".loss.json",
                                  "--mixln-telemetry-path", out + ".telemetry.jsonl"])
            assert code == 0, f"{name}: exit {code}"
            if rank == 0:
                with open(out + ".used.json", "w") as f:
                    json.dump({**recorder.used, "args": used_args(), "checkpoint_calls": recorder.checkpoint_calls},
                              f, indent=1)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # a failed rank must not leave its peers waiting in a collective
    import torch

    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
