"""torchrun worker (2 ranks): a model of every layer kind under DP2, TP2(+SP), PP2, PP2xVPP3 and uneven PP2;
torch_dist saved at one layout and loaded at another; DeepNorm's init through TP2.

    python -m torch.distributed.run --nproc_per_node 2 layer_kinds_worker.py --workdir DIR

Layout of the 6-layer model: deepnorm:1, sandwich:2, post:3, sandwich:4, pre:5-6 (sandwich layers
on both PP2 stages, so their rows of mixln_norm_c / _d come from two stages). Rank 0 writes
DIR/layer_kinds.json with what tests/test_layer_kinds_parallel.py asserts on.
"""

import json
import os

import torch

from harness import testing

LAYOUT = "deepnorm:1,sandwich:2,post:3,sandwich:4,pre:5-6"
NUM_LAYERS = 6


class Run(testing.TinyTrainer):
    """The tiny GPT of LAYOUT at one parallel layout (local backend), in megatron's DDP."""

    def __init__(self, tp=1, pp=1, vpp=None, sp=False, seed=1234, load=None, **cfg_overrides):
        from mixln_megatron.model.settings import MixLNSettings
        from mixln_megatron.model.specs import get_mixln_decoder_block_spec

        testing.init_distributed(tp, pp, vpp, seed=seed)
        torch.manual_seed(seed)
        cfg = testing.tiny_config(num_layers=NUM_LAYERS, tp=tp, pp=pp, vpp=vpp, sequence_parallel=sp, **cfg_overrides)
        settings = MixLNSettings(layout=LAYOUT)
        self.models = [
            testing.build_gpt(cfg, get_mixln_decoder_block_spec(cfg, backend="local", settings=settings,
                                                                vp_stage=i if vpp else None),
                              vp_stage=i if vpp else None)
            for i in range(vpp or 1)
        ]
        if load:
            self.load(load)
        super().__init__(cfg, self.models)

    def save(self, path):
        from megatron.core import dist_checkpointing

        os.makedirs(path, exist_ok=True)
        metadata = {}
        dist_checkpointing.save(testing.chunks_sharded_state_dict(self.models, metadata), path,
                                content_metadata=metadata)

    def load(self, path):
        testing.load_chunks(self.models, path)

    def layers(self):
        return [layer for m in self.models for layer in m.decoder.layers]

    def kinds(self):
        return list(testing.gathered_by_layer({l.layer_number: l.kind for l in self.layers()}).values())

    def gathered_qkv(self):
        """{layer: full linear_qkv weight} gathered over TP (TP shards are whole query groups)."""
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        out = {}
        for layer in self.layers():
            w = layer.self_attention.linear_qkv.weight.detach()
            parts = [torch.empty_like(w) for _ in range(ps.get_tensor_model_parallel_world_size())]
            torch.distributed.all_gather(parts, w.contiguous(), group=group)
            out[layer.layer_number] = torch.cat(parts, 0)
        return out

    def sandwich_norms_identical_across_tp(self):
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        same = True
        for layer in self.layers():
            for name in getattr(layer, "extra_norm_names", ()):
                w = getattr(layer, name).weight.detach().clone()
                parts = [torch.empty_like(w) for _ in range(ps.get_tensor_model_parallel_world_size())]
                torch.distributed.all_gather(parts, w, group=group)
                same &= all(torch.equal(parts[0], p) for p in parts)
        return bool(same)


def figures(run):
    return {"eval": run.eval_loss(), "losses": run.train(steps=2)[0]}


def main(workdir):
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", 0))
    out = {}
    base, tp2_dir = os.path.join(workdir, "base_dp2"), os.path.join(workdir, "saved_tp2")

    # DP2 (TP1 PP1): train, perturb the norms (same on both ranks), save; the reference figures.
    ref = Run(seed=1)
    ref.train(steps=2, seed=7)
    testing.perturb_norms(ref.models[0])
    ref.save(base)
    out["kinds"] = ref.kinds()
    out["dp2"] = figures(Run(load=base))
    if rank == 0:
        from megatron.core import dist_checkpointing

        shapes = dist_checkpointing.load_tensors_metadata(base)
        out["shapes"] = {k: list(v.global_shape) for k, v in shapes.items() if "mixln_norm" in k}

    # TP2 + SP: load the DP2 checkpoint; save it again at TP2
    tp2 = Run(tp=2, sp=True, load=base)
    out["tp2_sp"] = figures(tp2)
    out["tp2_sp_norms_identical"] = tp2.sandwich_norms_identical_across_tp()
    Run(tp=2, load=base).save(tp2_dir)
    # PP2 and uneven PP2 (stages of 2 and 4 layers): load what TP2 saved
    out["pp2"] = figures(Run(pp=2, load=tp2_dir))
    pp2 = Run(pp=2)
    out["pp2_kinds"] = pp2.kinds()
    uneven = dict(num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=4)
    out["pp2_uneven"] = figures(Run(pp=2, load=tp2_dir, **uneven))
    out["pp2_uneven_kinds"] = Run(pp=2, **uneven).kinds()
    out["pp2_vpp3"] = figures(Run(pp=2, vpp=3, load=tp2_dir))  # one layer per virtual stage
    out["pp2_vpp3_kinds"] = Run(pp=2, vpp=3).kinds()
    # uneven PP2 with VPP2 (a shape small runs never have; megatron's first/last-stage counts need
    # a middle stage with VPP, its pipeline layout does not): virtual stages of 1, 3, 1 and 1
    # layers, so stage 0 holds layers 1 and 5, stage 1 layers 2-4 and 6
    uneven_vpp = dict(pipeline_model_parallel_layout="Et|ttt|t|tL")
    out["pp2_uneven_vpp2"] = figures(Run(pp=2, vpp=2, load=tp2_dir, **uneven_vpp))
    uneven_run = Run(pp=2, vpp=2, **uneven_vpp)
    out["pp2_uneven_vpp2_kinds"] = uneven_run.kinds()
    stages = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(
        stages, [[layer.layer_number for layer in m.decoder.layers] for m in uneven_run.models])
    out["pp2_uneven_vpp2_stage_layers"] = stages

    # DeepNorm's init: TP2 shards of CPU init equal the TP1 weights (value rows found per shard)
    tp1 = Run(seed=5).gathered_qkv()
    tp2_init = Run(tp=2, seed=5).gathered_qkv()
    out["qkv_tp2_equals_tp1"] = all(torch.equal(tp1[n], tp2_init[n]) for n in tp1)
    # ... and TP-sharded (GPU-style) init: on each shard, std(value rows) / std(query rows) = beta
    sharded = Run(tp=2, seed=6, use_cpu_initialization=False)
    deep = sharded.layers()[0]
    attention = deep.self_attention
    groups, dim = attention.num_query_groups_per_partition, attention.hidden_size_per_attention_head
    heads = attention.num_attention_heads_per_partition
    w = attention.linear_qkv.weight.detach().view(groups, (heads // groups + 2) * dim, -1)
    q, v = w[:, : heads // groups * dim], w[:, -dim:]
    ratios = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ratios, {"ratio": (v.std() / q.std()).item(), "numel": [q.numel(), v.numel()],
                                                 "beta": deep.placement.deepnorm_beta, "kind": deep.kind})
    out["gpu_style_tp2_value_ratios"] = ratios
    if rank == 0:
        with open(os.path.join(workdir, "layer_kinds.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    from workdir_main import run_workdir_main

    run_workdir_main(main)
