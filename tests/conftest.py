import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def mcore_single():
    """A single-process gloo group with megatron's parallel state (TP1 PP1), torn down after."""
    import torch

    from mixln_megatron.dev import cpu, testing

    testing.init_distributed()
    yield
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    cpu.disable()
