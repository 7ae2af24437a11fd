"""MixLNTransformerLayer: megatron's TransformerLayer, of the kind the placement gives its global layer.

Pre-LN (megatron as is):  h = x + Attn(N_in(x));           y = h + MLP(N_mlp(h))
Post-LN (this module):    h = N1(x + Attn(x));             y = N2(h + MLP(h))
DeepNorm (Post-LN):       h = N1(a * x + Attn(x));         y = N2(a * h + MLP(h))
Sandwich (Pre-LN):        h = x + N_b(Attn(N_in(x)));      y = h + N_d(MLP(N_mlp(h)))

The kind is decided once, before TransformerLayer.__init__, from the global 1-based layer_number
(megatron's offset already accounts for PP, VPP and layouts), so one spec serves every layer and
every pipeline split builds the same network. A HybridModel `*` / `-` layer is this class with
attention / MLP only, numbered by transformer block (hybrid_pattern.py).

The Post-LN layer reuses megatron's attention, MLP and bias-dropout-add; only the norms move: N1
runs at the end of `_forward_attention`, N2 at the end of the MLP residual step (the methods
CUDA-graph capture calls, so the norms live inside the captured paths). DeepNorm's residual scale
and Sandwich's output norms wrap the bias-dropout-add steps (ResidualStep). Checkpoint keys: the
table in docs/checkpoints.md; DeepNorm's init: docs/configuration.md and CONTRIBUTING.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Optional

import torch

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)
from megatron.core.utils import get_pg_rank, make_viewless_tensor

from .. import compat
from . import backends, checkpoint as mixln_checkpoint, hybrid_pattern as hybrid, layout, qkv_layout
from .checkpoint import MIXLN_NORM_A, MIXLN_NORM_B, MIXLN_NORM_C, MIXLN_NORM_D
from .support import MixLNUnsupportedError, check_kind_supported, check_supported
from .placement import MixLNSettings, Placement, resolve_placement


# Where each norm of a Mix-LN model (P > 0 or LNS) is stored in sharded checkpoints. Both
# backends' Pre-LN names map, so the TE and local layouts are one layout.
PRE_LN_KEYS_MAP = {
    "input_layernorm.": MIXLN_NORM_A,
    "self_attention.linear_qkv.layer_norm_": MIXLN_NORM_A,
    "pre_mlp_layernorm.": MIXLN_NORM_B,
    "mlp.linear_fc1.layer_norm_": MIXLN_NORM_B,
}
POST_LN_KEYS_MAP = {
    "post_attention_layernorm.": MIXLN_NORM_B,
    "post_mlp_layernorm.": MIXLN_NORM_A,
}
POST_LN_NORM_NAMES = ("post_attention_layernorm", "post_mlp_layernorm")
# A sandwich layer's output norms N_b, N_d and their keys (stacked over the sandwich layers only).
SANDWICH_KEYS_MAP = {
    "attn_output_layernorm.": MIXLN_NORM_C,
    "mlp_output_layernorm.": MIXLN_NORM_D,
}
SANDWICH_NORM_NAMES = ("attn_output_layernorm", "mlp_output_layernorm")


_ON_LAYER_BUILT = "_mixln_on_layer_built"


def on_layer_built(config, callback) -> None:
    """Call `callback(layer)` for every MixLNTransformerLayer built from now on with `config`
    (idempotent): how hooks installed before the build reach the layers. On the config because
    megatron-core has no layer-built hook (torch's module-registration hook is process-wide)."""
    config = getattr(config, "transformer", config)
    callbacks = config.__dict__.setdefault(_ON_LAYER_BUILT, [])
    if callback not in callbacks:
        callbacks.append(callback)


def remove_on_layer_built(config, callback) -> None:
    """Undo on_layer_built(config, callback); the config is as before once no callback is left."""
    config = getattr(config, "transformer", config)
    callbacks = config.__dict__.get(_ON_LAYER_BUILT, [])
    if callback in callbacks:
        callbacks.remove(callback)
    if not callbacks:
        config.__dict__.pop(_ON_LAYER_BUILT, None)


def _without_fused_norm(spec):
    """Copy of an attention / MLP spec with any fused norm+linear replaced by a plain linear."""
    if isinstance(spec, functools.partial):  # MLP.as_mlp_submodule builders (megatron-core 0.18+)
        subs = spec.keywords.get("submodules")
        if subs is None or not hasattr(subs, "linear_fc1"):
            return spec
        new_subs = dataclasses.replace(subs, linear_fc1=backends.post_ln_linear(subs.linear_fc1))
        return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": new_subs})
    if isinstance(spec, ModuleSpec) and spec.submodules is not None and dataclasses.is_dataclass(spec.submodules):
        field = "linear_qkv" if hasattr(spec.submodules, "linear_qkv") else (
            "linear_fc1" if hasattr(spec.submodules, "linear_fc1") else None)
        if field is None:
            return spec
        new_subs = dataclasses.replace(
            spec.submodules, **{field: backends.post_ln_linear(getattr(spec.submodules, field))}
        )
        # replace() keeps every other field of the spec (metainfo included)
        return dataclasses.replace(spec, params=dict(spec.params), submodules=new_subs)
    return spec


def post_ln_submodules(submodules: TransformerLayerSubmodules) -> TransformerLayerSubmodules:
    """The Post-LN variant of the submodules a layer received; the shared spec is never mutated."""
    return dataclasses.replace(
        submodules,
        input_layernorm=IdentityOp,
        pre_mlp_layernorm=IdentityOp,
        self_attention=_without_fused_norm(submodules.self_attention),
        mlp=_without_fused_norm(submodules.mlp),
        sharded_state_dict_keys_map=dict(POST_LN_KEYS_MAP),
    )


def _check_extra_state_empty(key: str, item) -> None:
    """A Post-LN norm's `_extra_state` is dropped from sharded checkpoints; refuse to drop state."""
    state = getattr(item, "data", item)
    if state is None or (torch.is_tensor(state) and state.numel() == 0):
        return
    if isinstance(state, (bytes, bytearray, dict, list, tuple)) and len(state) == 0:
        return
    if hasattr(state, "getbuffer") and state.getbuffer().nbytes == 0:  # io.BytesIO
        return
    raise RuntimeError(
        f"{key} is not empty ({type(state).__name__}); Mix-LN drops a Post-LN norm's extra state "
        "from sharded checkpoints (torch_dist stacks it over all layers), which would lose it. "
        "Save without fp8 state in the norms, or report this configuration to mixln_megatron"
    )


class ResidualStep:
    """A deepnorm or sandwich layer's bias-dropout-add, megatron's own called as megatron calls
    it, `bda(training, fusion)(out_with_bias, residual, dropout)`, with (deepnorm) the residual
    times `residual_scale` or (sandwich) the sublayer output through `output_norm` first.
    A plain object, not a Module: the norm is the layer's own submodule."""

    def __init__(self, bda, residual_scale: float = 1.0, output_norm=None):
        self.bda, self.residual_scale, self.output_norm = bda, float(residual_scale), output_norm

    def __call__(self, training: bool, fused: bool):
        inner = self.bda(training, fused)

        def step(x_with_bias, residual, prob):
            if self.output_norm is not None:
                out, bias = x_with_bias
                if bias is not None:
                    out = out + bias
                x_with_bias = (self.output_norm(out), None)
            if self.residual_scale != 1.0:
                residual = residual * self.residual_scale
            return inner(x_with_bias, residual, prob)

        return step


def value_rows(weight_rows: int, attention) -> slice:
    """The value rows of (a TP shard of) megatron's fused linear_qkv, as [groups, rows] indices
    (model.qkv_layout)."""
    groups = attention.num_query_groups_per_partition
    heads = attention.num_attention_heads_per_partition
    dim = attention.hidden_size_per_attention_head
    if heads % groups or groups * qkv_layout.group_rows(heads // groups, dim) != weight_rows:
        raise MixLNUnsupportedError(
            f"DeepNorm's init cannot find the value rows of linear_qkv ({weight_rows} rows for {groups} query "
            f"groups of {heads // max(groups, 1)} heads of {dim}): a QKV layout other than megatron's [q, k, v] per group")
    return qkv_layout.value_rows(heads // groups, dim)


def expert_linears(mlp) -> list:
    """The fc1 / fc2 linears of an MoE MLP's experts and shared experts (empty for a dense MLP):
    one MLP per sequential expert, one grouped linear per projection for grouped-GEMM experts."""
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


@contextlib.contextmanager
def output_layers_at_base_init(config):
    """While a deepnorm layer is built, linear_proj and linear_fc2 draw from the base init, not
    megatron's depth-scaled output-layer init (why: CONTRIBUTING.md, DeepNorm's output
    projections). Only for the construction, which reads every init method; undone on failure."""
    saved = config.output_layer_init_method
    config.output_layer_init_method = config.init_method
    try:
        yield
    finally:
        config.output_layer_init_method = saved


@compat.keep_release_hooks  # only the MLP residual-step override this release calls stays
class MixLNTransformerLayer(TransformerLayer):
    """A TransformerLayer of the kind the placement gives its global layer (`kind`; `is_post_ln`
    for post and deepnorm). Extra spec params: `mixln_settings` (None: environment, then
    defaults) and `post_ln_norm`, the class of N1 / N2 / N_b / N_d, called as (config=,
    hidden_size=, eps=)."""

    def __init__(
        self,
        config,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: Optional[float] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        vp_stage: Optional[int] = None,
        is_mtp_layer: bool = False,
        add_layer_offset: bool = True,
        mixln_settings: Optional[MixLNSettings] = None,
        post_ln_norm=None,
        hybrid_part: Optional[str] = None,
        **kwargs,
    ):
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        # Same global numbering TransformerLayer computes, needed before its __init__ builds modules.
        if is_mtp_layer or not add_layer_offset:
            global_number = layer_number
        else:
            global_number = layer_number + get_transformer_layer_offset(
                config, vp_stage, get_pg_rank(pg_collection.pp)
            )
        # The placement counts transformer blocks: a GPT layer is one block, a HybridModel `*` / `-`
        # layer is half of one (hybrid_part, see hybrid.py).
        self.hybrid_part = hybrid_part
        self.block_number = hybrid.block_number(global_number, hybrid_part)
        num_blocks = hybrid.num_blocks(config.num_layers, hybrid_part)
        self.placement: Placement = resolve_placement(num_blocks, mixln_settings)
        # MTP layers (after the decoder, megatron's stock spec) stay Pre-LN if one ever gets here.
        self.kind = layout.PRE if is_mtp_layer else self.placement.kind(self.block_number)
        self.is_post_ln = self.kind in layout.POST_LN_KINDS  # post and deepnorm
        self.norm_output_scale = 1.0 if is_mtp_layer else self.placement.norm_output_scale(self.block_number)
        check_supported(config, backend=backends.backend_of_norm(post_ln_norm), post_ln=self.is_post_ln)
        check_kind_supported(config, self.kind)
        # A sandwich layer's place among the model's sandwich layers: its row of mixln_norm_c / _d.
        rows = layout.sandwich_rows(self.placement.kinds)
        self.sandwich_index = rows.get(self.block_number - 1)  # None unless a sandwich layer
        self.sandwich_count = len(rows)
        if (self.is_post_ln or self.kind == layout.SANDWICH) and post_ln_norm is None:
            raise ValueError(
                "MixLNTransformerLayer needs `post_ln_norm` in its spec params; build the spec "
                "with mixln_megatron.spec.MixLNTransformerLayerSpec(...)"
            )
        if self.is_post_ln:
            submodules = post_ln_submodules(submodules)
        elif self.kind == layout.SANDWICH:
            submodules = dataclasses.replace(
                submodules, sharded_state_dict_keys_map={**PRE_LN_KEYS_MAP, **SANDWICH_KEYS_MAP})
        elif not self.placement.is_stock:
            submodules = dataclasses.replace(submodules, sharded_state_dict_keys_map=dict(PRE_LN_KEYS_MAP))
        deepnorm_init = self.kind == layout.DEEPNORM and getattr(config, "perform_initialization", True)
        with output_layers_at_base_init(config) if deepnorm_init else contextlib.nullcontext():
            super().__init__(
                config,
                submodules,
                layer_number=layer_number,
                hidden_dropout=hidden_dropout,
                pg_collection=pg_collection,
                vp_stage=vp_stage,
                is_mtp_layer=is_mtp_layer,
                add_layer_offset=add_layer_offset,
                **kwargs,
            )
        assert self.layer_number == global_number, (self.layer_number, global_number)
        # Never the fused-residual RMSNorm: the residual add happens in bias-dropout-add.
        make = None if post_ln_norm is None else functools.partial(
            post_ln_norm, config=self.config, hidden_size=self.config.hidden_size,
            eps=self.config.layernorm_epsilon,
        )
        # A hybrid `*` layer has only the attention residual step, a `-` layer only the MLP's: each
        # changes (and holds the norm of) its own step; the other half's step is an identity.
        has_attention, has_mlp = hybrid_part != hybrid.MLP, hybrid_part != hybrid.ATTENTION
        if self.is_post_ln:
            self.post_attention_layernorm = make() if has_attention else None  # N1
            self.post_mlp_layernorm = make() if has_mlp else None  # N2
        if self.kind == layout.DEEPNORM:
            alpha = self.placement.deepnorm_alpha
            if has_attention:
                self.self_attn_bda = ResidualStep(self.self_attn_bda, residual_scale=alpha)  # N1(a x + Attn(x))
            if has_mlp:
                self.mlp_bda = ResidualStep(self.mlp_bda, residual_scale=alpha)  # N2(a h + MLP(h))
            if self.config.perform_initialization:
                self._apply_deepnorm_init(self.placement.deepnorm_beta)
        if self.kind == layout.SANDWICH:
            self.attn_output_layernorm = make() if has_attention else None  # N_b
            self.mlp_output_layernorm = make() if has_mlp else None  # N_d
            if has_attention:
                self.self_attn_bda = ResidualStep(self.self_attn_bda, output_norm=self.attn_output_layernorm)
            if has_mlp:
                self.mlp_bda = ResidualStep(self.mlp_bda, output_norm=self.mlp_output_layernorm)
        if not self.is_post_ln and self.norm_output_scale != 1.0:
            self._apply_layernorm_scaling()
        self._register_state_dict_hook(
            lambda module, state_dict, prefix, _meta: mixln_checkpoint.add_legacy_record(module, state_dict, prefix)
        )
        for callback in getattr(self.config, _ON_LAYER_BUILT, ()):
            callback(self)  # e.g. the spike scaler's checkpoint state (see on_layer_built)

    # ---------------------------------------------------------------- the two norms
    def norm_parameters(self) -> list:
        """[(role, parameter)] of this layer's norms (spike scaler, telemetry, analysis). Roles,
        whatever the backend: 'norm1.<name>' / 'norm2.<name>' the first / second norm in forward
        order, a sandwich layer's N_b / N_d 'norm3.' / 'norm4.'; <name> 'weight' (and 'bias')."""
        def own(module):
            return list(module.named_parameters()) if module is not None else []

        def fused(linear):  # TE LayerNormLinear: only its layer_norm_* parameters are the norm's
            params = linear.named_parameters(recurse=False) if linear is not None else []
            return [(n[len("layer_norm_"):], p) for n, p in params if n.startswith("layer_norm_")]

        if self.is_post_ln:
            groups = (own(self.post_attention_layernorm), own(self.post_mlp_layernorm))
        else:
            groups = (
                own(self.input_layernorm) or fused(getattr(self.self_attention, "linear_qkv", None)),
                own(self.pre_mlp_layernorm) or fused(getattr(self.mlp, "linear_fc1", None)),
            )
            if self.kind == layout.SANDWICH:  # N_b, N_d: norm3, norm4
                groups += (own(self.attn_output_layernorm), own(self.mlp_output_layernorm))
        # A hybrid layer holds one of its block's two norms: `*` norm1, `-` norm2 (the other
        # group is empty), so (block_number, role) names a norm in both model kinds.
        return [(f"norm{i}.{name}", p) for i, params in enumerate(groups, 1) for name, p in params]

    # ---------------------------------------------------------------- DeepNorm's init
    @torch.no_grad()
    def _apply_deepnorm_init(self, beta: float) -> None:
        """DeepNet's init on this TP shard's weights as megatron made them: fc1, fc2 (each
        expert's too), linear_proj and linear_qkv's value rows times `beta`; the rest unchanged."""
        attention, mlp = self.self_attention, self.mlp
        for module, name in ((mlp, "linear_fc1"), (mlp, "linear_fc2"), (attention, "linear_proj")):
            linear = getattr(module, name, None)
            if linear is not None and getattr(linear, "weight", None) is not None:
                linear.weight.mul_(beta)
        for linear in expert_linears(mlp):  # an MoE MLP: every expert's fc1 / fc2
            for weight in linear_weights(linear):
                weight.mul_(beta)
        qkv = getattr(attention, "linear_qkv", None)
        if qkv is not None and getattr(qkv, "weight", None) is not None:
            weight = qkv.weight
            rows = value_rows(weight.shape[0], attention)
            groups = attention.num_query_groups_per_partition
            weight.view(groups, -1, *weight.shape[1:])[:, rows].mul_(beta)

    # ---------------------------------------------------------------- LayerNorm Scaling
    def _apply_layernorm_scaling(self) -> None:
        """Scale the output of both pre-norms by 1/sqrt(l); the stored weights stay untouched."""
        backends.set_norm_output_scale(self, self.norm_output_scale)

    # ---------------------------------------------------------------- forward
    def _forward_attention(self, *args, **kwargs):
        hidden_states, context = super()._forward_attention(*args, **kwargs)
        if self.is_post_ln and self.post_attention_layernorm is not None:
            hidden_states = self.post_attention_layernorm(hidden_states)  # h = N1(x + Attn(x))
        return hidden_states, context

    def _apply_mlp_bda_step(self, mlp_output_with_bias, residual, mlp_state=()):  # 0.20+
        return self._after_mlp_residual(super()._apply_mlp_bda_step(mlp_output_with_bias, residual, mlp_state))

    def _forward_post_mlp(self, mlp_output_with_bias, residual):  # 0.17-0.19
        return self._after_mlp_residual(super()._forward_post_mlp(mlp_output_with_bias, residual))

    def _after_mlp_residual(self, output):
        if not self.is_post_ln or self.post_mlp_layernorm is None:
            return output
        output = self.post_mlp_layernorm(output)  # y = N2(h + MLP(h))
        # Pipeline send and activation checkpointing need a view-less tensor.
        return make_viewless_tensor(inp=output, requires_grad=output.requires_grad, keep_graph=True)

    # ---------------------------------------------------------------- CUDA graphs
    def _get_submodules_under_cudagraphs(self):
        """Add N1 / N2 (sandwich: N_b / N_d), which run inside the attention / MLP paths, to the
        modules a scoped CUDA graph covers: DDP's pre-replay hooks wait only for listed ones."""
        submodules = super()._get_submodules_under_cudagraphs()
        if not self.extra_norm_names or not self.config.cuda_graph_modules:
            return submodules  # unscoped: megatron lists the whole layer
        # Post-LN: N1 follows attention, N2 the MLP; sandwich: N_b follows attention, N_d the MLP.
        first, second = (getattr(self, name) for name in self.extra_norm_names)
        scoped = [(self.self_attention, first), (self.mlp, second)]
        return submodules + [
            norm for block, norm in scoped
            if norm is not None and any(m is block for m in submodules) and not any(m is norm for m in submodules)
        ]

    # ---------------------------------------------------------------- checkpoints
    @property
    def extra_norm_names(self) -> tuple:
        """The norms megatron's TransformerLayer does not have: Post-LN N1 / N2, sandwich N_b / N_d."""
        if self.is_post_ln:
            return POST_LN_NORM_NAMES
        return SANDWICH_NORM_NAMES if self.kind == layout.SANDWICH else ()

    @property
    def norms_without_extra_state(self) -> tuple:
        """The norms whose `_extra_state` stays out of sharded checkpoints: the extra norms, and in
        a Mix-LN-keyed model an MoE layer's standalone TE pre-MLP norm (the other layers' mixln_norm_b
        has no such state)."""
        standalone = not self.placement.is_stock and not isinstance(self.pre_mlp_layernorm, IdentityOp) \
            and type(self.pre_mlp_layernorm).get_extra_state is not torch.nn.Module.get_extra_state
        return self.extra_norm_names + (("pre_mlp_layernorm",) if standalone else ())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.kind == layout.SANDWICH:
            self._stack_over_sandwich_layers(sharded, prefix, sharded_offsets, metadata)
        if self.norms_without_extra_state:
            # TE norms carry an (empty, fp8-less) `_extra_state`; Pre-LN layers have no such key,
            # and torch_dist stacks every per-layer key over all layers, so it must not appear.
            for key in [k for k in sharded if k.endswith("_extra_state")]:
                if any(key.startswith(f"{prefix}{name}.") for name in self.norms_without_extra_state):
                    _check_extra_state_empty(key, sharded[key])
                    del sharded[key]
        mixln_checkpoint.add_settings_record(self, sharded, prefix, metadata)
        return sharded

    def _stack_over_sandwich_layers(self, sharded: dict, prefix: str, sharded_offsets: tuple, metadata) -> None:
        """N_b / N_d under mixln_norm_c / _d, their layer axis (0, rank among the sandwich layers,
        S) instead of TransformerBlock's (0, global layer - 1, L): torch_dist needs a stacked key
        to cover its whole axis. Without a layer axis (per-layer keys) nothing changes."""
        from megatron.core.dist_checkpointing.utils import apply_prefix_mapping
        from megatron.core.transformer.utils import sharded_state_dict_default

        if not sharded_offsets:
            return
        axis, global_layer, num_layers = sharded_offsets[0]
        if (axis, global_layer, num_layers) != (0, self.layer_number - 1, self.config.num_layers):
            raise RuntimeError(
                f"{prefix}: unexpected layer offset {sharded_offsets[0]} for layer {self.layer_number} of "
                f"{self.config.num_layers}; the sandwich norms cannot be stacked over the sandwich layers")
        offsets = ((0, self.sandwich_index, self.sandwich_count),) + tuple(sharded_offsets[1:])
        for name, key in zip(SANDWICH_NORM_NAMES, (MIXLN_NORM_C, MIXLN_NORM_D)):
            for k in [k for k in sharded if k.startswith(f"{prefix}{name}.")]:
                del sharded[k]
            own = sharded_state_dict_default(getattr(self, name), f"{prefix}{name}.", offsets, metadata,
                                             tp_group=self.tp_group)
            apply_prefix_mapping(own, {f"{prefix}{name}.": f"{prefix}{key}"})
            sharded.update(own)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        mixln_checkpoint.check_settings_record(self, state_dict, prefix, error_msgs)
        # The dropped `_extra_state` entries (see sharded_state_dict): keep the module's own.
        for name in self.norms_without_extra_state:
            module = getattr(self, name)
            key = f"{prefix}{name}._extra_state"
            if (
                module is not None
                and type(module).get_extra_state is not torch.nn.Module.get_extra_state
                and key not in state_dict
            ):
                state_dict[key] = module.get_extra_state()
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
