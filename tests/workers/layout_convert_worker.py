"""torchrun worker (2 ranks): a layout model's TP1 torch_dist checkpoint loaded and saved again at
TP2 and at PP2, with Megatron-LM's args in the common state (tests/test_convert_layouts.py exports
both and compares them with the TP1 export).

    python -m torch.distributed.run --nproc_per_node 2 layout_convert_worker.py \
        --load DIR/iter_0000001 --out OUT --layout LAYOUT --args ARGS.json

Writes OUT/tp2 and OUT/pp2, each a Megatron-LM save directory (iter_0000001 + the tracker).
"""

import argparse
import json
import os
import sys
import traceback

import torch

from harness import testing


def run(load, out, layout, args_values, tp, pp):
    from megatron.core import dist_checkpointing

    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec

    testing.init_model_parallel(tp, pp)
    cfg = testing.tiny_config(num_layers=args_values["num_layers"], query_groups=args_values["num_query_groups"],
                              tp=tp, pp=pp)
    spec = get_mixln_decoder_block_spec(cfg, backend="local", settings=MixLNSettings(layout=layout,
                                                                                     scheme=args_values["mixln_scheme"]))
    model = testing.build_gpt(cfg, spec, untie=args_values["untie_embeddings_and_output_weights"])
    metadata = dist_checkpointing.load_content_metadata(load)
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict(metadata=metadata)}, load)["model"])
    args = argparse.Namespace(**{**args_values, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp})
    ckpt = os.path.join(out, "iter_0000001")
    if torch.distributed.get_rank() == 0:
        os.makedirs(ckpt)
    torch.distributed.barrier()
    metadata = {}
    state = {"model": model.sharded_state_dict(metadata=metadata), "args": args, "iteration": 1,
             "checkpoint_version": 3.0}
    dist_checkpointing.save(state, ckpt, content_metadata=metadata)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    torch.distributed.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--load", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--layout", required=True)
    parser.add_argument("--args", required=True)
    opts = parser.parse_args()
    with open(opts.args) as f:
        args_values = json.load(f)
    testing.init_distributed()
    try:
        for name, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2)):
            run(opts.load, os.path.join(opts.out, name), opts.layout, args_values, tp, pp)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    finally:
        testing.shutdown()


if __name__ == "__main__":
    main()
