"""Which configurations Mix-LN does not support, and why: one declarative table.

Each row names a TransformerConfig field followed by its Megatron-LM argument aliases (a config
and an argparse Namespace are both checked by name), the reason, and who rejects it:

    layer     the Mix-LN layer and the decoder spec, at model build (`post_ln_only` rows only for
              Post-LN layers, which are the ones that cannot honour them)
    pretrain  the `mixln-megatron pretrain` entry point, on the parsed arguments, before building
    stock     the stock `--spec mixln_megatron.spec ...` objects, on Megatron-LM's parsed arguments,
              when Megatron-LM builds the spec (before the model)
    convert   the Megatron -> Hugging Face converter (Llama cannot express the feature)
    analysis  the checkpoint loader of the analysis tools

A row with `backend` applies only with that backend ("te" or "local"); callers that do not know
the backend (converter, analysis) skip such rows. Megatron releases with other field names extend
the aliases here, not the callers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..errors import MixLNError

LAYER, PRETRAIN, CONVERT, ANALYSIS, STOCK = "layer", "pretrain", "convert", "analysis", "stock"
_BUILD = frozenset({LAYER, PRETRAIN, CONVERT, ANALYSIS})
_TRAIN = frozenset({LAYER, PRETRAIN})


class MixLNUnsupportedError(MixLNError, NotImplementedError):
    """A configuration the Mix-LN layer does not support (yet); the message says why."""


@dataclass(frozen=True)
class Unsupported:
    names: tuple  # TransformerConfig field first, then Megatron-LM argument aliases
    what: str  # the feature, with its Megatron-LM flag
    why: str  # the reason, and what to do instead
    where: frozenset
    off: tuple = (None, False, 0)  # values that mean "feature not used"
    backend: Optional[str] = None
    post_ln_only: bool = False

    def message(self, name: str, value) -> str:
        scope = f" with the {self.backend} backend" if self.backend else ""
        scope += " in Post-LN layers" if self.post_ln_only else ""
        return f"{self.what} is not supported{scope}: {self.why} [{name}={value!r}]"


def _row(names, what, why, where, **kw) -> Unsupported:
    return Unsupported(tuple(names.split()), what, why, frozenset(where), **kw)


_LLAMA = "the Hugging Face Llama export cannot express it"
_NOT_DDP = ("the spike scaler and the telemetry read Megatron DDP's per-parameter main_grad, and the "
            "Mix-LN layers have not been trained under it; use Megatron's DDP, optionally with "
            "--use-distributed-optimizer")
TABLE: tuple = (
    _row("multi_latent_attention", "multi-latent attention (MLA, --multi-latent-attention)",
         "MLA fuses the input norm into its down-projections, so a Post-LN MLA layer needs its "
         "own design", _BUILD),
    _row("experimental_attention_variant", "an experimental attention variant",
         "Mix-LN layers are built on megatron's SelfAttention", _BUILD),
    _row("heterogeneous_block_specs heterogeneous_layers_config_path "
         "heterogeneous_layers_config_encoded_json", "heterogeneous layers",
         "every Mix-LN layer is built from one spec", _BUILD),
    _row("use_transformer_engine_op_fuser use_te_op_fuser",
         "TE's op fuser (--use-transformer-engine-op-fuser)",
         "TE's fused MLP owns the pre-MLP norm, which a Post-LN layer applies after the residual "
         "add instead", _TRAIN),
    _row("inference_fuse_tp_communication", "inference_fuse_tp_communication",
         "it fuses the residual add with the next layer's input norm, which a Post-LN layer does "
         "not have", _TRAIN),
    _row("context_parallel_size", "context parallelism (--context-parallel-size > 1)",
         "it needs TransformerEngine's attention; use the TE spec (mixln_layer_spec, "
         "--transformer-impl transformer_engine)", _TRAIN, off=(None, 0, 1), backend="local"),
    _row("fp8", "fp8 (--fp8-format)",
         "megatron-core's local modules have no fp8 path, so the run would train in the base precision "
         "while asking for fp8; use the TE spec (mixln_layer_spec, --transformer-impl transformer_engine) "
         "on a GPU", _TRAIN, off=(None, False, ""), backend="local"),
    _row("use_te_activation_func", "use_te_activation_func (--use-te-activation-func)",
         "megatron's local MLP has no TE activation module and would apply the plain activation "
         "to the gated width; use the TE spec or drop the flag", _TRAIN, backend="local"),
    _row("fp32_residual_connection", "fp32_residual_connection (--fp32-residual-connection)",
         "the TE norm and plain TE linear of a Post-LN layer receive the fp32 residual stream "
         "against bf16/fp16 weights, which TE refuses; drop the flag or use the local spec",
         {LAYER}, backend="te", post_ln_only=True),
    _row("use_kitchen", "use_kitchen (--kitchen-config-file / --use-kitchen)",
         "Mix-LN maps only TransformerEngine's fused norm+linear to a plain linear, so a kitchen "
         "Post-LN layer would keep a norm before attention", {LAYER}, post_ln_only=True),
    _row("mtp_num_layers", "multi-token prediction (--mtp-num-layers)",
         "the entry point and the converter build and map the decoder only", {PRETRAIN, CONVERT}),
    # The data-parallel wrappers other than Megatron's DDP (docs/support-matrix.md).
    _row("use_megatron_fsdp", "Megatron-FSDP (--use-megatron-fsdp)", _NOT_DDP, {PRETRAIN, STOCK}),
    _row("use_torch_fsdp2", "torch FSDP2 (--use-torch-fsdp2)", _NOT_DDP, {PRETRAIN, STOCK}),
    # HybridModel checkpoints: conversion and analysis read Mix-LN `*-` patterns as the GPT network
    # they are (convert's reader) and refuse other patterns with hybrid_pattern.pattern_problem
    # (convert.shape), so no row here.
    # Features the Mix-LN layer handles but the Llama export cannot express.
    _row("qk_layernorm", "QK layernorm (--qk-layernorm)", "Llama has no q/k norms", {CONVERT}),
    _row("qk_l2_norm", "QK L2 norm (--qk-l2-norm)", "Llama has no q/k norms", {CONVERT}),
    _row("attention_output_gate", "a gated attention output (--attention-output-gate)", _LLAMA, {CONVERT}),
    _row("softmax_type", "a non-vanilla softmax (--softmax-type)", _LLAMA, {CONVERT},
         off=(None, "vanilla")),
    _row("window_size", "sliding-window attention (--window-size)", _LLAMA, {CONVERT}, off=(None,)),
    _row("no_rope_freq", "NoPE layers (--no-rope-freq)", _LLAMA, {CONVERT}, off=(None,)),
    _row("mrope_section", "multimodal RoPE (--mrope-section)", _LLAMA, {CONVERT}, off=(None,)),
    _row("squared_relu", "a squared-ReLU MLP (--squared-relu)", "Llama uses SwiGLU", {CONVERT}),
    _row("quick_geglu", "a quick-GeGLU MLP", "Llama uses SwiGLU", {CONVERT}),
    _row("activation_func_clamp_value", "a clamped activation", _LLAMA, {CONVERT}, off=(None,)),
    _row("apply_residual_connection_post_layernorm",
         "apply_residual_connection_post_layernorm (BERT-style residual)", _LLAMA, {CONVERT}),
)


def _is_on(value, off: Sequence) -> bool:
    try:
        return value not in off  # `in` compares by ==, so 0 / False / 1 match as numbers
    except Exception:  # a value that cannot be compared (e.g. a tensor) counts as set
        return True


def problems(obj, where: str, backend: Optional[str] = None, post_ln: bool = False) -> list:
    """`<feature> is not supported...: <why> [name=value]` for every row of `where` that `obj` (config or arguments) turns on."""
    found = []
    for row in TABLE:
        if where not in row.where or (row.post_ln_only and not post_ln):
            continue
        if row.backend is not None and row.backend != backend:
            continue
        for name in row.names:
            if hasattr(obj, name) and _is_on(getattr(obj, name), row.off):
                found.append(row.message(name, getattr(obj, name)))
                break
    return found


def message_of(name: str, value=True) -> str:
    """The message of the TABLE row that has `name` (a field or alias), for `name=value`: what a
    check raises, for code that meets the feature elsewhere (the spike scaler's targets)."""
    row = next(r for r in TABLE if name in r.names)
    return row.message(name, value)


def check(obj, where: str, backend: Optional[str] = None, post_ln: bool = False,
          error=MixLNUnsupportedError) -> None:
    """Raise `error` naming every unsupported feature of `obj`, in one line."""
    found = problems(obj, where, backend=backend, post_ln=post_ln)
    if found:
        raise error("; ".join(found))


def check_supported(config, backend: Optional[str] = None, post_ln: bool = False) -> None:
    """The model-build check (layer and decoder spec); see TABLE."""
    check(getattr(config, "transformer", config), LAYER, backend=backend, post_ln=post_ln)


# What a deepnorm layer cannot honour when megatron initialises the weights (perform_initialization):
# DeepNet's init multiplies the weights megatron's init methods made, and the value rows of the
# fused linear_qkv, per TP shard (model.layer). Off when the weights come from a checkpoint.
DEEPNORM_INIT_TABLE: tuple = (
    _row("init_model_with_meta_device", "meta-device init (--init-model-with-meta-device)",
         "the weights are initialised after the model is built, without DeepNorm's init factor; "
         "build on a real device", {LAYER}),
    _row("fp8_param fp8_param_gather", "fp8 parameters (--fp8-param-gather)",
         "DeepNorm's init scales the initialised weights in place, which fp8 weights cannot "
         "take exactly; initialise without fp8 parameters, save, and continue with them", {LAYER}),
    _row("attention_output_gate", "a gated attention output (--attention-output-gate)",
         "linear_qkv then holds gate rows as well, and DeepNorm's init scales the value rows of "
         "megatron's [q, k, v] layout only", {LAYER}),
)


def check_kind_supported(config, kind: str) -> None:
    """The model-build check of one layer kind (layout.py) beyond TABLE: DeepNorm's init."""
    config = getattr(config, "transformer", config)
    if kind != "deepnorm" or not getattr(config, "perform_initialization", True):
        return
    found = []
    for row in DEEPNORM_INIT_TABLE:
        for name in row.names:
            if hasattr(config, name) and _is_on(getattr(config, name), row.off):
                found.append(f"{row.what} is not supported in deepnorm layers: {row.why} [{name}={getattr(config, name)!r}]")
                break
    groups, tp = getattr(config, "num_query_groups", None), getattr(config, "tensor_model_parallel_size", 1) or 1
    if groups and groups % tp:
        found.append(f"{groups} query groups over tensor parallelism {tp} is not supported in deepnorm layers: "
                     "DeepNorm's init scales the value rows of each TP shard of linear_qkv, which needs whole "
                     f"query groups per shard; use num_query_groups a multiple of {tp} [num_query_groups={groups}]")
    if found:
        raise MixLNUnsupportedError("; ".join(found))
