"""torchrun worker (2 ranks) for tests/test_convert_moe.py: the every-kind MoE model's EP1 checkpoint
loaded and saved again at EP2 and at TP2 (sequence parallel), as Megatron-LM saves (args in the
common state), and a from-hf checkpoint loaded at EP2, whose logits rank 0 writes.

    python -m torch.distributed.run --nproc_per_node 2 moe_convert_worker.py EP1_ITER_DIR FROM_HF_RELEASE OUT

The model (layout, experts, shared expert, dense first layer) is test_convert_moe.build_moe_gpt's.
"""

import os
import sys

import torch

from harness import testing

LAYOUT = "post:1,deepnorm:2,sandwich:3,pre:4"
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_layer_freq=[0, 1, 1, 1],
           moe_shared_expert_intermediate_size=40, moe_grouped_gemm=False, moe_token_dispatcher_type="allgather")


def build(tp, ep):
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec

    testing.init_distributed(tp, 1, seed=5, expert_model_parallel_size=ep)
    cfg = testing.tiny_config(num_layers=4, tp=tp, query_groups=2, sequence_parallel=tp > 1,
                              expert_model_parallel_size=ep, **MOE)
    spec = get_mixln_decoder_block_spec(cfg, backend="local", settings=MixLNSettings(layout=LAYOUT))
    return testing.build_gpt(cfg, spec, untie=True).eval()


def save_as_megatron_lm(model, args, path):
    from megatron.core import dist_checkpointing

    metadata = {}
    sharded = model.sharded_state_dict(metadata=metadata)
    ckpt = os.path.join(path, "iter_0000001")
    if torch.distributed.get_rank() == 0:
        os.makedirs(ckpt)
        with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    torch.distributed.barrier()
    dist_checkpointing.save({"model": sharded, "args": args, "iteration": 1}, ckpt, content_metadata=metadata)


def main(ep1, from_hf, out):
    from megatron.core import dist_checkpointing

    testing.init_distributed()
    args = dist_checkpointing.load_common_state_dict(ep1)["args"]
    for name, tp, ep in (("ep2", 1, 2), ("tp2", 2, 1)):
        model = build(tp, ep)
        testing.load_chunks([model], ep1)
        save_as_megatron_lm(model, args, os.path.join(out, name))
    model = build(1, 2)  # the from-hf checkpoint at EP2: each rank holds 2 of the 4 experts
    testing.load_chunks([model], from_hf)
    ids, _, pos, mask = testing.batch(seed=11)
    with torch.no_grad():
        logits = model(ids, pos, mask)
    if torch.distributed.get_rank() == 0:
        torch.save({"logits": logits, "local_experts": len(model.decoder.layers[1].mlp.experts.local_experts)},
                   os.path.join(out, "ep2_from_hf.pt"))
    testing.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
