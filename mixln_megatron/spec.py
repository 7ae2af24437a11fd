"""Mix-LN specs, for Megatron-LM's `--spec` and for megatron-core users.

Megatron-LM (core 0.19):   --spec mixln_megatron.spec mixln_layer_spec         (TransformerEngine)
                           --spec mixln_megatron.spec mixln_local_layer_spec   (local modules)
  Settings come from MIXLN_ALPHA / MIXLN_POST_LN_LAYERS / MIXLN_SCHEME. The builder calls these
  objects as `spec(model_config, vp_stage=...)`; they return the whole decoder's submodules, so
  the final norm is the backend's norm too (megatron's default for a layer spec is LayerNormImpl,
  which on the local path refuses sequence parallelism).

megatron-core:
  MixLNTransformerLayerSpec(backend="te", alpha=0.25)           -> ModuleSpec (one layer)
  get_mixln_decoder_block_spec(config, backend="te", alpha=...)  -> TransformerBlockSubmodules

This module imports with megatron-core's base dependencies only (no TE, no transformers):
megatron's spec_utils.import_module swallows ImportError, after which Megatron-LM would silently
train the stock Pre-LN model.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from . import backends, grads_hook, telemetry
from .layer import MixLNTransformerLayer, MixLNUnsupportedError, check_supported
from .placement import MixLNSettings

__all__ = [
    "MixLNTransformerLayerSpec",
    "get_mixln_decoder_block_spec",
    "mixln_layer_spec",
    "mixln_local_layer_spec",
]


def MixLNTransformerLayerSpec(
    backend: str = "te",
    alpha=None,
    post_ln_layers: Optional[int] = None,
    scheme: Optional[str] = None,
    normalization: str = "RMSNorm",
    qk_layernorm: bool = False,
) -> ModuleSpec:
    """A layer ModuleSpec; each layer picks Post-LN or Pre-LN from its global layer_number.

    alpha / post_ln_layers / scheme left as None fall back to the MIXLN_* environment, then to the
    default (alpha 0.25, only for models of at most 24 layers).
    """
    settings = MixLNSettings(alpha=alpha, post_ln_layers=post_ln_layers, scheme=scheme)
    return ModuleSpec(
        module=MixLNTransformerLayer,
        submodules=backends.layer_submodules(backend, normalization, qk_layernorm),
        params={"mixln_settings": settings, "post_ln_norm": backends.norm_class(backend)},
    )


def get_mixln_decoder_block_spec(
    config,
    backend: str = "te",
    alpha=None,
    post_ln_layers: Optional[int] = None,
    scheme: Optional[str] = None,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> TransformerBlockSubmodules:
    """Submodules of the whole decoder on this pipeline stage, final norm included."""
    config = getattr(config, "transformer", config)  # Megatron-LM's GPTModelConfig wraps it
    check_supported(config)
    if backend == "local" and getattr(config, "context_parallel_size", 1) > 1:
        raise MixLNUnsupportedError(
            "context parallelism needs TransformerEngine's attention; use the TE spec (mixln_layer_spec)"
        )
    layer = MixLNTransformerLayerSpec(
        backend=backend, alpha=alpha, post_ln_layers=post_ln_layers, scheme=scheme,
        normalization=config.normalization, qk_layernorm=getattr(config, "qk_layernorm", False),
    )
    layer = grads_hook.install_from_spec(config, layer)  # spike scaler, only with MIXLN_SPIKE_SCALER=1
    # per-layer grad norms, only with MIXLN_TELEMETRY_INTERVAL=N; after the scaler, to see its output
    telemetry.install_from_env(config)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * num_layers, layer_norm=backends.norm_class(backend)
    )


def mixln_layer_spec(config, vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """`--spec mixln_megatron.spec mixln_layer_spec`: Mix-LN with TransformerEngine."""
    return get_mixln_decoder_block_spec(config, backend="te", vp_stage=vp_stage)


def mixln_local_layer_spec(config, vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """`--spec mixln_megatron.spec mixln_local_layer_spec`: Mix-LN with megatron's local modules."""
    return get_mixln_decoder_block_spec(config, backend="local", vp_stage=vp_stage)
