"""One stock-path refusal, met the way Megatron-LM's own scripts meet it, on this release.

    stock_refusal_worker.py CASE [--load DIR] [--rank-0-never-gets-there]

Run as every rank of a job (torchrun, or processes started with RANK / WORLD_SIZE / MASTER_*).
The --spec object is resolved as each release's pretrain_gpt.py / pretrain_hybrid.py does it
(megatron's spec_utils.import_module; 0.19+ calls the function with the model config, 0.17/0.18
hand the ModuleSpec to GPTModel uncalled); Megatron-LM's parsed args are what the edge reads.
CASE:
  bad_alpha          MIXLN_ALPHA="a quarter" (set by the caller): refused when the spec is resolved
  settings_mismatch  a P = 1 model asked for its sharded state dict with the content metadata of a
                     P = 2 checkpoint, the call Megatron-LM's load_checkpoint makes
  newer_checkpoint   --load DIR names a 0.19+ torch_dist checkpoint (no common.pt), which the caller
                     writes before any rank starts, as a real job finds it; refused on 0.17/0.18
  hybrid_pattern     pretrain_hybrid.py's stack spec with '*-|*-' at PP1 (0.19+): the stack refuses
A run that is not refused prints `NOT REFUSED` and exits 0. --rank-0-never-gets-there makes
rank 0 sleep once the process group exists (a rank 0 slower than everyone: the others fail first, and the launcher
stops it).
"""

import argparse
import os
import sys
import time

from mixln_megatron import cpu
from harness import testing as mu


def megatron_lm_args(**values):
    """What Megatron-LM's initialize sets before the model is built (the edge reads these)."""
    from megatron.training import global_vars

    global_vars._GLOBAL_ARGS = argparse.Namespace(**values)


def resolved_spec(name):
    from megatron.core.transformer.spec_utils import import_module

    return import_module(("mixln_megatron.spec", name))


def gpt(config):
    from mixln_megatron import compat

    spec = resolved_spec("mixln_local_layer_spec")
    return mu.build_gpt(config, spec(config, vp_stage=None) if compat.SPEC_GETS_THE_CONFIG else spec)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=["bad_alpha", "settings_mismatch", "newer_checkpoint", "hybrid_pattern"])
    parser.add_argument("--load", help="newer_checkpoint: Megatron-LM's --load")
    parser.add_argument("--rank-0-never-gets-there", action="store_true")
    a = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    cpu.enable_training()
    mu.init_distributed()
    if a.rank_0_never_gets_there and rank == 0:
        time.sleep(3600)  # after the group exists, as a slow rank 0 would be
    config = mu.tiny_config()
    megatron_lm_args()
    if a.case == "bad_alpha":
        gpt(config)
    elif a.case == "settings_mismatch":
        os.environ["MIXLN_POST_LN_LAYERS"] = "1"
        model = gpt(config)
        saved = {"format": 1, "scheme": "mixln", "num_layers": 4, "post_ln_layers": 2, "alpha": None}
        model.sharded_state_dict(metadata={"mixln": saved})
    elif a.case == "newer_checkpoint":
        os.environ["MIXLN_POST_LN_LAYERS"] = "1"
        megatron_lm_args(load=a.load)
        gpt(config)
    elif a.case == "hybrid_pattern":
        os.environ["MIXLN_POST_LN_LAYERS"] = "1"
        mu.build_hybrid(mu.tiny_config(num_layers=4), resolved_spec("mixln_hybrid_local_stack_spec"), "*-|*-")
    print("NOT REFUSED", flush=True)
    mu.shutdown()


if __name__ == "__main__":
    sys.exit(main())
