"""Every megatron-core TransformerConfig field that is not an MoE setting, and every Megatron-LM
argument outside the config that shapes the network: what each one is to a Hugging Face export.
One table (TABLE), beside model.moe_fields (the MoE settings); together they name every field of
each supported release exactly once (tests/test_config_fields.py walks the installed release).

Each row has a handling:
  carried    the HF export (and from-hf, the analysis loader) reproduces it exactly; `where` names
             the HF config field (values the shape reader cannot carry are refused there, named)
  refused    the export stops with one line naming the flag and its value when the setting is on
             (`changes`, or: the value is not one of `off`); `where` says what the setting does
  no effect  the trained function does not depend on it; `category` says which kind of setting it
             is, so a reader can check the claim (tests/test_config_fields.py runs the ones that
             touch the forward pass)

A row also holds the refusals of the same field elsewhere (the model build, the entry point, the
stock --spec objects, the analysis loader, DeepNorm's init): model.support's deny-list is the
view of those refusals (support.TABLE), so a refusal is written once, here.

Pure data and small functions; nothing here imports megatron.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

from . import moe_fields as mf
from .moe_fields import RELEASES

CARRIED, REFUSED, NO_EFFECT = "carried", "refused", "no effect"
HANDLINGS = (CARRIED, REFUSED, NO_EFFECT)
# Where a refusal applies (model.support documents each).
LAYER, PRETRAIN, CONVERT, ANALYSIS, STOCK, DEEPNORM_INIT = (
    "layer", "pretrain", "convert", "analysis", "stock", "deepnorm_init")
BUILD = frozenset({LAYER, PRETRAIN})  # + CONVERT and ANALYSIS from the row's handling
TRAIN = frozenset({LAYER, PRETRAIN})

# What a "no effect" row is, so that the claim can be checked.
PARALLELISM = "parallelism"  # how the work is split; torch_dist saves the global tensors
FUSION = "fusion"  # a fused kernel of the same math
RECOMPUTE = "recompute"  # activation recomputation
OFFLOAD = "offload"  # where activations / weights wait between uses
PRECISION = "precision"  # the dtype of the computation; the export holds the saved weights
EXECUTION = "execution"  # kernels, backends, CUDA graphs, the inference engine: same weights, same math
LOGGING = "logging"
INIT = "init only"  # how weights start; the export holds the trained ones
TRAINING = "training only"  # losses, dropout (off in evaluation), gradient hooks, weight clipping
INERT = "inert alone"  # read only together with another setting, which is refused
CATEGORIES = (PARALLELISM, FUSION, RECOMPUTE, OFFLOAD, PRECISION, EXECUTION, LOGGING, INIT, TRAINING, INERT)

FIELD, ARGUMENT = "TransformerConfig", "Megatron-LM"
OFF = (None, False, 0)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One refusal of a feature: the names a config or saved args hold it under (field first), the
    feature with its flag, why and what to do instead, and where it applies."""

    names: tuple
    what: str
    why: str
    where: frozenset
    off: tuple = OFF  # values that mean "feature not used"
    backend: Optional[str] = None  # "te" / "local": only with that backend (callers without one skip it)
    post_ln_only: bool = False  # only Post-LN layers cannot honour it
    changes: Optional[Callable] = None  # changes(get) -> bool, instead of comparing with `off`

    def message(self, name: str, value) -> str:
        scope = f" with the {self.backend} backend" if self.backend else ""
        scope += " in Post-LN layers" if self.post_ln_only else ""
        return f"{self.what} is not supported{scope}: {self.why} [{name}={value!r}]"


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str  # the TransformerConfig field (or the Megatron-LM argument's dest)
    handling: str  # CARRIED / REFUSED / NO_EFFECT: flipping a refused row to carried is this one word
    where: str  # carried: the HF config field; refused: the feature, with its flag; no effect: what it is
    category: str = ""  # no effect: one of CATEGORIES
    why: str = ""  # refused: the reason, and what to do instead
    args: Tuple[str, ...] = ()  # other names saved Megatron-LM args hold it under
    off: tuple = OFF
    changes: Optional[Callable] = None  # changes(get) -> bool: the setting is on (default: value not in `off`)
    refused_in: frozenset = frozenset()  # scopes the export refusal also applies to (the model build, ...)
    also: Tuple[Refusal, ...] = ()  # other refusals of the field (other scopes, other reasons)
    releases: Tuple[str, ...] = RELEASES
    kind: str = FIELD
    analysis_carries: bool = False  # a refused row the analysis loader's CPU model builds anyway (not refused there)

    @property
    def names(self) -> tuple:
        return (self.name,) + self.args

    @property
    def refusals(self) -> Tuple[Refusal, ...]:
        """Every refusal of the row: the export's (when refused) first, then the others."""
        own = ()
        if self.handling == REFUSED:
            # the analysis loader builds its CPU model from the same saved args, so what the export
            # cannot carry, it cannot either (unless it builds it: analysis_carries)
            scopes = frozenset({CONVERT} if self.analysis_carries else {CONVERT, ANALYSIS}) | self.refused_in
            own = (Refusal(self.names, self.where, self.why, scopes, self.off, changes=self.changes),)
        elif self.refused_in:
            raise ValueError(f"{self.name}: refused_in without a refusal")
        return own + self.also


def _none(category: str, where: str, *names: str, **kw) -> Tuple[Setting, ...]:
    """No-effect rows of one category that share a description."""
    return tuple(Setting(name, NO_EFFECT, where, category, **kw) for name in names)


def _since(release: str) -> Tuple[str, ...]:
    return RELEASES[RELEASES.index(release):]


_LLAMA = "the Hugging Face Llama export cannot express it"
_NOT_DDP = ("the spike scaler and the telemetry read Megatron DDP's per-parameter main_grad, and the "
            "Mix-LN layers have not been trained under it; use Megatron's DDP, optionally with "
            "--use-distributed-optimizer")
_SAME_GLOBAL = "torch_dist saves the global tensors; the converter reads every split"

# fmt: off
TABLE: Tuple[Setting, ...] = (
    # ------------------------------------------------------------------ the shape: carried
    Setting("num_layers", CARRIED, "num_hidden_layers (a Mix-LN HybridModel: its `*-` pairs)"),
    Setting("hidden_size", CARRIED, "hidden_size"),
    Setting("num_attention_heads", CARRIED, "num_attention_heads"),
    Setting("num_query_groups", CARRIED, "num_key_value_heads (with --group-query-attention)"),
    Setting("ffn_hidden_size", CARRIED, "intermediate_size"),
    Setting("kv_channels", CARRIED, "head_dim"),
    Setting("layernorm_epsilon", CARRIED, "rms_norm_eps", args=("norm_epsilon",)),
    Setting("normalization", CARRIED, "RMSNorm (LlamaRMSNorm); LayerNorm refused by the shape reader"),
    Setting("layernorm_zero_centered_gamma", CARRIED, "the norm weights written as gamma + 1 (--apply-layernorm-1p)",
            args=("apply_layernorm_1p",)),
    Setting("gated_linear_unit", CARRIED, "hidden_act silu with a gate (--swiglu); a non-gated MLP refused by the "
            "shape reader", args=("swiglu",)),
    Setting("activation_func", CARRIED, "hidden_act silu (set by --swiglu; other activations have their own flags, "
            "refused)"),
    Setting("add_bias_linear", CARRIED, "attention_bias and mlp_bias", args=("disable_bias_linear",)),
    Setting("add_qkv_bias", CARRIED, "MoE classes: qkv_bias; a dense model's q/k/v-only bias refused by the shape "
            "reader (LLaMA's attention_bias has o_proj's too)"),
    Setting("rotary_interleaved", CARRIED, "the q / k rows permuted to LLaMA's half-split RoPE"),
    Setting("is_hybrid_model", CARRIED, "a Mix-LN HybridModel's `*-` pattern is the GPT network (other patterns "
            "refused by the hybrid-pattern check)"),
    # ------------------------------------------------------------------ the forward: refused
    Setting("multi_latent_attention", REFUSED, "multi-latent attention (MLA, --multi-latent-attention)",
            why="MLA fuses the input norm into its down-projections, so a Post-LN MLA layer needs its own design",
            refused_in=BUILD),
    Setting("experimental_attention_variant", REFUSED, "an experimental attention variant",
            why="Mix-LN layers are built on megatron's SelfAttention", refused_in=BUILD),
    Setting("heterogeneous_block_specs", REFUSED, "heterogeneous layers", why="every Mix-LN layer is built from one spec",
            args=("heterogeneous_layers_config_path", "heterogeneous_layers_config_encoded_json"), refused_in=BUILD),
    Setting("mtp_num_layers", REFUSED, "multi-token prediction (--mtp-num-layers)",
            why="the entry point, the --spec objects and the converter build and map the decoder only",
            refused_in=frozenset({PRETRAIN, STOCK})),
    Setting("qk_layernorm", REFUSED, "QK layernorm (--qk-layernorm)", why="Llama has no q/k norms",
            analysis_carries=True),
    Setting("qk_l2_norm", REFUSED, "QK L2 norm (--qk-l2-norm)", why="Llama has no q/k norms"),
    Setting("attention_output_gate", REFUSED, "a gated attention output (--attention-output-gate)", why=_LLAMA,
            also=(Refusal(("attention_output_gate",), "a gated attention output (--attention-output-gate)",
                          "linear_qkv then holds gate rows as well, and DeepNorm's init scales the value rows of "
                          "megatron's [q, k, v] layout only", frozenset({DEEPNORM_INIT})),)),
    Setting("softmax_type", REFUSED, "a non-vanilla softmax (--softmax-type)", why=_LLAMA, off=(None, "vanilla")),
    Setting("softmax_scale", REFUSED, "a softmax scale other than 1/sqrt(kv_channels) (TransformerConfig.softmax_scale)",
            why="Megatron-LM has no flag for it (muP's flags set it, and are carried)", off=(None,)),
    Setting("window_size", REFUSED, "sliding-window attention (--window-size)", why=_LLAMA, off=(None,)),
    Setting("no_rope_freq", REFUSED, "NoPE layers (--no-rope-freq)", why=_LLAMA, off=(None,)),
    Setting("mrope_section", REFUSED, "multimodal RoPE (--mrope-section)", why=_LLAMA, off=(None,)),
    Setting("activation_func_clamp_value", REFUSED, "a clamped activation", why=_LLAMA, off=(None,)),
    Setting("apply_residual_connection_post_layernorm", REFUSED,
            "apply_residual_connection_post_layernorm (BERT-style residual)", why=_LLAMA),
    Setting("glu_linear_offset", CARRIED, "glu_linear_offset (Mix-LN classes: silu(gate) * (up + offset))"),
    Setting("linear_attention_freq", REFUSED, "linear-attention layers (--linear-attention-freq)", why=_LLAMA,
            off=(None,)),
    Setting("enable_mhc_connections", REFUSED, "manifold hyper-connections (--enable-mhc-connections)",
            why="several residual streams, which Llama does not have", releases=_since("0.20")),
    # muP: the values megatron's __post_init__ derives (convert.shape.forward_scalars), as Mix-LN config fields
    Setting("use_mup", CARRIED, "attention_scale, embedding_multiplier, logits_multiplier (+ the megatron_mup record)"),
    *(Setting(name, CARRIED, "through use_mup's fields (read only under --use-mup)") for name in (
        "mup_base_hidden_size", "mup_width_mult", "mup_embedding_mult", "mup_output_mult", "mup_base_head_dim",
        "mup_attn_scale_power")),
    # ------------------------------------------------------------------ no effect on the function
    *_none(PARALLELISM, "tensor / pipeline / context / sequence parallel layout; " + _SAME_GLOBAL,
           "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
           "sequence_parallel", "hierarchical_context_parallel_sizes", "max_seqlen_per_dp_cp_rank",
           "hybrid_context_parallel", "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
           "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
           "account_for_loss_in_pipeline_split", "microbatch_group_size_per_vp_stage", "cp_comm_type"),
    Setting("context_parallel_size", NO_EFFECT, "context parallelism; " + _SAME_GLOBAL, PARALLELISM, off=(None, 0, 1),
            also=(Refusal(("context_parallel_size",), "context parallelism (--context-parallel-size > 1)",
                          "it needs TransformerEngine's attention; use the TE spec (mixln_layer_spec, "
                          "--transformer-impl transformer_engine)", TRAIN, off=(None, 0, 1), backend="local"),)),
    *_none(PARALLELISM, "communication between ranks and its overlap",
           "pipeline_model_parallel_comm_backend", "tp_comm_overlap", "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad",
           "tp_comm_overlap_ag", "tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag",
           "tp_comm_atomic_ag", "tp_comm_split_rs", "tp_comm_atomic_rs", "tp_comm_overlap_disable_qkv",
           "tp_comm_overlap_disable_fc1", "tp_comm_bootstrap_backend", "delay_wgrad_compute",
           "ep_overlap_early_attn_memory_release", "pipeline_dtype", "variable_seq_lengths", "overlap_p2p_comm",
           "batch_p2p_comm", "batch_p2p_sync", "use_ring_exchange_p2p", "deallocate_pipeline_outputs",
           "defer_embedding_wgrad_compute", "wgrad_deferral_limit", "overlap_p2p_comm_warmup_flush",
           "symmetric_ar_type", "nccl_all_reduce_for_prefill")
    + _none(PARALLELISM, "communication between ranks and its overlap", "high_priority_a2a_comm_stream",
            releases=_since("0.18"))
    + _none(PARALLELISM, "weight sharding over ranks; " + _SAME_GLOBAL, "tensor_parallel_num_weight_shards",
            "gtp_weight_remat_size", releases=_since("0.19"))
    + _none(PARALLELISM, "weight sharding over ranks; " + _SAME_GLOBAL, "gtp_remat_opt_in_modules",
            releases=_since("0.20")),
    *_none(FUSION, "a fused kernel of the same computation",
           "gradient_accumulation_fusion", "cross_entropy_loss_fusion", "cross_entropy_fusion_impl",
           "bias_activation_fusion", "masked_softmax_fusion", "persist_layer_norm", "memory_efficient_layer_norm",
           "bias_dropout_fusion", "apply_rope_fusion", "use_fused_weighted_squared_relu", "fused_single_qkv_rope",
           "fused_residual_rmsnorm"),
    Setting("use_transformer_engine_op_fuser", NO_EFFECT, "TE's op fuser: fused kernels of the same computation",
            FUSION, args=("use_te_op_fuser",), releases=_since("0.18"),
            also=(Refusal(("use_transformer_engine_op_fuser", "use_te_op_fuser"),
                          "TE's op fuser (--use-transformer-engine-op-fuser)",
                          "TE's fused MLP owns the pre-MLP norm, which a Post-LN layer applies after the residual "
                          "add instead", TRAIN),)),
    *_none(RECOMPUTE, "activation recomputation", "recompute_granularity", "recompute_method",
           "recompute_num_layers", "distribute_saved_activations", "recompute_modules",
           "num_microbatches_with_partial_activation_checkpoints"),
    *_none(OFFLOAD, "activation / weight offloading", "cpu_offloading", "cpu_offloading_num_layers",
           "_cpu_offloading_context", "cpu_offloading_activations", "cpu_offloading_weights",
           "cpu_offloading_double_buffering", "cpu_offloading_retain_pinned_cpu_buffers",
           "fine_grained_activation_offloading", "offload_modules", "min_offloaded_tensor_size")
    + _none(OFFLOAD, "activation offloading", "fine_grained_offloading_max_inflight_offloads",
            releases=_since("0.18"))
    + _none(OFFLOAD, "activation offloading", "delay_offload_until_cuda_graph", "delta_offload_bytes_across_pp_ranks",
            "activation_offload_fraction", releases=_since("0.19")),
    *_none(PRECISION, "the dtype the network computes in (the export writes the saved weights)",
           "fp16", "bf16", "params_dtype", "enable_autocast", "autocast_dtype", "attention_softmax_in_fp32",
           "disable_bf16_reduced_precision_matmul", "activation_func_fp8_input_store", "fp8_recipe",
           "fp8_quantizer_factory", "fp8_margin", "fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo",
           "fp8_wgrad", "fp8_dot_product_attention", "fp8_multi_head_attention", "tp_only_amax_red",
           "first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
           "use_kitchen_attention", "kitchen_attention_backend", "fp4", "fp4_recipe", "fp4_param",
           "fp4_quantizer_factory", "quant_recipe")
    + _none(PRECISION, "the dtype the network computes in", "fp8_output_proj", releases=_since("0.18")),
    Setting("fp8", NO_EFFECT, "fp8 computation (--fp8-format; the export writes the high-precision weights)", PRECISION,
            also=(Refusal(("fp8",), "fp8 (--fp8-format)",
                          "megatron-core's local modules have no fp8 path, so the run would train in the base "
                          "precision while asking for fp8; use the TE spec (mixln_layer_spec, --transformer-impl "
                          "transformer_engine) on a GPU", TRAIN, off=(None, False, ""), backend="local"),)),
    Setting("fp8_param", NO_EFFECT, "fp8 parameters (the saved weights are high precision)", PRECISION,
            args=("fp8_param_gather",),
            also=(Refusal(("fp8_param", "fp8_param_gather"), "fp8 parameters (--fp8-param-gather)",
                          "DeepNorm's init scales the initialised weights in place, which fp8 weights cannot take "
                          "exactly; initialise without fp8 parameters, save, and continue with them",
                          frozenset({DEEPNORM_INIT})),)),
    Setting("fp32_residual_connection", NO_EFFECT, "the residual stream kept in fp32", PRECISION,
            also=(Refusal(("fp32_residual_connection",), "fp32_residual_connection (--fp32-residual-connection)",
                          "the TE norm and plain TE linear of a Post-LN layer receive the fp32 residual stream "
                          "against bf16/fp16 weights, which TE refuses; drop the flag or use the local spec",
                          frozenset({LAYER}), backend="te", post_ln_only=True),)),
    Setting("use_kitchen", NO_EFFECT, "quantized kitchen kernels", PRECISION,
            also=(Refusal(("use_kitchen",), "use_kitchen (--kitchen-config-file / --use-kitchen)",
                          "Mix-LN maps only TransformerEngine's fused norm+linear to a plain linear, so a kitchen "
                          "Post-LN layer would keep a norm before attention", frozenset({LAYER}),
                          post_ln_only=True),)),
    Setting("apply_query_key_layer_scaling", NO_EFFECT, "divides q.k by the layer number and the softmax multiplies "
            "it back (an fp16 range guard)", PRECISION),
    *_none(EXECUTION, "how the same computation runs (kernels, backends, CUDA graphs, the inference engine)",
           "deterministic_mode", "attention_backend", "enable_cuda_graph", "cuda_graph_use_single_mempool",
           "cuda_graph_retain_backward_graph", "cuda_graph_warmup_steps", "external_cuda_graph", "cuda_graph_impl",
           "cuda_graph_scope", "clone_scatter_output_in_embedding", "disable_parameter_transpose_cache", "flash_decode",
           "batch_invariant_mode", "inference_rng_tracker", "inference_sampling_seed", "use_inference_optimized_layers",
           "inference_disable_triton_nvls_kernels", "inference_grouped_gemm_backend", "mlp_chunks_for_prefill",
           "transformer_impl", "test_mode")
    + _none(EXECUTION, "how the same computation runs", "use_grouped_gemm_for_dense_mlp", "cuda_graph_modules",
            "inference_cuda_graph_scope", "mlp_chunks_for_training", releases=_since("0.18"))
    + _none(EXECUTION, "how the same computation runs", "flash_attention_version", releases=_since("0.19"))
    + _none(EXECUTION, "how the same computation runs", "batch_invariant_backend", releases=_since("0.20")),
    Setting("use_te_activation_func", NO_EFFECT, "TE's activation module for the same activation", EXECUTION,
            also=(Refusal(("use_te_activation_func",), "use_te_activation_func (--use-te-activation-func)",
                          "megatron's local MLP has no TE activation module and would apply the plain activation "
                          "to the gated width; use the TE spec or drop the flag", TRAIN, backend="local"),)),
    Setting("inference_fuse_tp_communication", NO_EFFECT, "inference: the residual add fused with the next norm",
            EXECUTION, also=(Refusal(("inference_fuse_tp_communication",), "inference_fuse_tp_communication",
                                     "it fuses the residual add with the next layer's input norm, which a Post-LN "
                                     "layer does not have", TRAIN),)),
    *_none(LOGGING, "timing, logging and diagnostics", "timers", "barrier_with_L1_time", "log_max_attention_logit",
           "config_logger_dir"),
    *_none(INIT, "how the weights start (the export holds the trained ones)", "perform_initialization",
           "use_cpu_initialization", "init_method", "output_layer_init_method", "init_method_std",
           "embedding_init_method", "embedding_init_method_std", "use_te_rng_tracker"),
    Setting("init_model_with_meta_device", NO_EFFECT, "the model built on the meta device, initialised after", INIT,
            also=(Refusal(("init_model_with_meta_device",), "meta-device init (--init-model-with-meta-device)",
                          "the weights are initialised after the model is built, without DeepNorm's init factor; "
                          "build on a real device", frozenset({DEEPNORM_INIT})),)),
    *_none(TRAINING, "dropout (evaluation, and the export, have none)", "hidden_dropout", "attention_dropout"),
    *_none(TRAINING, "the loss and the gradients (hooks the training loop sets)", "calculate_per_token_loss",
           "finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func"),
    *_none(TRAINING, "QK-clip: the optimizer step rescales q / k weights (the saved weights are the clipped ones)",
           "qk_clip", "qk_clip_alpha", "qk_clip_threshold"),
    *_none(INERT, "read only with multi-token prediction (--mtp-num-layers, refused)", "mtp_loss_scaling_factor",
           "mtp_use_repeated_layer", "mtp_hybrid_override_pattern", "mtp_standalone")
    + _none(INERT, "read only with multi-token prediction (refused)", "mtp_grad_scale_func", "mtp_detach_heads",
            releases=_since("0.19"))
    + _none(INERT, "read only with multi-token prediction (refused)", "mtp_hsm", releases=_since("0.20")),
    *_none(INERT, "read only with sliding-window attention (--window-size, refused)", "window_attn_skip_freq"),
    *_none(INERT, "read only with an experimental attention variant (refused)", "dsa_indexer_n_heads",
           "dsa_indexer_head_dim", "dsa_indexer_topk", "dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss",
           "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
           "linear_num_value_heads")
    + _none(INERT, "read only with an experimental attention variant (refused)",
            "experimental_attention_variant_loss_scale_func", "dsa_indexer_topk_freq", "dsa_indexer_skip_topk_offset",
            "dsa_kernel_backend", "dsa_indexer_rope_interleaved", "dsa_indexer_rotate_activation",
            "dsa_indexer_scoring_relu", "dsa_indexer_k_norm_epsilon", "dsa_indexer_k_norm_fp32",
            releases=_since("0.19"))
    + _none(INERT, "read only with gated delta-product linear attention (refused)", "gdp_num_householder",
            "gdp_cutedsl_kernel", "gdp_num_chunk_states_to_recompute", releases=_since("0.20")),
    *_none(INERT, "read only by Mamba layers (a pattern with them is refused)", "mamba_state_dim", "mamba_head_dim",
           "mamba_num_groups", "mamba_num_heads", "use_mamba_mem_eff_path")
    + _none(INERT, "read only by Mamba layers (refused)", "mamba_training_ssm_states_dtype", releases=_since("0.19")),
    *_none(INERT, "read only with heterogeneous layers (refused)", "hetereogenous_dist_checkpoint"),
    *_none(INERT, "read only with manifold hyper-connections (refused)", "mhc_num_residual_streams",
           "mhc_sinkhorn_iterations", "mhc_init_gating_factor", "mhc_recompute_layer_num", releases=_since("0.20")),
    # ------------------------------------------------------------------ Megatron-LM arguments outside the config
    Setting("position_embedding_type", CARRIED, "rope (LLaMA's RoPE); learned_absolute, mrope, yarn, none refused by "
            "the shape reader", kind=ARGUMENT),
    Setting("rotary_base", CARRIED, "rope_parameters.rope_theta", kind=ARGUMENT),
    Setting("rotary_percent", CARRIED, "1.0 (every dimension rotated); partial rotation refused by the shape reader",
            kind=ARGUMENT),
    Setting("use_rope_scaling", CARRIED, "rope_parameters llama3 (factor, low 1, high 4, original 8192); with a "
            "hybrid layer pattern refused by the shape reader", kind=ARGUMENT,
            also=(Refusal(("use_rope_scaling",), "Llama 3 RoPE scaling (--use-rope-scaling) in a HybridModel",
                          "HybridModel takes no RoPE scaling, so the model trains without it while the saved args "
                          "say otherwise; drop it, or train a GPTModel (no --hybrid-layer-pattern)",
                          frozenset({PRETRAIN, STOCK}),
                          changes=lambda get: bool(get("use_rope_scaling")) and bool(get("hybrid_layer_pattern"))),)),
    Setting("rope_scaling_factor", CARRIED, "rope_parameters.factor (llama3)", kind=ARGUMENT,
            also=(Refusal(("rope_scaling_factor",), "--rope-scaling-factor other than 8 with the stock --spec objects",
                          "Megatron-LM's pretrain_gpt.py builds GPTModel without it (the model trains with 8.0 while "
                          "the saved args say otherwise); drop it, or train with mixln-megatron pretrain, which "
                          "passes it", frozenset({STOCK}),
                          changes=lambda get: bool(get("use_rope_scaling"))
                          and get("rope_scaling_factor") not in (None, 8, 8.0)),)),
    Setting("rotary_seq_len_interpolation_factor", CARRIED, "rope_parameters linear, factor", kind=ARGUMENT),
    Setting("rope_type", CARRIED, "rope; other types refused by the shape reader", kind=ARGUMENT),
    Setting("rotary_scaling_factor", NO_EFFECT, "read only with YaRN / mrope position embeddings (refused)", INERT,
            kind=ARGUMENT),
    Setting("add_position_embedding", NO_EFFECT, "read only with learned absolute position embeddings (refused)",
            INERT, kind=ARGUMENT),
    Setting("group_query_attention", CARRIED, "num_key_value_heads (off: one per head)", kind=ARGUMENT),
    Setting("untie_embeddings_and_output_weights", CARRIED, "tie_word_embeddings (false when untied)", kind=ARGUMENT),
    Setting("max_position_embeddings", CARRIED, "max_position_embeddings", args=("seq_length",), kind=ARGUMENT),
    Setting("vocab_size", CARRIED, "vocab_size (the true vocabulary: the tokenizer's, or --vocab-size)", kind=ARGUMENT),
    Setting("padded_vocab_size", CARRIED, "vocab_size: the padding rows are cut off (they are never a label)",
            kind=ARGUMENT),
    Setting("make_vocab_size_divisible_by", NO_EFFECT, "vocabulary padding (cut off by the export)", PARALLELISM,
            kind=ARGUMENT),
    Setting("squared_relu", REFUSED, "a squared-ReLU MLP (--squared-relu)", why="Llama uses SwiGLU", kind=ARGUMENT),
    Setting("quick_geglu", REFUSED, "a quick-GeGLU MLP (--quick-geglu)", why="Llama uses SwiGLU", kind=ARGUMENT),
    Setting("hybrid_layer_pattern", CARRIED, "a Mix-LN `*-` pattern: the GPT network; other patterns refused by the "
            "hybrid-pattern check", args=("hybrid_override_pattern",), kind=ARGUMENT),
    Setting("spec", NO_EFFECT, "the module that builds the layers: Mix-LN's (--spec mixln_megatron.spec ...) saves "
            "the Mix-LN record, which the converter reads; stock specs build pre-LN Llama layers", EXECUTION,
            kind=ARGUMENT),
    Setting("fp16_lm_cross_entropy", NO_EFFECT, "the loss in fp16", PRECISION, kind=ARGUMENT),
    Setting("use_megatron_fsdp", NO_EFFECT, "Megatron-FSDP; " + _SAME_GLOBAL, PARALLELISM, kind=ARGUMENT,
            also=(Refusal(("use_megatron_fsdp",), "Megatron-FSDP (--use-megatron-fsdp)", _NOT_DDP,
                          frozenset({PRETRAIN, STOCK})),)),
    Setting("use_torch_fsdp2", NO_EFFECT, "torch FSDP2; " + _SAME_GLOBAL, PARALLELISM, kind=ARGUMENT,
            also=(Refusal(("use_torch_fsdp2",), "torch FSDP2 (--use-torch-fsdp2)", _NOT_DDP,
                          frozenset({PRETRAIN, STOCK})),)),
)
# fmt: on
BY_NAME = {row.name: row for row in TABLE}


def _is_on(value, off) -> bool:
    try:
        return value not in off  # `in` compares by ==, so 0 / False / 1 match as numbers
    except Exception:  # a value that cannot be compared (e.g. a tensor) counts as set
        return True


def getter(source) -> Callable[[str], object]:
    """get(name) over saved Megatron-LM args or a TransformerConfig: the first of the row's names
    that is set (an unknown name reads its own attribute)."""
    def get(name: str):
        row = BY_NAME.get(name)
        for n in row.names if row else (name,):
            value = getattr(source, n, None)
            if value is not None:
                return value
        return None
    return get


def refusal_on(refusal: Refusal, source) -> Optional[Tuple[str, object]]:
    """(name, value) of the first of the refusal's names that `source` turns on, or None."""
    if refusal.changes is not None:
        if not refusal.changes(getter(source)):
            return None
        return next(((n, getattr(source, n)) for n in refusal.names if hasattr(source, n)), (refusal.names[0], None))
    for name in refusal.names:
        if hasattr(source, name) and _is_on(getattr(source, name), refusal.off):
            return name, getattr(source, name)
    return None


def refusals(scope: str) -> Tuple[Refusal, ...]:
    """Every refusal of the table that applies at `scope` (LAYER, PRETRAIN, CONVERT, ...)."""
    return tuple(r for row in TABLE for r in row.refusals if scope in r.where)


def fields_of_release(release: str) -> Tuple[str, ...]:
    """The table's TransformerConfig fields that exist in `release` (one of RELEASES)."""
    return tuple(row.name for row in TABLE if row.kind == FIELD and release in row.releases)


def counts(release: str) -> dict:
    """{handling: rows} of the fields (this table's and model.moe_fields') of `release`: the export's
    view, where moe_fields' folded counts as carried and its training / execution as no effect."""
    out = {h: 0 for h in HANDLINGS}
    for row in TABLE:
        if row.kind == FIELD and release in row.releases:
            out[row.handling] += 1
    moe = {mf.CARRIED: CARRIED, mf.FOLDED: CARRIED, mf.REFUSED: REFUSED, mf.TRAINING: NO_EFFECT,
           mf.EXECUTION: NO_EFFECT}
    for row in mf.TABLE:
        if release in row.releases:
            out[moe[row.handling]] += 1
    return out


# The "no effect" rows whose claim touches the forward pass and is verified by running: a tiny
# Mix-LN GPT built with each changed, loaded with the same weights, gives the default's logits
# (tests/test_config_fields.py::test_no_effect_rows_leave_the_logits_unchanged).
AUDITED = frozenset({
    "apply_query_key_layer_scaling", "attention_softmax_in_fp32", "masked_softmax_fusion", "attention_backend",
    "hidden_dropout", "attention_dropout", "init_method_std", "embedding_init_method_std", "perform_initialization",
    "use_cpu_initialization", "init_model_with_meta_device", "bias_dropout_fusion", "bias_activation_fusion",
    "memory_efficient_layer_norm", "use_fused_weighted_squared_relu", "fused_residual_rmsnorm",
    "activation_func_fp8_input_store", "fp32_residual_connection", "test_mode", "deterministic_mode",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "clone_scatter_output_in_embedding",
    "cross_entropy_loss_fusion", "calculate_per_token_loss", "mlp_chunks_for_prefill",
    "disable_bf16_reduced_precision_matmul", "use_kitchen_attention", "log_max_attention_logit", "qk_clip",
    "qk_clip_alpha", "qk_clip_threshold", "window_attn_skip_freq", "mtp_loss_scaling_factor", "mtp_use_repeated_layer",
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk",
    "dsa_indexer_loss_coeff", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
    "use_mamba_mem_eff_path",
})
