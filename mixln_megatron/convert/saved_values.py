"""The shapes of what a checkpoint saves beside its tensors: the Mix-LN settings record,
Megatron-LM's args and its common state. Read from untrusted files, each is checked here (type
and range) before any reader uses it, so a value of an allowed class but the wrong shape is one
ConversionError naming the file, not an AttributeError deep in a reader. The readers
(torch_dist_reader, legacy_reader) and convert.inspect all check through this module.
"""

from __future__ import annotations

import argparse
import numbers

from ..errors import ConversionError

_RECORD_INTS = ("format", "num_layers", "post_ln_layers")
# args fields convert and analysis read: (name, allowed types); None is allowed for every one
_ARGS_FIELDS = (
    (("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
      "max_position_embeddings", "seq_length", "padded_vocab_size", "vocab_size", "mixln_post_ln_layers",
      "make_vocab_size_divisible_by", "tensor_model_parallel_size", "pipeline_model_parallel_size"), "int"),
    (("norm_epsilon", "layernorm_epsilon", "rotary_base", "rotary_percent", "rope_scaling_factor",
      "rotary_seq_len_interpolation_factor"), "number"),
    (("normalization", "position_embedding_type", "hybrid_layer_pattern", "mixln_scheme", "mixln_layout",
      "mixln_deepnorm_alpha", "mixln_deepnorm_beta"), "str"),
    (("swiglu", "add_bias_linear", "untie_embeddings_and_output_weights", "group_query_attention",
      "layernorm_zero_centered_gamma", "use_rope_scaling", "add_qkv_bias"), "bool"),
)
_MAX_COUNT = 1 << 40


def _is(value, kind: str) -> bool:
    if value is None:
        return True
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_COUNT
    if kind == "number":
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    return isinstance(value, bool)


def check_record(record, where: str) -> dict:
    """The Mix-LN settings record read from `where`: a dict with int format / num_layers /
    post_ln_layers, a string scheme and an alpha (number or text); one ConversionError otherwise."""
    if not isinstance(record, dict) or not all(isinstance(k, str) for k in record):
        raise ConversionError(f"{where}: the Mix-LN settings record is a {type(record).__name__}, not the "
                              "record's dict (a damaged or crafted checkpoint?)")
    for key in _RECORD_INTS:
        if not _is(record.get(key), "int"):
            raise ConversionError(f"{where}: the Mix-LN settings record's {key} is {record[key]!r:.60}, not a "
                                  "non-negative integer (a damaged or crafted checkpoint?)")
    if not _is(record.get("scheme"), "str") or not (record.get("alpha") is None or _is(record["alpha"], "str")
                                                     or _is(record["alpha"], "number")):
        raise ConversionError(f"{where}: the Mix-LN settings record's scheme / alpha are not text / a number "
                              "(a damaged or crafted checkpoint?)")
    layout = record.get("layout")
    if not _is(layout, "str") or not all(_is(record.get(k), "number") for k in ("deepnorm_alpha", "deepnorm_beta")):
        raise ConversionError(f"{where}: the Mix-LN settings record's layout / deepnorm_alpha / deepnorm_beta are "
                              "not text / numbers (a damaged or crafted checkpoint?)")
    if layout is not None:
        from ..errors import MixLNConfigError
        from ..model.layout import parse_layout

        try:  # bounded: parse_layout refuses text over 4 KiB, and L is checked above
            if record.get("num_layers") is None or record["num_layers"] > 1 << 16:
                raise MixLNConfigError("the record's num_layers is missing or over 65536")
            parse_layout(layout, record["num_layers"], "the record")
        except MixLNConfigError as e:
            raise ConversionError(f"{where}: the Mix-LN settings record's layout is not one this project "
                                  f"writes ({e}); a damaged or crafted checkpoint?") from None
    return record


def check_args(args, where: str):
    """The saved args: an argparse.Namespace (or None) whose model fields have their types."""
    if args is None:
        return None
    if not isinstance(args, argparse.Namespace):
        raise ConversionError(f"{where}: the saved args are a {type(args).__name__}, not Megatron-LM's "
                              "argparse.Namespace (a damaged or crafted checkpoint?)")
    for names, kind in _ARGS_FIELDS:
        for name in names:
            value = getattr(args, name, None)
            if not _is(value, kind):
                want = {"int": "a non-negative integer", "number": "a number", "str": "text",
                        "bool": "true or false"}[kind]
                raise ConversionError(f"{where}: the saved args have {name} = {value!r:.60}, not {want} "
                                      "(a damaged or crafted checkpoint?)")
    return args


def check_common_state(common, where: str) -> dict:
    """Megatron-LM's common state (common.pt, the common_state item, a legacy rank file): a dict
    whose `args` are checked (check_args), `iteration` an int, `content_metadata` a dict or None
    (its `mixln` entry a record)."""
    if not isinstance(common, dict):
        raise ConversionError(f"{where}: the checkpoint's common state is a {type(common).__name__}, not a dict "
                              "(a damaged or crafted checkpoint?)")
    check_args(common.get("args"), where)
    iteration = common.get("iteration")
    if iteration is not None and not _is(iteration, "int"):
        raise ConversionError(f"{where}: the saved iteration is {iteration!r:.60}, not a non-negative integer "
                              "(a damaged or crafted checkpoint?)")
    meta = common.get("content_metadata")
    if meta is not None:
        if not isinstance(meta, dict):
            raise ConversionError(f"{where}: the content metadata is a {type(meta).__name__}, not a dict "
                                  "(a damaged or crafted checkpoint?)")
        if meta.get("mixln") is not None:
            check_record(meta["mixln"], f"{where} (content metadata)")
    return common
