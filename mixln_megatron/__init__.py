"""Mix-LN (arXiv 2412.13795) for Megatron-LM / megatron-core.

Importing the package is cheap and patches nothing. Stock Megatron-LM uses `mixln_megatron.spec`
(`--spec mixln_megatron.spec <name>`); what each package does: CONTRIBUTING.md, "Architecture".
"""

from .errors import MixLNConfigError, MixLNError
from .model.placement import Placement, post_ln_count, resolve_placement
from .model.settings import MixLNSettings, SpikeSettings, TelemetrySettings

__version__ = "0.1.0"


def install_training_hooks(config, settings=None, hybrid: bool = False) -> dict:
    """Install the spike scaler / telemetry that `settings` asks for (training.hooks);
    `hybrid=True` for a HybridModel's config (its num_layers counts `*` and `-` layers)."""
    from .training.hooks import install_training_hooks as install  # imports torch: only when called

    return install(config, settings, hybrid=hybrid)


__all__ = [
    "MixLNConfigError", "MixLNError", "MixLNSettings", "Placement", "SpikeSettings",
    "TelemetrySettings", "install_training_hooks", "post_ln_count", "resolve_placement",
    "__version__",
]
