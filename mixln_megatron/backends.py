"""Which classes fill a Mix-LN layer's submodules: TransformerEngine or megatron's local modules.

`te`:    megatron's TE layer submodules. Pre-LN layers keep TE's fused norm+linear
         (TELayerNormColumnParallelLinear for linear_qkv and linear_fc1); Post-LN layers get
         plain TE linears (layer.py derives them) and TE norms after the residual adds.
`local`: megatron's local linears and attention, with the project's MixLNNorm, which supports
         sequence parallelism (megatron's local WrappedTorchNorm refuses it). For CPU and tests.
"""

from __future__ import annotations

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_submodules,
    get_gpt_layer_with_transformer_engine_submodules,
)
import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from .norms import MixLNNorm

BACKENDS = ("te", "local")


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
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def layer_submodules(backend: str, normalization: str = "RMSNorm", qk_layernorm: bool = False) -> TransformerLayerSubmodules:
    """The Pre-LN submodules for `backend` (Post-LN layers derive theirs from these)."""
    check_backend(backend)
    if normalization not in ("RMSNorm", "LayerNorm"):
        raise ValueError(f"Mix-LN supports normalization RMSNorm or LayerNorm, got {normalization!r}")
    if backend == "te":
        require_te("The Mix-LN TE spec")
        # TE's norms read config.normalization themselves (RMSNorm or LayerNorm).
        return get_gpt_layer_with_transformer_engine_submodules(qk_layernorm=qk_layernorm)
    subs = get_gpt_layer_local_submodules(normalization=normalization, qk_layernorm=qk_layernorm)
    subs.input_layernorm = MixLNNorm
    subs.pre_mlp_layernorm = MixLNNorm
    return subs


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
        (layer.input_layernorm, layer.self_attention.linear_qkv),
        (layer.pre_mlp_layernorm, layer.mlp.linear_fc1),
    ]
    for norm, linear in pairs:
        if isinstance(norm, MixLNNorm):
            norm.output_scale = scale
        elif isinstance(norm, IdentityOp) and hasattr(linear, "layer_norm_weight"):
            scale_linear_output(linear, scale)
        else:
            raise NotImplementedError(
                f"LayerNorm Scaling does not know how to scale {type(norm).__name__} followed by "
                f"{type(linear).__name__}; use the te or local backend of mixln_megatron"
            )
