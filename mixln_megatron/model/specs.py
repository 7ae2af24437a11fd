"""The Mix-LN spec factories for megatron-core users: plain data, they install nothing.

  MixLNTransformerLayerSpec(backend="te", alpha=0.25)           -> ModuleSpec (one layer)
  get_mixln_decoder_block_spec(config, backend="te", alpha=...)  -> TransformerBlockSubmodules
  get_mixln_hybrid_stack_spec(config, backend="te", alpha=...)   -> ModuleSpec (HybridModel stack)

Then `mixln_megatron.install_training_hooks(config, settings)` installs what the settings ask for
(spike scaler, telemetry). The stock `--spec` objects, which read flags and MIXLN_* and install
hooks, are the edge above this module (mixln_megatron.spec, which re-exports these factories).
"""

from __future__ import annotations

from typing import Optional

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from .. import compat
from . import backends, hybrid_pattern
from .layer import MixLNTransformerLayer
from .placement import resolve_placement
from .settings import MixLNSettings, layered
from .support import MixLNUnsupportedError, check_kind_supported, check_supported


def _with_arguments(settings: Optional[MixLNSettings], alpha, post_ln_layers, scheme, layout=None) -> MixLNSettings:
    """The factory's keyword arguments over `settings` (arguments win, as everywhere)."""
    given = MixLNSettings(alpha=alpha, post_ln_layers=post_ln_layers, scheme=scheme, layout=layout)
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
    layout: Optional[str] = None,
    moe: Optional[bool] = None,
) -> ModuleSpec:
    """A layer ModuleSpec; each layer picks its kind from its global layer_number.

    alpha / post_ln_layers / scheme / layout override `settings`. `moe`: with a config of
    num_moe_experts, False builds a dense layer of it (a --moe-layer-freq stack's dense layers);
    None follows the config.
    """
    settings = _with_arguments(settings, alpha, post_ln_layers, scheme, layout)
    return ModuleSpec(
        module=MixLNTransformerLayer,
        submodules=backends.layer_submodules(backend, normalization, qk_layernorm, config=config, moe=moe),
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
    layout: Optional[str] = None,
) -> TransformerBlockSubmodules:
    """Submodules of the whole decoder on this pipeline stage, final norm included. Plain data:
    nothing is installed on `config` (see install_training_hooks)."""
    config = getattr(config, "transformer", config)  # Megatron-LM's GPTModelConfig wraps it
    settings = _with_arguments(settings, alpha, post_ln_layers, scheme, layout)
    pattern = moe_layer_pattern(config)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if len(set(pattern)) == 1:  # every layer alike (dense, or all MoE): one spec
        layer_specs = [checked_layer_spec(config, backend, settings, moe=pattern[0])] * num_layers
    else:  # megatron's --moe-layer-freq mixed stack: each layer the MLP its global number gets
        by_kind = {moe: checked_layer_spec(config, backend, settings, moe=moe) for moe in (False, True)}
        layer_specs = [by_kind[pattern[i]] for i in stage_layer_ids(config, num_layers, vp_stage, pp_rank)]
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=backends.norm_class(backend))


def checked_layer_spec(config, backend: str, settings: MixLNSettings, moe: Optional[bool] = None) -> ModuleSpec:
    """The layer spec for `config`, after the support table and the placement rule accept it.

    moe: an MoE layer (True) or a dense one (False); None: what config asks of every layer, which
    a mixed --moe-layer-freq stack cannot be given by one spec (refused, see uniform_moe)."""
    check_supported(config, backend=backend)  # mixln_megatron.model.support.TABLE
    placement = resolve_placement(config.num_layers, settings)  # a bad setting fails here, not inside a layer
    for kind in sorted(set(placement.kinds)):
        # Each layer checks its kind again when built; checked here, a refusal (e.g. deepnorm with
        # fewer query groups than TP ranks) leaves through the --spec edge's one line, not from
        # inside megatron's block construction.
        check_kind_supported(config, kind)
    if moe is None:
        moe = uniform_moe(config)
    return MixLNTransformerLayerSpec(
        backend=backend, settings=settings,
        normalization=config.normalization, qk_layernorm=getattr(config, "qk_layernorm", False),
        config=config,  # every flag megatron's builder takes, from the config (backends.BUILDER_FLAGS)
        moe=moe,
    )


def get_mixln_hybrid_stack_spec(
    config=None,
    backend: str = "te",
    alpha=None,
    post_ln_layers: Optional[int] = None,
    scheme: Optional[str] = None,
    settings: Optional[MixLNSettings] = None,
    hybrid_layer_pattern: Optional[str] = None,
    layout: Optional[str] = None,
) -> ModuleSpec:
    """The stack spec for megatron's HybridModel (its `hybrid_stack_spec`) with a `*-*-...` pattern
    of L transformer blocks (`E` for a `-`: an MoE MLP), final norm the backend's; plain data.
    With `config` (num_layers = the pattern's length) the builder flags come from it and the
    settings are checked here; with the pattern, so is the pattern."""
    compat.require_hybrid_model()
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules  # optional: megatron-core 0.19+

    from .hybrid import MixLNHybridStack, hybrid_layer_submodules  # optional: megatron-core 0.19+

    settings = _with_arguments(settings, alpha, post_ln_layers, scheme, layout)
    if hybrid_layer_pattern is not None:
        hybrid_pattern.check_pattern(hybrid_layer_pattern)
    if config is not None:
        config = getattr(config, "transformer", config)
        check_supported(config, backend=backend)
        # a bad setting fails here, not inside a layer; the placement counts blocks
        resolve_placement(hybrid_pattern.num_blocks(config.num_layers, hybrid_pattern.ATTENTION), settings)
        # `-` layers dense whatever the config says; `E` layers (hybrid_pattern.MOE_MLP) megatron's MoE
        layer = backends.layer_submodules(backend, config=config, moe=False)
        moe_layer = backends.layer_submodules(backend, config=config, moe=True) \
            if getattr(config, "num_moe_experts", None) else None
    else:
        layer, moe_layer = backends.layer_submodules(backend), None
    params = {"mixln_settings": settings, "post_ln_norm": backends.norm_class(backend)}

    def part(name, submodules=layer):
        return ModuleSpec(module=MixLNTransformerLayer, submodules=hybrid_layer_submodules(submodules, name),
                          params={**params, "hybrid_part": name})

    extra = {} if moe_layer is None else {"moe_layer": part(hybrid_pattern.MLP, moe_layer)}
    return ModuleSpec(
        module=MixLNHybridStack,
        submodules=HybridStackSubmodules(
            attention_layer=part(hybrid_pattern.ATTENTION), mlp_layer=part(hybrid_pattern.MLP), **extra),
        params={"final_norm": backends.norm_class(backend)},
    )


# ------------------------------------------------------------------------------ MoE layers
# Which layers are MoE layers: megatron's --moe-layer-freq, read once for the specs. An MoE layer
# takes the same norms as a dense one (docs/configuration.md); a mixed stack gives each layer its
# MLP by its global 0-based index, as megatron's own decoder spec does.
def moe_layer_pattern(config) -> list:
    """[bool] per global layer: True for an MoE layer. A dense config: all False."""
    config = getattr(config, "transformer", config)
    if not getattr(config, "num_moe_experts", None):
        return [False] * config.num_layers
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int):  # one MoE layer every `freq` layers, the first one included
        return [i % freq == 0 for i in range(config.num_layers)]
    if isinstance(freq, (list, tuple)) and len(freq) == config.num_layers and set(freq) <= {0, 1}:
        return [bool(v) for v in freq]
    raise MixLNUnsupportedError(
        f"moe_layer_freq must be an int or a list of 0/1 per layer ({config.num_layers} layers), "
        f"got {freq!r}")


def uniform_moe(config) -> bool:
    """Whether every layer is an MoE layer (False: every layer dense); a mixed stack is refused,
    because a single layer spec (the 0.17/0.18 `--spec` path) builds every layer alike."""
    pattern = moe_layer_pattern(config)
    if len(set(pattern)) > 1:
        raise MixLNUnsupportedError(
            f"a mixed dense/MoE stack (moe_layer_freq={getattr(config, 'moe_layer_freq', None)!r}) needs one "
            "spec per layer: build the decoder with get_mixln_decoder_block_spec (megatron-core 0.19+'s "
            "--spec call, or the mixln-megatron pretrain entry point)")
    return bool(pattern and pattern[0])


def stage_layer_ids(config, num_layers: int, vp_stage: Optional[int], pp_rank: Optional[int]) -> list:
    """The global 0-based indices of the `num_layers` layers this (virtual) pipeline stage builds."""
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:
        from megatron.core.transformer.enums import LayerType  # optional: pipeline layouts only

        return list(layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank))
    offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
    return list(range(offset, offset + num_layers))
