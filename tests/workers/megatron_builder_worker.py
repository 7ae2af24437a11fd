"""Build a model the way Megatron-LM's pretrain_gpt.py does (core 0.19.2 wheel), from real args.

Run as a plain script (one process); prints one JSON line with what was built.
"""

import json
import sys

from mixln_megatron import cpu

from harness import testing

ARGS = [*testing.TINY_MEGATRON_LM_ARGS, "--spec", "mixln_megatron.spec", "mixln_local_layer_spec"]


def main():
    cpu.enable_training()
    testing.init_distributed()
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.models.gpt import GPTModelBuilder

    sys.argv = [sys.argv[0], *ARGS, *sys.argv[1:]]
    args = parse_and_validate_args()
    model_config = gpt_config_from_args(args)
    model = GPTModelBuilder(model_config).build_model(ProcessGroupCollection.use_mpu_process_groups())
    layers = model.decoder.layers
    print("RESULT " + json.dumps({
        "layer_class": type(layers[0]).__name__,
        "post_ln": [layer.layer_number for layer in layers if layer.is_post_ln],
        "final_norm": type(model.decoder.final_layernorm).__name__,
    }), flush=True)


if __name__ == "__main__":
    main()
