"""torchrun worker (2 processes, gloo): HybridModel Mix-LN at TP2, and at PP2 with `|` splits, is
the single-process GPTModel Mix-LN network (P = 2 of L = 4).

    python -m torch.distributed.run --nproc_per_node 2 hybrid_worker.py --workdir DIR

1. Reference, TP1 PP1 (each rank holds the whole model and computes it alone): GPTModel Mix-LN
   with randomised weights; its loss, logits and norm gradients on one micro-batch. Its HybridModel
   twin (the GPT weights under the hybrid names, loaded strictly) is saved as a torch_dist
   checkpoint with megatron's dist_checkpointing.
2. Each layout loads that checkpoint in its own sharded layout (dist_checkpointing reshards: TP
   rows / columns, PP per-layer keys by global hybrid index, the tied output layer), runs the same
   micro-batch through megatron's forward_backward schedule and reports, against the reference:
   loss, logits (last stage, gathered over TP) and the gradient of every norm, named by (block,
   role) so that GPT and hybrid norms meet.
Rank 0 prints `RESULT {json}` (differences, not verdicts: the test asserts).
"""

import argparse
import json
import os
import sys
import traceback

import torch
import torch.nn.functional as F

from harness import testing as mu

L, P = 4, 2
PATTERN = "*-" * L
LAYOUTS = {  # name: (tp, pp, pattern)
    "tp2": (2, 1, PATTERN),
    "pp2_even": (1, 2, "*-*-|*-*-"),
    "pp2_uneven": (1, 2, "*-|*-*-*-"),
    "pp2_inside_block": (1, 2, "*-*|-*-*-"),
}


def norm_grads(model) -> dict:
    """{"<block>.<role>": grad} of this stage's norms, and the final norm's ("final.weight")."""
    grads = {f"{layer.block_number}.{role}": p.grad.clone() for layer in model.decoder.layers
             for role, p in layer.norm_parameters()}
    final = getattr(model.decoder, "final_norm", None) or getattr(model.decoder, "final_layernorm", None)
    if final is not None and model.post_process:
        grads["final.weight"] = final.weight.grad.clone()
    return grads


def step(model):
    """One micro-batch through megatron's schedule (forward and backward) -> (loss, full logits)
    on the last stage, (None, None) elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    ids, labels, pos, mask = mu.batch()
    seen = {}

    def forward_step(data_iterator, model):
        next(data_iterator)
        output = model(ids, pos, mask)  # logits [b, s, vocab / tp] on the last stage

        def loss_func(logits):
            full = gather_from_tensor_model_parallel_region(logits)
            loss = F.cross_entropy(full.float().flatten(0, 1), labels.flatten())
            seen["loss"], seen["logits"] = loss.detach(), full.detach()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    model.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=model, num_microbatches=1,
        seq_length=mu.SEQ, micro_batch_size=ids.shape[0], forward_only=False)
    return seen.get("loss"), seen.get("logits")


def hybrid_spec(cfg, pattern):
    from mixln_megatron.spec import get_mixln_hybrid_stack_spec

    return get_mixln_hybrid_stack_spec(cfg, backend="local", post_ln_layers=P, hybrid_layer_pattern=pattern)


def reference(ckpt):
    from mixln_megatron.spec import get_mixln_decoder_block_spec

    mu.init_model_parallel(1, 1)  # DP2: both ranks compute the whole model alone, identically
    cfg = mu.tiny_config(num_layers=L)
    gpt = mu.build_gpt(cfg, get_mixln_decoder_block_spec(cfg, backend="local", post_ln_layers=P))
    mu.randomize([gpt])
    loss, logits = step(gpt)
    grads = norm_grads(gpt)

    hcfg = mu.tiny_config(num_layers=2 * L)
    twin = mu.build_hybrid(hcfg, hybrid_spec(hcfg, PATTERN), PATTERN)
    twin.load_state_dict(mu.hybrid_state_dict(gpt), strict=True)
    twin_loss, _ = step(twin)
    mu.save_chunks([twin], ckpt)
    return {"loss": float(loss), "twin_loss": float(twin_loss), "logits": logits, "grads": grads,
            "logits_max_abs": float(logits.abs().max()),
            "norm_grads": {k: float(g.abs().max()) for k, g in grads.items()}}


def gather(value):
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def layout(name, ckpt, ref):
    tp, pp, pattern = LAYOUTS[name]
    mu.init_model_parallel(tp, pp)
    cfg = mu.tiny_config(num_layers=2 * L, tp=tp, pp=pp)
    model = mu.build_hybrid(cfg, hybrid_spec(cfg, pattern), pattern)
    mu.randomize([model], seed=17)  # not the reference's values: only the load can make them so
    missing = mu.load_chunks([model], ckpt)
    assert missing == [], missing
    loss, logits = step(model)
    local = {
        "layers": [[l.layer_number, l.block_number, l.hybrid_part, bool(l.is_post_ln)] for l in model.decoder.layers],
        "loss": None if loss is None else float(loss),
        "logits_max_diff": None if logits is None else float((logits - ref["logits"]).abs().max()),
        "norm_grads": {k: float((g - ref["grads"][k]).abs().max()) for k, g in norm_grads(model).items()},
    }
    ranks = gather(local)
    merged_layers = {tuple(layer) for r in ranks for layer in r["layers"]}
    norm_diffs = {}
    for r in ranks:  # a norm on two TP ranks: the larger difference
        for k, d in r["norm_grads"].items():
            norm_diffs[k] = max(d, norm_diffs.get(k, 0.0))
    last = [r for r in ranks if r["loss"] is not None]
    return {
        "pattern": pattern,
        "stage_layers": [[layer[0] for layer in r["layers"]] for r in ranks],
        "layers": [list(layer) for layer in sorted(merged_layers)],
        "loss": last[0]["loss"],
        "losses_on_last_stage_ranks": [r["loss"] for r in last],
        "logits_max_diff": max(r["logits_max_diff"] for r in last),
        "norm_grads": norm_diffs,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    try:
        mu.init_distributed()
        ckpt = os.path.join(args.workdir, "hybrid_tp1")
        ref = reference(ckpt)
        result = {
            "reference": {k: ref[k] for k in ("loss", "twin_loss", "logits_max_abs", "norm_grads")},
            "layouts": {name: layout(name, ckpt, ref) for name in LAYOUTS},
        }
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # a failed rank must not leave its peer waiting in a collective
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
