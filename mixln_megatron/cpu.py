"""Run megatron-core (and Megatron-LM's training loop) on a machine without a GPU, with gloo.

For `pretrain --cpu` / MIXLN_CPU=1, the tests, the CPU demo and debugging on a laptop; never for
production (CONTRIBUTING.md, "The development harness"). Nothing happens at import time: call
`enable()` (megatron-core) and, for `megatron.training.pretrain`, also `enable_training()`, or
enter `harness()` for a block that undoes them on exit. All are idempotent; all refuse to run
when CUDA is available, since then the shims would hide real bugs.

What they change (measured on megatron-core 0.19.2): enable() answers torch.cuda's device,
stream, synchronize and RNG calls (megatron's tracker included) on the CPU, gives DataLoaders a
seed stream of their own, and maps literal CUDA device requests to the CPU while reporting tensor
types as torch.cuda.* (the optimizer and clip_grads assert on it). enable_training() lets
initialize_megatron run without CUDA (one device reported, or model-parallel groups and seeds
are silently skipped) and gives validate_args device architecture 0 and
CUDA_DEVICE_MAX_CONNECTIONS=1.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch
from torch.overrides import TorchFunctionMode

_state = {"core": False, "training": False, "mode": None}
_saved = []  # (object, attribute, original value) for disable()


def _patch(obj, name, value) -> None:
    _saved.append((obj, name, getattr(obj, name)))
    setattr(obj, name, value)


class _NullEvent:
    """Stands in for torch.cuda.Event: on the CPU every operation has already completed."""

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True


class _NullStream:
    """Stands in for torch.cuda.Stream: every method is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args, **kwargs):
        return _NullEvent()  # MoE's alltoall dispatcher waits on it

    def query(self):
        return True


def _is_cuda_device(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device requests to CPU and reports CPU tensors' types as torch.cuda.*."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type:
            if len(args) == 1 and not kwargs:
                name = func(*args)
                return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
            if len(args) > 1 and isinstance(args[1], str):
                args = (args[0], args[1].replace("torch.cuda.", "torch."), *args[2:])
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _check_no_cuda(what: str) -> None:
    if torch.cuda.is_available():
        raise RuntimeError(
            f"mixln_megatron.cpu.{what}() is for machines without a GPU; CUDA is available here, "
            "so run megatron-core on the GPU instead of shimming it"
        )


def _separate_dataloader_seed_stream() -> None:
    """DataLoader.__iter__ draws its base seed from a host generator of its own. On a GPU the
    loaders' seeds come from the CPU generator while dropout uses the CUDA one; on CPU they would
    share one stream, so a resumed run (which builds its loaders after loading the RNG state)
    would drift."""
    import torch.utils.data as tud

    host = torch.Generator().manual_seed(torch.initial_seed() & 0xFFFFFFFF)
    original_iter = tud.DataLoader.__iter__

    @functools.wraps(original_iter)
    def __iter__(self):
        device_stream = torch.get_rng_state()
        torch.set_rng_state(host.get_state())
        try:
            return original_iter(self)
        finally:
            host.set_state(torch.get_rng_state())
            torch.set_rng_state(device_stream)

    _patch(tud.DataLoader, "__iter__", __iter__)


def enable() -> None:
    """Make megatron-core run on CPU with gloo. Idempotent."""
    if _state["core"]:
        return
    _check_no_cuda("enable")
    cuda = torch.cuda
    _patch(cuda, "current_device", lambda: torch.device("cpu"))
    _patch(cuda, "synchronize", lambda *a, **k: None)
    _patch(cuda, "current_stream", lambda *a, **k: _NullStream())
    _patch(cuda, "default_stream", lambda *a, **k: _NullStream())
    _patch(cuda, "Stream", _NullStream)
    _patch(cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    _patch(cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    _patch(cuda, "set_rng_state", lambda new_state, device="cuda": torch.set_rng_state(new_state))
    # Seed the CPU generator directly: torch.manual_seed itself calls torch.cuda.manual_seed_all.
    _patch(cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)))

    import megatron.core.tensor_parallel.random as mrandom

    _patch(mrandom, "_get_cuda_rng_state",
           lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state())
    _patch(mrandom, "_set_cuda_rng_state",
           lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state))
    # The tracker logs a warning per fork when it cannot find CUDA graphs support; noise on CPU.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    _separate_dataloader_seed_stream()
    mode = _CudaToCpuMode()
    mode.__enter__()
    _state.update(core=True, mode=mode)


def enable_training() -> None:
    """Additionally make megatron.training.pretrain run on CPU. Calls enable(). Idempotent."""
    enable()
    if _state["training"]:
        return
    from megatron.training import arguments as margs
    from megatron.training import initialize as minit
    from megatron.training import training as mtrain

    original_initialize = minit.initialize_megatron

    @functools.wraps(original_initialize)
    def initialize_megatron_on_cpu(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        saved = (torch.cuda.device_count, torch.cuda.set_device)
        torch.cuda.device_count = lambda: 1
        torch.cuda.set_device = lambda *a, **k: None
        try:
            return original_initialize(*args, **kwargs)
        finally:
            torch.cuda.device_count, torch.cuda.set_device = saved

    _patch(mtrain, "initialize_megatron", initialize_megatron_on_cpu)
    _patch(margs, "get_device_arch_version", lambda: 0)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    _state["training"] = True


def disable() -> None:
    """Undo enable() / enable_training() (for test isolation)."""
    while _saved:
        obj, name, value = _saved.pop()
        setattr(obj, name, value)
    if _state["mode"] is not None:
        _state["mode"].__exit__(None, None, None)
    _state.update(core=False, training=False, mode=None)


def is_enabled() -> bool:
    return _state["core"]


@contextlib.contextmanager
def harness(training: bool = False):
    """`with cpu.harness(): ...`: megatron-core on CPU inside the block (training=True: also
    enable_training()), the process as it was after. A harness already in place (a test's, an
    outer block's) is reused and left in place."""
    owner = not _state["core"]
    enable_training() if training else enable()
    try:
        yield
    finally:
        if owner:
            disable()


# ------------------------------------------------------------------ TransformerEngine on a CPU
TE_REQUIRED_ENV = "TE_TESTS_REQUIRED"
"""Set (to 1) by `make test-te`: a test that needs TE then fails instead of skipping without it."""


def te_unavailable_reason():
    """None when TransformerEngine's PyTorch modules import and megatron-core sees them, else why not.

    Importing TE on a CPU works with the PyTorch extension built for this torch (see
    scripts/install_te.sh); torch must be imported first (TE then finds torch's libnccl).
    """
    import importlib
    import importlib.util

    try:
        if importlib.util.find_spec("transformer_engine") is None:
            return "TransformerEngine is not installed (make test-te installs it)"
        importlib.import_module("transformer_engine.pytorch")
    except Exception as exc:  # an extension built for another torch, a missing library...
        return f"transformer_engine.pytorch does not import: {type(exc).__name__}: {str(exc)[:200]}"
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return None if HAVE_TE else "TE imports but megatron.core.extensions.transformer_engine.HAVE_TE is False"


@contextlib.contextmanager
def te_modules():
    """`with cpu.te_modules(): build...`: TransformerEngine's modules can be constructed on the CPU.

    TE refuses to construct a module while torch.cuda.is_available() is False; inside the block it
    reads True (after it, everything must see the truth again). Needs the CPU harness first, which
    refuses to start where CUDA is really available. TE's forward and backward do not work (CUDA
    kernels); construction, state dicts and dist_checkpointing do.
    """
    if not _state["core"]:
        raise RuntimeError("mixln_megatron.cpu.te_modules() needs the CPU harness: call cpu.enable() first")
    saved = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        yield
    finally:
        torch.cuda.is_available = saved


CPU_MEGATRON_FLAGS = (
    "--distributed-backend", "gloo",
    "--no-gradient-accumulation-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion",
    "--transformer-impl", "local",
)
"""Megatron-LM flags a CPU run needs (fused CUDA kernels off, gloo, local modules)."""
