"""The Megatron-LM args a converted checkpoint carries, and the flags that rebuild its model."""

from __future__ import annotations

import argparse
from typing import List, Optional

from .forward_scalars import mup_flags_for
from .mapping import uses_mixln_layout
from .shape import ModelShape

# ModelShape's fields carry Megatron-LM's argument names.
SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "max_position_embeddings")
# What every Llama is in Megatron-LM's terms (RMSNorm, SwiGLU, full RoPE, dense, no dropout).
LLAMA_FIXED_ARGS = dict(
    normalization="RMSNorm", layernorm_zero_centered_gamma=False, apply_layernorm_1p=False, swiglu=True,
    squared_relu=False, position_embedding_type="rope", add_position_embedding=True,
    use_rotary_position_embeddings=False, rotary_percent=1.0, rotary_interleaved=False,
    apply_query_key_layer_scaling=False, attention_dropout=0.0, hidden_dropout=0.0, num_experts=None,
    moe_layer_freq=1, mtp_num_layers=None, multi_latent_attention=False, vocab_file=None, merge_file=None,
)
# A converted checkpoint starts training afresh: no optimizer / RNG state, no data consumed, one
# model replica, and P (not alpha) recorded.
FRESH_START_ARGS = dict(
    virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1, context_parallel_size=1,
    data_parallel_size=1, data_parallel_random_init=False, no_save_optim=True, no_save_rng=True, iteration=0,
    consumed_train_samples=0, skipped_train_samples=0, consumed_valid_samples=0, mixln_alpha=None,
)

def megatron_args_namespace(
    shape: ModelShape,
    *,
    tp: int,
    pp: int,
    ckpt_format: str,
    params_dtype,
    padded_vocab: int,
    make_vocab_size_divisible_by: int,
    placement_record: dict,
    transformer_impl: str,
    tokenizer_type: Optional[str],
    tokenizer_model: Optional[str],
    source: str,
) -> argparse.Namespace:
    """The args a converted checkpoint carries (what Megatron-LM's loader and --use-checkpoint-args read).

    Only model-defining arguments are set (plus what Megatron-LM's load_checkpoint compares);
    everything about training (batch sizes, lr, data) is left to the run that loads it.
    """
    import torch

    stock = not uses_mixln_layout(placement_record)
    spec = None
    if not stock:
        spec = ["mixln_megatron.spec",
                "mixln_layer_spec" if transformer_impl == "transformer_engine" else "mixln_local_layer_spec"]
    scaling = shape.rope_scaling or {}
    return argparse.Namespace(
        **moe_args(shape),
        **forward_args(shape),
        **{name: getattr(shape, name) for name in SHAPE_ARGS},
        **{k: v for k, v in LLAMA_FIXED_ARGS.items() if shape.moe is None or k not in ("num_experts", "moe_layer_freq")},
        **FRESH_START_ARGS,
        group_query_attention=shape.num_query_groups != shape.num_attention_heads,
        seq_length=shape.max_position_embeddings,
        encoder_seq_length=shape.max_position_embeddings,
        layernorm_epsilon=shape.norm_epsilon,
        norm_epsilon=shape.norm_epsilon,
        add_bias_linear=shape.add_bias_linear,
        add_qkv_bias=shape.add_bias_linear or shape.add_qkv_bias,
        rotary_base=shape.rotary_base,
        rotary_seq_len_interpolation_factor=(
            scaling.get("factor") if scaling.get("rope_type") == "linear" else None),
        use_rope_scaling=scaling.get("rope_type") == "llama3",
        rope_scaling_factor=float(scaling.get("factor", 8.0)) if scaling.get("rope_type") == "llama3" else 8.0,
        untie_embeddings_and_output_weights=not shape.tie_embeddings,
        spec=spec,
        transformer_impl=transformer_impl,
        # vocabulary / tokenizer
        vocab_size=shape.vocab_size,
        padded_vocab_size=padded_vocab,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        tokenizer_type=tokenizer_type,
        tokenizer_model=tokenizer_model,
        # precision
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # checkpoint / parallel layout it was written for
        ckpt_format=ckpt_format,
        use_dist_ckpt=ckpt_format == "torch_dist",
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        world_size=tp * pp,
        # Mix-LN: the integer P is authoritative (alpha only informational); a layout other than
        # Mix-LN's first P is --mixln-layout instead (the flags are exclusive), DeepNorm's constants as
        # text, as --mixln-deepnorm-alpha / -beta parse them (convert.saved_values)
        **placement_args(placement_record),
        mixln_scheme=placement_record.get("scheme", "mixln"),
        mixln_converted_from=source,
    )


def moe_args(shape: ModelShape) -> dict:
    """Megatron-LM's MoE args of an MoE shape (convert.moe_shape): routing as the HF model routes
    (softmax scores, top-k; --moe-router-pre-softmax when the k weights are not renormalised; fp32
    logits with --moe-router-dtype fp32). What the written tensors are: no top-k scaling factor (an
    export folded it into the experts' fc2) and plain [gate; up] fc1 rows (no GLU interleave)."""
    moe = shape.moe
    if moe is None:
        return {}
    return dict(num_experts=moe.num_experts, moe_router_topk=moe.topk, moe_ffn_hidden_size=moe.expert_ffn,
                moe_layer_freq=[int(m) for m in moe.moe_layers],
                moe_shared_expert_intermediate_size=moe.shared_ffn, moe_shared_expert_gate=moe.shared_gate,
                moe_router_pre_softmax=not moe.norm_topk_prob, moe_router_score_function="softmax",
                moe_router_dtype="fp32" if moe.router_fp32 else None,
                moe_router_topk_scaling_factor=None, moe_router_enable_expert_bias=False,
                moe_expert_capacity_factor=None, moe_mlp_glu_interleave_size=None,
                moe_shared_expert_glu_interleave_size=None)


def forward_args(shape: ModelShape) -> dict:
    """Megatron-LM's args for the shape's forward scalars: --glu-linear-offset (the fused SwiGLU
    kernel has no offset, so megatron needs it off) and the muP flags (the export's record, else
    flags that give the same scalars: convert.forward_scalars.mup_flags_for)."""
    out = {}
    if shape.forward.glu_linear_offset != 0.0:
        out.update(glu_linear_offset=shape.forward.glu_linear_offset, bias_swiglu_fusion=False)
    out.update(mup_flags_for(shape.forward, shape.hidden_size, shape.kv_channels, shape.mup))
    return out


def forward_flags(ns: argparse.Namespace) -> List[str]:
    """The flags of forward_args (none for LLaMA's forward)."""
    flags = []
    if getattr(ns, "glu_linear_offset", 0.0):
        flags += ["--glu-linear-offset", repr(float(ns.glu_linear_offset)), "--no-bias-swiglu-fusion"]
    if getattr(ns, "use_mup", False):
        flags.append("--use-mup")
        for name in ("mup_base_hidden_size", "mup_width_mult", "mup_embedding_mult", "mup_output_mult",
                     "mup_base_head_dim", "mup_attn_scale_power"):
            if getattr(ns, name, None) is not None:
                flags += ["--" + name.replace("_", "-"), repr(getattr(ns, name))]
    return flags


def moe_flags(ns: argparse.Namespace) -> List[str]:
    """The MoE flags of converted args (none for a dense model)."""
    if not getattr(ns, "num_experts", None):
        return []
    flags = ["--num-experts", ns.num_experts, "--moe-router-topk", ns.moe_router_topk,
             "--moe-ffn-hidden-size", ns.moe_ffn_hidden_size,
             "--moe-layer-freq", "[" + ",".join(str(v) for v in ns.moe_layer_freq) + "]"]
    if ns.moe_shared_expert_intermediate_size is not None:
        flags += ["--moe-shared-expert-intermediate-size", ns.moe_shared_expert_intermediate_size]
    if ns.moe_shared_expert_gate:
        flags.append("--moe-shared-expert-gate")
    if ns.moe_router_pre_softmax:
        flags.append("--moe-router-pre-softmax")
    if getattr(ns, "moe_router_dtype", None):
        flags += ["--moe-router-dtype", ns.moe_router_dtype]
    return [str(f) for f in flags]


def placement_args(placement_record: dict) -> dict:
    """mixln_post_ln_layers, or mixln_layout with mixln_deepnorm_alpha / _beta (text: repr of the
    float, exact), of a placement record (model.placement.Placement.record())."""
    layout = placement_record.get("layout")
    if layout is None:
        return {"mixln_post_ln_layers": int(placement_record.get("post_ln_layers", 0)), "mixln_layout": None,
                "mixln_deepnorm_alpha": None, "mixln_deepnorm_beta": None}
    text = {k: None if placement_record.get(k) is None else repr(float(placement_record[k]))
            for k in ("deepnorm_alpha", "deepnorm_beta")}
    return {"mixln_post_ln_layers": None, "mixln_layout": layout, "mixln_deepnorm_alpha": text["deepnorm_alpha"],
            "mixln_deepnorm_beta": text["deepnorm_beta"]}


def placement_flags(ns: argparse.Namespace) -> List[str]:
    """The --mixln-* placement flags of converted args: --mixln-post-ln-layers P, or --mixln-layout
    (with DeepNorm's constants when it has deepnorm layers); --mixln-scheme unless mixln."""
    if getattr(ns, "mixln_layout", None):
        flags = ["--mixln-layout", ns.mixln_layout]
        for name in ("deepnorm_alpha", "deepnorm_beta"):
            if getattr(ns, f"mixln_{name}", None) is not None:
                flags += [f"--mixln-{name.replace('_', '-')}", getattr(ns, f"mixln_{name}")]
    else:
        flags = ["--mixln-post-ln-layers", ns.mixln_post_ln_layers]
    if ns.mixln_scheme != "mixln":
        flags += ["--mixln-scheme", ns.mixln_scheme]
    return [str(f) for f in flags]


def launch_flags(ns: argparse.Namespace) -> List[str]:
    """The Megatron-LM flags that rebuild the model a converted checkpoint's args describe.

    Every shape flag, including those Megatron-LM's --use-checkpoint-args does not copy (the norm
    epsilon, rope scaling), and the Mix-LN placement: what the launch hint after from-hf prints.
    """
    flags = ["--num-layers", ns.num_layers, "--hidden-size", ns.hidden_size, "--ffn-hidden-size", ns.ffn_hidden_size,
             "--num-attention-heads", ns.num_attention_heads, "--kv-channels", ns.kv_channels]
    if ns.group_query_attention:
        flags += ["--group-query-attention", "--num-query-groups", ns.num_query_groups]
    flags += ["--max-position-embeddings", ns.max_position_embeddings, "--normalization", ns.normalization,
              "--norm-epsilon", repr(float(ns.layernorm_epsilon)), "--swiglu",
              "--position-embedding-type", "rope", "--rotary-base", f"{ns.rotary_base:g}"]
    if not ns.add_bias_linear:
        flags.append("--disable-bias-linear")
        if getattr(ns, "add_qkv_bias", False):
            flags.append("--add-qkv-bias")
    if ns.rotary_seq_len_interpolation_factor:
        flags += ["--rotary-seq-len-interpolation-factor", f"{ns.rotary_seq_len_interpolation_factor:g}"]
    if ns.use_rope_scaling:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", f"{ns.rope_scaling_factor:g}"]
    if ns.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    flags += ["--make-vocab-size-divisible-by", ns.make_vocab_size_divisible_by, *placement_flags(ns), *moe_flags(ns),
              *forward_flags(ns)]
    if ns.ckpt_format == "torch":
        flags += ["--ckpt-format", "torch", "--tensor-model-parallel-size", ns.tensor_model_parallel_size,
                  "--pipeline-model-parallel-size", ns.pipeline_model_parallel_size]
    return [str(f) for f in flags]
