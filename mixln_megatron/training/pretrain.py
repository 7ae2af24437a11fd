"""`mixln-megatron pretrain` / `python -m mixln_megatron.training.pretrain`: Megatron-LM's own
training loop with Mix-LN (usage: docs/training.md). This module holds the entry point's
arguments, its refusals and main(); the providers are in providers.py, --loss-log in
loss_log.py. Settings come from the --mixln-* flags (run_settings: flags > the checkpoint's
args with --use-checkpoint-args > defaults), never from MIXLN_*. So that the CPU harness
(--cpu, MIXLN_CPU=1) comes first, nothing here imports megatron at module level.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import socket
import sys
import time
from functools import partial
from typing import Optional, Sequence

from .. import cpu
from ..cli_parsing import one_line_usage_errors
from ..convert.dcp_files import metadata_cache
from ..convert.inspect import apply_resume_args, open_checkpoint
from ..convert.vet import megatron_iteration_dir, vet_load_args
from ..errors import EXIT_STATUS, MixLNError, report
from ..known_warnings import quiet_known_warnings
from ..megatron_args import add_mixln_args, backend_from_args, run_settings
from ..model import hybrid_pattern, settings as mixln_settings, support
from ..model.placement import resolve_placement
from ..model.settings import MixLNSettings
from . import runtime
from .loss_log import LossLog


class MixLNPretrainUnsupported(MixLNError, ValueError):
    """A run configuration this entry point does not support with Mix-LN (yet)."""


# ------------------------------------------------------------------ arguments
def add_pretrain_args(parser):
    """extra_args_provider: the --mixln-* flags and this entry point's own."""
    add_mixln_args(parser)
    group = parser.add_argument_group("mixln-megatron pretrain", "the entry point's own options")
    cpu_flags = " ".join(f.replace("%", "%%") for f in cpu.CPU_MEGATRON_FLAGS)
    group.add_argument(
        "--cpu", action="store_true",
        help="Development on a machine without a GPU: apply mixln_megatron.cpu.enable_training() "
        f"first and add the flags a CPU run needs ({cpu_flags}). Same as "
        "MIXLN_CPU=1. Never for production runs.",
    )
    group.add_argument(
        "--loss-log", type=str, default=None,
        help="Write the per-iteration training losses and every evaluation result to this JSON file.",
    )
    return parser


def cpu_requested(argv: Sequence[str], environ=None) -> bool:
    return "--cpu" in argv or mixln_settings.cpu_requested(environ)


def with_cpu_flags(argv: Sequence[str]) -> list:
    """The CPU flags first, so that a flag given on the command line overrides their values."""
    return list(cpu.CPU_MEGATRON_FLAGS) + list(argv)


MIXLN_SPECS = tuple(["mixln_megatron.spec", name] for name in (
    "mixln_layer_spec", "mixln_local_layer_spec", "mixln_hybrid_stack_spec", "mixln_hybrid_local_stack_spec"))


def check_supported_args(args, spec_from_checkpoint: bool = False) -> None:
    """Reject the configurations Mix-LN does not support yet, before anything is built.

    spec_from_checkpoint: args after --use-checkpoint-args, whose --spec (if any) came from the
    checkpoint; a Mix-LN spec there is what this entry point builds anyway (from-hf records it).
    """
    support.check(args, support.PRETRAIN, backend=backend_from_args(args), error=MixLNPretrainUnsupported)
    if spec_from_checkpoint and list(getattr(args, "spec", None) or []) in MIXLN_SPECS:
        return
    if getattr(args, "spec", None):
        raise MixLNPretrainUnsupported(
            f"--spec {' '.join(args.spec)}: this entry point always builds the Mix-LN spec (configure it "
            "with --mixln-alpha / --mixln-post-ln-layers / --mixln-scheme and --transformer-impl); "
            "--spec is for Megatron-LM's own pretrain_gpt.py (--spec mixln_megatron.spec "
            "mixln_layer_spec) and pretrain_hybrid.py (--spec mixln_megatron.spec mixln_hybrid_stack_spec)"
        )


def check_hooks_against_cuda_graphs(args, settings: MixLNSettings) -> None:
    """The hooks' refusal of full-iteration CUDA graphs (training.hooks), here before Megatron-LM
    initialises anything: its CUDA-graph set-up would fail first on a machine without CUDA."""
    from .hooks import check_no_full_iteration_graph  # heavy: both import megatron
    from .spike import resolve_spike_settings

    check_no_full_iteration_graph(args, resolve_spike_settings(settings.spike).enabled,
                                  (settings.telemetry.interval or 0) > 0)


# ------------------------------------------------------------------ HybridModel
class MixLNHybridUnsupported(MixLNPretrainUnsupported):
    """A HybridModel run Mix-LN does not support: a pattern other than `*-*-...`, or a release
    without HybridModel."""


def check_hybrid_args(args) -> None:
    """A hybrid run needs a release with HybridModel and a Mix-LN pattern (model.hybrid_pattern);
    MixLNHybridUnsupported otherwise. A GPT run passes."""
    pattern = hybrid_pattern.pattern_of_args(args)
    if pattern is None:
        return
    from .. import compat  # imports megatron: after the CPU harness

    try:
        compat.require_hybrid_model()
    except MixLNError as error:
        raise MixLNHybridUnsupported(str(error)) from None
    problem = hybrid_pattern.pattern_problem(pattern)
    if problem:
        raise MixLNHybridUnsupported(problem)


def check_command_line(args) -> MixLNSettings:
    """Every refusal that depends on the command line alone (before Megatron-LM validates `args`),
    alike on every rank, so the job prints it once. Returns the flags' settings."""
    check_supported_args(args)
    check_hybrid_args(args)
    settings = MixLNSettings.from_args(args)
    blocks = hybrid_pattern.blocks_of_args(args)
    if blocks is not None and not getattr(args, "use_checkpoint_args", False):  # no depth: Megatron-LM says so
        resolve_placement(blocks, settings)
    check_hooks_against_cuda_graphs(args, settings)
    return settings


def _single_process_defaults(environ=None) -> bool:
    """Without a launcher (no RANK / WORLD_SIZE): one process, True. Its process group gets an
    in-process store (single_process_store), so no port is bound; MASTER_ADDR / MASTER_PORT are
    still set (a free port at the time) for code that reads them."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return False
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in env:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(s.getsockname()[1])
    return True


def single_process_store():
    """The store of a one-process run: in memory. A TCP store on a port picked beforehand loses
    the port to any process that binds it in between (EADDRINUSE on a busy machine)."""
    import torch.distributed  # heavy

    return torch.distributed.HashStore()


# ------------------------------------------------------------------ dataset helpers
# Megatron-LM's start-up runs `make` for dataset helpers the wheel ships prebuilt, without a
# Makefile (CONTRIBUTING.md, "The entry point's dataset helpers").
HELPERS_MODULE = "megatron.core.datasets.helpers_cpp"


def _compile_helpers_prebuilt():
    """Stands in for megatron.core.datasets.utils.compile_helpers: the library is prebuilt."""
    importlib.import_module(HELPERS_MODULE)


_compile_helpers_prebuilt.mixln_prebuilt = True


def use_prebuilt_dataset_helpers(datasets_utils=None) -> bool:
    """Replace compile_helpers by an import of the prebuilt helpers, only when the Makefile is
    absent and that import works (a source tree keeps compiling). Returns whether it is in place.
    `datasets_utils`: the module to patch (tests pass a stand-in)."""
    utils = datasets_utils
    if utils is None:
        utils = importlib.import_module("megatron.core.datasets.utils")
    if getattr(utils.compile_helpers, "mixln_prebuilt", False):
        return True
    directory = os.path.dirname(os.path.abspath(utils.__file__))
    if os.path.exists(os.path.join(directory, "Makefile")):
        return False
    try:
        importlib.import_module(HELPERS_MODULE)
    except ImportError:
        return False
    utils.compile_helpers = _compile_helpers_prebuilt
    return True


# ------------------------------------------------------------------ settings
def _checkpoint_args(args):
    """With --use-checkpoint-args: the args saved in the checkpoint (Megatron-LM copies only its
    own shape flags from them, not the Mix-LN placement that from-hf records)."""
    if not getattr(args, "use_checkpoint_args", False) or not getattr(args, "load", None):
        return None
    from megatron.training.checkpointing import load_args_from_checkpoint  # heavy

    loaded = load_args_from_checkpoint(copy.deepcopy(args))
    return loaded[1] if isinstance(loaded, tuple) else None


def _saved_settings_sources(args) -> dict:
    """With --use-checkpoint-args: the settings record and the `mixln` content-metadata entry of
    the iteration Megatron-LM will load, to be cross-checked against the saved args as `convert
    inspect` does (the run's settings still come from run_settings)."""
    if not getattr(args, "use_checkpoint_args", False):
        return {}
    path = megatron_iteration_dir(getattr(args, "load", None), getattr(args, "ckpt_step", None))
    if path is None:
        return {}
    reader = open_checkpoint(path)
    metadata = reader.content_metadata if isinstance(reader.content_metadata, dict) else {}
    return {"record": reader.settings_record, "metadata": metadata.get("mixln")}


# ------------------------------------------------------------------ entry point
def _write_loss_log(loss_log: Optional[LossLog], args, settings: MixLNSettings) -> None:
    """--loss-log: the recorded losses with the run's placement and depth."""
    if loss_log is None:
        return
    placement = resolve_placement(hybrid_pattern.blocks_of_args(args), settings)
    loss_log.write(args.loss_log, {
        "mixln": {**placement.record(), "post_ln_layer_numbers": placement.post_ln_layer_numbers},
        "num_layers": args.num_layers,
        "hybrid_layer_pattern": hybrid_pattern.pattern_of_args(args),
    })


def _note_ignored_environment() -> None:
    """The entry point takes its settings from flags; say so when MIXLN_* settings are exported."""
    names = mixln_settings.settings_variables_set()
    if names and os.environ.get("RANK", "0") == "0":
        print(f"[mixln_megatron] WARNING: {', '.join(names)} ignored: mixln-megatron pretrain takes its "
              "settings from its --mixln-* flags (MIXLN_* is for Megatron-LM's own pretrain_gpt.py "
              "with --spec)", file=sys.stderr, flush=True)


def help_parser():
    """The parser --help shows: the --mixln-* flags and this entry point's own (megatron-core
    0.19.2's own --help crashes on a help string with a stray '%')."""
    parser = argparse.ArgumentParser(
        prog="mixln-megatron pretrain", allow_abbrev=False,
        description="Megatron-LM's pretraining loop with the Mix-LN GPT model (or HybridModel with "
        "--hybrid-layer-pattern '*-*-...', megatron-core 0.19+). Takes every "
        "Megatron-LM flag (see megatron/training/arguments.py; Megatron's own --help is broken in "
        "megatron-core 0.19.2) plus the flags below.",
    )
    return add_pretrain_args(parser)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run pretraining with Megatron-LM's command-line flags (argv without the program name).

    0 on success, 2 for a refusal: one `[mixln_megatron] ERROR:` line before any process group
    exists, once per job for the command line alone (before Megatron-LM's argument table), once
    per node for one that reads the checkpoint. Every pickle the load will read is vetted first.
    """
    t0 = time.time()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        help_parser().print_help()
        return 0
    quiet_known_warnings()  # every rank imports megatron-core below: its CPU-machine warnings stay off
    if cpu_requested(argv):
        cpu.enable_training()  # before any other megatron code runs
        argv = with_cpu_flags(argv)
    single_process = _single_process_defaults()
    use_prebuilt_dataset_helpers()

    from megatron.training.arguments import parse_args  # heavy: after the CPU harness

    from .. import compat  # imports megatron: after the CPU harness

    saved_argv = sys.argv
    sys.argv = [saved_argv[0] if saved_argv else "mixln-megatron-pretrain", *argv]
    cache = metadata_cache()  # the vetting's read of a .metadata serves the settings check below too
    cache.__enter__()
    try:
        # The unsupported configurations get a clear message before Megatron validates anything.
        with one_line_usage_errors():  # Megatron-LM's parser: a bad flag is one line, not its whole usage
            given = parse_args(add_pretrain_args)
        try:
            check_command_line(given)
        except MixLNError as error:
            report(error, alike_on_every_rank=True)
            return EXIT_STATUS
        # Every pickle Megatron-LM's load will touch (--use-checkpoint-args reads the args next),
        # read through the allow-list first: a payload is refused here, before Megatron sees it.
        vet_load_args(given)
        with one_line_usage_errors():
            args = compat.parse_and_validate_args(add_pretrain_args)
        check_supported_args(args, spec_from_checkpoint=True)
        check_hybrid_args(args)  # --use-checkpoint-args may bring the pattern
        checkpoint_args = _checkpoint_args(args)
        apply_resume_args(args, checkpoint_args, argv)  # the shape flags Megatron-LM does not copy
        # The checkpoint's sources (saved args, record, content metadata) must agree, as inspect checks.
        MixLNSettings.from_checkpoint(checkpoint_args, **_saved_settings_sources(args))
        settings = run_settings(args, checkpoint_args)
        resolve_placement(hybrid_pattern.blocks_of_args(args), settings)  # a bad setting stops here, in one line
        check_hooks_against_cuda_graphs(args, settings)
    except MixLNError as error:  # the checkpoint's: a node may read other files than rank 0's
        report(error)
        return EXIT_STATUS
    finally:
        sys.argv = saved_argv
        cache.__exit__(None, None, None)
    _note_ignored_environment()
    loss_log = LossLog() if args.loss_log else None

    from . import providers  # imports megatron.training: after the CPU harness

    try:
        compat.run_pretrain(
            args, argv,
            datasets_provider=providers.train_valid_test_datasets_provider,
            model_provider=partial(
                providers.hybrid_model_provider if hybrid_pattern.pattern_of_args(args) else providers.model_provider,
                settings=settings, backend=backend_from_args(args)),
            forward_step=partial(providers.forward_step, loss_log=loss_log),
            extra_args_provider=add_pretrain_args,
            non_loss_data_func=loss_log.close_eval_pass if loss_log else None,
            adjust_args=partial(apply_resume_args, checkpoint_args=checkpoint_args, argv=argv),
            store=single_process_store() if single_process else None,
        )
    except SystemExit as exit_:
        # --exit-interval / --exit-duration-in-mins / signals end pretrain() with sys.exit on
        # every rank alike (after a barrier): the losses so far still get written.
        if exit_.code in (0, None):
            _write_loss_log(loss_log, args, settings)
        raise
    _write_loss_log(loss_log, args, settings)
    runtime.print_rank_0(f"mixln-megatron pretrain: done in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
