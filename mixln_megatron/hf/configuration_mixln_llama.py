"""Configuration of a Mix-LN / LayerNorm-Scaling LLaMA (arXiv 2412.13795) for Hugging Face transformers.

This file is copied verbatim next to config.json in exported checkpoints (remote code), so it imports
nothing but `transformers`.

Extra fields on top of `LlamaConfig`:
  post_ln_layers  P: the layers with 0-based index < P are Post-LN, all others Pre-LN.
  mixln_scheme    "mixln"     Mix-LN, no scaling;
                  "lns"       LayerNorm Scaling: all layers Pre-LN (P must be 0), each norm output of
                              layer l (1-based) multiplied by 1/sqrt(l);
                  "mixln+lns" Mix-LN whose Pre-LN layers (l > P) get the LNS scaling 1/sqrt(l).
  mixln_alpha     informational only: the text of the alpha that produced P, or None.

Tested with transformers 5.24; written for transformers >= 4.56, < 6 (the legacy `__init__` style
works with both the v4 configs and the v5 dataclass configs).
"""

import math

from transformers import LlamaConfig

MIXLN_SCHEMES = ("mixln", "lns", "mixln+lns")


class MixLNConfigValueError(ValueError):
    """A Mix-LN field of the config is invalid."""


def _check_mixln_fields(post_ln_layers, mixln_scheme, num_hidden_layers) -> None:
    if isinstance(post_ln_layers, bool) or not isinstance(post_ln_layers, int):
        raise MixLNConfigValueError(
            f"post_ln_layers must be an integer (the number P of leading Post-LN layers), got {post_ln_layers!r}"
        )
    if mixln_scheme not in MIXLN_SCHEMES:
        raise MixLNConfigValueError(f"mixln_scheme must be one of {', '.join(MIXLN_SCHEMES)}; got {mixln_scheme!r}")
    if num_hidden_layers is not None and not 0 <= post_ln_layers <= num_hidden_layers:
        raise MixLNConfigValueError(
            f"post_ln_layers = {post_ln_layers} is outside [0, num_hidden_layers = {num_hidden_layers}]"
        )
    if post_ln_layers < 0:
        raise MixLNConfigValueError(f"post_ln_layers must be >= 0, got {post_ln_layers}")
    if mixln_scheme == "lns" and post_ln_layers != 0:
        raise MixLNConfigValueError(
            f"mixln_scheme 'lns' keeps every layer Pre-LN, but post_ln_layers = {post_ln_layers}; "
            "use mixln_scheme 'mixln+lns' for LayerNorm Scaling on top of Mix-LN"
        )


class MixLNLlamaConfig(LlamaConfig):
    r"""LLaMA configuration with Mix-LN / LayerNorm Scaling norm placement.

    Args:
        post_ln_layers (`int`, defaults to 0): number P of leading Post-LN layers (0 <= P <= num_hidden_layers).
        mixln_scheme (`str`, defaults to `"mixln"`): one of `"mixln"`, `"lns"`, `"mixln+lns"`.
        mixln_alpha (`str`, *optional*): informational record of the alpha that gave P (numbers are stored as text).
        kwargs: every `LlamaConfig` argument.
    """

    model_type = "mixln_llama"

    def __init__(self, post_ln_layers: int = 0, mixln_scheme: str = "mixln", mixln_alpha=None, **kwargs):
        # Set before the parent init so that validation hooks running inside it can see them.
        if isinstance(mixln_alpha, (int, float)) and not isinstance(mixln_alpha, bool):
            mixln_alpha = repr(mixln_alpha) if isinstance(mixln_alpha, float) else str(mixln_alpha)
        if mixln_alpha is not None and not isinstance(mixln_alpha, str):
            raise MixLNConfigValueError(f"mixln_alpha must be a string or None, got {mixln_alpha!r}")
        self.post_ln_layers = post_ln_layers
        self.mixln_scheme = mixln_scheme
        self.mixln_alpha = mixln_alpha
        super().__init__(**kwargs)
        self.validate_mixln()

    def validate_mixln(self) -> None:
        """Raise `MixLNConfigValueError` (a `ValueError`) when the Mix-LN fields are inconsistent."""
        _check_mixln_fields(self.post_ln_layers, self.mixln_scheme, getattr(self, "num_hidden_layers", None))

    def validate_architecture(self):
        # Part of transformers v5's config validation when called on this class; absent in v4.
        parent = getattr(super(), "validate_architecture", None)
        if parent is not None:
            parent()
        self.validate_mixln()

    def save_pretrained(self, save_directory, *args, **kwargs):
        # Fields may have been edited after construction: never write an invalid config.json.
        self.validate_mixln()
        return super().save_pretrained(save_directory, *args, **kwargs)

    def is_post_ln_layer(self, layer_idx: int) -> bool:
        """Whether the layer with 0-based index `layer_idx` is Post-LN."""
        return layer_idx < self.post_ln_layers

    def norm_output_scale(self, layer_idx: int) -> float:
        """Factor applied to the norm outputs of the layer with 0-based index `layer_idx`.

        1/sqrt(layer_idx + 1) on Pre-LN layers under "lns" / "mixln+lns", else 1.0.
        """
        if self.mixln_scheme == "mixln" or self.is_post_ln_layer(layer_idx):
            return 1.0
        return 1.0 / math.sqrt(layer_idx + 1)


__all__ = ["MIXLN_SCHEMES", "MixLNConfigValueError", "MixLNLlamaConfig"]
