"""Mix-LN (arXiv 2412.13795) for Megatron-LM / megatron-core.

Importing the package is cheap and patches nothing. The packages:
  mixln_megatron.spec       specs for `--spec mixln_megatron.spec <name>` and megatron-core users
  mixln_megatron.model      settings and their sources, the placement rule, MixLNTransformerLayer,
                            backends, norms, the checkpoint record, the unsupported-config table,
                            the HybridModel stack and its patterns
  mixln_megatron.training   the `pretrain` entry point, Megatron-LM flags, spike scaler, telemetry
  mixln_megatron.convert    Megatron checkpoint <-> Hugging Face; checkpoint inspection
  mixln_megatron.hf         the Hugging Face Mix-LN / LNS model code
  mixln_megatron.data       corpus -> Megatron indexed dataset
  mixln_megatron.analysis   grad norms, angular distance, layer drop, training health
  mixln_megatron.dev        the explicit CPU/gloo harness, the demo
  mixln_megatron.megatron_args  the `--mixln-*` flags (patched Megatron-LM checkouts import it)
"""

from .errors import MixLNConfigError, MixLNError
from .model.placement import Placement, post_ln_count, resolve_placement
from .model.settings import MixLNSettings, SpikeSettings, TelemetrySettings

__version__ = "0.1.0"


def install_training_hooks(config, settings=None, hybrid: bool = False) -> dict:
    """Install the spike scaler / telemetry that `settings` asks for (see training_hooks);
    `hybrid=True` for a HybridModel's config (its num_layers counts `*` and `-` layers)."""
    from .training.hooks import install_training_hooks as install  # imports torch: only when called

    return install(config, settings, hybrid=hybrid)


__all__ = [
    "MixLNConfigError", "MixLNError", "MixLNSettings", "Placement", "SpikeSettings",
    "TelemetrySettings", "install_training_hooks", "post_ln_count", "resolve_placement",
    "__version__",
]
