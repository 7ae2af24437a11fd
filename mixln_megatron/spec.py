"""Mix-LN specs, for Megatron-LM's `--spec` and for megatron-core users.

Megatron-LM (core 0.17-0.19): --spec mixln_megatron.spec mixln_layer_spec        (TransformerEngine)
                              --spec mixln_megatron.spec mixln_local_layer_spec  (local modules)
  These objects are an edge: they build the settings (a patched checkout's --mixln-* flags from
  Megatron-LM's global args, then MIXLN_*, then defaults) and install the training hooks the
  settings ask for (the only place stock Megatron-LM gives a plugin). On 0.19 the builder calls
  them as `spec(model_config, vp_stage=...)` and they return the whole decoder's submodules, so
  the final norm is the backend's norm too. On 0.17/0.18 the builder passes the object uncalled
  to GPTModel, so they are layer ModuleSpecs that do the same when each layer is built, and the
  final norm is Megatron's default (LayerNormImpl; mixln_megatron.compat, README). A bad
  setting is printed as one `[mixln_megatron] ERROR:` line on rank 0 before the traceback.

megatron-core (plain data, installs nothing; then call mixln_megatron.install_training_hooks):
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

from .model import backends, env_settings
from . import compat, megatron_args
from .errors import MixLNError, report_once
from .training.spike import SpikeScalerLayer
from .model.layer import MixLNTransformerLayer, MixLNUnsupportedError, check_supported
from .model.placement import resolve_placement
from .model.settings import MixLNSettings, layered
from .training.hooks import install_training_hooks

__all__ = [
    "MixLNTransformerLayerSpec",
    "get_mixln_decoder_block_spec",
    "mixln_layer_spec",
    "mixln_local_layer_spec",
]


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
    0.25, only for models of at most 24 layers). With the spike scaler enabled in the settings
    the layer class also carries the scaler's checkpoint holder (it joins a scaler installed on
    its config by install_training_hooks, and does nothing without one).
    """
    settings = _with_arguments(settings, alpha, post_ln_layers, scheme)
    return ModuleSpec(
        module=SpikeScalerLayer if settings.spike.enabled else MixLNTransformerLayer,
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
    layer = _checked_layer_spec(config, backend, _with_arguments(settings, alpha, post_ln_layers, scheme))
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * num_layers, layer_norm=backends.norm_class(backend)
    )


def _checked_layer_spec(config, backend: str, settings: MixLNSettings) -> ModuleSpec:
    """The layer spec for `config`, after the support table and the placement rule accept it."""
    check_supported(config, backend=backend)  # mixln_megatron.model.support.TABLE
    resolve_placement(config.num_layers, settings)  # a bad setting fails here, not inside a layer
    return MixLNTransformerLayerSpec(
        backend=backend, settings=settings,
        normalization=config.normalization, qk_layernorm=getattr(config, "qk_layernorm", False),
        config=config,  # every flag megatron's builder takes, from the config (backends.BUILDER_FLAGS)
    )


# ------------------------------------------------------------------ the stock Megatron-LM edge
def _megatron_global_args():
    """Megatron-LM's parsed args when a training run set them, else None (never imports training)."""
    from .training import runtime

    return runtime.megatron_args()


def settings_for_spec(environ=None, args=None) -> MixLNSettings:
    """The settings a `--spec` function uses: a patched checkout's --mixln-* flags (Megatron-LM's
    global args, or `args`), then the MIXLN_* environment (os.environ, or `environ`)."""
    args = _megatron_global_args() if args is None else args
    flags = megatron_args.settings_from_args(args) if megatron_args.has_mixln_args(args) else None
    return layered(flags, env_settings.settings_from_environ(environ))


def _at_the_edge(config, build, environ=None, args=None):
    """Settings from the edge, `build(settings)`, then the hooks; a MixLN error printed in one line."""
    try:
        settings = settings_for_spec(environ, args)
        spec = build(settings)
        install_training_hooks(config, settings)
    except (MixLNError, MixLNUnsupportedError) as error:
        report_once(error)  # one clear line before Megatron-LM's traceback
        raise
    return spec


def stock_decoder_spec(config, backend: str, vp_stage: Optional[int] = None, environ=None,
                       args=None) -> TransformerBlockSubmodules:
    """What the two --spec functions do: settings from the edge, spec, hooks; errors in one line."""
    return _at_the_edge(config, lambda settings: get_mixln_decoder_block_spec(
        config, backend=backend, vp_stage=vp_stage, settings=settings), environ, args)


def stock_layer_spec(config, backend: str, environ=None, args=None) -> ModuleSpec:
    """The same for one layer, on releases that never call the --spec object (0.17/0.18: see
    compat.stock_spec); runs as each layer is built."""
    return _at_the_edge(config, lambda settings: _checked_layer_spec(config, backend, settings), environ, args)


def mixln_layer_spec(config, vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """`--spec mixln_megatron.spec mixln_layer_spec`: Mix-LN with TransformerEngine."""
    return stock_decoder_spec(config, "te", vp_stage)


def mixln_local_layer_spec(config, vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """`--spec mixln_megatron.spec mixln_local_layer_spec`: Mix-LN with megatron's local modules."""
    return stock_decoder_spec(config, "local", vp_stage)


# What Megatron-LM's --spec gets on this release: the functions above (0.19) or layer ModuleSpecs.
mixln_layer_spec = compat.stock_spec(mixln_layer_spec, "te")
mixln_local_layer_spec = compat.stock_spec(mixln_local_layer_spec, "local")
