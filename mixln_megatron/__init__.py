"""Mix-LN (arXiv 2412.13795) for Megatron-LM / megatron-core.

Importing the package is cheap and patches nothing. The pieces:
  mixln_megatron.placement  settings and the rule "which global layer is Post-LN" (pure Python)
  mixln_megatron.spec       specs for `--spec mixln_megatron.spec <name>` and megatron-core users
  mixln_megatron.layer      MixLNTransformerLayer
  mixln_megatron.cpu        the explicit CPU/gloo harness for development (enable() to use it)
"""

from .placement import MixLNConfigError, MixLNSettings, Placement, post_ln_count, resolve_placement

__version__ = "0.1.0"

__all__ = ["MixLNConfigError", "MixLNSettings", "Placement", "post_ln_count", "resolve_placement", "__version__"]
