"""Mix-LN as a Megatron-Bridge model (optional: `pip install 'mixln-megatron[bridge]'`).

Importing this package registers the bridges of `MixLNLlamaForCausalLM` (bridge.llama) and
`MixLNMoeForCausalLM` (bridge.moe); usage and what is refused: docs/conversion.md, "Megatron-Bridge".

Tested with megatron-bridge 0.6.2 (scripts/install_bridge.sh pins it), whose Llama bridge still
goes through a GPTModelProvider (`provider_bridge`); these bridges build on that Llama bridge.
Nothing else in mixln_megatron imports this package: megatron.bridge is imported here only.
"""

from .provider import MixLNModelProvider, mixln_block_spec, use_local_backend  # noqa: F401
from .llama import MIXLN_ARCHITECTURE, MixLNBridgeError, MixLNLlamaBridge, post_ln_mappings  # noqa: F401
from .checkpoint import save_megatron_checkpoint  # noqa: F401
from .moe import MOE_ARCHITECTURE, MixLNMoeBridge, moe_mappings  # noqa: F401

__all__ = [
    "MIXLN_ARCHITECTURE",
    "MOE_ARCHITECTURE",
    "MixLNMoeBridge",
    "moe_mappings",
    "MixLNBridgeError",
    "MixLNLlamaBridge",
    "MixLNModelProvider",
    "mixln_block_spec",
    "post_ln_mappings",
    "save_megatron_checkpoint",
    "use_local_backend",
]
