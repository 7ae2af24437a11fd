"""Save or load a tiny Mix-LN model's torch_dist checkpoint with whichever megatron-core release
this process imports (tests/test_compat.py runs it once per release, with that release's overlay
on PYTHONPATH). One process, gloo.

    python release_checkpoint_worker.py save|load DIR [save|load DIR ...]

Prints one JSON line per action, in order: {"release", "loss"} (the eval loss on a fixed batch
after the save / load), or {"release", "error"} when the load is refused with a MixLNError.
`run(action, directory)` is the same step for a caller that already holds a gloo group and
megatron's parallel state (tests/test_compat.py runs the venv's release's side in-process).
"""

import json
import os
import sys

import torch
import torch.nn.functional as F


def build(seed):
    from harness import testing
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.spec import get_mixln_decoder_block_spec

    torch.manual_seed(seed)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = testing.tiny_config()
    spec = get_mixln_decoder_block_spec(config, backend="local", settings=MixLNSettings(post_ln_layers=2))
    return testing.build_gpt(config, spec).eval()


def loss_of(model):
    from harness import testing

    ids, labels, pos, mask = testing.batch()
    with torch.no_grad():
        logits = model(ids, pos, mask)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)).item()


def run(action, directory) -> dict:
    """One save or load in this process (a gloo group and parallel state already set up)."""
    from megatron.core import dist_checkpointing

    from mixln_megatron import compat
    from mixln_megatron.errors import MixLNError, one_line

    result = {"release": compat.VERSION}
    if action == "save":
        model = build(seed=1)
        os.makedirs(directory, exist_ok=True)
        metadata = {}  # as Megatron-LM: the dict given to sharded_state_dict is the content metadata
        dist_checkpointing.save({"model": model.sharded_state_dict(metadata=metadata)}, directory, content_metadata=metadata)
    else:
        model = build(seed=2)  # different weights until the load
        try:
            compat.check_readable(directory)  # before Megatron's own reads of the common state
            metadata = dist_checkpointing.load_content_metadata(directory)
            loaded = compat.dist_load({"model": model.sharded_state_dict(metadata=metadata)}, directory)
        except MixLNError as error:
            return {**result, "error": one_line(error)}
        model.load_state_dict(loaded["model"])
    return {**result, "loss": loss_of(model)}


def main():
    steps = sys.argv[1:]
    assert steps and len(steps) % 2 == 0, "usage: save|load DIR [save|load DIR ...]"
    from harness import testing

    testing.init_distributed()
    for action, directory in zip(steps[::2], steps[1::2]):
        print(json.dumps(run(action, directory)), flush=True)
    testing.shutdown()


if __name__ == "__main__":
    main()
