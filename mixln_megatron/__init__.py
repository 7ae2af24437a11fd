"""Mix-LN (arXiv 2412.13795) for Megatron-LM / megatron-core.

Importing the package is cheap and patches nothing. The pieces:
  mixln_megatron.settings        what the user chose and where from (MixLNSettings; pure Python)
  mixln_megatron.env_settings    the MIXLN_* environment (the only module that reads it)
  mixln_megatron.placement       the rule "which global layer is Post-LN" (pure Python)
  mixln_megatron.spec            specs for `--spec mixln_megatron.spec <name>` and megatron-core users
  mixln_megatron.training_hooks  install_training_hooks: the spike scaler and telemetry, in one place
  mixln_megatron.layer           MixLNTransformerLayer
  mixln_megatron.cpu             the explicit CPU/gloo harness for development (enable() to use it)
"""

from .errors import MixLNConfigError, MixLNError
from .placement import Placement, post_ln_count, resolve_placement
from .settings import MixLNSettings, SpikeSettings, TelemetrySettings

__version__ = "0.1.0"


def install_training_hooks(config, settings=None) -> dict:
    """Install the spike scaler / telemetry that `settings` asks for (see training_hooks)."""
    from .training_hooks import install_training_hooks as install  # imports torch: only when called

    return install(config, settings)


__all__ = [
    "MixLNConfigError", "MixLNError", "MixLNSettings", "Placement", "SpikeSettings",
    "TelemetrySettings", "install_training_hooks", "post_ln_count", "resolve_placement",
    "__version__",
]
