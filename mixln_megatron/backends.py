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


def set_norm_output_scale(layer, scale: float) -> None:
    """LayerNorm Scaling on a Pre-LN layer: scale both pre-norm outputs by `scale`."""
    targets = [layer.input_layernorm, layer.pre_mlp_layernorm]
    for module in targets:
        if isinstance(module, MixLNNorm):
            module.output_scale = scale
        else:
            raise NotImplementedError(
                f"LayerNorm Scaling is not available for norm module {type(module).__name__} yet; "
                "use the local backend"
            )
