"""The local backend's norm: RMSNorm or LayerNorm in plain torch, with sequence parallelism.

megatron's own local norm (WrappedTorchNorm) refuses sequence parallelism and zero-centred gamma.
This one supports both: under sequence parallelism each TP rank normalises its own sequence
shard, and the weight is marked `sequence_parallel` so that megatron's finalize_model_grads
all-reduces its gradient over the TP group (as TE's norms do), keeping the replicas identical.
"""

from __future__ import annotations

import torch
from torch import nn


class MixLNNorm(nn.Module):
    """RMSNorm / LayerNorm built like megatron norms: `MixLNNorm(config=, hidden_size=, eps=)`.

    `config.normalization` picks the kind; `config.layernorm_zero_centered_gamma` stores
    gamma - 1 (so weight decay pulls gamma towards 1). Computation runs in fp32.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused_kwargs):
        super().__init__()
        normalization = getattr(config, "normalization", "RMSNorm")
        if normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(
                f"mixln_megatron supports normalization RMSNorm or LayerNorm, got {normalization!r}"
            )
        if getattr(config, "persist_layer_norm", False):
            raise ValueError(
                "persist_layer_norm needs apex's fused kernel, which the local backend does not use; "
                "pass --no-persist-layer-norm (or use the TE spec)"
            )
        self.rms = normalization == "RMSNorm"
        self.eps = eps
        self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        dtype = getattr(config, "params_dtype", torch.float32)
        self.weight = nn.Parameter(init(hidden_size, dtype=dtype))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        # LayerNorm Scaling multiplies the output (never the stored weight) by 1/sqrt(l).
        self.output_scale = 1.0
        sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        for p in self.parameters():
            # finalize_model_grads all-reduces grads of params marked this way over TP.
            setattr(p, "sequence_parallel", sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        if self.rms:
            normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            mean = x32.mean(-1, keepdim=True)
            var = (x32 - mean).pow(2).mean(-1, keepdim=True)
            normed = (x32 - mean) * torch.rsqrt(var + self.eps)
        gamma = self.weight.float() + 1 if self.zero_centered_gamma else self.weight.float()
        out = normed * gamma
        if self.bias is not None:
            out = out + self.bias.float()
        if self.output_scale != 1.0:
            out = out * self.output_scale
        return out.to(x.dtype)
