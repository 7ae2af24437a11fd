"""Build a model the way Megatron-LM's pretrain_gpt.py does (core 0.19.2 wheel), from real args.

Run as a plain script (one process); prints one JSON line with what was built.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mcore_utils  # noqa: E402

from mixln_megatron.dev import cpu  # noqa: E402

ARGS = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
    "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "1", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--normalization", "RMSNorm",
    "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
    "--use-cpu-initialization", *cpu.CPU_MEGATRON_FLAGS,
    "--spec", "mixln_megatron.spec", "mixln_local_layer_spec",
]


def main():
    cpu.enable_training()
    mcore_utils.init_distributed()
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
