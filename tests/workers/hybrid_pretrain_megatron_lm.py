"""Megatron-LM's own HybridModel path (what pretrain_hybrid.py's __main__ does on core 0.19), on CPU.

    args = parse_and_validate_args(...)
    model_cfg = hybrid_config_from_args(args)          # --spec -> import_module(args.spec)
    pretrain(pretrain_cfg_container_from_args(args, model_cfg), datasets, ModelType..., forward_step)

with `--spec mixln_megatron.spec mixln_hybrid_local_stack_spec`: Megatron's HybridModelBuilder
builds the stack from the imported ModuleSpec, so the Mix-LN settings come from the --spec edge
(MIXLN_* here: stock Megatron-LM has no --mixln-* flags). The 0.19 wheel ships no
pretrain_hybrid.py (and main's imports a hybrid_builders module), so this worker is its model
path; batches, forward step and datasets are the project's providers, which for a `*-` decoder
without packed sequences or MTP are pretrain_hybrid.py's. The only addition is an observer in
the model config's pre_wrap_hooks that records what was built (it returns the chunks unchanged).

Run under torchrun with the Megatron-LM flags as arguments. Every rank prints one line
`RESULT {"rank": ..., "chunks": [...], "train": [...]}` (train: the per-iteration losses, on the
last pipeline stage).
"""

import json
import sys
from functools import partial

from mixln_megatron import cpu


def describe(chunk) -> dict:
    """What one built model chunk is: its stack, layers and final norm."""
    decoder = chunk.decoder
    final_norm = getattr(decoder, "final_norm", None) if getattr(decoder, "post_layer_norm", False) else None
    return {
        "stack": type(decoder).__name__,
        "final_norm": type(final_norm).__name__ if final_norm is not None else None,
        "layers": [
            {"class": type(layer).__name__, "layer_number": layer.layer_number,
             "hybrid_part": getattr(layer, "hybrid_part", None), "block": getattr(layer, "block_number", None),
             "is_post_ln": getattr(layer, "is_post_ln", None), "kind": getattr(layer, "kind", None),
             "sandwich_norms": [name for name in ("attn_output_layernorm", "mlp_output_layernorm")
                                if getattr(layer, name, None) is not None]}
            for layer in decoder.layers
        ],
    }


def main():
    cpu.enable_training()  # before any other megatron code runs
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import hybrid_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from mixln_megatron.training import providers
    from mixln_megatron.training.pretrain import use_prebuilt_dataset_helpers
    from mixln_megatron.training.loss_log import LossLog

    use_prebuilt_dataset_helpers()
    sys.argv = [sys.argv[0], *cpu.CPU_MEGATRON_FLAGS, *sys.argv[1:]]
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    model_cfg = hybrid_config_from_args(args)

    built = []

    def observe(chunks):
        built.extend(describe(chunk) for chunk in chunks)
        return chunks

    model_cfg.pre_wrap_hooks.append(observe)
    loss_log = LossLog()
    pretrain(
        pretrain_cfg_container_from_args(args, model_cfg),
        providers.train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        partial(providers.forward_step, loss_log=loss_log),
        non_loss_data_func=loss_log.close_eval_pass,
    )

    import torch
    from megatron.core import mpu

    record = loss_log.finalize(group=mpu.get_data_parallel_group(with_context_parallel=True))
    print("RESULT " + json.dumps({
        "rank": torch.distributed.get_rank(), "chunks": built,
        "stack_spec": type(model_cfg.hybrid_stack_spec).__name__,
        "train": record["train"] if mpu.is_pipeline_last_stage(ignore_virtual=True) else [],
    }), flush=True)


if __name__ == "__main__":
    main()
