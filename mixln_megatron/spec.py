"""The stock `--spec` edge: what Megatron-LM's `--spec mixln_megatron.spec <name>` imports
(the four names and their use: docs/training.md), and the megatron-core factories re-exported.

Each object reads the settings (a patched checkout's --mixln-* flags from Megatron-LM's global
args, then MIXLN_*, then defaults), builds the spec and installs the training hooks (the only
place stock Megatron-LM gives a plugin). On 0.19+ the builder calls them with the model config
and they return the whole decoder's submodules; on 0.17/0.18 it passes the object uncalled to
GPTModel, so they are layer ModuleSpecs whose layer class (LayerFromStockSpec) does the same as
each layer is built. pretrain_hybrid.py never calls its stack ModuleSpec: its stack class
(HybridStackFromStockSpec) does it when HybridModel builds the stack.

The objects Megatron-LM calls are the edge: a MixLNError in them leaves as errors.refuse does
(one line, exit 2 on every rank); the functions below them print the line and raise the error.

This module imports with megatron-core's base dependencies only (no TE, no transformers):
megatron's spec_utils.import_module swallows ImportError, after which Megatron-LM would silently
train the stock Pre-LN model.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from . import compat, megatron_args
from .convert.vet import check_load_dir
from .errors import MixLNConfigError, MixLNError, refusals_leave, report
from .model.layer import MixLNTransformerLayer
from .model.settings import MixLNSettings, layered
from .model.specs import (
    MixLNTransformerLayerSpec,
    checked_layer_spec,
    get_mixln_decoder_block_spec,
    get_mixln_hybrid_stack_spec,
)
from .model import support
from .model.support import MixLNUnsupportedError
from .training import runtime
from .training.hooks import install_training_hooks

__all__ = [
    "MixLNTransformerLayerSpec",
    "get_mixln_decoder_block_spec",
    "get_mixln_hybrid_stack_spec",
    "mixln_hybrid_local_stack_spec",
    "mixln_hybrid_stack_spec",
    "mixln_layer_spec",
    "mixln_local_layer_spec",
]


def settings_for_spec(environ=None, args=None) -> MixLNSettings:
    """The settings a `--spec` function uses: a patched checkout's --mixln-* flags (Megatron-LM's
    global args, or `args`), then the MIXLN_* environment (os.environ, or `environ`)."""
    args = runtime.megatron_args() if args is None else args
    flags = MixLNSettings.from_args(args) if megatron_args.has_mixln_args(args) else None
    return layered(flags, MixLNSettings.from_environ(environ))


# The spec names by (backend, hybrid), and the --transformer-impl each backend's modules are.
SPEC_NAMES = {("te", False): "mixln_layer_spec", ("local", False): "mixln_local_layer_spec",
              ("te", True): "mixln_hybrid_stack_spec", ("local", True): "mixln_hybrid_local_stack_spec"}
TRANSFORMER_IMPL = {"te": "transformer_engine", "local": "local"}


def check_spec_backend(args, backend: str, hybrid: bool = False) -> None:
    """The --spec's backend against Megatron-LM's --transformer-impl, which the rest of the run
    (its checkpoint keys, Megatron-LM's own checks) follows: MixLNConfigError when they disagree."""
    impl = getattr(args, "transformer_impl", None)
    if impl not in TRANSFORMER_IMPL.values() or impl == TRANSFORMER_IMPL[backend]:
        return
    other = "local" if backend == "te" else "te"
    raise MixLNConfigError(
        f"--spec mixln_megatron.spec {SPEC_NAMES[backend, hybrid]} builds "
        f"{'TransformerEngine' if backend == 'te' else 'local'} modules, but --transformer-impl is {impl}: use "
        f"--spec mixln_megatron.spec {SPEC_NAMES[other, hybrid]} with it, or --transformer-impl "
        f"{TRANSFORMER_IMPL[backend]}")


def _at_the_edge(config, build, environ=None, args=None, hybrid: bool = False, backend: Optional[str] = None):
    """Settings from the edge, `build(settings)`, then the hooks; a MixLN error printed in one line
    and raised (the objects Megatron-LM calls turn it into a Refusal). First Megatron-LM's
    arguments against the support table's `stock` rows and --transformer-impl, and the --load
    directory against this release (it runs before Megatron-LM loads it). The checkpoint's pickles
    are not vetted here: Megatron-LM's --use-checkpoint-args has read them already."""
    try:
        megatron_lm_args = runtime.megatron_args() if args is None else args
        if megatron_lm_args is not None:  # the run's data-parallel wrapper, MTP (support.STOCK rows)
            support.check(megatron_lm_args, support.STOCK)
            if backend is not None:
                check_spec_backend(megatron_lm_args, backend, hybrid)
        check_load_dir(getattr(megatron_lm_args, "load", None), getattr(megatron_lm_args, "dist_ckpt_strictness", None))
        settings = settings_for_spec(environ, args)
        spec = build(settings)
        install_training_hooks(config, settings, hybrid=hybrid)
    except (MixLNError, MixLNUnsupportedError) as error:
        report(error)
        raise
    return spec


def stock_decoder_spec(config, backend: str, vp_stage: Optional[int] = None, environ=None,
                       args=None) -> TransformerBlockSubmodules:
    """What the two --spec functions do: settings from the edge, spec, hooks; errors in one line."""
    return _at_the_edge(config, lambda settings: get_mixln_decoder_block_spec(
        config, backend=backend, vp_stage=vp_stage, settings=settings), environ, args, backend=backend)


def stock_layer_spec(config, backend: str, environ=None, args=None) -> ModuleSpec:
    """The same for one layer, on releases that never call the --spec object (0.17/0.18); runs
    as each layer is built (LayerFromStockSpec)."""
    return _at_the_edge(config, lambda settings: checked_layer_spec(config, backend, settings), environ, args,
                        backend=backend)


class LayerFromStockSpec(MixLNTransformerLayer):
    """0.17/0.18: the layer class of the --spec ModuleSpec (a MixLNTransformerLayer subclass, so
    TransformerBlock takes the spec as a layer spec). Constructing it builds the real Mix-LN layer
    from the settings of the --spec edge."""

    def __new__(cls, config, *args, mixln_backend: str = "local", submodules=None, **kwargs):
        with refusals_leave():  # an edge Megatron-LM calls: one line, exit 2
            layer_spec = stock_layer_spec(config, mixln_backend)
        # An instance of the real class, not of cls, so Python does not run __init__ again.
        return build_module(layer_spec, config, *args, **kwargs)


class HybridStackFromStockSpec:
    """The "stack class" of the hybrid --spec ModuleSpecs: constructing it returns the real Mix-LN
    stack (a model.hybrid.MixLNHybridStack) for the whole of Megatron-LM's --hybrid-layer-pattern,
    settings and hooks as for the other --spec objects. Not a subclass of it, so that this module
    imports on releases without HybridModel (0.17)."""

    def __new__(cls, config, *args, mixln_backend: str = "te", submodules=None, **kwargs):
        with refusals_leave():  # an edge Megatron-LM calls, the stack's constructor included
            megatron_lm_args = runtime.megatron_args()
            pattern = getattr(megatron_lm_args, "hybrid_layer_pattern", None)
            stack_spec = _at_the_edge(config, lambda settings: get_mixln_hybrid_stack_spec(
                config, backend=mixln_backend, settings=settings, hybrid_layer_pattern=pattern),
                args=megatron_lm_args, hybrid=True, backend=mixln_backend)
            return build_module(stack_spec, config, *args, **kwargs)


# `--spec mixln_megatron.spec mixln_hybrid_stack_spec` (TE) / `mixln_hybrid_local_stack_spec`
# (local) for pretrain_hybrid.py. No submodules: HybridModel reads them only for MTP, refused.
mixln_hybrid_stack_spec = ModuleSpec(module=HybridStackFromStockSpec, params={"mixln_backend": "te"})
mixln_hybrid_local_stack_spec = ModuleSpec(module=HybridStackFromStockSpec, params={"mixln_backend": "local"})


def _stock(decoder_spec, backend: str):
    """The object --spec imports on this release (compat.SPEC_GETS_THE_CONFIG: 0.19 calls it)."""
    if compat.SPEC_GETS_THE_CONFIG:
        return decoder_spec
    return ModuleSpec(module=LayerFromStockSpec, params={"mixln_backend": backend})


def mixln_layer_spec(config, vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """`--spec mixln_megatron.spec mixln_layer_spec`: Mix-LN with TransformerEngine."""
    with refusals_leave():  # an edge Megatron-LM calls: one line, exit 2
        return stock_decoder_spec(config, "te", vp_stage)


def mixln_local_layer_spec(config, vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """`--spec mixln_megatron.spec mixln_local_layer_spec`: Mix-LN with megatron's local modules."""
    with refusals_leave():  # an edge Megatron-LM calls: one line, exit 2
        return stock_decoder_spec(config, "local", vp_stage)


mixln_layer_spec = _stock(mixln_layer_spec, "te")
mixln_local_layer_spec = _stock(mixln_local_layer_spec, "local")
