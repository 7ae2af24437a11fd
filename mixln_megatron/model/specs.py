"""The Mix-LN spec factories for megatron-core users: plain data, they install nothing.

  MixLNTransformerLayerSpec(backend="te", alpha=0.25)           -> ModuleSpec (one layer)
  get_mixln_decoder_block_spec(config, backend="te", alpha=...)  -> TransformerBlockSubmodules

Then `mixln_megatron.install_training_hooks(config, settings)` installs what the settings ask for
(spike scaler, telemetry). The stock `--spec` objects, which read flags and MIXLN_* and install
hooks, are the edge above this module (mixln_megatron.spec, which re-exports these factories).
"""

from __future__ import annotations

from typing import Optional

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from . import backends
from .layer import MixLNTransformerLayer
from .placement import resolve_placement
from .settings import MixLNSettings, layered
from .support import check_supported


def _with_arguments(settings: Optional[MixLNSettings], alpha, post_ln_layers, scheme) -> MixLNSettings:
    """The factory's keyword arguments over `settings` (arguments win, as everywhere)."""
    given = MixLNSettings(alpha=alpha, post_ln_layers=post_ln_layers, scheme=scheme)
    return given if settings is None else layered(given, settings)


def MixLNTransformerLayerSpec(
    backend: str = "te",
    alpha=None,
    post_ln_layers: Optional[int] = None,
    scheme: Optional[str] = None,
    normalization: str = "RMSNorm",
    qk_layernorm: bool = False,
    settings: Optional[MixLNSettings] = None,
    config=None,
) -> ModuleSpec:
    """A layer ModuleSpec; each layer picks Post-LN or Pre-LN from its global layer_number.

    alpha / post_ln_layers / scheme override `settings`; left unset, the default applies (alpha
    0.25, only for models of at most 24 layers).
    """
    settings = _with_arguments(settings, alpha, post_ln_layers, scheme)
    return ModuleSpec(
        module=MixLNTransformerLayer,
        submodules=backends.layer_submodules(backend, normalization, qk_layernorm, config=config),
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
    settings: Optional[MixLNSettings] = None,
) -> TransformerBlockSubmodules:
    """Submodules of the whole decoder on this pipeline stage, final norm included. Plain data:
    nothing is installed on `config` (see install_training_hooks)."""
    config = getattr(config, "transformer", config)  # Megatron-LM's GPTModelConfig wraps it
    layer = checked_layer_spec(config, backend, _with_arguments(settings, alpha, post_ln_layers, scheme))
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * num_layers, layer_norm=backends.norm_class(backend)
    )


def checked_layer_spec(config, backend: str, settings: MixLNSettings) -> ModuleSpec:
    """The layer spec for `config`, after the support table and the placement rule accept it."""
    check_supported(config, backend=backend)  # mixln_megatron.model.support.TABLE
    resolve_placement(config.num_layers, settings)  # a bad setting fails here, not inside a layer
    return MixLNTransformerLayerSpec(
        backend=backend, settings=settings,
        normalization=config.normalization, qk_layernorm=getattr(config, "qk_layernorm", False),
        config=config,  # every flag megatron's builder takes, from the config (backends.BUILDER_FLAGS)
    )
