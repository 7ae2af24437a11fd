"""Run a Megatron-LM checkout's own pretrain_gpt.py on CPU (gloo) with the Mix-LN spec.

A development check of the stock path (`--spec mixln_megatron.spec mixln_local_layer_spec`),
not a training tool: it puts the checkout's `megatron` first on sys.path (before anything imports
megatron, so a patched checkout behaves patched), enters the CPU harness, applies the entry
point's prebuilt-helpers workaround, then runs the checkout's script unchanged.

    MEGATRON_LM_DIR=/path/to/Megatron-LM MIXLN_ALPHA=0.5 \
    python -m torch.distributed.run --nproc_per_node 1 scripts/run_megatron_lm_cpu.py <pretrain_gpt.py args>

What comes from where: pretrain_gpt.py, megatron/training and megatron/core from the checkout
(checked after import); mixln_megatron and torch from this Python environment.
"""

import glob
import importlib.metadata
import importlib.util
import os
import runpy
import sys

PREFIX = "run_megatron_lm_cpu:"


def helpers_hint(mlm: str):
    """One line on how to get the dataset helpers when Megatron's `make` would fail, else None.

    A checkout's megatron/core/datasets has a Makefile and helpers.cpp; Megatron builds
    helpers_cpp with `make` at start, which needs pybind11. The wheel ships the built library.
    """
    datasets = os.path.join(mlm, "megatron", "core", "datasets")
    if not os.path.isfile(os.path.join(datasets, "Makefile")):
        return None  # no make step (the entry point's workaround imports the prebuilt library)
    if glob.glob(os.path.join(datasets, "helpers_cpp*.so")) or importlib.util.find_spec("pybind11"):
        return None
    wheel = _wheel_helpers()
    copy = f", or copy the megatron-core wheel's prebuilt {wheel} there" if wheel else ""
    return (f"{PREFIX} {datasets} has a Makefile but no built helpers_cpp and pybind11 is not "
            f"installed, so Megatron's `make` will fail: `pip install pybind11` (Megatron then builds "
            f"them) or `make -C {datasets}`{copy}")


def _wheel_helpers():
    try:
        dist = importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if os.path.basename(str(f)).startswith("helpers_cpp") and str(f).endswith(".so"):
            return str(dist.locate_file(f))
    return None


def main():
    mlm = os.environ.get("MEGATRON_LM_DIR")
    if not mlm and os.environ.get("MLM_DIR"):
        sys.exit(f"{PREFIX} MLM_DIR is not read: set MEGATRON_LM_DIR to the Megatron-LM checkout instead")
    script = os.path.join(mlm or "", "pretrain_gpt.py")
    if not mlm or not os.path.isfile(script):
        sys.exit(f"{PREFIX} set MEGATRON_LM_DIR to a Megatron-LM checkout (its root, with pretrain_gpt.py)")
    mlm = os.path.abspath(mlm)
    if any(name == "megatron" or name.startswith("megatron.") for name in sys.modules):
        sys.exit(f"{PREFIX} megatron was imported before the checkout was put on sys.path")
    sys.path.insert(0, mlm)  # first: the checkout's megatron.core / megatron.training win
    hint = helpers_hint(mlm)
    if hint:
        print(hint, file=sys.stderr, flush=True)
        sys.exit(2)

    from mixln_megatron import cpu  # imports megatron: only now
    from mixln_megatron.training.pretrain import use_prebuilt_dataset_helpers

    import megatron.training

    where = os.path.abspath(megatron.training.__file__)
    if not where.startswith(mlm + os.sep):
        sys.exit(f"{PREFIX} megatron.training was imported from {where}, not from MEGATRON_LM_DIR={mlm}")
    cpu.enable_training()
    use_prebuilt_dataset_helpers()
    sys.argv = [script, *sys.argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
