"""torchrun worker (2 ranks): a Mix-LN MoE model of every layer kind under DP2, EP2 (both token
dispatchers gloo runs), TP2+SP and uneven PP2; torch_dist saved at one layout and loaded at
another (EP2 -> EP1 and back); a checkpoint of another layout refused on load.

    python -m torch.distributed.run --nproc_per_node 2 moe_parallel_worker.py --workdir DIR

The 4-layer model: a dense Post-LN first layer (moe_layer_freq [0, 1, 1, 1]), then deepnorm,
sandwich and pre MoE layers of 4 experts (top-2) with a shared expert. Rank 0 writes
DIR/moe_parallel.json with what tests/test_moe_parallel.py asserts on.
"""

import json
import os

import torch

from harness import testing

LAYOUT = "post:1,deepnorm:2,sandwich:3,pre:4"
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=False, moe_ffn_hidden_size=48,
           moe_shared_expert_intermediate_size=40, moe_layer_freq=[0, 1, 1, 1])


class Run(testing.TinyTrainer):
    """The tiny MoE GPT of `layout` at one parallel layout (local backend), in megatron's DDP."""

    def __init__(self, tp=1, pp=1, ep=1, sp=False, seed=1234, load=None, layout=LAYOUT,
                 dispatcher="allgather", distributed_optimizer=False, **cfg_overrides):
        from mixln_megatron.model.settings import MixLNSettings
        from mixln_megatron.model.specs import get_mixln_decoder_block_spec

        testing.init_distributed(tp, pp, seed=seed, expert_model_parallel_size=ep)
        torch.manual_seed(seed)
        cfg = testing.tiny_config(num_layers=4, tp=tp, pp=pp, sequence_parallel=sp, query_groups=2,
                                  expert_model_parallel_size=ep, moe_token_dispatcher_type=dispatcher,
                                  **MOE, **cfg_overrides)
        spec = get_mixln_decoder_block_spec(cfg, backend="local", settings=MixLNSettings(layout=layout))
        self.models = [testing.build_gpt(cfg, spec)]
        if load:
            testing.load_chunks(self.models, load)
        super().__init__(cfg, self.models, distributed_optimizer=distributed_optimizer)

    def save(self, path):
        testing.save_chunks(self.models, path)

    def layers(self):
        return list(self.models[0].decoder.layers)

    def gathered(self, fn):
        """[fn(layer) for every layer of the model], in layer order, over every rank's layers."""
        return list(testing.gathered_by_layer({l.layer_number: fn(l) for l in self.layers()}).values())


def local_experts(layer):
    experts = getattr(layer.mlp, "experts", None)
    return None if experts is None else len(experts.local_experts)


def telemetry_norms(run, workdir, name):
    """The telemetry's per-layer gradient norms (all parameters, norm1, norm2) of one step."""
    from mixln_megatron.training.telemetry import install_telemetry

    telemetry = install_telemetry(run.cfg, interval=1, path=os.path.join(workdir, f"{name}.jsonl"))
    run.train(steps=1, seed=500)
    record = telemetry.records[-1]
    return [list(r) for r in zip(record["layer_grad_norm"], record["norm1_grad_norm"], record["norm2_grad_norm"])]


def figures(run):
    return {"eval": run.eval_loss(), "losses": run.train(steps=2)[0]}


def attempt(what, fn):
    """fn() -> its figures, or the error's first line (a layout megatron's MoE cannot run here)."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - reported, asserted on by the test
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]}


def main(workdir):
    from mixln_megatron.model.checkpoint import MixLNCheckpointMismatch

    out = {}
    base, ep2_dir = os.path.join(workdir, "base_dp2"), os.path.join(workdir, "saved_ep2")

    # DP2 (EP1): train, perturb the norms (same on both ranks), save; the reference figures.
    ref = Run(seed=1)
    ref.train(steps=2, seed=7)
    testing.perturb_norms(ref.models[0])
    ref.save(base)
    out["kinds"] = ref.gathered(lambda l: l.kind)
    out["mlps"] = ref.gathered(lambda l: type(l.mlp).__name__)
    out["dp2"] = figures(Run(load=base))

    # EP2: each rank holds 2 of the 4 experts; load the DP2 checkpoint, then save at EP2
    ep2 = Run(ep=2, load=base)
    out["ep2_local_experts"] = ep2.gathered(local_experts)
    out["ep2"] = figures(ep2)
    Run(ep=2, load=base).save(ep2_dir)
    out["ep1_from_ep2"] = figures(Run(load=ep2_dir))  # and back to EP1
    out["ep2_alltoall"] = attempt("alltoall", lambda: figures(Run(ep=2, load=ep2_dir, dispatcher="alltoall")))
    out["tp2_sp"] = attempt("tp2", lambda: figures(Run(tp=2, sp=True, load=ep2_dir)))
    uneven = dict(num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=3)
    out["pp2_uneven"] = attempt("pp2", lambda: figures(Run(pp=2, load=ep2_dir, **uneven)))
    out["pp2_uneven_mlps"] = Run(pp=2, **uneven).gathered(lambda l: type(l.mlp).__name__)

    # telemetry: every expert counted once across EP ranks (the same batch on every rank), with and
    # without the distributed optimizer (experts then shard over their own data-parallel group)
    for name, kw in (("ep1", {}), ("ep2", dict(ep=2)), ("ep2_distopt", dict(ep=2, distributed_optimizer=True))):
        out[f"telemetry_{name}"] = telemetry_norms(Run(load=base, **kw), workdir, name)

    # the settings record: a checkpoint of another layout is refused, naming both
    try:
        Run(ep=2, load=ep2_dir, layout="post:1-2,pre:3-4")
        out["refusal"] = None
    except MixLNCheckpointMismatch as error:
        out["refusal"] = str(error)
    if torch.distributed.get_rank() == 0:
        from megatron.core import dist_checkpointing

        shapes = dist_checkpointing.load_tensors_metadata(ep2_dir)
        out["ep2_keys"] = sorted(k for k in shapes if "experts" in k or "router" in k)
        with open(os.path.join(workdir, "moe_parallel.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    from workdir_main import run_workdir_main

    run_workdir_main(main)
