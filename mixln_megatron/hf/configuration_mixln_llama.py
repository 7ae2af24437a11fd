"""Configuration of a Mix-LN / LayerNorm-Scaling LLaMA (arXiv 2412.13795) for Hugging Face transformers.

This file is copied verbatim next to config.json in exported checkpoints (remote code), so it imports
nothing but `transformers`. The fields on top of `LlamaConfig` are listed in MixLNLlamaConfig's docstring,
what each layer kind computes in modeling_mixln_llama.py's. layer_kinds (None: Mix-LN's first-P layout) and
the forward scalars (Megatron's muP and GLU offset) reach config.json only when set, so earlier exports keep
their config.json.

Tested with transformers 5.24; written for transformers >= 4.56, < 6 (the legacy `__init__` style
works with both the v4 configs and the v5 dataclass configs).
"""

import math

from transformers import LlamaConfig

MIXLN_SCHEMES = ("mixln", "lns", "mixln+lns")
LAYER_KINDS = ("pre", "post", "deepnorm", "sandwich")
POST_LN_KINDS = ("post", "deepnorm")  # the residual stream goes through the norm
# Present in config.json only when layer_kinds is given, so that Mix-LN's own layout keeps its config.json.
LAYOUT_FIELDS = ("layer_kinds", "deepnorm_alpha", "deepnorm_beta")
# The forward scalars and their defaults (the default is LLaMA's network): written only when set.
FORWARD_SCALAR_DEFAULTS = {"attention_scale": None, "embedding_multiplier": 1.0, "logits_multiplier": 1.0,
                           "glu_linear_offset": 0.0}
OPTIONAL_FIELDS = dict(FORWARD_SCALAR_DEFAULTS, megatron_mup=None)


class MixLNConfigValueError(ValueError):
    """A Mix-LN field of the config is invalid."""


def _positive_float(name, value, required_by):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise MixLNConfigValueError(f"{name} must be a finite number > 0 ({required_by}), got {value!r:.60}")
    return float(value)


def _check_layer_kinds(layer_kinds, num_hidden_layers):
    """layer_kinds as a list of kinds (validated), or None."""
    if layer_kinds is None:
        return None
    if isinstance(layer_kinds, str) or not isinstance(layer_kinds, (list, tuple)):
        raise MixLNConfigValueError(
            f"layer_kinds must be None or a list with one of {', '.join(LAYER_KINDS)} per layer, "
            f"got {layer_kinds!r:.120}"
        )
    bad = [(i, k) for i, k in enumerate(layer_kinds) if not isinstance(k, str) or k not in LAYER_KINDS]
    if bad:
        i, k = bad[0]
        raise MixLNConfigValueError(
            f"layer_kinds[{i}] = {k!r:.40} is not one of {', '.join(LAYER_KINDS)} ({len(bad)} invalid entr"
            f"{'y' if len(bad) == 1 else 'ies'})"
        )
    if num_hidden_layers is not None and len(layer_kinds) != num_hidden_layers:
        raise MixLNConfigValueError(
            f"layer_kinds has {len(layer_kinds)} entries but num_hidden_layers = {num_hidden_layers}: one kind per layer"
        )
    return list(layer_kinds)


def _check_mixln_fields(post_ln_layers, mixln_scheme, num_hidden_layers, layer_kinds=None, deepnorm_alpha=None,
                        deepnorm_beta=None) -> None:
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
    kinds = _check_layer_kinds(layer_kinds, num_hidden_layers)
    if kinds is not None:
        count = sum(k in POST_LN_KINDS for k in kinds)
        if post_ln_layers != count:
            raise MixLNConfigValueError(
                f"post_ln_layers = {post_ln_layers} but layer_kinds has {count} Post-LN-kind layers "
                f"(post or deepnorm): post_ln_layers must count them"
            )
    if mixln_scheme == "lns" and post_ln_layers != 0:
        raise MixLNConfigValueError(
            f"mixln_scheme 'lns' keeps every layer Pre-LN, but post_ln_layers = {post_ln_layers}; "
            "use mixln_scheme 'mixln+lns' for LayerNorm Scaling on top of Mix-LN"
        )
    has_deepnorm = kinds is not None and "deepnorm" in kinds
    _positive_float("deepnorm_alpha", deepnorm_alpha, "the residual scale of the deepnorm layers")
    _positive_float("deepnorm_beta", deepnorm_beta, "the init factor of the deepnorm layers")
    if has_deepnorm and deepnorm_alpha is None:
        raise MixLNConfigValueError(
            "layer_kinds has deepnorm layers but deepnorm_alpha is None: set their residual scale "
            "(DeepNet's (2 * num_hidden_layers) ** 0.25 unless the model was trained with another)"
        )
    if not has_deepnorm and (deepnorm_alpha is not None or deepnorm_beta is not None):
        name = "deepnorm_alpha" if deepnorm_alpha is not None else "deepnorm_beta"
        raise MixLNConfigValueError(f"{name} is set but no layer is deepnorm (layer_kinds = {layer_kinds!r:.120})")


def mixln_fields(get, num_hidden_layers=None) -> dict:
    """The Mix-LN fields of a config, checked: the one reading that this class's checks, `mixln-megatron
    convert from-hf` (a config.json's dict) and the Megatron-Bridge bridge (a loaded config) share.
    `get(name, default)` reads one field; a null post_ln_layers / mixln_scheme is its default.
    Raises MixLNConfigValueError naming the field."""
    fields = {"post_ln_layers": get("post_ln_layers", 0), "mixln_scheme": get("mixln_scheme", "mixln"),
              "mixln_alpha": get("mixln_alpha", None), "layer_kinds": get("layer_kinds", None),
              "deepnorm_alpha": get("deepnorm_alpha", None), "deepnorm_beta": get("deepnorm_beta", None)}
    fields["post_ln_layers"] = 0 if fields["post_ln_layers"] is None else fields["post_ln_layers"]
    fields["mixln_scheme"] = fields["mixln_scheme"] or "mixln"
    alpha = fields["mixln_alpha"]
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float, str))):
        raise MixLNConfigValueError(f"mixln_alpha must be a number, text or None, got {alpha!r:.60}")
    _check_mixln_fields(fields["post_ln_layers"], fields["mixln_scheme"], num_hidden_layers, fields["layer_kinds"],
                        fields["deepnorm_alpha"], fields["deepnorm_beta"])
    for name in ("deepnorm_alpha", "deepnorm_beta"):
        fields[name] = None if fields[name] is None else float(fields[name])
    return fields


def _finite_float(name, value, positive=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            positive and value <= 0):
        raise MixLNConfigValueError(f"{name} must be a finite number{' > 0' if positive else ''}, got {value!r:.60}")
    return float(value)


def check_forward_scalars(attention_scale=None, embedding_multiplier=1.0, logits_multiplier=1.0,
                          glu_linear_offset=0.0, megatron_mup=None) -> dict:
    """The forward scalars as floats (attention_scale None or > 0, the multipliers > 0, the offset finite)."""
    if megatron_mup is not None and not isinstance(megatron_mup, dict):
        raise MixLNConfigValueError(f"megatron_mup must be an object or None, got {megatron_mup!r:.60}")
    return {
        "attention_scale": None if attention_scale is None else _finite_float("attention_scale", attention_scale, True),
        "embedding_multiplier": _finite_float("embedding_multiplier", embedding_multiplier, True),
        "logits_multiplier": _finite_float("logits_multiplier", logits_multiplier, True),
        "glu_linear_offset": _finite_float("glu_linear_offset", glu_linear_offset),
        "megatron_mup": megatron_mup,
    }


class MixLNLlamaConfig(LlamaConfig):
    r"""LLaMA configuration with Mix-LN / LayerNorm Scaling norm placement, and any per-layer kind.

    Args:
        post_ln_layers (`int`, defaults to 0): number P of Post-LN-kind layers, "post" and "deepnorm"
            (0 <= P <= num_hidden_layers); without `layer_kinds`, the first P layers.
        mixln_scheme (`str`, defaults to `"mixln"`): `"mixln"` (no scaling), `"lns"` (LayerNorm Scaling, P = 0:
            the pre-norm outputs of layer l (1-based) times 1/sqrt(l)) or `"mixln+lns"` (that scale on the "pre"
            and "sandwich" layers).
        mixln_alpha (`str`, *optional*): informational record of the alpha that gave P (numbers are stored as text).
        layer_kinds (`list[str]`, *optional*): one of `"pre"`, `"post"`, `"deepnorm"`, `"sandwich"` per layer;
            None means the first P layers `"post"`, the rest `"pre"`.
        deepnorm_alpha (`float`, *optional*): residual scale of the `"deepnorm"` layers (required iff one exists).
        deepnorm_beta (`float`, *optional*): informational record of their init factor in training.
        attention_scale (`float`, *optional*): softmax scale of q.k; None means 1/sqrt(head_dim).
        embedding_multiplier (`float`, defaults to 1.0): factor on the token embeddings (mup_embedding_mult).
        logits_multiplier (`float`, defaults to 1.0): factor on the output logits (mup_output_mult).
        glu_linear_offset (`float`, defaults to 0.0): the MLP computes silu(gate) * (up + offset)
            (--glu-linear-offset).
        megatron_mup (`dict`, *optional*): informational record of Megatron's muP flags.
        kwargs: every `LlamaConfig` argument.
    """

    model_type = "mixln_llama"

    def __init__(self, post_ln_layers: int = 0, mixln_scheme: str = "mixln", mixln_alpha=None, layer_kinds=None,
                 deepnorm_alpha=None, deepnorm_beta=None, attention_scale=None, embedding_multiplier=1.0,
                 logits_multiplier=1.0, glu_linear_offset=0.0, megatron_mup=None, **kwargs):
        # Set before the parent init so that validation hooks running inside it can see them.
        if isinstance(mixln_alpha, (int, float)) and not isinstance(mixln_alpha, bool):
            mixln_alpha = repr(mixln_alpha) if isinstance(mixln_alpha, float) else str(mixln_alpha)
        if mixln_alpha is not None and not isinstance(mixln_alpha, str):
            raise MixLNConfigValueError(f"mixln_alpha must be a string or None, got {mixln_alpha!r}")
        self.post_ln_layers = post_ln_layers
        self.mixln_scheme = mixln_scheme
        self.mixln_alpha = mixln_alpha
        self.layer_kinds = _check_layer_kinds(layer_kinds, None)  # a list (JSON), the length checked below
        self.deepnorm_alpha = _positive_float("deepnorm_alpha", deepnorm_alpha, "the residual scale of the deepnorm layers")
        self.deepnorm_beta = _positive_float("deepnorm_beta", deepnorm_beta, "the init factor of the deepnorm layers")
        for name, value in check_forward_scalars(attention_scale, embedding_multiplier, logits_multiplier,
                                                 glu_linear_offset, megatron_mup).items():
            setattr(self, name, value)
        super().__init__(**kwargs)
        self.validate_mixln()

    def validate_mixln(self) -> None:
        """Raise `MixLNConfigValueError` (a `ValueError`) when the Mix-LN fields are inconsistent."""
        _check_mixln_fields(self.post_ln_layers, self.mixln_scheme, getattr(self, "num_hidden_layers", None),
                            getattr(self, "layer_kinds", None), getattr(self, "deepnorm_alpha", None),
                            getattr(self, "deepnorm_beta", None))

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

    def to_dict(self):
        out = super().to_dict()
        if out.get("layer_kinds") is None:
            # Mix-LN's own layout: config.json stays what it was before layer_kinds existed.
            for key in LAYOUT_FIELDS:
                if out.get(key) is None:
                    out.pop(key, None)
        for key, default in OPTIONAL_FIELDS.items():  # LLaMA's forward: config.json as before these fields
            if key in out and out[key] == default:
                out.pop(key)
        return out

    def layer_kind(self, layer_idx: int) -> str:
        """"pre", "post", "deepnorm" or "sandwich": the kind of the layer with 0-based index `layer_idx`."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_hidden_layers:
            raise IndexError(f"layer_idx {layer_idx!r} outside 0..{self.num_hidden_layers - 1}")
        if self.layer_kinds is not None:
            return self.layer_kinds[layer_idx]
        return "post" if layer_idx < self.post_ln_layers else "pre"

    def is_post_ln_layer(self, layer_idx: int) -> bool:
        """Whether the layer with 0-based index `layer_idx` is of a Post-LN kind ("post" or "deepnorm")."""
        return self.layer_kind(layer_idx) in POST_LN_KINDS

    def norm_output_scale(self, layer_idx: int) -> float:
        """Factor applied to the pre-norm outputs of the layer with 0-based index `layer_idx`.

        1/sqrt(layer_idx + 1) on "pre" and "sandwich" layers under "lns" / "mixln+lns", else 1.0 (never on
        Post-LN kinds, and never on the norms a sandwich layer applies after attention and MLP).
        """
        if self.mixln_scheme == "mixln" or self.is_post_ln_layer(layer_idx):
            return 1.0
        return 1.0 / math.sqrt(layer_idx + 1)


__all__ = ["FORWARD_SCALAR_DEFAULTS", "LAYER_KINDS", "MIXLN_SCHEMES", "check_forward_scalars", "MixLNConfigValueError", "MixLNLlamaConfig", "POST_LN_KINDS", "mixln_fields"]
