"""torchrun worker: Mix-LN GPTModel / HybridModel torch_dist checkpoints (megatron-core 0.19+, gloo, CPU).

    python -m torch.distributed.run --nproc_per_node N hybrid_ckpt_worker.py JOBS.json WORKDIR

JOBS.json is a list of actions, run in order (parallel state re-initialised for each):
  {"do": "save", "name", "kind": "gpt"|"hybrid", "P", "tp", "layout": optional}   build (local backend;
        a layout, e.g. "deepnorm:1,sandwich:2,post:3,pre:4", instead of P), randomise, save
        WORKDIR/<name>/iter_0000005 as Megatron-LM does (model + its args, iteration, content metadata;
        the tracker file), and the logits
  {"do": "load", "name", "path", "kind", "P", "tp", "layout", "resave": optional dir, "content_metadata": true}
        load (megatron's default strictness; content metadata checked unless false), the logits; a
        refused load records its message
  {"do": "megatron_args", "name", "path"}   Megatron-LM's --use-checkpoint-args on the checkpoint:
        load_args_from_checkpoint + validate_args, what they decided
  {"do": "convert", "name", "direction": "gpt-to-hybrid"|"hybrid-to-gpt", "path", "save"}   rank 0
        converts `path` into `save` (mixln_megatron.convert, as `mixln-megatron convert` does; the
        others wait) and writes the conversion's summary to WORKDIR/<name>.summary.pt
Rank 0 writes WORKDIR/<name>.pt ({"logits", "error"}) and WORKDIR/<name>.json; every rank writes its
parameters to WORKDIR/<name>.rank<r>.pt (its TP shards).
"""

import json
import os
import sys

import torch

from mixln_megatron import cpu

from harness import testing

L = 4
ITERATION = 5


def _without(flags, *names):
    """`flags` (a Megatron-LM argv) without the flags `names` and their values."""
    out, skip = [], False
    for i, a in enumerate(flags):
        if skip:
            skip = False
        elif a in names:
            skip = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        else:
            out.append(a)
    return out


MODEL_FLAGS = _without(list(testing.TINY_MEGATRON_LM_ARGS), "--global-batch-size")


def build(kind, P, tp, layout=None):
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec, get_mixln_hybrid_stack_spec

    testing.init_distributed(tp=tp)
    if kind == "gpt":
        cfg = testing.tiny_config(num_layers=L, tp=tp)
        return testing.build_gpt(cfg, get_mixln_decoder_block_spec(cfg, backend="local", post_ln_layers=P,
                                                                   layout=layout))
    cfg = testing.tiny_config(num_layers=2 * L, tp=tp)
    spec = get_mixln_hybrid_stack_spec(cfg, backend="local", post_ln_layers=P, layout=layout)
    return testing.build_hybrid(cfg, spec, "*-" * L)


def randomize(model):
    """Seeded weights; TP shards get a rank offset so that a swapped or repeated shard shows."""
    from megatron.core import parallel_state as ps

    testing.randomize([model])
    with torch.no_grad():
        for p in model.parameters():
            if getattr(p, "tensor_model_parallel", False):
                p.add_(0.01 * ps.get_tensor_model_parallel_rank())


def logits(model):
    from megatron.core import parallel_state as ps

    ids, _, pos, mask = testing.batch()
    model.eval()
    with torch.no_grad():
        out = model(ids, pos, mask)
    parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def megatron_lm_args(kind, P, tp, layout=None):
    """The args Megatron-LM's own parser and validation give this model (what it saves in checkpoints)."""
    from megatron.training.arguments import parse_args, validate_args

    spec = "mixln_local_layer_spec" if kind == "gpt" else "mixln_hybrid_local_stack_spec"
    flags = [*MODEL_FLAGS, "--global-batch-size", "4", "--ffn-hidden-size", "128", "--tensor-model-parallel-size",
             str(tp), "--ckpt-format", "torch_dist", "--transformer-impl", "local", "--spec", "mixln_megatron.spec", spec]
    if kind == "hybrid":
        flags += ["--hybrid-layer-pattern", "*-" * L]
    sys.argv = [sys.argv[0], *flags]
    args = parse_args()
    validate_args(args)
    args.mixln_post_ln_layers = P  # what a patched checkout's --mixln-post-ln-layers saves
    args.mixln_layout = layout  # ... and --mixln-layout
    return args


def save(model, path, args):
    """dist_checkpointing.save as Megatron-LM's save_checkpoint calls it (model + common state)."""
    from megatron.core import dist_checkpointing

    ckpt = os.path.join(path, f"iter_{ITERATION:07d}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
    torch.distributed.barrier()
    metadata = {}
    state = {"model": model.sharded_state_dict(metadata=metadata), "args": args, "iteration": ITERATION,
             "checkpoint_version": 3.0}
    dist_checkpointing.save(state, ckpt, content_metadata=metadata)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    torch.distributed.barrier()


def load(model, path, content_metadata=True):
    """As Megatron-LM loads: the content metadata handed to sharded_state_dict (False: without it, so
    only the sharded settings record can tell a mismatch)."""
    from megatron.core import dist_checkpointing

    with open(os.path.join(path, "latest_checkpointed_iteration.txt")) as f:
        text = f.read().strip()
    ckpt = os.path.join(path, "release" if text == "release" else f"iter_{int(text):07d}")
    metadata = dist_checkpointing.load_content_metadata(ckpt) if content_metadata else None
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=metadata)}, ckpt)
    model.load_state_dict(loaded["model"])


def run_model_job(job, workdir):
    rank = torch.distributed.get_rank()
    shape = (job["kind"], job["P"], job["tp"], job.get("layout"))
    model = build(*shape)
    result = {"error": None, "logits": None}
    try:
        if job["do"] == "save":
            randomize(model)
            save(model, os.path.join(workdir, job["name"]), megatron_lm_args(*shape))
        else:
            load(model, job["path"], job.get("content_metadata", True))
            if job.get("resave"):
                save(model, job["resave"], megatron_lm_args(*shape))
        result["logits"] = logits(model)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        result["error"] = f"{type(e).__name__}: {e}"
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save(params, os.path.join(workdir, f"{job['name']}.rank{rank}.pt"))
    if rank == 0:
        torch.save(result, os.path.join(workdir, f"{job['name']}.pt"))


def run_args_job(job, workdir):
    """Megatron-LM's --use-checkpoint-args path: the args it takes from the converted checkpoint."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.checkpointing import load_args_from_checkpoint

    testing.init_distributed()
    flags = _without(MODEL_FLAGS, "--num-layers")  # from the checkpoint
    sys.argv = [sys.argv[0], *flags, "--global-batch-size", "4", "--use-checkpoint-args", "--load", job["path"],
                "--no-load-optim", "--no-load-rng", "--ckpt-format", "torch_dist", "--transformer-impl", "local"]
    out = {}
    try:
        args = parse_args()
        load_args_from_checkpoint(args)
        validate_args(args)
        out = {"num_layers": args.num_layers, "hybrid_layer_pattern": args.hybrid_layer_pattern,
               "spec": list(args.spec) if args.spec else None, "hidden_size": args.hidden_size}
    except BaseException as e:  # noqa: BLE001
        out = {"error": f"{type(e).__name__}: {e}"}
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(workdir, f"{job['name']}.json"), "w") as f:
            json.dump(out, f)


def run_convert_job(job, workdir):
    """A conversion between the launch's saves and loads (one process writes; the others wait)."""
    from mixln_megatron.convert.gpt_hybrid import convert_gpt_to_hybrid, convert_hybrid_to_gpt

    if torch.distributed.get_rank() == 0:
        convert = {"gpt-to-hybrid": convert_gpt_to_hybrid, "hybrid-to-gpt": convert_hybrid_to_gpt}[job["direction"]]
        summary = convert(job["path"], job["save"], progress=False)
        torch.save(summary, os.path.join(workdir, f"{job['name']}.summary.pt"))


def main():
    jobs_file, workdir = sys.argv[1], sys.argv[2]
    with open(jobs_file) as f:
        jobs = json.load(f)
    cpu.enable_training()
    testing.init_distributed()
    for job in jobs:
        if job["do"] == "megatron_args":
            run_args_job(job, workdir)
        elif job["do"] == "convert":
            run_convert_job(job, workdir)
        else:
            run_model_job(job, workdir)
        torch.distributed.barrier()
    print("RESULT " + json.dumps({"jobs": len(jobs)}), flush=True)


if __name__ == "__main__":
    main()
