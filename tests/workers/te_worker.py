"""torchrun worker of tests/test_te_parallel.py: the Mix-LN TE spec with real TransformerEngine
modules (built on the CPU, gloo) at one parallel layout.

    layout  --tp T --pp P [--vpp V] [--sp] --dir D
        for P = 0, 2, L: build the TE Mix-LN chunks and megatron's stock TE chunks at this layout;
        every Pre-LN layer must be the stock layer (classes, flags, parameters and their TP/SP
        attributes), every Post-LN layer plain TE linears + TE norms with this layout's TP / SP;
        then torch_dist save (all parameters drawn afresh first) and strict load into fresh
        chunks: every tensor equal. One RESULT line per P.
    save    --tp T --pp P [--backend te|local] [--post-ln N] --dir D    (parameters drawn afresh)
    reload  --tp T --pp P [--backend te|local] [--post-ln N] [--strictness S] --src S --dir D
        load of S (strict by default; a failure prints RESULT {"error": ...}), then save to D.
    compare --src A --dir B    (one process) every tensor of two torch_dist checkpoints, by key.
"""

import argparse
import json
import os
import sys
import traceback

import torch

from mixln_megatron import cpu
from harness import testing as mu

L = 4


def rank0_print(obj):
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, obj)
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps(gathered), flush=True)


def config(a):
    return mu.tiny_config(num_layers=L, query_groups=2, tp=a.tp, pp=a.pp, vpp=a.vpp, sequence_parallel=a.sp)


def chunks_for(a, cfg, post_ln, backend=None):
    # untied output layer: a tied one on the last stage is a copy that randomize() would desync
    return mu.build_chunks(cfg, post_ln, backend=backend or a.backend, vpp=a.vpp, untie=True)


def check_layers(a, cfg, chunks, post_ln) -> dict:
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TELayerNormColumnParallelLinear
    import transformer_engine.pytorch as te

    with cpu.te_modules():
        stock = [mu.build_gpt(cfg, mu.stock_te_spec(cfg, vp_stage=i if a.vpp else None),
                              vp_stage=i if a.vpp else None, untie=True) for i in range(a.vpp or 1)]
    seen = {"pre": [], "post": []}
    for ours_chunk, stock_chunk in zip(chunks, stock):
        for ours, theirs in zip(ours_chunk.decoder.layers, stock_chunk.decoder.layers):
            n = ours.layer_number
            assert ours.is_post_ln == (n <= post_ln), (n, post_ln)
            if not ours.is_post_ln:
                mu.same_as_stock_layer(ours, theirs)
                seen["pre"].append(n)
                continue
            for name in ("self_attention.linear_qkv", "mlp.linear_fc1"):
                linear, ref = ours.get_submodule(name), theirs.get_submodule(name)
                assert isinstance(linear, TEColumnParallelLinear) and not isinstance(
                    linear, TELayerNormColumnParallelLinear), name
                assert linear.parallel_mode == "column" and linear.tp_size == a.tp, name
                assert linear.sequence_parallel == a.sp == ref.sequence_parallel, name
                assert linear.weight.shape == ref.weight.shape, name
                assert linear.weight.tensor_model_parallel and linear.weight.partition_dim == 0, name
            for norm in (ours.post_attention_layernorm, ours.post_mlp_layernorm):
                assert type(norm) is te.RMSNorm
                assert norm.sequence_parallel == a.sp and norm.eps == cfg.layernorm_epsilon
                # under SP, finalize_model_grads all-reduces params marked sequence_parallel over TP
                assert getattr(norm.weight, "sequence_parallel", False) == a.sp
                assert not getattr(norm.weight, "tensor_model_parallel", False)
            seen["post"].append(n)
    return seen


def tensors(chunks) -> dict:
    return {f"{i}.{k}": v for i, c in enumerate(chunks) for k, v in c.state_dict().items() if torch.is_tensor(v)}


def layout(a):
    mu.init_distributed(a.tp, a.pp, a.vpp)
    cfg = config(a)
    results = []
    for post_ln in (0, 2, L):
        chunks = chunks_for(a, cfg, post_ln)
        seen = check_layers(a, cfg, chunks, post_ln)
        mu.randomize(chunks, seed=100 + post_ln)
        path = os.path.join(a.dir, f"p{post_ln}")
        mu.save_chunks(chunks, path)
        torch.manual_seed(999)
        fresh = chunks_for(a, cfg, post_ln)
        want, before = tensors(chunks), tensors(fresh)
        assert any(not torch.equal(want[k], before[k]) for k in want if want[k].numel())
        mu.load_chunks(fresh, path)
        got = tensors(fresh)
        assert list(got) == list(want)
        unequal = [k for k in want if not torch.equal(want[k], got[k])]
        assert not unequal, unequal
        results.append({"P": post_ln, **seen, "tensors": len(want)})
    rank0_print(results)


def save(a):
    mu.init_distributed(a.tp, a.pp, a.vpp)
    chunks = chunks_for(a, config(a), a.post_ln)
    mu.randomize(chunks, seed=7)
    mu.save_chunks(chunks, a.dir)
    rank0_print({"saved": a.dir, "backend": a.backend})


def reload(a):
    mu.init_distributed(a.tp, a.pp, a.vpp)
    torch.manual_seed(4242)  # an init unlike the saved model's
    chunks = chunks_for(a, config(a), a.post_ln)
    try:
        missing = mu.load_chunks(chunks, a.src, ckpt_strictness=a.strictness)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        rank0_print({"error": f"{type(e).__name__}: {str(e)[-1500:]}"})
        return
    if a.dir:
        mu.save_chunks(chunks, a.dir)
    rank0_print({"loaded": a.src, "backend": a.backend, "saved": a.dir, "missing": missing})


def flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}/").items()}
    return {prefix.rstrip("/"): tree}


def compare(a):
    from megatron.core import dist_checkpointing

    mu.init_distributed()
    first, second = ({k: v for k, v in flat(dist_checkpointing.load_plain_tensors(d)).items() if torch.is_tensor(v)}
                     for d in (a.src, a.dir))
    keys = sorted(first)
    out = {"keys": keys, "only_first": sorted(set(first) - set(second)),
           "only_second": sorted(set(second) - set(first)),
           "unequal": [k for k in keys if k in second and not torch.equal(first[k], second[k])],
           "elements": sum(first[k].numel() for k in keys)}
    rank0_print(out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=["layout", "save", "reload", "compare"])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--backend", default="te", choices=["te", "local"])
    parser.add_argument("--post-ln", type=int, default=2)
    parser.add_argument("--strictness", default=None, help="dist_checkpointing StrictHandling, e.g. log_all")
    parser.add_argument("--src")
    parser.add_argument("--dir")
    a = parser.parse_args()
    try:
        {"layout": layout, "save": save, "reload": reload, "compare": compare}[a.action](a)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    mu.shutdown()


if __name__ == "__main__":
    main()
