"""The providers Megatron-LM's training loop calls: model, batch, forward step, loss, datasets.

Laid out like Megatron-LM's pretrain_gpt.py (core_r0.19.0) so that a diff against it shows the
Mix-LN changes only: the Mix-LN decoder block spec (HybridModel: pretrain_hybrid.py's builder
with the Mix-LN stack spec), the training hooks installed on the config before the build, the
losses handed to the run's LossLog; what Mix-LN refuses before the build (packed sequences, FIM,
ModelOpt, distillation) is left out. Imports megatron.training: only after the CPU harness.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.models.gpt import GPTModel
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import get_attr_wrapped_model, get_pg_rank
from megatron.training import get_args, get_timers, get_tokenizer, print_rank_0
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

from .. import compat
from ..compat import core_transformer_config_from_args  # its module differs by release
from ..errors import refusals_leave
from ..megatron_args import backend_from_args, run_settings
from ..model.settings import MixLNSettings
from ..model.specs import get_mixln_decoder_block_spec, get_mixln_hybrid_stack_spec
from .hooks import install_training_hooks
from .loss_log import LossLog

# The fields get_batch returns, in the order forward_step unpacks them.
BATCH_KEYS = ["tokens", "labels", "loss_mask", "attention_mask", "position_ids"]


def _settings_and_backend(args, settings: Optional[MixLNSettings], backend: Optional[str]):
    """The entry point binds both; a caller of Megatron's get_model gets them from the global args."""
    settings = settings if settings is not None else run_settings(args)
    return settings, (backend if backend is not None else backend_from_args(args))


# Megatron-LM calls the providers: a refusal while building (a layer's unsupported kind, a hook
# the run's CUDA graphs would capture) is one line and exit 2 on every rank, not a traceback.
@refusals_leave()
def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None,
                   settings: Optional[MixLNSettings] = None, backend: Optional[str] = None):
    """Megatron-LM's model-provider contract: GPTModel with the Mix-LN decoder block spec."""
    args = get_args()
    settings, backend = _settings_and_backend(args, settings, backend)
    if config is None:
        config = core_transformer_config_from_args(args)
    pp_rank = get_pg_rank(pg_collection.pp) if pg_collection is not None else None
    block_spec = get_mixln_decoder_block_spec(
        config, backend=backend, vp_stage=vp_stage, pp_rank=pp_rank, settings=settings
    )
    install_training_hooks(config, settings)
    print_rank_0(f"> building Mix-LN GPT model (backend {backend}) ...")
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
        # The export reads both from the saved args, so the model must honour them; Megatron-LM's
        # own builders drop the factor (the stock --spec edge refuses a non-default one).
        rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


@refusals_leave()
def hybrid_model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None,
                          settings: Optional[MixLNSettings] = None, backend: Optional[str] = None):
    """The same contract for HybridModel (--hybrid-layer-pattern), built by Megatron-LM's own
    hybrid_config_from_args and HybridModelBuilder; only the stack spec is Mix-LN's."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import hybrid_config_from_args
    from megatron.training.models.hybrid import HybridModelBuilder

    compat.require_hybrid_model()
    args = get_args()
    settings, backend = _settings_and_backend(args, settings, backend)
    model_config = hybrid_config_from_args(args, config)  # args.spec is None: the entry point refuses --spec
    model_config.hybrid_stack_spec = get_mixln_hybrid_stack_spec(
        model_config.transformer, backend=backend, settings=settings,
        hybrid_layer_pattern=args.hybrid_layer_pattern,
    )
    install_training_hooks(model_config.transformer, settings, hybrid=True)
    print_rank_0(f"> building Mix-LN Hybrid model {args.hybrid_layer_pattern!r} (backend {backend}) ...")
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return HybridModelBuilder(model_config).build_model(
        pg_collection, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


def get_batch(data_iterator, vp_stage: Optional[int] = None):
    """This rank's micro-batch: read on TP rank 0, broadcast over TP, sliced for CP."""
    args = get_args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return [None for _ in BATCH_KEYS]

    batch = compat.batch_on_this_tp_rank(data_iterator, vp_stage)  # the helpers differ by release
    if args.context_parallel_size > 1:
        batch = compat.batch_on_this_cp_rank(batch)

    return [batch.get(key) for key in BATCH_KEYS]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model: Optional[GPTModel] = None,
              on_report=None):
    """Sum of the masked per-token losses and the token count (Megatron averages globally).

    `on_report` (the run's LossLog, when --loss-log is set) receives tensor([loss sum, tokens]).
    """
    args = get_args()

    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().detach().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.view(1).to(loss.dtype)])

    # Check individual rank losses are not NaN prior to DP all-reduce.
    if args.check_for_nan_in_loss_and_grad:
        rerun_state_machine = get_rerun_state_machine()
        rerun_state_machine.validate_result(result=loss, rejection_func=torch.isnan, fatal=True,
                                            message="found NaN in the local forward loss")
        rerun_state_machine.validate_result(result=loss, rejection_func=torch.isinf, fatal=True,
                                            message="found Inf in the local forward loss")
    if on_report is not None:
        on_report(report)
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model: GPTModel, return_schedule_plan: bool = False,
                 loss_log: Optional[LossLog] = None):
    """Megatron-LM's forward-step contract: (output tensor, loss function)."""
    args = get_args()
    timers = get_timers()

    if return_schedule_plan:
        # Schedule plans serve MoE communication overlap (--overlap-moe-expert-parallel-comm), which
        # the Mix-LN layer does not split into schedule nodes.
        raise NotImplementedError("combined 1F1B schedule plans are not supported by mixln-megatron pretrain")

    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()

    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)

    on_report = None
    if loss_log is not None:
        on_report = loss_log.reporter(model.training, args.curr_iteration + 1, data_iterator)
    return output_tensor, partial(loss_func, loss_mask, model=model, on_report=on_report)


def is_dataset_built_on_rank(vp_stage=None):
    """Whether the dataset should be built on the current rank."""
    return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0


# GPTDatasetConfig fields that take the flag of the same name.
DATASET_FLAGS = ("split", "multiple_validation_sets", "full_validation", "num_dataset_builder_threads",
                 "mmap_bin_files", "reset_position_ids", "reset_attention_mask", "eod_mask_loss",
                 "context_parallel_size")


def core_gpt_dataset_config_from_args(args) -> GPTDatasetConfig:
    """The GPT dataset config of the parsed flags."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(),
        create_attention_mask=args.create_attention_mask_in_dataloader,
        **{name: getattr(args, name) for name in DATASET_FLAGS},
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """GPTDataset over the indexed datasets of --data-path (or MockGPTDataset with --mock-data)."""
    args = get_args()

    config = core_gpt_dataset_config_from_args(args)
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset

    print_rank_0(f"> building {dataset_type.__name__} train, validation and test datasets ...")

    is_dataset_built = partial(is_dataset_built_on_rank, vp_stage=vp_stage)
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, is_dataset_built, config
    ).build()

    print_rank_0("> finished creating GPT datasets ...")

    return train_ds, valid_ds, test_ds


train_valid_test_datasets_provider.is_distributed = True
