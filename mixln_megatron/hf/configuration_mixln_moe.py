"""Configuration of a Mix-LN / LayerNorm-Scaling mixture-of-experts LLaMA for Hugging Face transformers.

This file is copied next to config.json in exported checkpoints (remote code), together with
configuration_mixln_llama.py, which it imports relatively; it imports nothing else but `transformers`.
Every Mix-LN field and layer kind is `MixLNLlamaConfig`'s (the norms sit around an MoE block exactly as
around a dense MLP); the MoE fields are listed in MixLNMoeConfig's docstring. Experts and shared expert are
SwiGLU (`hidden_act`) without biases; `mlp_bias` applies to the dense layers only.

Written for transformers >= 5 (its fused Qwen2-MoE experts); tested with 5.25.
"""

from .configuration_mixln_llama import MixLNConfigValueError, MixLNLlamaConfig

MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "shared_expert_intermediate_size", "shared_expert_gate", "mlp_only_layers")
ROUTER_DTYPES = ("float32",)  # besides None (the model's dtype)
# Written to config.json only when set, so that folders without them keep their config.json.
OPTIONAL_FIELDS = {"qkv_bias": False, "router_dtype": None}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(name, value, what):
    if not _is_int(value) or value < 1:
        raise MixLNConfigValueError(f"{name} must be an integer >= 1 ({what}), got {value!r:.60}")
    return value


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise MixLNConfigValueError(f"{name} must be true or false, got {value!r:.60}")
    return value


def _check_mlp_only_layers(mlp_only_layers, num_hidden_layers):
    """The dense layers' indices as a sorted list (validated)."""
    if mlp_only_layers is None:
        return []
    if isinstance(mlp_only_layers, (str, bytes)) or not isinstance(mlp_only_layers, (list, tuple)):
        raise MixLNConfigValueError(
            f"mlp_only_layers must be a list of 0-based layer indices (the dense layers), got {mlp_only_layers!r:.80}"
        )
    bad = [i for i in mlp_only_layers if not _is_int(i) or i < 0
           or (num_hidden_layers is not None and i >= num_hidden_layers)]
    if bad:
        last = "" if num_hidden_layers is None else num_hidden_layers - 1
        raise MixLNConfigValueError(f"mlp_only_layers has {bad[0]!r:.40}, not a layer index in 0..{last}")
    if len(set(mlp_only_layers)) != len(mlp_only_layers):
        raise MixLNConfigValueError(f"mlp_only_layers lists a layer twice: {list(mlp_only_layers)!r:.80}")
    return sorted(mlp_only_layers)


def check_moe_fields(num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob=True,
                     shared_expert_intermediate_size=None, shared_expert_gate=False, mlp_only_layers=None,
                     num_hidden_layers=None, qkv_bias=False, router_dtype=None) -> list:
    """Raise MixLNConfigValueError (one line) on an invalid MoE field; return mlp_only_layers as a sorted list."""
    _check_bool("qkv_bias", qkv_bias)
    if router_dtype is not None and (not isinstance(router_dtype, str) or router_dtype not in ROUTER_DTYPES):
        raise MixLNConfigValueError(f"router_dtype must be null (the model's dtype) or one of "
                                    f"{', '.join(ROUTER_DTYPES)}, got {router_dtype!r:.60}")
    _positive_int("num_experts", num_experts, "the routed experts per MoE layer")
    _positive_int("num_experts_per_tok", num_experts_per_tok, "the experts each token is routed to")
    if num_experts_per_tok > num_experts:
        raise MixLNConfigValueError(
            f"num_experts_per_tok = {num_experts_per_tok} exceeds num_experts = {num_experts}"
        )
    _positive_int("moe_intermediate_size", moe_intermediate_size, "the FFN size of one expert")
    _check_bool("norm_topk_prob", norm_topk_prob)
    if shared_expert_intermediate_size is not None:
        _positive_int("shared_expert_intermediate_size", shared_expert_intermediate_size,
                      "the FFN size of the shared expert; None for no shared expert")
    _check_bool("shared_expert_gate", shared_expert_gate)
    if shared_expert_gate and shared_expert_intermediate_size is None:
        raise MixLNConfigValueError("shared_expert_gate is true but there is no shared expert "
                                    "(shared_expert_intermediate_size is None)")
    return _check_mlp_only_layers(mlp_only_layers, num_hidden_layers)


class MixLNMoeConfig(MixLNLlamaConfig):
    r"""Mix-LN LLaMA configuration whose MLPs are mixtures of experts (except the layers in `mlp_only_layers`).

    Args:
        num_experts (`int`, defaults to 8): routed experts per MoE layer.
        num_experts_per_tok (`int`, defaults to 2): experts per token (top-k).
        moe_intermediate_size (`int`, defaults to 1408): FFN size of one routed expert.
        norm_topk_prob (`bool`, defaults to True): softmax over all experts, then the top-k probabilities
            renormalised to sum to 1 (Megatron's default routing); False: as they are (--moe-router-pre-softmax).
        shared_expert_intermediate_size (`int`, *optional*): FFN size of the shared expert; None for none.
        shared_expert_gate (`bool`, defaults to False): sigmoid gate on the shared expert's output.
        mlp_only_layers (`list[int]`, defaults to []): 0-based indices of the dense layers (LLaMA's MLP of size
            `intermediate_size`); every other layer is an MoE layer.
        qkv_bias (`bool`, defaults to False): a bias on q, k, v only (--add-qkv-bias; LLaMA's `attention_bias`
            puts one on o_proj too).
        router_dtype (`str`, *optional*): "float32" for the router's logits (fp32 weight and input), softmax and
            top-k in fp32 whatever the model's dtype (--moe-router-dtype fp32; a bf16 router picks other
            experts on near ties); None: the model's dtype.
        kwargs: every `MixLNLlamaConfig` argument (post_ln_layers, mixln_scheme, layer_kinds, ... and LLaMA's).

    A model whose layers are all "pre" with scheme "mixln" is exported as a stock Mixtral or Qwen2-MoE where one
    of them is the same network; it has model_type "mixln_moe" (every layer "pre") only where none is: a shared
    expert without gate, or dense layers without a gated shared expert.
    """

    model_type = "mixln_moe"

    def __init__(self, num_experts: int = 8, num_experts_per_tok: int = 2, moe_intermediate_size: int = 1408,
                 norm_topk_prob: bool = True, shared_expert_intermediate_size=None, shared_expert_gate: bool = False,
                 mlp_only_layers=None, qkv_bias: bool = False, router_dtype=None, **kwargs):
        # Set before the parent init, like the Mix-LN fields, and checked in full (with the layer count) after it.
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.shared_expert_gate = shared_expert_gate
        self.mlp_only_layers = mlp_only_layers  # a sorted list once validated
        self.qkv_bias = qkv_bias
        self.router_dtype = router_dtype
        super().__init__(**kwargs)

    def validate_mixln(self) -> None:
        """The Mix-LN fields (MixLNLlamaConfig's rules) and the MoE fields; MixLNConfigValueError if invalid."""
        super().validate_mixln()
        if getattr(self, "glu_linear_offset", 0.0) != 0.0:  # the fused experts compute silu(gate) * up
            raise MixLNConfigValueError(f"glu_linear_offset = {self.glu_linear_offset!r} is not supported by the "
                                        "MoE model (its experts have no GLU offset)")
        self.mlp_only_layers = check_moe_fields(
            self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size, self.norm_topk_prob,
            self.shared_expert_intermediate_size, self.shared_expert_gate, self.mlp_only_layers,
            getattr(self, "num_hidden_layers", None), getattr(self, "qkv_bias", False),
            getattr(self, "router_dtype", None))

    def to_dict(self):
        out = super().to_dict()
        for key, unset in OPTIONAL_FIELDS.items():
            if out.get(key, unset) == unset:
                out.pop(key, None)
        return out

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether the layer with 0-based index `layer_idx` has an MoE block (else LLaMA's dense MLP)."""
        self.layer_kind(layer_idx)  # IndexError outside the model
        return layer_idx not in self.mlp_only_layers


__all__ = ["MOE_FIELDS", "MixLNMoeConfig", "check_moe_fields"]
