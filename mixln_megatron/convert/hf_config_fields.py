"""Every config.json field `convert from-hf` meets, and what it is to the Megatron model: one table.

Each row is one field of the installed transformers config class of a model type (llama: LlamaConfig
and PretrainedConfig's common fields; mixtral, qwen2_moe; the Mix-LN classes add theirs) or a key
older transformers wrote (LEGACY), with its status:

  carried    from-hf reproduces it exactly; `what` names the Megatron-LM argument it becomes;
             `refused` (if any) names the values Megatron cannot express, refused in one line
  no effect  it does not change the function the weights compute (output options, generation,
             initialisation, training-only terms); `what` says which, so the claim can be checked
  refused    any value but the one named is refused

The refusals that are a rule on one field live here (`problems`); the readers of the shape
(convert.shape.hf_config_shape and moe_shape_of_hf_config) check types and ranges and parse the rope
settings. tests/test_hf_config_fields.py fails naming any field of the installed classes this table
lacks, and any row for a field the class does not have.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

CARRIED, NO_EFFECT, REFUSED = "carried", "no effect", "refused"
LLAMA, MIXLN, MIXLN_MOE, MIXTRAL, QWEN2_MOE = "llama", "mixln_llama", "mixln_moe", "mixtral", "qwen2_moe"
ALL = (LLAMA, MIXLN, MIXLN_MOE, MIXTRAL, QWEN2_MOE)
DENSE_AND_MIXLN = (LLAMA, MIXLN, MIXLN_MOE)
MIXLN_TYPES = (MIXLN, MIXLN_MOE)


@dataclasses.dataclass(frozen=True)
class HFField:
    name: str
    status: str
    what: str  # carried: the Megatron-LM argument; no effect: why not
    model_types: tuple = ALL
    refused: str = ""  # carried fields: the values from-hf refuses
    legacy: bool = False  # a key older transformers wrote, not a field of the installed class
    check: Optional[Callable[[dict], Optional[str]]] = None  # the problem of a refused value, or None


def _hidden_act(config: dict) -> Optional[str]:
    act = config.get("hidden_act")
    if act is not None and act != "silu":
        return f"hidden_act {act!r}: Megatron's --swiglu is SiLU-gated"
    return None


def _biases(config: dict) -> Optional[str]:
    attention, mlp = bool(config.get("attention_bias")), bool(config.get("mlp_bias"))
    if attention != mlp:
        return (f"attention_bias={attention} with mlp_bias={mlp}: Megatron's add_bias_linear puts biases on all "
                "linears or none")
    return None


def _quantized(config: dict) -> Optional[str]:
    if config.get("quantization_config"):
        return "a quantized checkpoint (quantization_config): convert the full-precision weights"
    return None


def _sliding(name: str):
    def check(config: dict) -> Optional[str]:
        if config.get(name):
            return f"sliding-window attention ({name}={config.get(name)!r}): Megatron's Llama attends to every position"
        return None
    return check


def _layer_types(config: dict) -> Optional[str]:
    types = config.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or any(t != "full_attention" for t in types):
        shown = repr(types)
        return (f"layer_types {shown if len(shown) <= 60 else shown[:60] + '...'}: every layer must be "
                "'full_attention' (a sliding-window layer is not Megatron's attention)")
    return None


_OUTPUT = "what forward returns, not what it computes"
_RECORD = "a record of the folder, not part of the network"
_TRAIN = "a training-only term (the auxiliary loss, router noise or dropout): eval logits are the same"
_F = HFField
TABLE: tuple = (
    # PretrainedConfig's common fields
    _F("transformers_version", NO_EFFECT, _RECORD),
    _F("architectures", NO_EFFECT, "names the class; from-hf reads model_type"),
    _F("_name_or_path", NO_EFFECT, _RECORD),
    _F("model_type", CARRIED, "which fields are read: llama, mixln_llama, mixln_moe, mixtral, qwen2_moe",
       refused="any other model type"),
    _F("output_hidden_states", NO_EFFECT, _OUTPUT),
    _F("output_attentions", NO_EFFECT, _OUTPUT),
    _F("return_dict", NO_EFFECT, _OUTPUT),
    _F("dtype", NO_EFFECT, "the stored precision: from-hf reads the weights' own dtype (--dtype picks the written one)"),
    _F("chunk_size_feed_forward", NO_EFFECT, "no module of these models reads it"),
    _F("is_encoder_decoder", NO_EFFECT, "these models are decoder-only whatever it says; only generate() reads it"),
    _F("id2label", NO_EFFECT, "labels of a classification head; a causal LM has none"),
    _F("label2id", NO_EFFECT, "labels of a classification head; a causal LM has none"),
    _F("problem_type", NO_EFFECT, "the loss of a classification head; a causal LM has none"),
    # LlamaConfig (and the same fields of the MoE classes)
    _F("vocab_size", CARRIED, "--vocab-size (Megatron pads it; the padding rows are zero)"),
    _F("hidden_size", CARRIED, "--hidden-size"),
    _F("intermediate_size", CARRIED, "--ffn-hidden-size (Mixtral: the experts' --moe-ffn-hidden-size)"),
    _F("num_hidden_layers", CARRIED, "--num-layers"),
    _F("num_attention_heads", CARRIED, "--num-attention-heads"),
    _F("num_key_value_heads", CARRIED, "--num-query-groups with --group-query-attention"),
    _F("head_dim", CARRIED, "--kv-channels (may differ from hidden_size / num_attention_heads)",
       model_types=(LLAMA, MIXLN, MIXLN_MOE, MIXTRAL)),
    _F("hidden_act", CARRIED, "--swiglu", refused="any activation but silu", check=_hidden_act),
    _F("max_position_embeddings", CARRIED, "--max-position-embeddings and --seq-length"),
    _F("initializer_range", NO_EFFECT, "initialisation only"),
    _F("rms_norm_eps", CARRIED, "--norm-epsilon"),
    _F("use_cache", NO_EFFECT, "the key/value cache of generate(): the same logits"),
    _F("pad_token_id", NO_EFFECT, "a token id of generation; as nn.Embedding's padding_idx it only zeroes that "
                                  "row's gradient"),
    _F("bos_token_id", NO_EFFECT, "a token id of generation"),
    _F("eos_token_id", NO_EFFECT, "a token id of generation"),
    _F("pretraining_tp", NO_EFFECT, "transformers 5's Llama ignores it; 4.x split the same matmuls into slices "
                                    "(the same function)", model_types=DENSE_AND_MIXLN),
    _F("tie_word_embeddings", CARRIED, "--untie-embeddings-and-output-weights when false"),
    _F("rope_parameters", CARRIED, "rope_theta: --rotary-base; linear: --rotary-seq-len-interpolation-factor; "
                                   "llama3: --use-rope-scaling --rope-scaling-factor",
       refused="other rope types (yarn, dynamic, longrope, ...) and llama3 with other than Megatron's fixed "
               "low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192 "
               "(convert.shape.hf_config_shape)"),
    # (Mixtral / Qwen2-MoE have no such fields; a config.json that holds them is read as Llama's)
    _F("attention_bias", CARRIED, "--add-bias-linear and --add-qkv-bias, with mlp_bias equal",
       refused="a value other than mlp_bias's (MoE models: true)", check=_biases),
    _F("mlp_bias", CARRIED, "--add-bias-linear, with attention_bias equal",
       refused="a value other than attention_bias's (MoE models: true)"),
    _F("attention_dropout", NO_EFFECT, _TRAIN + "; from-hf writes --attention-dropout 0.0, set it when fine-tuning"),
    # keys older transformers (4.x) wrote, or other Llama-like classes add
    _F("rope_theta", CARRIED, "--rotary-base (transformers 4 spelling of rope_parameters)", legacy=True),
    _F("rope_scaling", CARRIED, "as rope_parameters (transformers 4 spelling)", legacy=True,
       refused="as rope_parameters"),
    _F("torch_dtype", NO_EFFECT, "transformers 4 spelling of dtype", legacy=True),
    _F("quantization_config", REFUSED, "quantized weights", legacy=True, refused="any", check=_quantized),
    _F("sliding_window", REFUSED, "sliding-window attention", model_types=(LLAMA, MIXLN, MIXLN_MOE, MIXTRAL),
       legacy=True, refused="any window (null is Megatron's full attention)", check=_sliding("sliding_window")),
    # the Mix-LN classes (hf/configuration_mixln_llama.py, configuration_mixln_moe.py)
    _F("post_ln_layers", CARRIED, "--mixln-post-ln-layers", model_types=MIXLN_TYPES),
    _F("mixln_scheme", CARRIED, "--mixln-scheme", model_types=MIXLN_TYPES),
    _F("mixln_alpha", NO_EFFECT, "informational: the alpha that gave post_ln_layers", model_types=MIXLN_TYPES),
    _F("layer_kinds", CARRIED, "--mixln-layout", model_types=MIXLN_TYPES),
    _F("deepnorm_alpha", CARRIED, "--mixln-deepnorm-alpha", model_types=MIXLN_TYPES),
    _F("deepnorm_beta", NO_EFFECT, "initialisation only (recorded as --mixln-deepnorm-beta)", model_types=MIXLN_TYPES),
    _F("attention_scale", CARRIED, "--use-mup with the flags that give this softmax scale", model_types=MIXLN_TYPES),
    _F("embedding_multiplier", CARRIED, "--use-mup --mup-embedding-mult", model_types=MIXLN_TYPES),
    _F("logits_multiplier", CARRIED, "--use-mup --mup-output-mult", model_types=MIXLN_TYPES),
    _F("glu_linear_offset", CARRIED, "--glu-linear-offset", model_types=MIXLN_TYPES,
       refused="non-zero in mixln_moe (its experts have none)"),
    _F("megatron_mup", CARRIED, "the --use-mup / --mup-* flags as trained (checked against the scalars)",
       model_types=MIXLN_TYPES),
    # mixture of experts
    _F("num_experts", CARRIED, "--num-experts", model_types=(MIXLN_MOE, QWEN2_MOE)),
    _F("num_local_experts", CARRIED, "--num-experts", model_types=(MIXTRAL,)),
    _F("num_experts_per_tok", CARRIED, "--moe-router-topk", model_types=(MIXLN_MOE, MIXTRAL, QWEN2_MOE),
       refused="1 with renormalised weights (megatron builds no such router)"),
    _F("moe_intermediate_size", CARRIED, "--moe-ffn-hidden-size", model_types=(MIXLN_MOE, QWEN2_MOE)),
    _F("norm_topk_prob", CARRIED, "--moe-router-pre-softmax when false", model_types=(MIXLN_MOE, QWEN2_MOE)),
    _F("shared_expert_intermediate_size", CARRIED, "--moe-shared-expert-intermediate-size",
       model_types=(MIXLN_MOE, QWEN2_MOE)),
    _F("shared_expert_gate", CARRIED, "--moe-shared-expert-gate (Qwen2-MoE: always)", model_types=(MIXLN_MOE,)),
    _F("mlp_only_layers", CARRIED, "--moe-layer-freq", model_types=(MIXLN_MOE, QWEN2_MOE)),
    _F("decoder_sparse_step", CARRIED, "--moe-layer-freq", model_types=(QWEN2_MOE,)),
    _F("qkv_bias", CARRIED, "--add-qkv-bias", model_types=(MIXLN_MOE, QWEN2_MOE)),
    _F("router_dtype", CARRIED, "--moe-router-dtype fp32 for float32", model_types=(MIXLN_MOE,)),
    _F("output_router_logits", NO_EFFECT, _OUTPUT, model_types=(MIXTRAL, QWEN2_MOE)),
    _F("router_aux_loss_coef", NO_EFFECT, _TRAIN, model_types=(MIXTRAL, QWEN2_MOE)),
    _F("router_jitter_noise", NO_EFFECT, _TRAIN, model_types=(MIXTRAL,)),
    _F("use_sliding_window", REFUSED, "sliding-window attention", model_types=(QWEN2_MOE,), refused="true",
       check=_sliding("use_sliding_window")),
    _F("sliding_window", NO_EFFECT, "the window size, used only with use_sliding_window (refused)",
       model_types=(QWEN2_MOE,)),
    _F("max_window_layers", NO_EFFECT, "which layers slide, used only with use_sliding_window (refused)",
       model_types=(QWEN2_MOE,)),
    _F("layer_types", CARRIED, "every layer full attention (Megatron's)", model_types=(QWEN2_MOE,),
       refused="any 'sliding_attention' layer", check=_layer_types),
)


def rows(model_type: str) -> dict:
    """{field name: HFField} of one model type."""
    return {row.name: row for row in TABLE if model_type in row.model_types}


def problems(config: dict, model_type: str) -> list:
    """What Megatron cannot express in `config` (types already checked by convert.shape), one text per
    refused field value."""
    found = []
    for row in rows(model_type).values():
        if row.check is not None:
            problem = row.check(config)
            if problem:
                found.append(problem)
    return found


__all__ = ["ALL", "CARRIED", "NO_EFFECT", "REFUSED", "TABLE", "HFField", "problems", "rows"]
