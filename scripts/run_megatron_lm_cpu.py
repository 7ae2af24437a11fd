"""Run a Megatron-LM checkout's own pretrain_gpt.py on CPU (gloo) with the Mix-LN spec.

A development check of the stock path (`--spec mixln_megatron.spec mixln_local_layer_spec`),
not a training tool: it enters the CPU harness, applies the entry point's prebuilt-helpers
workaround, then runs the checkout's script unchanged.

    MLM_DIR=/path/to/Megatron-LM MIXLN_ALPHA=0.5 \
    python -m torch.distributed.run --nproc_per_node 1 scripts/run_megatron_lm_cpu.py <pretrain_gpt.py args>
"""

import os
import runpy
import sys

from mixln_megatron import cpu
from mixln_megatron.pretrain import use_prebuilt_dataset_helpers


def main():
    mlm = os.environ.get("MLM_DIR")
    script = os.path.join(mlm or "", "pretrain_gpt.py")
    if not mlm or not os.path.isfile(script):
        sys.exit("set MLM_DIR to a Megatron-LM checkout (core_r0.19.x) that has pretrain_gpt.py")
    cpu.enable_training()
    use_prebuilt_dataset_helpers()
    sys.path.insert(0, mlm)
    sys.argv = [script, *sys.argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
