"""Which layers of a model are MoE layers: megatron's --moe-layer-freq read once for the Mix-LN specs.

A layer kind is defined on the transformer block, so an MoE layer takes the same norms as a dense
one (Post-LN: y = N2(h + MoE(h)); Sandwich: N_c before the router, N_d on the MoE output); only
the MLP differs. Routing, the experts and their parallelism are megatron's. A mixed stack (e.g.
dense first layers, `moe_layer_freq=[0, 1, 1, 1]`) gives each layer its MLP by its global
0-based index, the way megatron's own decoder spec does, so every pipeline split builds the same
network.
"""

from __future__ import annotations

from typing import Optional

from .support import MixLNUnsupportedError


def moe_layer_pattern(config) -> list:
    """[bool] per global layer: True for an MoE layer. A dense config: all False."""
    config = getattr(config, "transformer", config)
    if not getattr(config, "num_moe_experts", None):
        return [False] * config.num_layers
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int):  # one MoE layer every `freq` layers, the first one included
        return [i % freq == 0 for i in range(config.num_layers)]
    if isinstance(freq, (list, tuple)) and len(freq) == config.num_layers and set(freq) <= {0, 1}:
        return [bool(v) for v in freq]
    raise MixLNUnsupportedError(
        f"moe_layer_freq must be an int or a list of 0/1 per layer ({config.num_layers} layers), "
        f"got {freq!r}")


def uniform_moe(config) -> bool:
    """Whether every layer is an MoE layer (False: every layer dense); a mixed stack is refused,
    because a single layer spec (the 0.17/0.18 `--spec` path) builds every layer alike."""
    pattern = moe_layer_pattern(config)
    if len(set(pattern)) > 1:
        raise MixLNUnsupportedError(
            f"a mixed dense/MoE stack (moe_layer_freq={getattr(config, 'moe_layer_freq', None)!r}) needs one "
            "spec per layer: build the decoder with get_mixln_decoder_block_spec (megatron-core 0.19+'s "
            "--spec call, or the mixln-megatron pretrain entry point)")
    return bool(pattern and pattern[0])


def stage_layer_ids(config, num_layers: int, vp_stage: Optional[int], pp_rank: Optional[int]) -> list:
    """The global 0-based indices of the `num_layers` layers this (virtual) pipeline stage builds."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:
        from megatron.core.transformer.enums import LayerType

        return list(layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank))
    offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
    return list(range(offset, offset + num_layers))


def expert_linears(mlp) -> list:
    """The fc1 / fc2 linears of an MoE MLP's experts and shared experts (empty for a dense MLP):
    sequential experts hold one MLP each, grouped-GEMM experts one grouped linear per projection
    (weights weight0..weightN-1). DeepNorm's init scales them like a dense MLP's; the router and
    the shared-expert gate stay as megatron made them."""
    found = []
    for part in ("experts", "shared_experts"):
        module = getattr(mlp, part, None)
        if module is None:
            continue
        found += [linear for name, linear in module.named_modules()
                  if name.rpartition(".")[2] in ("linear_fc1", "linear_fc2")]
    return found


def linear_weights(linear) -> list:
    """A linear's own weight tensors: `weight`, or a grouped linear's weight0, weight1, ..."""
    return [p for name, p in linear.named_parameters(recurse=False)
            if name == "weight" or (name.startswith("weight") and name[len("weight"):].isdigit())]
