"""Save or load a model through Megatron-LM's own checkpointing (megatron.training, core 0.19.2 wheel).

    python ckpt_keys_worker.py SPEC ACTION DIR [ACTION DIR ...]
SPEC: "stock" (megatron's stock local spec) or "mixln" (--spec mixln_megatron.spec
mixln_local_layer_spec, settings from MIXLN_* in the environment). ACTION: "save" (norm weights
randomised first, so a wrong load shows) or "load" (megatron.training.checkpointing.load_checkpoint
at the default --dist-ckpt-strictness). Prints one JSON line per action: the parameter sums
after it, or the error a load raised.
"""

import json
import sys

from mixln_megatron.dev import cpu, testing

ARGS = [
    *testing.TINY_MEGATRON_LM_ARGS, "--ckpt-format", "torch_dist", "--no-save-optim", "--no-save-rng",
    "--no-load-optim", "--no-load-rng",
]


def sums(model):
    return {name: round(float(p.detach().double().sum()), 6) for name, p in model.named_parameters()}


def main():
    spec, actions = sys.argv[1], sys.argv[2:]
    cpu.enable_training()
    testing.init_distributed()
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint
    from megatron.training.models.gpt import GPTModelBuilder

    extra = ["--spec", "mixln_megatron.spec", "mixln_local_layer_spec"] if spec == "mixln" else []
    sys.argv = [sys.argv[0], *ARGS, *extra]
    args = parse_and_validate_args()
    model = GPTModelBuilder(gpt_config_from_args(args)).build_model(ProcessGroupCollection.use_mpu_process_groups())
    layer_class = type(model.decoder.layers[0]).__name__
    for action, directory in zip(actions[::2], actions[1::2]):
        out = {"action": action, "layer_class": layer_class,
               "post_ln": [l.layer_number for l in model.decoder.layers if getattr(l, "is_post_ln", False)]}
        if action == "save":
            g = torch.Generator().manual_seed(7)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            args.save = directory
            save_checkpoint(1, [model], None, None, 0)
        else:
            args.load = directory
            try:
                load_checkpoint([model], None, None)
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                out["error"] = f"{type(e).__name__}: {e}"
        out["sums"] = sums(model)
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
