"""A TE Mix-LN model through Megatron-LM's own checkpointing (megatron.training, core 0.19.2 wheel),
one process on the CPU, for tests/test_te_megatron_lm.py. Settings from MIXLN_* (the stock path).

    python te_megatron_lm_worker.py save DIR
        parse_and_validate_args with --transformer-impl transformer_engine --spec
        mixln_megatron.spec mixln_layer_spec, the model built by Megatron-LM's GPTModelBuilder
        with real TE modules, every parameter drawn afresh, then save_checkpoint (args included,
        as a TE training run writes them); DIR/../te_params.pt keeps the parameters.
    python te_megatron_lm_worker.py logits DIR HF_DIR
        the local backend (--transformer-impl local, mixln_local_layer_spec) loads DIR with
        load_checkpoint; its logits of a fixed batch (forward on the local path) against the
        logits of the Hugging Face folder HF_DIR (trust_remote_code, fp32).
    python te_megatron_lm_worker.py te-load DIR PARAMS [STRICTNESS]
        a TE model loads DIR with load_checkpoint (--dist-ckpt-strictness STRICTNESS, default
        Megatron-LM's); every parameter compared with PARAMS.
Prints one RESULT JSON line.
"""

import json
import os
import sys

import torch

from mixln_megatron import cpu

from harness import testing

ARGS = [
    *testing.TINY_MEGATRON_LM_ARGS, "--ckpt-format", "torch_dist", "--no-save-optim", "--no-save-rng",
    "--no-load-optim", "--no-load-rng", "--untie-embeddings-and-output-weights",
]
TE = ["--transformer-impl", "transformer_engine", "--spec", "mixln_megatron.spec", "mixln_layer_spec"]
LOCAL = ["--transformer-impl", "local", "--spec", "mixln_megatron.spec", "mixln_local_layer_spec"]


def build(extra, te):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.models.gpt import GPTModelBuilder

    sys.argv = [sys.argv[0], *ARGS, *extra]
    args = parse_and_validate_args()
    with cpu.te_modules() if te else torch.no_grad():
        model = GPTModelBuilder(gpt_config_from_args(args)).build_model(ProcessGroupCollection.use_mpu_process_groups())
    return args, model


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main():
    action, directory = sys.argv[1], sys.argv[2]
    rest = sys.argv[3:]
    cpu.enable_training()
    testing.init_distributed()
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint

    out = {"action": action}
    if action == "save":
        args, model = build(TE, te=True)
        testing.randomize([model], seed=11)
        args.save = directory
        save_checkpoint(1, [model], None, None, 0)
        torch.save(params(model), os.path.join(os.path.dirname(directory), "te_params.pt"))
        out["layers"] = [(type(l).__name__, l.is_post_ln, type(l.self_attention.linear_qkv).__name__)
                         for l in model.decoder.layers]
    elif action == "logits":
        args, model = build(LOCAL, te=False)
        args.load = directory
        load_checkpoint([model], None, None)
        model.eval()
        ids, _, pos, mask = testing.batch(seed=3)
        with torch.no_grad():
            local = model(ids, pos, mask).float()
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(rest[0], trust_remote_code=True, dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = hf(ids).logits.float()
        vocab = theirs.shape[-1]
        out.update(layers=[(type(l).__name__, l.is_post_ln) for l in model.decoder.layers],
                   hf_class=type(hf).__name__, hf_vocab=vocab, megatron_vocab=local.shape[-1],
                   max_abs=float((local[..., :vocab] - theirs).abs().max()),
                   logit_scale=float(theirs.abs().max()))
    elif action == "te-load":
        strictness = rest[1:] and ["--dist-ckpt-strictness", rest[1]] or []
        args, model = build(TE + strictness, te=True)
        args.load = directory
        args.finetune = False
        try:
            load_checkpoint([model], None, None)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            out["error"] = f"{type(e).__name__}: {str(e)[-1200:]}"
        else:
            want, got = torch.load(rest[0]), params(model)
            out.update(names=sorted(got) == sorted(want),
                       unequal=[n for n in want if n in got and not torch.equal(want[n], got[n])],
                       count=len(got))
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
