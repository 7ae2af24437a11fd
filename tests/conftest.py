import os

import pytest

from harness import testing  # noqa: F401  (puts tests/ on the workers' PYTHONPATH)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def mcore_single():
    """A single-process gloo group with megatron's parallel state (TP1 PP1), torn down after."""
    import torch

    from mixln_megatron import cpu

    from harness import testing

    testing.init_distributed()
    yield
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    cpu.disable()


@pytest.fixture(scope="module")
def te_single():
    """A single-process gloo group with megatron's parallel state, for the TE tests (built with
    cpu.te_modules()): torn down after, the CPU patches undone."""
    from mixln_megatron import cpu
    from harness import testing

    testing.init_distributed()
    yield
    testing.shutdown()
    cpu.disable()


@pytest.fixture(scope="module")
def analysis_process():
    """The analysis command sets up a one-rank gloo group and parallel state in the test's own
    process (test_untrusted_*): whatever it leaves is torn down after."""
    yield
    import torch

    from harness import testing

    if torch.distributed.is_initialized():
        testing.shutdown()


@pytest.fixture(scope="session")
def mixln_checkpoints(tmp_path_factory):
    """Real checkpoints of one tiny Mix-LN model (P = 2 of 4: test_convert.make_mixln_folder), built
    once for the whole run and shared by the untrusted-input tests: {"hf": its HF folder,
    "torch_dist": `convert from-hf`, "torch": the legacy format, "hybrid": `gpt-to-hybrid` of the
    torch_dist one}. Read them only: a test that plants, damages or rewrites files copies first."""
    from test_convert import make_mixln_folder

    from mixln_megatron.convert import convert_from_hf, convert_gpt_to_hybrid

    root = tmp_path_factory.mktemp("mixln_checkpoints")
    paths = {name: root / name for name in ("hf", "torch_dist", "torch", "hybrid")}
    make_mixln_folder(paths["hf"])
    convert_from_hf(str(paths["hf"]), str(paths["torch_dist"]), progress=False)
    convert_from_hf(str(paths["hf"]), str(paths["torch"]), progress=False, ckpt_format="torch")
    convert_gpt_to_hybrid(str(paths["torch_dist"]), str(paths["hybrid"]))
    return paths


def pytest_configure(config):
    # python/torchrun commands of the tests fork from one server that imported torch and
    # megatron-core once (tests/harness/forked_ranks.py) instead of starting fresh interpreters
    from harness import testing

    testing.FORKED_RANKS = True


def pytest_collection_modifyitems(session, config, items):
    # Files with multi-process tests first (they are the long ones): pytest-xdist hands out whole
    # files in this order, so the last file to finish is a short one rather than a long tail.
    multi_process = {item.path for item in items if item.get_closest_marker("mp")}
    items.sort(key=lambda item: item.path not in multi_process)  # stable: each file keeps its order
