"""torchrun worker (2 ranks): a deepnorm:* model at TP2 (local backend), CPU init and TP-sharded
(GPU-style) init; each rank measures the std of its own shard of every weight DeepNet's rule names.

    python -m torch.distributed.run --nproc_per_node 2 deepnorm_init_worker.py --workdir DIR

Rank 0 writes DIR/deepnorm_init.json: {mode: [per rank: [per layer: {name: [std, numel]}]]}, which
tests/test_deepnorm_init.py compares with DeepNet's formula.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import test_deepnorm_init as T  # noqa: E402  (the model's shape and the q / k / v split)
from harness import testing  # noqa: E402


def shard_stats(model) -> list:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    head_dim = T.HIDDEN // T.HEADS
    return [{name: [w.std().item(), w.numel()]
             for name, w in T.layer_weights(layer, T.HEADS // tp, T.GROUPS // tp, head_dim).items()}
            for layer in model.decoder.layers]


def main(workdir):
    testing.init_distributed(tp=2, seed=5)
    out = {}
    for mode, cpu_init in (("cpu_init", True), ("gpu_style_init", False)):
        _, model = T.build(cpu_init, tp=2)
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, shard_stats(model))
        out[mode] = gathered
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(workdir, "deepnorm_init.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    from workdir_main import run_workdir_main

    run_workdir_main(main)
