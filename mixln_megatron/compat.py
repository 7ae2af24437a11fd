"""Every difference between the megatron-core releases mixln_megatron supports (0.17, 0.18, 0.19
and 0.20: Megatron-LM main, d98e8a64), and the one torch difference megatron-core's checkpoint
reader trips on. The rest of the package is written against one API; what a release does
differently is adapted here and nowhere else, one section per subject (CONTRIBUTING.md's design
notes say what each absorbs; docs/compatibility.md what was measured).

The release is that of the megatron.core actually imported (a Megatron-LM checkout on sys.path
wins over the installed wheel), so its own version string decides, not the installed dist-info.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from importlib.metadata import version as dist_version
from typing import Callable, Optional, Sequence, Tuple

from .errors import MixLNError

SUPPORTED = ">=0.17,<0.21"
OLDEST, FIRST_UNSUPPORTED = (0, 17), (0, 21)


class UnsupportedMegatronRelease(MixLNError, RuntimeError):
    """megatron-core outside SUPPORTED. Not an ImportError: Megatron-LM's spec import swallows those."""


def parse_release(version: str) -> Tuple[int, int]:
    """(major, minor) of a megatron-core version string ('0.18.2+abc123' -> (0, 18))."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise UnsupportedMegatronRelease(
            f"cannot read the megatron-core version {version!r}; mixln_megatron supports megatron-core {SUPPORTED}"
        ) from None


def check_release(version: str) -> Tuple[int, int]:
    """The release of `version`, or UnsupportedMegatronRelease naming the supported range."""
    release = parse_release(version)
    if not OLDEST <= release < FIRST_UNSUPPORTED:
        raise UnsupportedMegatronRelease(
            f"megatron-core {version.split('+')[0]} found; mixln_megatron supports megatron-core {SUPPORTED} "
            "(0.17.x, 0.18.x, 0.19.x, 0.20.x): install one of those (pip install 'megatron-core>=0.17,<0.21')"
        )
    return release


def _imported_version() -> str:
    import megatron.core  # heavy

    version = getattr(megatron.core, "__version__", None)
    if version:
        return version
    return dist_version("megatron-core")


VERSION = _imported_version().split("+")[0]
RELEASE = check_release(VERSION)
RELEASE_NAME = "%d.%d" % RELEASE  # as the settings tables name releases ("0.19")


# -------------------- Megatron-LM's arguments and pretrain() (0.17 / 0.18 / 0.19+)
def core_transformer_config_from_args(args, config_class=None):
    """Megatron-LM's TransformerConfig from parsed args, wherever this release keeps the function."""
    if RELEASE >= (0, 18):
        from megatron.training.argument_utils import core_transformer_config_from_args as build  # optional
    else:
        from megatron.training.arguments import core_transformer_config_from_args as build  # optional
    return build(args) if config_class is None else build(args, config_class)


def parse_and_validate_args(extra_args_provider: Callable):
    """Megatron-LM's args from sys.argv, loaded from the checkpoint with --use-checkpoint-args.

    0.18+: Megatron's parse_and_validate_args (validated; they become the global args). 0.17 has
    none and its pretrain() parses and validates sys.argv itself, so here the args are parsed
    (and checkpoint args loaded) for the entry point's own early checks only.
    """
    from megatron.training.arguments import parse_args  # optional

    args = parse_args(extra_args_provider)
    if RELEASE >= (0, 18):
        from megatron.training.arguments import parse_and_validate_args  # optional

        return parse_and_validate_args(extra_args_provider)
    if args.use_checkpoint_args:
        from megatron.training.checkpointing import load_args_from_checkpoint  # optional

        load_args_from_checkpoint(args, load_arg="pretrained_checkpoint")
        load_args_from_checkpoint(args)
    return args


def run_pretrain(args, argv: Sequence[str], *, datasets_provider, model_provider, forward_step,
                 extra_args_provider, non_loss_data_func=None, adjust_args: Optional[Callable] = None,
                 store=None):
    """megatron.training.pretrain() for a GPT model provider, with `args` from parse_and_validate_args;
    `store` (every release takes one): the process group's store, None for the launcher's.

    adjust_args(args) is what the caller changed on `args` after parsing; on 0.17 pretrain()
    parses again, so it is applied to the args Megatron then uses, before the first model build.
    """
    from megatron.core.enums import ModelType  # heavy
    from megatron.training import pretrain  # optional

    shared = dict(  # the keyword names all three releases share
        train_valid_test_dataset_provider=datasets_provider, model_type=ModelType.encoder_or_decoder,
        forward_step_func=forward_step, non_loss_data_func=non_loss_data_func, store=store,
    )
    if RELEASE >= (0, 18):
        from megatron.training.argument_utils import pretrain_cfg_container_from_args  # optional

        with warnings.catch_warnings():
            # It recommends a ModelConfig over a model provider; the provider is how Mix-LN gets in.
            warnings.filterwarnings("ignore", message=r"[\s\S]*recommended to use a ModelConfig")
            cfg = pretrain_cfg_container_from_args(args, None)
        return pretrain(cfg, model_provider=model_provider, **shared)
    saved_argv = sys.argv
    sys.argv = [saved_argv[0] if saved_argv else "mixln-megatron-pretrain", *argv]
    try:
        return pretrain(model_provider=_adjusting_provider(model_provider, adjust_args),
                        extra_args_provider=extra_args_provider, **shared)
    finally:
        sys.argv = saved_argv


def _adjusting_provider(model_provider, adjust_args):
    if adjust_args is None:
        return model_provider
    done = []

    def provider(*args, **kwargs):
        if not done:
            from megatron.training import get_args  # optional

            adjust_args(get_args())
            done.append(True)
        return model_provider(*args, **kwargs)

    return provider


# -------------------- training batches: the TP / CP batch helpers (0.17 / 0.18 / 0.19+)
def batch_on_this_tp_rank(data_iterator, vp_stage: Optional[int] = None) -> dict:
    """One micro-batch, read on TP rank 0 and broadcast over TP (first/last pipeline stages).

    0.17: megatron.training.utils' version reads the iterator itself; 0.18 moved it to
    megatron.core.utils taking the batch (flag `is_sft`), 0.19 renamed that flag `has_cu_seqlens`.
    """
    import torch  # heavy
    from megatron.core import mpu  # heavy
    from megatron.training import get_args  # optional

    if RELEASE < (0, 18):
        from megatron.training.utils import get_batch_on_this_tp_rank  # optional

        return get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank=False)
    from megatron.core.utils import get_batch_on_this_tp_rank  # heavy

    args = get_args()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        batch = {k: (v.cuda(non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
        batch.setdefault("attention_mask", None)
    no_packed_sequences = {"has_cu_seqlens" if RELEASE >= (0, 19) else "is_sft": False}
    ignore_virtual = vp_stage is None
    return get_batch_on_this_tp_rank(
        batch,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage),
        **no_packed_sequences,
    )


def batch_on_this_cp_rank(batch: dict) -> dict:
    """This context-parallel rank's slice of the sequence (0.18 added the is_hybrid_cp flag)."""
    from megatron.core import mpu  # heavy
    from megatron.core.utils import get_batch_on_this_cp_rank  # heavy

    hybrid = {"is_hybrid_cp": False} if RELEASE >= (0, 18) else {}
    return get_batch_on_this_cp_rank(batch, cp_group=mpu.get_context_parallel_group(), **hybrid)


# -------------------- building the model: `--spec` (0.19+), the MLP residual step (0.20), HybridModel (0.19+)
SPEC_GETS_THE_CONFIG = RELEASE >= (0, 19)

MLP_BDA_HOOK = "_apply_mlp_bda_step" if RELEASE >= (0, 20) else "_forward_post_mlp"
_MLP_BDA_HOOKS = ("_apply_mlp_bda_step", "_forward_post_mlp")


def keep_release_hooks(cls):
    """Class decorator: of the MLP residual-step overrides `cls` defines (one per name, both kept
    readable in the class), keep the one this release's TransformerLayer calls and drop the
    other, so 0.20 never routes a subclass through its `_forward_post_mlp` deprecation shim."""
    for name in _MLP_BDA_HOOKS:
        if name != MLP_BDA_HOOK and name in vars(cls):
            delattr(cls, name)
    return cls


# HybridModel (megatron.core.models.hybrid, `--hybrid-layer-pattern`, pretrain_hybrid.py's
# --spec stack ModuleSpec) is what Mix-LN builds on from 0.19; 0.17 has only MambaStack.
HYBRID_MODEL = RELEASE >= (0, 19)


def require_hybrid_model() -> None:
    """MixLNError unless this release has the HybridModel Mix-LN is built for."""
    if not HYBRID_MODEL:
        raise UnsupportedMegatronRelease(
            f"Mix-LN on HybridModel needs megatron-core 0.19 or newer (found {VERSION}); on this "
            "release train GPTModel with --spec mixln_megatron.spec mixln_layer_spec")


# -------------------- the finalize hook survives train() (0.17 / 0.18)
TRAIN_KEEPS_FINALIZE_HOOK = RELEASE >= (0, 19)  # 0.19 sets it only when None


def keep_finalize_hook(config) -> None:
    """Make the hook now on config.finalize_model_grads_func survive Megatron-LM's train().

    0.17/0.18's train() assigns its module global `finalize_model_grads` to every model config.
    That global becomes a dispatcher that runs the hook recorded here for the model's config (and
    megatron's finalize for any other model). Idempotent; a no-op on 0.19 and where
    megatron.training is not in use.
    """
    if TRAIN_KEEPS_FINALIZE_HOOK:
        return
    config = getattr(config, "transformer", config)
    hook = getattr(config, "finalize_model_grads_func", None)
    if hook is None or isinstance(hook, _FinalizeWithKeptHook):
        return
    if "_mixln_finalize_hook" not in vars(config):
        _recorded[0] += 1
    config._mixln_finalize_hook = hook
    training = sys.modules.get("megatron.training.training")
    if training is None and "megatron.training" in sys.modules:
        training = importlib.import_module("megatron.training.training")
    if training is not None and not isinstance(training.finalize_model_grads, _FinalizeWithKeptHook):
        training.finalize_model_grads = _FinalizeWithKeptHook(training.finalize_model_grads)


def finalize_chain_head(config):
    """The finalize function our hooks wrap on `config`: its field, or, on 0.17/0.18 once train()
    put the dispatcher there, the hook keep_finalize_hook recorded for the config."""
    config = getattr(config, "transformer", config)
    hook = getattr(config, "finalize_model_grads_func", None)
    if isinstance(hook, _FinalizeWithKeptHook):
        return getattr(config, "_mixln_finalize_hook", None)
    return hook


def set_finalize_chain_head(config, hook) -> None:
    """Make `hook` the head of `config`'s finalize chain (see finalize_chain_head), undoing
    keep_finalize_hook where nothing of ours is left: when `hook` is None or has no `.original`
    (megatron's own finalize), the config's record goes, the config gets megatron's function back
    from the dispatcher, and the module global is megatron's again once no config records a hook."""
    config = getattr(config, "transformer", config)
    current = getattr(config, "finalize_model_grads_func", None)
    dispatched = isinstance(current, _FinalizeWithKeptHook)
    ours_left = hook is not None and hasattr(hook, "original")
    if not dispatched:
        config.finalize_model_grads_func = hook
    if "_mixln_finalize_hook" not in vars(config):
        return
    if ours_left:
        config._mixln_finalize_hook = hook
        return
    del config._mixln_finalize_hook
    _recorded[0] -= 1
    if dispatched:
        config.finalize_model_grads_func = hook if hook is not None else current.original
    training = sys.modules.get("megatron.training.training")
    if _recorded[0] <= 0 and training is not None and isinstance(training.finalize_model_grads, _FinalizeWithKeptHook):
        training.finalize_model_grads = training.finalize_model_grads.original


# How many configs record a hook for the dispatcher (megatron's function goes back at zero).
_recorded = [0]


class _FinalizeWithKeptHook:
    """The dispatcher keep_finalize_hook puts in place of megatron.training.training.finalize_model_grads
    on 0.17/0.18; undone by set_finalize_chain_head when the last of our hooks is removed."""

    def __init__(self, original: Callable):
        self.original = original

    def __call__(self, model, *args, **kwargs):
        from megatron.core.utils import get_model_config  # heavy

        first = model[0] if isinstance(model, (list, tuple)) else model
        hook = getattr(get_model_config(first), "_mixln_finalize_hook", None)
        return (hook or self.original)(model, *args, **kwargs)


# -------------------- checkpoints: dist_checkpointing's load (0.19's process_group=, 0.19's common state)
class CheckpointFromNewerRelease(MixLNError, RuntimeError):
    """A torch_dist checkpoint saved by megatron-core 0.19+, being loaded by 0.17/0.18."""


def check_readable(checkpoint_dir: str, strict=None) -> None:
    """Refuse, in one line, a torch_dist checkpoint this release cannot load (at strictness
    `strict`: Megatron-LM's --dist-ckpt-strictness; None is megatron's default).

    0.19 keeps the common state (args, iteration, content metadata) in the DCP files and writes no
    common.pt, which 0.17/0.18 require (Megatron's own limitation; older -> newer loads); and a
    load that checks the checkpoint's keys needs megatron's metadata reader to take this torch's
    metadata (check_metadata_reader). convert.vet.check_load_dir calls it on the --load directory.
    """
    if not os.path.isfile(os.path.join(checkpoint_dir, ".metadata")):
        return
    check_metadata_reader(strict)
    if RELEASE >= (0, 19):
        return
    if not os.path.isfile(os.path.join(checkpoint_dir, "common.pt")):
        raise CheckpointFromNewerRelease(
            f"{checkpoint_dir} was saved by megatron-core 0.19 or newer (its common state is in the "
            f"DCP files, there is no common.pt); megatron-core {VERSION} cannot load it: load it with "
            "megatron-core 0.19, or convert it (mixln-megatron convert to-hf, then convert from-hf with this release)"
        )


def dist_load(sharded_state_dict, checkpoint_dir, process_group=None, **kwargs):
    """dist_checkpointing.load; process_group= exists from 0.19 (older releases use the world)."""
    from megatron.core import dist_checkpointing  # heavy

    check_readable(str(checkpoint_dir), kwargs.get("strict"))
    if process_group is not None and RELEASE >= (0, 19):
        kwargs["process_group"] = process_group
    return dist_checkpointing.load(sharded_state_dict, checkpoint_dir, **kwargs)


# -------------------- checkpoints: torch's DCP metadata in megatron's reader (torch 2.15's `strides`)
class UnsupportedTorchRelease(MixLNError, RuntimeError):
    """torch whose checkpoint metadata this megatron-core's metadata reader cannot take."""


# What a fresh install gets (setup.py's torch requirement; tests/test_torch_metadata_reader.py keeps them equal).
TORCH_REQUIREMENT = "torch>=2.4,<2.15"
_UNPROBED = object()
_reader_problem = _UNPROBED


def metadata_reader_problem(properties=None) -> Optional[str]:
    """Why megatron-core's torch_dist metadata reader fails on this torch's DCP metadata, or None.

    megatron's load_tensors_metadata calls torch.empty(size, **properties.__dict__), which fails on
    an attribute torch.empty does not take (torch 2.15's `strides`). So the reader itself runs on
    a one-tensor Metadata in memory with `properties` (default: as this torch makes them, probed
    once per process): the verdict follows a fix in either library."""
    global _reader_problem
    if properties is None and _reader_problem is not _UNPROBED:
        return _reader_problem
    import torch  # heavy
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy  # heavy
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,  # heavy
                                                       TensorStorageMetadata)

    props = TensorProperties(dtype=torch.float32) if properties is None else properties
    one = torch.Size([1])
    entry = TensorStorageMetadata(properties=props, size=one,
                                  chunks=[ChunkStorageMetadata(offsets=torch.Size([0]), sizes=one)])
    try:
        TorchDistLoadShardedStrategy().load_tensors_metadata(None, Metadata(state_dict_metadata={"probe": entry}))
        problem = None
    except TypeError as e:  # what an unexpected keyword raises; anything else is not this probe's to judge
        problem = str(e)
    if properties is None:
        _reader_problem = problem
    return problem


def check_metadata_reader(strict) -> None:
    """UnsupportedTorchRelease, in one line, when a dist_checkpointing load at strictness
    `strict` reads the checkpoint's tensor metadata (megatron does for every strictness but its
    default, assume_ok_unexpected) and megatron's reader cannot take this torch's metadata."""
    if strict is None:
        return
    from megatron.core.dist_checkpointing.validation import StrictHandling, parse_strict_flag  # heavy

    try:
        handling = parse_strict_flag(strict)
    except ValueError:
        return  # not a strictness megatron knows: its own argument check says so
    if not StrictHandling.requires_explicit_ckpt_mismatch_check(handling):
        return
    problem = metadata_reader_problem()
    if problem is None:
        return
    import torch  # heavy

    raise UnsupportedTorchRelease(
        f"torch {torch.__version__.split('+')[0]} with megatron-core {VERSION}: megatron-core's checkpoint "
        f"metadata reader, which a load with --dist-ckpt-strictness {handling.value} uses, fails on this "
        f"torch's metadata ({problem}): load with --dist-ckpt-strictness "
        f"{StrictHandling.ASSUME_OK_UNEXPECTED.value} (megatron's default), or install a torch it reads "
        f"(pip install '{TORCH_REQUIREMENT}')")


# -------------------- CUDA graphs of the whole iteration (0.17 / 0.18+)
def full_iteration_cuda_graph(config) -> Optional[str]:
    """How `config` (a TransformerConfig, or Megatron-LM's parsed args) asks for a CUDA graph of
    the whole forward-backward step, which captures config.finalize_model_grads_func; None when
    it does not."""
    config = getattr(config, "transformer", config)
    impl = getattr(config, "cuda_graph_impl", "none")
    if impl == "full_iteration":  # 0.18+
        return "--cuda-graph-impl full_iteration"
    scopes = []
    for name in ("cuda_graph_scope", "cuda_graph_modules"):  # 0.17's field; 0.19's flag takes the old value too
        value = getattr(config, name, None) or []
        scopes += value.split(",") if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else [value]
    if impl == "local" and any(getattr(s, "name", s) == "full_iteration" for s in scopes):  # 0.17
        how = "--enable-cuda-graph" if getattr(config, "enable_cuda_graph", False) else "--cuda-graph-impl local"
        return f"{how} --cuda-graph-scope full_iteration"
    return None
