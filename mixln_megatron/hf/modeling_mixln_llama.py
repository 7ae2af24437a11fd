"""Mix-LN / LayerNorm-Scaling LLaMA (arXiv 2412.13795) for Hugging Face transformers.

Relative to LLaMA only the placement (and, for LNS, the output scale) of the decoder-layer norms changes,
and for DeepNorm the weight of the residual. Each layer has one kind (config.layer_kind(index); without
config.layer_kinds the first P layers are "post", the rest "pre"):

  "pre"      stock LLaMA plus an optional norm-output scale s (MixLNLlamaPreLNDecoderLayer):
      h = x + Attn(s * input_layernorm(x));   y = h + MLP(s * post_attention_layernorm(h))
  "post"     no norm in front of attention, never scaled (MixLNLlamaPostLNDecoderLayer):
      h = post_attention_layernorm(x + Attn(x));   y = post_feedforward_layernorm(h + MLP(h))
  "deepnorm" DeepNet's Post-LN, a = config.deepnorm_alpha (MixLNLlamaDeepNormDecoderLayer):
      h = post_attention_layernorm(a * x + Attn(x));   y = post_feedforward_layernorm(a * h + MLP(h))
  "sandwich" Sandwich-LN with Gemma 2's four norm names (MixLNLlamaSandwichDecoderLayer):
      h = x + post_attention_layernorm(Attn(s * input_layernorm(x)))
      y = h + post_feedforward_layernorm(MLP(s * pre_feedforward_layernorm(h)))

s = 1/sqrt(index + 1) on "pre" and "sandwich" layers under the "lns" and "mixln+lns" schemes, else 1. The
final model norm is always applied.

The forward scalars of the config (Megatron's muP and GLU offset; LLaMA's values by default): attention's softmax
scale `attention_scale`, the embeddings times `embedding_multiplier` (MixLNScaledEmbedding), the logits times
`logits_multiplier` (MixLNScaledLMHead), the MLP as down(silu(gate(x)) * (up(x) + glu_linear_offset))
(MixLNLlamaOffsetMLP). Parameter names stay LLaMA's. Attention, MLP, norms, rotary embeddings, the model loop, caching and generation
are transformers' LLaMA components, reused by subclassing.

This file is copied verbatim next to config.json in exported checkpoints (remote code): it imports only
`transformers`/`torch` and the configuration file next to it. config.json's auto_map names the base model
(MixLNLlamaModel, where all Mix-LN changes live) too, for serving engines' Transformers backends.
"""

from typing import Optional, Tuple

import torch
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from .configuration_mixln_llama import MixLNLlamaConfig


class MixLNLlamaOffsetMLP(LlamaMLP):
    """LLaMA's MLP with Megatron's GLU offset: down(act(gate(x)) * (up(x) + offset)); same parameters."""

    def __init__(self, config):
        super().__init__(config)
        self.glu_linear_offset = float(config.glu_linear_offset)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * (self.up_proj(x) + self.glu_linear_offset))


class MixLNScaledEmbedding(nn.Embedding):
    """nn.Embedding whose output is multiplied by `multiplier` (muP's embedding multiplier), so that
    `get_input_embeddings()(ids)` is the model's own input; the parameter stays `weight`."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, multiplier: float = 1.0):
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.multiplier = float(multiplier)

    def forward(self, input_ids):
        return super().forward(input_ids) * self.multiplier


class MixLNScaledLMHead(nn.Linear):
    """The output projection (no bias) with its logits multiplied by `multiplier` (muP's output multiplier)."""

    def __init__(self, in_features, out_features, multiplier: float = 1.0):
        super().__init__(in_features, out_features, bias=False)
        self.multiplier = float(multiplier)

    def forward(self, hidden_states):
        return super().forward(hidden_states) * self.multiplier


def _embedding(config) -> nn.Embedding:
    multiplier = getattr(config, "embedding_multiplier", 1.0)
    if multiplier == 1.0:
        return nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
    return MixLNScaledEmbedding(config.vocab_size, config.hidden_size, config.pad_token_id, multiplier)


def _lm_head(config) -> nn.Linear:
    multiplier = getattr(config, "logits_multiplier", 1.0)
    if multiplier == 1.0:
        return nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    return MixLNScaledLMHead(config.hidden_size, config.vocab_size, multiplier)


class _MixLNDecoderLayer(LlamaDecoderLayer):
    """LLaMA's attention and MLP; the subclasses say where the norms sit around them."""

    def __init__(self, config: MixLNLlamaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        scale = getattr(config, "attention_scale", None)
        if scale is not None:  # read by every attention implementation LlamaAttention calls
            self.self_attn.scaling = float(scale)
        if getattr(config, "glu_linear_offset", 0.0) != 0.0:
            self.mlp = MixLNLlamaOffsetMLP(config)

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


class MixLNLlamaDeepNormDecoderLayer(MixLNLlamaPostLNDecoderLayer):
    """DeepNet's Post-LN layer (arXiv 2203.00555): the Post-LN layer with the residual scaled before each add.

    Same parameters as the Post-LN layer; alpha = `config.deepnorm_alpha` (DeepNet: (2N)^(1/4) for N layers).
    DeepNet's init is done by the Megatron side in training; these weights come from conversion.

    The Mix-LN authors' `deeppost` (pixeli99/MixLN) has the same forward with alpha fixed at 2.8284271247461903
    (= (2N)^(1/4) at N = 32) at every depth: exporting their model means deepnorm_alpha = 2.8284271247461903.
    """

    def __init__(self, config: MixLNLlamaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.deepnorm_alpha = float(config.deepnorm_alpha)

    def residuals_and_mlp(self, hidden_states: torch.Tensor, attn_output: torch.Tensor) -> torch.Tensor:
        alpha = self.deepnorm_alpha
        hidden_states = self.post_attention_layernorm(alpha * hidden_states + attn_output)
        return self.post_feedforward_layernorm(alpha * hidden_states + self.mlp(hidden_states))

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, post_ln=True, deepnorm_alpha={self.deepnorm_alpha:.6g}"


class MixLNLlamaSandwichDecoderLayer(MixLNLlamaPreLNDecoderLayer):
    """Sandwich-LN layer (Ding et al. 2021; Peri-LN; Gemma 2's four norms): a norm before and after each sublayer.

    input_layernorm -> Attn -> post_attention_layernorm -> residual add, then pre_feedforward_layernorm -> MLP
    -> post_feedforward_layernorm -> residual add. LNS (`norm_output_scale`) scales the two pre-norms only.
    Note that `post_attention_layernorm` is the norm after attention here (Gemma 2's naming), whereas in a
    Pre-LN layer it is the norm in front of the MLP.

    The Mix-LN authors' `sandwich` (pixeli99/MixLN) has the same structure and names, every layer sandwich,
    no scaling.
    """

    def __init__(self, config: MixLNLlamaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.pre_feedforward_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def residuals_and_mlp(self, hidden_states: torch.Tensor, attn_output: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.post_attention_layernorm(attn_output)
        mlp_output = self.mlp(self._scaled(self.pre_feedforward_layernorm(hidden_states)))
        return hidden_states + self.post_feedforward_layernorm(mlp_output)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", sandwich=True"


class MixLNLlamaPreTrainedModel(LlamaPreTrainedModel):
    config_class = MixLNLlamaConfig
    config: MixLNLlamaConfig
    _no_split_modules = [
        "MixLNLlamaPreLNDecoderLayer",
        "MixLNLlamaPostLNDecoderLayer",
        "MixLNLlamaDeepNormDecoderLayer",
        "MixLNLlamaSandwichDecoderLayer",
    ]
    # Every layer passes its **kwargs down to LlamaAttention's attention interface, which the Transformers
    # backend of vLLM / SGLang needs; LLaMA's value, stated so that the base model keeps it.
    _supports_attention_backend = True
    # Inherited as is: the output recording (every layer class is a LlamaDecoderLayer) and LLaMA's
    # `_init_weights` (not DeepNet's init, which the Megatron side does in training).


DECODER_LAYER_CLASSES = {
    "pre": MixLNLlamaPreLNDecoderLayer,
    "post": MixLNLlamaPostLNDecoderLayer,
    "deepnorm": MixLNLlamaDeepNormDecoderLayer,
    "sandwich": MixLNLlamaSandwichDecoderLayer,
}


def mixln_decoder_layer(config: MixLNLlamaConfig, layer_idx: int) -> nn.Module:
    """The decoder layer for 0-based `layer_idx`, of kind `config.layer_kind(layer_idx)`."""
    return DECODER_LAYER_CLASSES[config.layer_kind(layer_idx)](config, layer_idx)


class MixLNLlamaModel(MixLNLlamaPreTrainedModel, LlamaModel):
    """LlamaModel with Mix-LN decoder layers; `forward` (masks, cache, rotary, final norm) is LlamaModel's."""

    # The class of each layer kind: the MoE model (modeling_mixln_moe) puts its own here.
    decoder_layer_classes = DECODER_LAYER_CLASSES

    def __init__(self, config: MixLNLlamaConfig):
        if not callable(getattr(config, "validate_mixln", None)):
            raise TypeError(f"MixLNLlamaModel needs a MixLNLlamaConfig, got {type(config).__name__}")
        config.validate_mixln()
        # Skip LlamaModel.__init__ (it would build stock layers only to throw them away) and build the same
        # attributes LlamaModel.forward reads, with Mix-LN layers.
        super(LlamaModel, self).__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = _embedding(config)
        self.layers = nn.ModuleList([self.decoder_layer_classes[config.layer_kind(i)](config, i)
                                     for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class MixLNLlamaForCausalLM(MixLNLlamaPreTrainedModel, LlamaForCausalLM):
    """LlamaForCausalLM around a MixLNLlamaModel; forward, loss, generate() and weight tying are LLaMA's."""

    base_model_class = MixLNLlamaModel  # the MoE model's causal LM puts its own base model here

    def __init__(self, config: MixLNLlamaConfig):
        # As above: skip LlamaForCausalLM.__init__, which would build a stock LlamaModel first.
        super(LlamaForCausalLM, self).__init__(config)
        self.model = self.base_model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = _lm_head(config)
        self.post_init()


__all__ = [
    "DECODER_LAYER_CLASSES",
    "MixLNLlamaDeepNormDecoderLayer",
    "MixLNLlamaForCausalLM",
    "MixLNLlamaModel",
    "MixLNLlamaOffsetMLP",
    "MixLNLlamaPostLNDecoderLayer",
    "MixLNLlamaPreLNDecoderLayer",
    "MixLNLlamaPreTrainedModel",
    "MixLNLlamaSandwichDecoderLayer",
    "MixLNScaledEmbedding",
    "MixLNScaledLMHead",
    "mixln_decoder_layer",
]
