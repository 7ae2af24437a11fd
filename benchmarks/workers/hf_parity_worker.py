"""torchrun worker of benchmarks/hf_parity.py (and of the parity tests in tests/test_convert.py):
a real Megatron-LM checkpoint and Megatron's own logits.

    python -m torch.distributed.run --nproc_per_node N benchmarks/workers/hf_parity_worker.py \
        --workdir DIR --tp T --pp P --ckpt-format torch_dist|torch [--extra-args ...]

1. `mixln-megatron pretrain` (Megatron-LM's training loop, mixln_megatron.training.pretrain.main) trains a
   tiny Mix-LN GPT (GQA, untied output, true vocab 250 padded by Megatron for TP, fp32) for a few
   iterations and saves it with Megatron-LM's own save_checkpoint to DIR/megatron.
2. A fresh model is built from the same args and the checkpoint is loaded with Megatron-LM's
   load_checkpoint; Megatron's forward gives the logits of a fixed, unpadded batch and a greedy
   generation loop (full forward per token, argmax over the true vocabulary, top-2 gap recorded).
3. Rank 0 converts DIR/megatron -> DIR/hf (to-hf) -> DIR/roundtrip (from-hf, same TP / PP and
   format, local module names); every rank loads DIR/roundtrip with load_checkpoint and computes
   the same logits again.
Rank 0 writes DIR/megatron_logits.pt, DIR/roundtrip_logits.pt and DIR/result.json.
"""

import argparse
import json
import os
import sys
import time
import traceback

import torch

TRUE_VOCAB = 250
SEQ = 16
BATCH = 2
PROMPT = [5, 17, 42, 99]
NEW_TOKENS = 10


def pretrain_argv(a) -> list:
    return [
        "--cpu",
        "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "176",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
        "--seq-length", "32", "--max-position-embeddings", "32",
        "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--mixln-post-ln-layers", "2", "--use-cpu-initialization",
        "--tensor-model-parallel-size", str(a.tp), "--pipeline-model-parallel-size", str(a.pp),
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
        "--lr", "3e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(TRUE_VOCAB),
        "--num-workers", "0", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
        "--save", os.path.join(a.workdir, "megatron"), "--save-interval", "2", "--ckpt-format", a.ckpt_format,
        "--seed", "7",
    ] + list(a.extra_args or [])


def build_and_load(load_dir):
    from megatron.core.enums import ModelType
    from megatron.training import get_args
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.training import get_model

    from mixln_megatron.training import providers

    args = get_args()
    args.load = load_dir
    args.no_load_optim = True
    args.no_load_rng = True
    args.finetune = False
    model = get_model(providers.model_provider, ModelType.encoder_or_decoder, wrap_with_ddp=False)
    load_checkpoint(model, None, None)
    for m in model:
        m.eval()
    return model


def megatron_logits(model, tokens):
    """Full logits [b, s, V_true] of `tokens` on every rank (collective), via Megatron's schedule."""
    from megatron.core import mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    b, s = tokens.shape
    captured = []
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)

    def forward_step(data_iterator, m):
        next(data_iterator)
        out = m(tokens, position_ids, mask)

        def loss_func(output):
            captured.append(gather_from_tensor_model_parallel_region(output)[..., :TRUE_VOCAB].detach().clone())
            return output.sum() * 0.0, {}

        return out, loss_func

    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([None]), model=model[0] if len(model) == 1 else model,
            num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True,
        )
    local = captured[0] if (captured and mpu.is_pipeline_last_stage(ignore_virtual=True)
                            and mpu.get_tensor_model_parallel_rank() == 0) else None
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local)
    return next(g for g in gathered if g is not None).float()


def greedy(model):
    seq = list(PROMPT)
    gaps = []
    for _ in range(NEW_TOKENS):
        logits = megatron_logits(model, torch.tensor([seq]))[0, -1]
        top = torch.topk(logits, 2)
        gaps.append(float(top.values[0] - top.values[1]))
        seq.append(int(top.indices[0]))
    return seq, gaps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ckpt-format", default="torch_dist")
    parser.add_argument("--extra-args", nargs=argparse.REMAINDER)
    a = parser.parse_args()
    t0 = time.time()

    def mark(what):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[hf_parity_worker] {time.time() - t0:6.1f} s  {what}", flush=True)

    try:
        from mixln_megatron.training import pretrain

        pretrain.main(pretrain_argv(a))
        mark("trained and saved")
        rank = torch.distributed.get_rank()
        g = torch.Generator().manual_seed(11)
        batch = torch.randint(0, TRUE_VOCAB, (BATCH, SEQ), generator=g)

        model = build_and_load(os.path.join(a.workdir, "megatron"))
        logits = megatron_logits(model, batch)
        tokens, gaps = greedy(model)
        del model
        mark("megatron logits and greedy loop")

        hf_dir, rt_dir = os.path.join(a.workdir, "hf"), os.path.join(a.workdir, "roundtrip")
        summary = {}
        if rank == 0:
            from mixln_megatron.convert import convert_from_hf, convert_to_hf

            summary["to_hf"] = convert_to_hf(os.path.join(a.workdir, "megatron"), hf_dir, progress=False)
            summary["from_hf"] = convert_from_hf(hf_dir, rt_dir, tp=a.tp, pp=a.pp, ckpt_format=a.ckpt_format,
                                         transformer_impl="local", progress=False)
        torch.distributed.barrier()
        mark("to-hf and from-hf")
        model = build_and_load(rt_dir)
        rt_logits = megatron_logits(model, batch)
        mark("from-hf checkpoint loaded by megatron")
        if rank == 0:
            torch.save({"batch": batch, "logits": logits}, os.path.join(a.workdir, "megatron_logits.pt"))
            torch.save({"batch": batch, "logits": rt_logits}, os.path.join(a.workdir, "roundtrip_logits.pt"))
            result = {"tokens": tokens, "gaps": gaps, "prompt": PROMPT, "summary": summary,
                      "roundtrip_max_abs_diff": float((rt_logits - logits).abs().max())}
            with open(os.path.join(a.workdir, "result.json.tmp"), "w") as f:
                json.dump(result, f, indent=1, default=str)
            os.replace(os.path.join(a.workdir, "result.json.tmp"), os.path.join(a.workdir, "result.json"))
        torch.distributed.barrier()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
