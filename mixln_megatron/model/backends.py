"""Which classes fill a Mix-LN layer's submodules: TransformerEngine (`te`: Pre-LN layers keep TE's
fused norm+linear, Post-LN layers get plain TE linears and TE norms after the residual adds) or
megatron's local modules (`local`, for CPU and tests) with MixLNNorm: megatron's local
WrappedTorchNorm refuses sequence parallelism and zero-centred gamma, MixLNNorm supports both
(each TP rank normalises its sequence shard; the weight is marked `sequence_parallel` so that
finalize_model_grads all-reduces its gradient over TP, as TE's norms do).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_submodules,
    get_gpt_layer_with_transformer_engine_submodules,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules
from torch import nn

BACKENDS = ("te", "local")


class MixLNNorm(nn.Module):
    """RMSNorm / LayerNorm built like megatron norms: `MixLNNorm(config=, hidden_size=, eps=)`.

    `config.normalization` picks the kind; `config.layernorm_zero_centered_gamma` stores
    gamma - 1 (so weight decay pulls gamma towards 1). Computation runs in fp32.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused_kwargs):
        super().__init__()
        normalization = getattr(config, "normalization", "RMSNorm")
        if normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(
                f"mixln_megatron supports normalization RMSNorm or LayerNorm, got {normalization!r}"
            )
        if getattr(config, "persist_layer_norm", False):
            raise ValueError(
                "persist_layer_norm needs apex's fused kernel, which the local backend does not use; "
                "pass --no-persist-layer-norm (or use the TE spec)"
            )
        self.rms = normalization == "RMSNorm"
        self.eps = eps
        self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        dtype = getattr(config, "params_dtype", torch.float32)
        self.weight = nn.Parameter(init(hidden_size, dtype=dtype))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        # LayerNorm Scaling multiplies the output (never the stored weight) by 1/sqrt(l).
        self.output_scale = 1.0
        sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        for p in self.parameters():
            # finalize_model_grads all-reduces grads of params marked this way over TP.
            setattr(p, "sequence_parallel", sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        if self.rms:
            normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            mean = x32.mean(-1, keepdim=True)
            var = (x32 - mean).pow(2).mean(-1, keepdim=True)
            normed = (x32 - mean) * torch.rsqrt(var + self.eps)
        gamma = self.weight.float() + 1 if self.zero_centered_gamma else self.weight.float()
        out = normed * gamma
        if self.bias is not None:
            out = out + self.bias.float()
        if self.output_scale != 1.0:
            out = out * self.output_scale
        return out.to(x.dtype)


class TransformerEngineMissingError(ImportError):
    """The TE spec was asked for on a machine without TransformerEngine."""


def have_te() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def require_te(what: str) -> None:
    if not have_te():
        raise TransformerEngineMissingError(
            f"{what} uses TransformerEngine, which is not installed here. On a machine without TE "
            "use the local backend: `--spec mixln_megatron.spec mixln_local_layer_spec` with "
            "`--transformer-impl local` (or MixLNTransformerLayerSpec(backend='local')). The TE "
            "spec never falls back silently, so that a GPU cluster does not train on slow modules."
        )


def check_backend(backend: str) -> str:
    """`backend` if it is one of BACKENDS."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


@dataclass(frozen=True)
class BuilderFlag:
    """How one argument of megatron's layer-submodule builder is filled: `field`, the
    TransformerConfig field its value comes from (None: never passed), and `note`, why."""

    field: Optional[str]
    note: str = ""


# Every argument of megatron 0.19's get_gpt_layer_with_transformer_engine_submodules ("te") and
# get_gpt_layer_local_submodules ("local"). tests/test_spec_drift.py compares these keys with the
# builders' signatures, so a release with a new flag fails until it is handled here; a
# release-compatibility module extends this table for other releases.
_COMMON_FLAGS = {
    "num_experts": BuilderFlag("num_moe_experts", "MoE layers (dense ones of a mixed stack: None)"),
    "moe_grouped_gemm": BuilderFlag("moe_grouped_gemm", "only read with experts"),
    "qk_layernorm": BuilderFlag("qk_layernorm", "passed through"),
    "multi_latent_attention": BuilderFlag("multi_latent_attention", "MLA: rejected by support.TABLE"),
    "fp8": BuilderFlag(None, "deprecated by megatron, unused"),
    "qk_l2_norm": BuilderFlag("qk_l2_norm", "passed through (q/k L2Norm)"),
    "use_kitchen": BuilderFlag("use_kitchen", "passed through; Post-LN rejected by support.TABLE"),
    "use_kitchen_attention": BuilderFlag("use_kitchen_attention", "passed through (with use_kitchen)"),
    "kitchen_attention_backend": BuilderFlag("kitchen_attention_backend", "passed through (with use_kitchen)"),
}
BUILDER_FLAGS = {
    "te": {
        **_COMMON_FLAGS,
        "use_te_op_fuser": BuilderFlag("use_transformer_engine_op_fuser", "rejected by support.TABLE"),
        "use_te_activation_func": BuilderFlag("use_te_activation_func", "passed through (TE activation)"),
        "mla_down_proj_fusion": BuilderFlag("mla_down_proj_fusion", "only read with MLA (MLATransformerConfig)"),
        "use_grouped_gemm_for_dense_mlp": BuilderFlag(
            "use_grouped_gemm_for_dense_mlp", "only read with use_te_op_fuser"),
    },
    "local": {
        **_COMMON_FLAGS,
        "normalization": BuilderFlag("normalization", "passed through (norms replaced by MixLNNorm)"),
    },
}


def builder(backend: str):
    """megatron's layer-submodule builder for `backend`."""
    check_backend(backend)
    return get_gpt_layer_with_transformer_engine_submodules if backend == "te" else get_gpt_layer_local_submodules


def builder_kwargs(backend: str, config, moe: Optional[bool] = None) -> dict:
    """The builder's arguments, each from its TransformerConfig field (absent fields: the default).
    moe=False: a dense layer of an MoE config (megatron's --moe-layer-freq stacks do the same)."""
    kwargs = {flag: getattr(config, h.field) for flag, h in BUILDER_FLAGS[check_backend(backend)].items()
              if h.field is not None and hasattr(config, h.field)}
    if moe is False:
        kwargs.update(num_experts=None, moe_grouped_gemm=False)
    return kwargs


def layer_submodules(backend: str, normalization: str = "RMSNorm", qk_layernorm: bool = False,
                     config=None, moe: Optional[bool] = None) -> TransformerLayerSubmodules:
    """The Pre-LN submodules for `backend`: megatron's stock builder called with the config's flags
    (Post-LN layers derive theirs from these). Without a config only normalization and
    qk_layernorm are set, the rest keep megatron's defaults. moe=False: a dense layer even when
    the config has experts."""
    check_backend(backend)
    if config is not None:
        config = getattr(config, "transformer", config)
        normalization = getattr(config, "normalization", normalization)
        kwargs = builder_kwargs(backend, config, moe)
    else:
        kwargs = {"qk_layernorm": qk_layernorm}
    if normalization not in ("RMSNorm", "LayerNorm"):
        raise ValueError(f"Mix-LN supports normalization RMSNorm or LayerNorm, got {normalization!r}")
    if backend == "te":
        require_te("The Mix-LN TE spec")
        # TE's norms read config.normalization themselves (RMSNorm or LayerNorm).
        return builder("te")(**kwargs)
    kwargs["normalization"] = normalization
    subs = builder("local")(**kwargs)
    # megatron's local norm refuses sequence parallelism; MixLNNorm supports it (same keys).
    subs.input_layernorm = MixLNNorm
    subs.pre_mlp_layernorm = MixLNNorm
    return subs


def _is_te_norm(module) -> bool:
    from megatron.core.extensions.transformer_engine import TENorm

    # TENorm builds TE's RMSNorm / LayerNorm (its __new__ returns those classes' instances)
    return isinstance(module, TENorm) or type(module).__module__.startswith("transformer_engine")


def backend_of_norm(norm_cls) -> Optional[str]:
    """"local" or "te" for the norm class a Mix-LN spec uses for N1/N2 (None: neither)."""
    if isinstance(norm_cls, type) and issubclass(norm_cls, MixLNNorm):
        return "local"
    if have_te():
        from megatron.core.extensions.transformer_engine import TENorm

        if norm_cls is TENorm:
            return "te"
    return None


# ---------------------------------------------------------------- Post-LN linears (TE)
def post_ln_linear(linear_cls):
    """The Post-LN counterpart of a fused norm+linear class: the norm moves after the residual
    add, so TE's LayerNorm+Linear becomes its plain column-parallel linear (which honours the
    tp_comm_overlap_disable_* switches, see overlap_config). Other classes stay as they are."""
    try:
        from megatron.core.extensions import transformer_engine as te_ext
    except ImportError:  # pragma: no cover - megatron without the TE extension module
        return linear_cls
    if te_ext.HAVE_TE and isinstance(linear_cls, type) and issubclass(
        linear_cls, te_ext.TELayerNormColumnParallelLinear
    ):
        return _honouring_overlap_switches(te_ext.TEColumnParallelLinear)
    return linear_cls


def overlap_config(config, tp_comm_buffer_name: Optional[str]):
    """The config a Post-LN qkv / fc1 linear is built with: the plain TE linear ignores
    tp_comm_overlap_disable_qkv / _fc1, which the fused one honours, so a shallow copy with
    tp_comm_overlap off gives it the same answer without touching the shared config."""
    if (
        getattr(config, "tp_comm_overlap", False)
        and tp_comm_buffer_name in ("qkv", "fc1")
        and getattr(config, f"tp_comm_overlap_disable_{tp_comm_buffer_name}", False)
    ):
        config = copy.copy(config)
        config.tp_comm_overlap = False
    return config


@functools.lru_cache(maxsize=None)
def _honouring_overlap_switches(base: type) -> type:
    class MixLNPostLNColumnParallelLinear(base):
        """Post-LN qkv / fc1: the plain TE column-parallel linear, overlap switches honoured."""

        def __init__(self, *args, config, tp_comm_buffer_name=None, **kwargs):
            super().__init__(*args, config=overlap_config(config, tp_comm_buffer_name),
                             tp_comm_buffer_name=tp_comm_buffer_name, **kwargs)

    return MixLNPostLNColumnParallelLinear


def norm_class(backend: str):
    """The norm for Post-LN N1/N2 and the decoder's final norm."""
    check_backend(backend)
    if backend == "te":
        require_te("The Mix-LN TE spec")
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm  # has_residual stays False: never the fused-residual RMSNorm
    return MixLNNorm


def scale_linear_output(linear, scale: float):
    """Make a fused norm+linear behave as linear(scale * norm(x)), exactly.

    The linear map commutes with the scalar: W (s n) = s (W n). A bias that the module adds
    itself is unscaled, so it is restored: s (W n + b) + (1 - s) b = W (s n) + b. A bias that
    megatron receives separately (skip_bias_add) is left alone. The fused TE kernel, and the
    stored norm weight, stay untouched. Returns the hook handle.
    """

    def hook(module, inputs, output):
        out, extra = output if isinstance(output, tuple) else (output, None)
        scaled = out * scale
        bias = getattr(module, "bias", None)
        returns_bias_separately = bool(getattr(module, "te_return_bias", False) or getattr(module, "skip_bias_add", False))
        if torch.is_tensor(bias) and bias.numel() and not returns_bias_separately:
            scaled = scaled + (1.0 - scale) * bias
        return (scaled, extra) if isinstance(output, tuple) else scaled

    return linear.register_forward_hook(hook)


def set_norm_output_scale(layer, scale: float) -> None:
    """LayerNorm Scaling on a Pre-LN layer: scale both pre-norm outputs by `scale`.

    Local norms scale their own output. TE's fused norm+linear (LayerNormColumnParallelLinear)
    gets its GEMM output scaled instead, which is the same map and keeps the fused kernel.
    """
    pairs = [
        (layer.input_layernorm, getattr(layer.self_attention, "linear_qkv", None)),
        (layer.pre_mlp_layernorm, getattr(layer.mlp, "linear_fc1", None)),
    ]
    for norm, linear in pairs:
        if linear is None and isinstance(norm, IdentityOp):
            continue  # a HybridModel layer has attention or an MLP, not both
        if isinstance(norm, MixLNNorm):
            norm.output_scale = scale
        elif isinstance(norm, IdentityOp) and hasattr(linear, "layer_norm_weight"):
            scale_linear_output(linear, scale)
        elif linear is None and have_te() and _is_te_norm(norm):
            # an MoE layer with TE: a standalone norm before the router (nothing fused to scale)
            norm.register_forward_hook(lambda _module, _inputs, out: out * scale)
        else:
            raise NotImplementedError(
                f"LayerNorm Scaling does not know how to scale {type(norm).__name__} followed by "
                f"{type(linear).__name__}; use the te or local backend of mixln_megatron"
            )
