"""Mix-LN / LayerNorm-Scaling LLaMA (arXiv 2412.13795) for Hugging Face transformers.

Relative to LLaMA only the placement (and, for LNS, the output scale) of the decoder-layer norms changes:

  Pre-LN layer (index >= P), stock LLaMA plus an optional norm-output scale s:
      h = x + Attn(s * input_layernorm(x));   y = h + MLP(s * post_attention_layernorm(h))
  Post-LN layer (index < P), no norm in front of attention, never scaled:
      h = post_attention_layernorm(x + Attn(x));   y = post_feedforward_layernorm(h + MLP(h))

s = 1/sqrt(index + 1) on Pre-LN layers under the "lns" and "mixln+lns" schemes, else 1. The final model
norm is always applied. Attention, MLP, norms, rotary embeddings, the model loop, caching and generation
are transformers' LLaMA components, reused by subclassing.

This file is copied verbatim next to config.json in exported checkpoints (remote code): it imports only
`transformers`/`torch` and the configuration file next to it. config.json's auto_map names the base model
(`AutoModel` -> MixLNLlamaModel, where all Mix-LN changes live) as well as the causal LM, for serving
engines' Transformers backends, which load the base model and call attention through
ALL_ATTENTION_FUNCTIONS with the kwargs they pass to the model.
"""

from typing import Optional, Tuple

import torch
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from .configuration_mixln_llama import MixLNLlamaConfig


class _MixLNDecoderLayer(LlamaDecoderLayer):
    """LLaMA's attention and MLP; the subclasses say where the norms sit around them."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        position_embeddings: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        **kwargs,
    ) -> torch.Tensor:
        # Cache, use_cache, cache_position etc. travel in **kwargs under whatever names the installed
        # transformers uses, straight to LlamaAttention.
        attn_output, _ = self.self_attn(
            hidden_states=self.attention_input(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        return self.residuals_and_mlp(hidden_states, attn_output)


class MixLNLlamaPreLNDecoderLayer(_MixLNDecoderLayer):
    """LLaMA's decoder layer (same parameters) whose two norm outputs are multiplied by `norm_output_scale`."""

    def __init__(self, config: MixLNLlamaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.layer_idx = layer_idx
        self.norm_output_scale = float(config.norm_output_scale(layer_idx))

    def _scaled(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.norm_output_scale != 1.0:
            hidden_states = hidden_states * self.norm_output_scale
        return hidden_states

    def attention_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._scaled(self.input_layernorm(hidden_states))

    def residuals_and_mlp(self, hidden_states: torch.Tensor, attn_output: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + attn_output
        return hidden_states + self.mlp(self._scaled(self.post_attention_layernorm(hidden_states)))

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, norm_output_scale={self.norm_output_scale:.6g}"


class MixLNLlamaPostLNDecoderLayer(_MixLNDecoderLayer):
    """Post-LN layer: LLaMA's attention and MLP, a norm after each residual add, none in front of attention.

    N1 = `post_attention_layernorm`, N2 = `post_feedforward_layernorm`; there is no `input_layernorm`.
    """

    def __init__(self, config: MixLNLlamaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        del self.input_layernorm
        self.post_feedforward_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layer_idx = layer_idx

    def attention_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def residuals_and_mlp(self, hidden_states: torch.Tensor, attn_output: torch.Tensor) -> torch.Tensor:
        hidden_states = self.post_attention_layernorm(hidden_states + attn_output)
        return self.post_feedforward_layernorm(hidden_states + self.mlp(hidden_states))

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, post_ln=True"


class MixLNLlamaPreTrainedModel(LlamaPreTrainedModel):
    config_class = MixLNLlamaConfig
    config: MixLNLlamaConfig
    _no_split_modules = ["MixLNLlamaPreLNDecoderLayer", "MixLNLlamaPostLNDecoderLayer"]
    # Attention goes through transformers' attention interface (ALL_ATTENTION_FUNCTIONS, chosen by
    # config._attn_implementation) in LlamaAttention, and every layer passes its **kwargs down to it:
    # what the Transformers backend of vLLM / SGLang needs to put its own attention in. LLaMA's value,
    # stated here so that the base model (AutoModel) keeps it whatever LlamaPreTrainedModel does.
    _supports_attention_backend = True
    # Both layer classes subclass LlamaDecoderLayer, so the inherited output recording
    # (`_can_record_outputs`: hidden states per decoder layer, attentions per LlamaAttention) applies as is.


def mixln_decoder_layer(config: MixLNLlamaConfig, layer_idx: int) -> nn.Module:
    """The decoder layer for 0-based `layer_idx`: Post-LN when layer_idx < config.post_ln_layers."""
    if config.is_post_ln_layer(layer_idx):
        return MixLNLlamaPostLNDecoderLayer(config, layer_idx)
    return MixLNLlamaPreLNDecoderLayer(config, layer_idx)


class MixLNLlamaModel(MixLNLlamaPreTrainedModel, LlamaModel):
    """LlamaModel with Mix-LN decoder layers; `forward` (masks, cache, rotary, final norm) is LlamaModel's."""

    def __init__(self, config: MixLNLlamaConfig):
        if not callable(getattr(config, "validate_mixln", None)):
            raise TypeError(f"MixLNLlamaModel needs a MixLNLlamaConfig, got {type(config).__name__}")
        config.validate_mixln()
        # Skip LlamaModel.__init__ (it would build stock layers only to throw them away) and build the same
        # attributes LlamaModel.forward reads, with Mix-LN layers.
        super(LlamaModel, self).__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([mixln_decoder_layer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class MixLNLlamaForCausalLM(MixLNLlamaPreTrainedModel, LlamaForCausalLM):
    """LlamaForCausalLM around a MixLNLlamaModel; forward, loss, generate() and weight tying are LLaMA's."""

    def __init__(self, config: MixLNLlamaConfig):
        # As above: skip LlamaForCausalLM.__init__, which would build a stock LlamaModel first.
        super(LlamaForCausalLM, self).__init__(config)
        self.model = MixLNLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


__all__ = [
    "MixLNLlamaForCausalLM",
    "MixLNLlamaModel",
    "MixLNLlamaPostLNDecoderLayer",
    "MixLNLlamaPreLNDecoderLayer",
    "MixLNLlamaPreTrainedModel",
    "mixln_decoder_layer",
]
