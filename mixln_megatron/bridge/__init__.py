"""Mix-LN as a Megatron-Bridge model (optional: `pip install 'mixln-megatron[bridge]'`).

Importing this package registers a bridge for `MixLNLlamaForCausalLM`, the architecture of the
folders `mixln-megatron convert to-hf` writes for P > 0 or an LNS scheme, so that

    import mixln_megatron.bridge                      # registers the bridge
    from megatron.bridge import AutoBridge
    bridge = AutoBridge.from_hf_pretrained(folder, trust_remote_code=True)
    provider = bridge.to_megatron_provider()         # a MixLNModelProvider
    model = provider.provide_distributed_model(...)  # GPTModel with the Mix-LN block spec
    bridge.save_hf_pretrained(model, out)            # the same HF folder again
    mixln_megatron.bridge.save_megatron_checkpoint(model, "ckpt/")  # a Megatron-LM checkpoint
                                                     # that convert to-hf and pretrain --load read

builds the Megatron model with this package's own block spec (mixln_megatron.model.specs), the
same settings record in its checkpoints, and the same HF folder on export. A P = 0, scheme
"mixln" folder is a stock LlamaForCausalLM (Bridge's own Llama bridge takes it). The Mix-LN MoE
model (`MixLNMoeForCausalLM`, model_type "mixln_moe") has its bridge too (bridge.moe).

Tested with megatron-bridge 0.6.2 (scripts/install_bridge.sh pins it), whose Llama bridge still
goes through a GPTModelProvider (`provider_bridge`); this bridge builds on that Llama bridge.
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
