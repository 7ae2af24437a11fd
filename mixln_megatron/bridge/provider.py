"""The Mix-LN model provider for Megatron-Bridge: Bridge's GPTModelProvider plus the Mix-LN layout.

The layout is the one the HF config carries (post_ln_layers P, mixln_scheme, mixln_alpha as
text); the transformer_layer_spec is a callable that hands Bridge this package's whole decoder
block spec (final norm included), so the model Bridge builds is the model `pretrain` builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.bridge.models.gpt_provider import GPTModelProvider

from ..model.backends import check_backend
from ..model.settings import MixLNSettings
from ..model.specs import get_mixln_decoder_block_spec

# Fusions that need CUDA kernels (apex / TE / triton); use_local_backend(cpu=True) turns them off.
CUDA_ONLY_FUSIONS = (
    "apply_rope_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "masked_softmax_fusion",
    "gradient_accumulation_fusion",
    "cross_entropy_loss_fusion",
)

# How MoE layers run on the CPU: the allgather dispatcher, sequential experts, no fused kernels.
CPU_MOE_EXECUTION = {"moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": False,
                     "moe_permute_fusion": False, "moe_router_fusion": False, "moe_shared_expert_overlap": False}


def mixln_settings(config) -> MixLNSettings:
    """The settings a provider describes: its per-layer layout (with DeepNorm's constants) when it
    has one, else P as given (never re-derived from alpha); and the scheme."""
    scheme = getattr(config, "mixln_scheme", "mixln")
    layout = getattr(config, "mixln_layout", None)
    if layout is not None:
        return MixLNSettings(layout=layout, scheme=scheme, deepnorm_alpha=getattr(config, "mixln_deepnorm_alpha", None),
                             deepnorm_beta=getattr(config, "mixln_deepnorm_beta", None))
    return MixLNSettings(post_ln_layers=int(getattr(config, "post_ln_layers", 0)), scheme=scheme)


def mixln_block_spec(config, vp_stage: Optional[int] = None):
    """GPTModelProvider.transformer_layer_spec for Mix-LN: the decoder block spec of this pipeline
    (and virtual pipeline) stage, built by mixln_megatron.model.specs from the provider's fields."""
    return get_mixln_decoder_block_spec(
        config, backend=getattr(config, "mixln_backend", "te"), vp_stage=vp_stage, settings=mixln_settings(config)
    )


@dataclass
class MixLNModelProvider(GPTModelProvider):
    """GPTModelProvider of a Mix-LN / LNS LLaMA.

    post_ln_layers: P, the number of leading Post-LN layers (global numbering); with a layout,
                    the number of its post and deepnorm layers.
    mixln_scheme:   "mixln", "lns" (P = 0, norm outputs of layer l scaled by 1/sqrt(l)) or
                    "mixln+lns".
    mixln_alpha:    the text of the alpha that gave P, carried to the exported HF config only.
    mixln_layout:   every layer's kind (model.layout text, e.g. "deepnorm:1,sandwich:2-"), for the
                    paper's comparison arms; None: Mix-LN's first P layers.
    mixln_deepnorm_alpha, mixln_deepnorm_beta: DeepNorm's residual scale and init factor (None:
                    DeepNet's defaults for the depth), for a layout with deepnorm layers.
    mixln_backend:  "te" (TransformerEngine modules, Bridge's default for Llama) or "local"
                    (megatron's local modules; see use_local_backend).
    """

    post_ln_layers: int = 0
    mixln_scheme: str = "mixln"
    mixln_alpha: Optional[str] = None
    mixln_layout: Optional[str] = None
    mixln_deepnorm_alpha: Optional[float] = None
    mixln_deepnorm_beta: Optional[float] = None
    mixln_backend: str = "te"
    normalization: str = "RMSNorm"
    transformer_layer_spec: object = mixln_block_spec

    def finalize(self) -> None:
        check_backend(self.mixln_backend)
        if self.mixln_backend == "local":
            self.persist_layer_norm = False  # apex's kernel; the local norm is plain torch
        super().finalize()


def use_local_backend(provider, cpu: bool = False):
    """Switch `provider` to this package's block spec with megatron's local modules (the project's
    MixLNNorm for every norm). A MixLNModelProvider keeps its layout; Bridge's own Llama provider
    (a P = 0 folder) gets the Mix-LN spec at P = 0, which is the stock Llama network.
    cpu=True also turns off the fusions that need CUDA kernels (CUDA_ONLY_FUSIONS), runs MoE
    layers as a CPU can (CPU_MOE_EXECUTION) and initialises parameters on the CPU, for
    megatron-core under mixln_megatron.cpu.
    Returns the provider."""
    provider.mixln_backend = "local"
    provider.transformer_layer_spec = mixln_block_spec
    provider.persist_layer_norm = False
    if cpu:
        for name in CUDA_ONLY_FUSIONS:
            if hasattr(provider, name):
                setattr(provider, name, False)
        provider.use_cpu_initialization = True
        if getattr(provider, "num_moe_experts", None):  # what runs in a CPU process (docs/compatibility.md)
            for name, value in CPU_MOE_EXECUTION.items():
                setattr(provider, name, value)
    return provider
