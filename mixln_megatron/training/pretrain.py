"""`mixln-megatron pretrain` / `python -m mixln_megatron.training.pretrain`: GPT pretraining with Mix-LN.

Megatron-LM's own training loop (`megatron.training.pretrain`, shipped in the megatron-core
wheel) with this project's pieces plugged in:
  - arguments: every Megatron-LM flag, plus the --mixln-* flags (megatron_args.add_mixln_args,
    turned into one MixLNSettings by run_settings: flags > the checkpoint's args with
    --use-checkpoint-args > defaults; the MIXLN_* environment is not read here) and the few
    flags of this entry point (--cpu, --loss-log);
  - model: megatron.core's GPTModel over get_mixln_decoder_block_spec (TransformerEngine modules
    with --transformer-impl transformer_engine, megatron's local modules otherwise);
  - data: GPTDataset over Megatron indexed datasets (--data-path / --split, or the per-split
    --train/valid/test-data-path), or MockGPTDataset with --mock-data, built by
    BlendedMegatronDatasetBuilder;
  - forward step and loss: next-token cross-entropy summed over the loss mask, reported to
    Megatron as (loss sum, token count) like Megatron-LM's GPT example.

Launch it like any Megatron-LM script, e.g.
    torchrun --nproc_per_node 8 -m mixln_megatron.training.pretrain --mixln-alpha 0.25 <megatron flags>
A run without torchrun (no RANK in the environment) is a single process on a free local port.

CPU (development only): `--cpu` or MIXLN_CPU=1 calls mixln_megatron.dev.cpu.enable_training() before
anything else and adds the Megatron flags a CPU run needs (cpu.CPU_MEGATRON_FLAGS: gloo, local
modules, the CUDA-only fusions off); flags given on the command line still win.

Per-iteration losses: `--loss-log PATH` writes a JSON file with the training loss of every
iteration (token-weighted over the global batch, the value Megatron logs for that iteration) and
every evaluation pass (split, iteration, loss, perplexity). They are recorded in this module's
loss function, not parsed from the log: Megatron's log line averages over --log-interval, and its
first line after a (re)start over two iterations.

Not supported with Mix-LN yet (rejected before anything is built): Megatron-FSDP
(--use-megatron-fsdp) and context parallelism with the local backend.

Workaround (named in the README): Megatron's initialize_megatron -> _compile_dependencies ->
megatron.core.datasets.utils.compile_helpers runs `make` in megatron/core/datasets. The
megatron-core wheel ships the prebuilt `helpers_cpp` extension there but no Makefile, so `make`
fails and the process exits, on GPU machines as well. main() (never an import) replaces
compile_helpers with an import of the prebuilt library, and only when the Makefile is absent and
that import succeeds; a source checkout with a Makefile is left alone. See
use_prebuilt_dataset_helpers().
"""

from __future__ import annotations

import importlib
import json
import math
import os
import socket
import sys
import time
import warnings
from functools import partial
from typing import Optional, Sequence

import torch

from ..model import env_settings, support
from ..errors import MixLNError, one_line
from ..megatron_args import add_mixln_args, settings_from_args, settings_from_checkpoint_args
from ..model.placement import resolve_placement
from ..model.settings import MixLNSettings, layered
HELPERS_MODULE = "megatron.core.datasets.helpers_cpp"


class MixLNPretrainUnsupported(MixLNError, ValueError):
    """A run configuration this entry point does not support with Mix-LN (yet)."""


# ------------------------------------------------------------------ the compile_helpers workaround
def _compile_helpers_prebuilt():
    """Stands in for megatron.core.datasets.utils.compile_helpers: the library is prebuilt."""
    importlib.import_module(HELPERS_MODULE)


_compile_helpers_prebuilt.mixln_prebuilt = True


def use_prebuilt_dataset_helpers(datasets_utils=None) -> bool:
    """Make Megatron use the wheel's prebuilt dataset helpers instead of running `make`.

    Megatron-LM's initialize_megatron compiles megatron/core/datasets/helpers.cpp by running
    `make` in that directory (compile_helpers). The megatron-core wheel has the compiled
    `helpers_cpp` module there but no Makefile, so `make` fails and Megatron exits. Only when the
    Makefile is absent AND the prebuilt module imports is compile_helpers replaced by that import;
    otherwise nothing changes (a source tree keeps compiling as upstream intends). Returns whether
    the replacement is in place. `datasets_utils` is the module to patch (tests pass a stand-in).
    """
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


# ------------------------------------------------------------------ arguments
def add_pretrain_args(parser):
    """extra_args_provider: the --mixln-* flags and this entry point's own."""
    add_mixln_args(parser)
    group = parser.add_argument_group("mixln-megatron pretrain", "the entry point's own options")
    group.add_argument(
        "--cpu", action="store_true",
        help="Development on a machine without a GPU: apply mixln_megatron.dev.cpu.enable_training() "
        "first and add the flags a CPU run needs (" + " ".join(_cpu_flags_text()) + "). Same as "
        "MIXLN_CPU=1. Never for production runs.",
    )
    group.add_argument(
        "--loss-log", type=str, default=None,
        help="Write the per-iteration training losses and every evaluation result to this JSON file.",
    )
    return parser


def _cpu_flags_text():
    from ..dev.cpu import CPU_MEGATRON_FLAGS

    return [f.replace("%", "%%") for f in CPU_MEGATRON_FLAGS]


def cpu_requested(argv: Sequence[str], environ=None) -> bool:
    return "--cpu" in argv or env_settings.cpu_requested(environ)


def with_cpu_flags(argv: Sequence[str]) -> list:
    """The CPU flags first, so that a flag given on the command line overrides their values."""
    from ..dev.cpu import CPU_MEGATRON_FLAGS

    return list(CPU_MEGATRON_FLAGS) + list(argv)


MIXLN_SPECS = (["mixln_megatron.spec", "mixln_layer_spec"], ["mixln_megatron.spec", "mixln_local_layer_spec"])


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
            "mixln_layer_spec)"
        )


def backend_from_args(args) -> str:
    return "te" if getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine" else "local"


def _single_process_defaults(environ=None) -> None:
    """Without a launcher (no RANK / WORLD_SIZE): one process, on a free local port."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in env:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(s.getsockname()[1])


# ------------------------------------------------------------------ per-iteration loss record
class LossRecorder:
    """Per-iteration training losses and per-pass evaluation losses, as our loss_func sees them.

    Each rank keeps its local (loss sum, token count) per training iteration and per evaluation
    pass, as detached tensors (no host sync in the training loop); finalize() sums them over the
    data-parallel (with context-parallel) group, which gives the token-weighted loss over the
    global batch that Megatron reports for the iteration. Evaluation passes are closed by the
    `non_loss_data_func` hook Megatron calls at the end of every evaluate(); each is labelled by
    the data iterator it read from, in order of first use: "valid", then "test".
    Recording is on only with --loss-log.
    """

    def __init__(self):
        self.enabled = False
        self.reset()

    def reset(self):
        self.train = {}  # iteration -> tensor([loss sum, tokens])
        self.evals = []  # (split, iteration, tensor([loss sum, tokens]))
        self._pending = None
        self._pending_split = None
        self._iterator_labels = {}
        self.last_train_iteration = None

    def split_of(self, data_iterator) -> str:
        key = id(data_iterator)
        if key not in self._iterator_labels:
            n = len(self._iterator_labels)
            self._iterator_labels[key] = ("valid", "test")[n] if n < 2 else f"eval{n}"
        return self._iterator_labels[key]

    def add(self, training: bool, iteration: int, report: torch.Tensor, split=None):
        """`report`: tensor([loss sum, tokens]) of one micro-batch on this rank."""
        if not self.enabled:
            return
        report = report.detach().double()
        if training:
            self.train[iteration] = report if iteration not in self.train else self.train[iteration] + report
            self.last_train_iteration = iteration
        elif self._pending is None:
            self._pending, self._pending_split = report, split
        else:
            self._pending = self._pending + report

    def close_eval(self, iteration: int):
        """End of one evaluate() call (Megatron's non_loss_data_func hook)."""
        if self._pending is not None:
            self.evals.append((self._pending_split, iteration, self._pending))
        self._pending = None
        self._pending_split = None

    def finalize(self, group=None) -> dict:
        """Reduce over `group` (a collective: every rank of the group calls it) -> the record."""
        iterations = sorted(self.train)
        parts = [self.train[it] for it in iterations] + [e[2] for e in self.evals]
        values = []
        if parts:
            flat = torch.stack([p.to(parts[0].device) for p in parts])
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(flat, group=group)
            values = flat.cpu().tolist()
        train, evals = [], []
        for (s, n), it in zip(values, iterations):
            train.append({"iteration": it, "loss": s / max(n, 1.0), "tokens": int(n)})
        for (s, n), (split, it, _) in zip(values[len(iterations):], self.evals):
            loss = s / max(n, 1.0)
            evals.append({"split": split, "iteration": it, "loss": loss,
                          "ppl": math.exp(min(loss, 50.0)), "tokens": int(n)})
        return {"train": train, "eval": evals}


RECORDER = LossRecorder()


# ------------------------------------------------------------------ model
def run_settings(args, checkpoint_args=None) -> MixLNSettings:
    """This run's settings: the --mixln-* flags, then the resumed checkpoint's args, then defaults."""
    return layered(settings_from_args(args), settings_from_checkpoint_args(checkpoint_args))


def _checkpoint_args(args):
    """With --use-checkpoint-args: the args saved in the checkpoint (Megatron-LM copies only its
    own shape flags from them, not the Mix-LN placement that from-hf records)."""
    if not getattr(args, "use_checkpoint_args", False) or not getattr(args, "load", None):
        return None
    import copy

    from megatron.training.checkpointing import load_args_from_checkpoint

    loaded = load_args_from_checkpoint(copy.deepcopy(args))
    return loaded[1] if isinstance(loaded, tuple) else None


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None,
                   settings: Optional[MixLNSettings] = None):
    """Megatron-LM's model-provider contract: GPTModel with the Mix-LN decoder block spec.

    `settings` (main binds it) defaults to the --mixln-* flags in Megatron-LM's global args.
    The spike scaler / telemetry they ask for are installed on the config here, before the build.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.utils import get_pg_rank
    from megatron.training import get_args, print_rank_0
    from megatron.training.argument_utils import core_transformer_config_from_args

    from ..spec import get_mixln_decoder_block_spec
    from .hooks import install_training_hooks

    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    pp_rank = get_pg_rank(pg_collection.pp) if pg_collection is not None else None
    if settings is None:
        settings = run_settings(args)
    block_spec = get_mixln_decoder_block_spec(
        config, backend=backend_from_args(args), vp_stage=vp_stage, pp_rank=pp_rank, settings=settings
    )
    install_training_hooks(config, settings)
    print_rank_0(f"> building Mix-LN GPT model (backend {backend_from_args(args)}) ...")
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


# ------------------------------------------------------------------ batches, forward, loss
def get_batch(data_iterator, vp_stage=None):
    """This rank's micro-batch: read on TP rank 0, broadcast over TP, sliced for CP."""
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    args = get_args()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        sample = next(data_iterator)
        batch = {k: (v.cuda(non_blocking=True) if torch.is_tensor(v) else v) for k, v in sample.items()}
        batch.setdefault("attention_mask", None)
    ignore_virtual = vp_stage is None
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage),
    )
    if args.context_parallel_size > 1:
        batch = get_batch_on_this_cp_rank(
            batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group()
        )
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"),
            batch["position_ids"])


def loss_func(loss_mask, output_tensor, training=True, iteration=0, split=None, model=None):
    """Sum of the masked per-token losses and the token count (Megatron averages globally)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    losses = output_tensor.view(-1).float()
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        rerun = get_rerun_state_machine()
        rerun.validate_result(result=loss, rejection_func=torch.isnan, fatal=True,
                              message="found NaN in the local forward loss")
        rerun.validate_result(result=loss, rejection_func=torch.isinf, fatal=True,
                              message="found Inf in the local forward loss")
    report = torch.cat([loss.detach().view(1), num_tokens.view(1).to(loss.dtype)])
    RECORDER.add(training, iteration, report, split)
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Megatron-LM's forward-step contract: (output tensor, loss function)."""
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_args, get_timers

    if return_schedule_plan:
        raise MixLNPretrainUnsupported("combined 1F1B schedule plans are not supported by mixln-megatron pretrain")
    args = get_args()
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    training = model.training
    split = None if training else RECORDER.split_of(data_iterator)
    return output_tensor, partial(
        loss_func, loss_mask, training=training, iteration=args.curr_iteration + 1, split=split, model=model
    )


def close_eval_pass(model):
    """Megatron's `non_loss_data_func`: called once at the end of every evaluate()."""
    RECORDER.close_eval(RECORDER.last_train_iteration or _loaded_iteration())
    return None


def _loaded_iteration() -> int:
    from megatron.training import get_args

    return int(getattr(get_args(), "iteration", 0) or 0)


# ------------------------------------------------------------------ datasets
def is_dataset_built_on_rank(vp_stage=None) -> bool:
    from megatron.core import mpu
    from megatron.training.utils import is_first_or_last_pipeline_stage

    return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0


def gpt_dataset_config_from_args(args):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training import get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        context_parallel_size=args.context_parallel_size,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """GPTDataset over the indexed datasets of --data-path (or MockGPTDataset with --mock-data)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args, print_rank_0

    args = get_args()
    config = gpt_dataset_config_from_args(args)
    dataset_cls = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {dataset_cls.__name__} train, validation and test datasets ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_cls, train_val_test_num_samples, partial(is_dataset_built_on_rank, vp_stage=vp_stage), config
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


train_valid_test_datasets_provider.is_distributed = True


# ------------------------------------------------------------------ entry point
def _write_loss_log(args, settings: MixLNSettings) -> None:
    """Reduce the recorded losses and write --loss-log from one rank of the last stage."""
    from megatron.core import mpu

    if not RECORDER.enabled or not torch.distributed.is_initialized() or not mpu.model_parallel_is_initialized():
        return
    record = RECORDER.finalize(group=mpu.get_data_parallel_group(with_context_parallel=True))
    writer = (
        mpu.is_pipeline_last_stage(ignore_virtual=True)
        and mpu.get_tensor_model_parallel_rank() == 0
        and mpu.get_data_parallel_rank(with_context_parallel=True) == 0
    )
    if writer:
        placement = resolve_placement(args.num_layers, settings)
        record["mixln"] = {**placement.record(), "post_ln_layer_numbers": placement.post_ln_layer_numbers}
        record["num_layers"] = args.num_layers
        os.makedirs(os.path.dirname(os.path.abspath(args.loss_log)), exist_ok=True)
        tmp = args.loss_log + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, args.loss_log)


def _note_ignored_environment() -> None:
    """The entry point takes its settings from flags; say so when MIXLN_* settings are exported."""
    names = env_settings.settings_variables_set()
    if names and os.environ.get("RANK", "0") == "0":
        print(f"[mixln_megatron] WARNING: {', '.join(names)} ignored: mixln-megatron pretrain takes its "
              "settings from its --mixln-* flags (MIXLN_* is for Megatron-LM's own pretrain_gpt.py "
              "with --spec)", file=sys.stderr, flush=True)


def print_help(file=None) -> None:
    """--help: this entry point's flags. (megatron-core 0.19.2's own --help crashes on a help
    string with a stray '%'; see Megatron-LM's arguments.py for its flags.)"""
    import argparse

    parser = argparse.ArgumentParser(
        prog="mixln-megatron pretrain", allow_abbrev=False,
        description="Megatron-LM's pretraining loop with the Mix-LN GPT model. Takes every "
        "Megatron-LM flag (see megatron/training/arguments.py; Megatron's own --help is broken in "
        "megatron-core 0.19.2) plus the flags below.",
    )
    add_pretrain_args(parser)
    parser.print_help(file)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run pretraining with Megatron-LM's command-line flags (argv without the program name).

    Returns 0 on success and 2 for a configuration Mix-LN does not support (the message goes to
    stderr on every rank, before any process group exists).
    """
    t0 = time.time()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print_help()
        return 0
    if cpu_requested(argv):
        from ..dev import cpu

        cpu.enable_training()  # before any other megatron code runs
        argv = with_cpu_flags(argv)
    _single_process_defaults()
    use_prebuilt_dataset_helpers()

    from megatron.core.enums import ModelType
    from megatron.training import pretrain, print_rank_0
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args, parse_args

    from ..convert.inspect import apply_resume_args

    saved_argv = sys.argv
    sys.argv = [saved_argv[0] if saved_argv else "mixln-megatron-pretrain", *argv]
    try:
        # The unsupported configurations get a clear message before Megatron validates anything.
        check_supported_args(parse_args(add_pretrain_args))
        args = parse_and_validate_args(add_pretrain_args)
        check_supported_args(args, spec_from_checkpoint=True)
        checkpoint_args = _checkpoint_args(args)
        apply_resume_args(args, checkpoint_args, argv)  # the shape flags Megatron-LM does not copy
        settings = run_settings(args, checkpoint_args)
        resolve_placement(args.num_layers, settings)  # a bad setting stops here, in one line
    except MixLNError as error:
        print(f"mixln-megatron pretrain: error: {one_line(error)}", file=sys.stderr, flush=True)
        return 2
    finally:
        sys.argv = saved_argv
    _note_ignored_environment()
    RECORDER.reset()
    RECORDER.enabled = bool(args.loss_log)

    with warnings.catch_warnings():
        # pretrain_cfg_container_from_args recommends a ModelConfig over a model provider; the
        # provider is deliberate here (it is how the Mix-LN spec gets in).
        warnings.filterwarnings("ignore", message=r"[\s\S]*recommended to use a ModelConfig")
        cfg = pretrain_cfg_container_from_args(args, None)
    try:
        pretrain(
            cfg,
            train_valid_test_datasets_provider,
            ModelType.encoder_or_decoder,
            forward_step,
            model_provider=partial(model_provider, settings=settings),
            non_loss_data_func=close_eval_pass,
        )
    except SystemExit as exit_:
        # --exit-interval / --exit-duration-in-mins / signals end pretrain() with sys.exit on
        # every rank alike (after a barrier): the losses so far still get written.
        if exit_.code in (0, None):
            _write_loss_log(args, settings)
        raise
    _write_loss_log(args, settings)
    print_rank_0(f"mixln-megatron pretrain: done in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
