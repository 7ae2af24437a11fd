"""Every megatron-core MoE setting, and what a Hugging Face conversion, the analysis loader and the
Megatron-Bridge MoE export do with it: one table (TABLE), read by convert.shape (MoEShape),
analysis.loading and bridge.moe, and shown in docs/conversion.md (scripts/moe_table.py).

Each row is one TransformerConfig field (every field whose name holds "moe" or "expert", in any
supported release 0.17-0.20; tests/test_moe_fields.py walks the installed release's fields) with:
  handling   carried     the exported model computes the same (an HF config field / MoEShape field)
             folded      carried by rewriting weights (the top-k scaling factor into each expert's fc2)
             refused     the conversion stops with one line naming the flag, when the setting is on
             training    changes only training (losses, bias updates, logging): the export is unchanged
             execution   how the experts run (dispatchers, kernels, parallel sizes, memory): same weights
  check      for a carried row: the values no HF router here reproduces (a one-line problem, or None)
  changes    whether the saved value makes the routing differ from megatron's plain top-k (default:
             the value is not one of `off`); what the Bridge refuses for the rows it does not carry
  analysis   what the analysis loader's CPU model takes: "carry" the saved value into megatron's
             own layer, ("cpu", v) a value that runs in one CPU process, "omit" (the default),
             "refuse" when on, "rows" (not a config value: the fc1 rows are de-interleaved on load)
  bridge     whether the Megatron-Bridge MoE provider carries it (else refused when not `off`)

The exported model is megatron's evaluation forward (model.eval()): sinkhorn routing in
training mode picks experts by a Sinkhorn-normalised score instead.

Pure data and small functions over a getter; nothing here imports megatron.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional, Tuple

CARRIED, FOLDED, REFUSED, TRAINING, EXECUTION = "carried", "folded", "refused", "training", "execution"
HANDLINGS = (CARRIED, FOLDED, REFUSED, TRAINING, EXECUTION)
RELEASES = ("0.17", "0.18", "0.19", "0.20")
# TransformerConfig fields this table must name (tests/test_moe_fields.py).
MOE_FIELD_NAME = re.compile(r"moe|expert")
# Load-balancing types that only add a training loss (or nothing): the routing is plain top-k.
LOSS_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
NO_FLAG = None


@dataclasses.dataclass(frozen=True)
class MoEField:
    name: str  # the TransformerConfig field
    handling: str
    where: str  # carried / folded: where it goes; refused: what it does; training / execution: what it is
    args: Tuple[str, ...] = ()  # Megatron-LM argparse dests ((): the field's own name); ("",): no flag
    off: tuple = (None, False, 0)  # values meaning "not used" / megatron's plain routing
    check: Optional[Callable] = None  # carried rows: check(get) -> problem text or None
    changes: Optional[Callable] = None  # changes(get): the routing differs from plain (default: value not `off`)
    analysis: object = "omit"
    bridge: bool = False
    releases: Tuple[str, ...] = RELEASES
    why: str = ""  # refused rows: the reason and what to do instead

    @property
    def dests(self) -> Tuple[str, ...]:
        """The names a saved Megatron-LM args Namespace holds it under (then the field's own)."""
        return tuple(a for a in self.args if a) + (self.name,)

    @property
    def flag(self) -> Optional[str]:
        """The Megatron-LM flag (None: no flag in any release; set in Python only)."""
        if self.args == ("",):
            return NO_FLAG
        return "--" + (self.args[0] if self.args else self.name).replace("_", "-")

    @property
    def label(self) -> str:
        return self.flag or self.name


def getter(source) -> Callable[[str], object]:
    """get(field name) over saved Megatron-LM args, a TransformerConfig or a Bridge provider: the
    first of the row's dests that is set (an unknown name reads its own attribute)."""
    def get(name: str):
        row = BY_NAME.get(name)
        for dest in row.dests if row else (name,):
            value = getattr(source, dest, None)
            if value is not None:
                return value
        return None
    return get


# ---------------------------------------------------------------------- routing helpers (eval forward)
def balancing(get) -> str:
    """The load-balancing type that routes: "sinkhorn", "quantile_balancing", else "plain"
    (a list of types is only ever of loss types: megatron compares the routing to a string)."""
    kind = get("moe_router_load_balancing_type")
    return kind if isinstance(kind, str) and kind in ("sinkhorn", "quantile_balancing") else "plain"


def _sinkhorn(get) -> bool:
    return balancing(get) == "sinkhorn"


def norm_topk_prob(get) -> bool:
    """Whether the k weights sum to 1. Plain routing: softmax over the k chosen logits (True), or
    --moe-router-pre-softmax: softmax over all experts, top-k, as they are (False). Sinkhorn in
    eval (k > 1): softmax over all experts, top-k, not renormalised (False), pre-softmax ignored."""
    return False if _sinkhorn(get) else not bool(get("moe_router_pre_softmax"))


def topk_scaling(get) -> float:
    """The factor megatron multiplies the k weights by (1.0: none). Megatron applies it only when
    truthy, and sinkhorn routing ignores it."""
    factor = get("moe_router_topk_scaling_factor")
    return 1.0 if _sinkhorn(get) or not factor else factor


# The router dtype's names: Megatron-LM's --moe-router-dtype value -> the HF config's router_dtype
# (hf.configuration_mixln_moe.ROUTER_DTYPES; None on both sides: the model's dtype).
HF_ROUTER_DTYPE = {"fp32": "float32"}
MEGATRON_ROUTER_DTYPE = {hf: megatron for megatron, hf in HF_ROUTER_DTYPE.items()}


def router_fp32(get) -> bool:
    return get("moe_router_dtype") == "fp32"


def num_experts(source):
    """The routed experts of saved args, a config or a provider (None or 0: a dense model)."""
    return getter(source)("num_moe_experts")


def expert_glu_interleave(get) -> Optional[int]:
    """The block size of the experts' saved fc1 rows ([gate s; up s] repeated), or None (plain
    [gate; up]). Only TE's grouped-GEMM experts (moe_grouped_gemm with the TE backend) with a GLU
    read the rows that way; sequential experts ignore the setting, so their rows are plain."""
    size = get("moe_mlp_glu_interleave_size")
    if size is None or not get("swiglu") and not get("gated_linear_unit"):
        return None
    if not get("moe_grouped_gemm") or get("transformer_impl") == "local":
        return None
    return size


def shared_glu_interleave(get) -> Optional[int]:
    """The shared expert's: only its fused TE path (use_grouped_gemm_for_shared_expert) reads it."""
    size = get("moe_shared_expert_glu_interleave_size")
    return size if size is not None and get("use_grouped_gemm_for_shared_expert") else None


def interleave_rank_problem(get) -> Optional[str]:
    """GLU-interleaved rows saved by more than one (expert) tensor-parallel rank: megatron cuts each
    rank's interleaved rows in two halves when it saves (the [gate; up] split of a plain fc1), so
    the saved order depends on the rank count. The one-line problem, or None."""
    experts, shared = expert_glu_interleave(get), shared_glu_interleave(get)
    tp = get("tensor_model_parallel_size") or 1
    etp = get("expert_tensor_parallel_size") or tp
    if experts is not None and etp > 1:
        return (f"GLU-interleaved expert fc1 rows [--moe-mlp-glu-interleave-size={experts}] saved at expert tensor "
                f"parallel size {etp}: their saved order depends on that size; use a save at size 1")
    if shared is not None and tp > 1:
        return (f"a GLU-interleaved shared-expert fc1 [--moe-shared-expert-glu-interleave-size={shared}] saved at "
                f"tensor parallel size {tp}: its saved order depends on that size; use a save at size 1")
    return None


def group_limited(get) -> bool:
    """Whether group-limited routing leaves some experts out: megatron only limits when a group
    top-k is set, and choosing every group is plain top-k (moe_utils.group_limited_topk)."""
    group_topk = get("moe_router_group_topk") or get("moe_router_topk_limited_devices")
    if not group_topk or _sinkhorn(get):
        return False
    groups = get("moe_router_num_groups")
    if groups is None and get("moe_router_topk_limited_devices"):
        groups = get("expert_model_parallel_size") or 1
    return group_topk != groups


# ---------------------------------------------------------------------- checks of carried rows
def _check_balancing(get) -> Optional[str]:
    kind = get("moe_router_load_balancing_type")
    kinds = kind if isinstance(kind, (list, tuple)) else [kind]
    unknown = [k for k in kinds if k not in LOSS_BALANCING + ("sinkhorn", "quantile_balancing", None)]
    if unknown:
        return f"load balancing type {unknown[0]!r:.40} is not one this converter knows"
    if kind == "quantile_balancing":
        return ("quantile balancing picks the top-k of the logits minus a per-expert bias learnt in "
                "training (the router's qb_beta), which no HF router here has")
    if kind == "sinkhorn" and (get("moe_router_topk") or 2) == 1:
        return "sinkhorn routing with top-1 weights the expert by sigmoid(logit), which no HF router here does"
    return None


def _check_score(get) -> Optional[str]:
    score = get("moe_router_score_function")
    if score in (None, "softmax") or _sinkhorn(get):  # sinkhorn has its own activation
        return None
    return f"router score function {score!r:.30}: the exported routers take a softmax; convert a softmax-routed model"


def _check_expert_bias(get) -> Optional[str]:
    if not get("moe_router_enable_expert_bias") or _sinkhorn(get):  # sinkhorn does not read the bias
        return None
    return "an expert bias in routing: HF's top-k router has none"


def _check_groups(get) -> Optional[str]:
    if not group_limited(get):
        return None
    return ("group-limited routing (--moe-router-group-topk below --moe-router-num-groups): HF's top-k "
            "router chooses among all experts")


def _groups_by(name: str) -> Callable:
    """_check_groups reported by the row of the group setting actually saved (the deprecated one too)."""
    return lambda get: _check_groups(get) if get(name) else None


def _check_dtype(get) -> Optional[str]:
    if get("moe_router_dtype") == "fp64":
        return ("routing in fp64: the exported routers compute in at most fp32, so a top-k choice can "
                "differ on near ties; convert a run trained with --moe-router-dtype fp32")
    if get("moe_router_dtype") not in (None, "fp32"):
        return f"router dtype {get('moe_router_dtype')!r:.20} is not fp32 or fp64"
    return None


def _check_capacity(get) -> Optional[str]:
    capacity = get("moe_expert_capacity_factor")
    if capacity is None or capacity < 0:  # megatron reads a negative factor as none
        return None
    return (f"an expert capacity factor {capacity!r:.20}: megatron drops the tokens over each expert's "
            "capacity, in evaluation too, which the HF model does not; train without token dropping")


def _check_scaling(get) -> Optional[str]:
    factor = get("moe_router_topk_scaling_factor")
    if factor is None or isinstance(factor, bool) or not isinstance(factor, (int, float)) \
            or factor != factor or factor in (float("inf"), float("-inf")) or factor < 0:
        return None if factor is None else f"top-k scaling factor {factor!r:.30} is not a finite number >= 0"
    return None


CARRY = "carry"

# fmt: off
TABLE: Tuple[MoEField, ...] = (
    # ---- the experts and which layers have them
    MoEField("num_moe_experts", CARRIED, "num_experts / num_local_experts", args=("num_experts",), analysis=CARRY,
             bridge=True),
    MoEField("moe_ffn_hidden_size", CARRIED, "moe_intermediate_size (Mixtral: intermediate_size)", analysis=CARRY,
             bridge=True),
    MoEField("moe_layer_freq", CARRIED, "mlp_only_layers (the dense layers) / decoder_sparse_step", analysis=CARRY,
             bridge=True, off=(1,)),
    MoEField("moe_shared_expert_intermediate_size", CARRIED, "shared_expert_intermediate_size", analysis=CARRY,
             bridge=True),
    MoEField("moe_shared_expert_gate", CARRIED, "shared_expert_gate (Qwen2-MoE: always gated)", analysis=CARRY,
             bridge=True),
    MoEField("moe_latent_size", REFUSED, "projects the tokens into a latent space around the experts",
             analysis="refuse", why="the HF MoE block has no latent projection"),
    MoEField("moe_mlp_glu_interleave_size", CARRIED,
             "MoEShape.expert_glu_interleave: the experts' fc1 rows de-interleaved into gate / up (TE grouped "
             "GEMM only; sequential experts ignore it)", analysis="rows", releases=RELEASES[1:],
             changes=lambda get: expert_glu_interleave(get) is not None),
    MoEField("moe_shared_expert_glu_interleave_size", CARRIED,
             "MoEShape.shared_glu_interleave: the shared fc1's rows de-interleaved (only with "
             "use_grouped_gemm_for_shared_expert)", analysis="rows", releases=RELEASES[2:],
             changes=lambda get: shared_glu_interleave(get) is not None),
    MoEField("moe_apply_probs_on_input", REFUSED, "scales each expert's input by its routing weight",
             analysis=CARRY, why="HF scales the expert's output, which differs through the SwiGLU"),
    # ---- routing
    MoEField("moe_router_topk", CARRIED, "num_experts_per_tok", analysis=CARRY, bridge=True, off=(2,)),
    MoEField("moe_router_pre_softmax", CARRIED, "norm_topk_prob false (softmax over all experts, top-k, "
             "not renormalised); off: true (softmax over the k chosen logits)", analysis=CARRY, bridge=True),
    MoEField("moe_router_load_balancing_type", CARRIED,
             "aux_loss / seq_aux_loss / global_aux_loss / none: plain top-k; sinkhorn (evaluation routing, "
             "top-k > 1): norm_topk_prob false; refused: sinkhorn top-1, quantile_balancing (0.19+)",
             off=LOSS_BALANCING + (None,), check=_check_balancing, analysis=CARRY,
             changes=lambda get: balancing(get) != "plain"),
    MoEField("moe_router_score_function", CARRIED, "softmax; refused: sigmoid, sqrtsoftplus",
             off=(None, "softmax"), check=_check_score, analysis=CARRY),
    MoEField("moe_router_topk_scaling_factor", FOLDED,
             "MoEShape.topk_scaling: multiplied into each routed expert's fc2 (down_proj)", check=_check_scaling,
             analysis=CARRY, off=(None, 0, 1)),
    MoEField("moe_router_dtype", CARRIED, "fp32: router_dtype float32 (MoEShape.router_fp32); refused: fp64",
             check=_check_dtype, analysis=CARRY, bridge=True, off=(None,)),
    MoEField("moe_router_num_groups", CARRIED, "plain top-k when no group top-k is set or it equals the group "
             "count; refused: group-limited routing", check=_groups_by("moe_router_num_groups"), analysis=CARRY,
             changes=group_limited),
    MoEField("moe_router_group_topk", CARRIED, "see moe_router_num_groups", check=_groups_by("moe_router_group_topk"),
             analysis=CARRY, changes=group_limited),
    MoEField("moe_router_topk_limited_devices", CARRIED, "deprecated spelling of group-limited routing "
             "(groups: the expert-parallel size)", args=("",), check=_groups_by("moe_router_topk_limited_devices"),
             analysis="refuse", changes=lambda get: bool(get("moe_router_topk_limited_devices")) and group_limited(get)),
    MoEField("moe_router_enable_expert_bias", CARRIED, "off (sinkhorn routing does not read it); refused: on",
             check=_check_expert_bias, analysis=CARRY),
    MoEField("moe_expert_capacity_factor", CARRIED, "none (dropless); refused: a factor >= 0",
             check=_check_capacity, analysis=CARRY, off=(None,), changes=lambda get: _check_capacity(get) is not None),
    MoEField("moe_pad_expert_input_to_capacity", CARRIED, "only with a capacity factor", analysis=CARRY),
    MoEField("moe_token_drop_policy", CARRIED, "only with a capacity factor", analysis=CARRY, off=("probs", None)),
    MoEField("moe_router_force_load_balancing", REFUSED, "replaces the router's logits by random ones "
             "(benchmarking)", analysis="refuse", why="the routing was random; convert a trained router"),
    MoEField("moe_router_force_biased", REFUSED, "adds a random bias to the router's logits (benchmarking)",
             analysis="refuse", why="the routing was random; convert a trained router"),
    MoEField("moe_input_jitter_eps", TRAINING, "multiplies the router's input by random noise (megatron "
             "does in evaluation too): the export is the noise-free router", analysis="omit"),
    # ---- training only
    MoEField("moe_aux_loss_coeff", TRAINING, "load-balancing loss weight"),
    MoEField("moe_z_loss_coeff", TRAINING, "router z-loss weight"),
    MoEField("moe_router_bias_update_rate", TRAINING, "expert-bias update rate"),
    MoEField("moe_router_quantile_balancing_ema", TRAINING, "quantile-balancing bias update",
             releases=RELEASES[2:]),
    MoEField("moe_enable_routing_replay", TRAINING, "records / replays routing decisions (RL); routes as "
             "usual when no replay is set"),
    MoEField("moe_per_layer_logging", TRAINING, "loss logging"),
    MoEField("moe_grad_scale_func", TRAINING, "gradient scaling", args=("",), releases=RELEASES[2:]),
    MoEField("moe_token_dropping", TRAINING, "deprecated; megatron requires it off", args=("",)),
    # ---- execution only (same weights, same forward)
    MoEField("moe_token_dispatcher_type", EXECUTION, "token dispatcher", analysis=("cpu", "allgather")),
    MoEField("moe_grouped_gemm", EXECUTION, "TE grouped-GEMM experts (same per-expert tensors)",
             analysis=("cpu", False)),
    MoEField("moe_permute_fusion", EXECUTION, "fused token permutation", analysis=("cpu", False)),
    MoEField("moe_router_fusion", EXECUTION, "fused routing kernel", analysis=("cpu", False)),
    MoEField("moe_shared_expert_overlap", EXECUTION, "overlaps the shared expert with dispatch",
             analysis=("cpu", False)),
    MoEField("use_grouped_gemm_for_shared_expert", EXECUTION, "the shared expert as a TE grouped linear",
             releases=RELEASES[2:]),
    MoEField("moe_single_grouped_weight", EXECUTION, "one grouped parameter for the experts (saved per expert)",
             releases=RELEASES[1:]),
    MoEField("moe_single_grouped_bias", EXECUTION, "one grouped bias parameter", releases=RELEASES[1:]),
    MoEField("moe_use_grouped_tensor", EXECUTION, "TE GroupedTensor GEMMs", releases=RELEASES[3:]),
    MoEField("moe_layer_recompute", EXECUTION, "activation recomputation"),
    MoEField("moe_router_padding_for_quantization", EXECUTION, "pads each expert's tokens with zero-weight "
             "ones for fp8 / fp4"),
    MoEField("moe_router_padding_for_fp8", EXECUTION, "old spelling of the padding above"),
    MoEField("moe_pad_experts_for_cuda_graph_inference", EXECUTION, "pads to a capacity no token exceeds"),
    MoEField("moe_expert_rank_capacity_factor", EXECUTION, "hybridep / ncclep per-rank token budget "
             "(the export is the dropless model, which megatron computes while the budget holds)",
             releases=RELEASES[1:]),
    MoEField("moe_enable_deepep", EXECUTION, "DeepEP dispatcher"),
    MoEField("moe_flex_dispatcher_backend", EXECUTION, "flex dispatcher backend"),
    MoEField("moe_flex_dispatcher_num_sms", EXECUTION, "dispatcher SMs", releases=RELEASES[2:]),
    MoEField("moe_deepep_num_sms", EXECUTION, "dispatcher SMs"),
    MoEField("moe_hybridep_num_sms", EXECUTION, "dispatcher SMs"),
    MoEField("moe_hybridep_num_blocks_permute", EXECUTION, "dispatcher blocks"),
    MoEField("moe_hybridep_num_blocks_unpermute", EXECUTION, "dispatcher blocks"),
    MoEField("moe_hybridep_num_sms_preprocessing", EXECUTION, "dispatcher SMs", releases=RELEASES[1:]),
    MoEField("moe_hybridep_pad_uneven_dispatch_inputs", EXECUTION, "dispatcher padding", releases=RELEASES[2:]),
    MoEField("moe_permute_fusion_into_hybridep", EXECUTION, "fused permutation in HybridEP"),
    MoEField("moe_ncclep_static_shape", EXECUTION, "ncclep buffers", releases=("0.19",)),
    MoEField("moe_ncclep_zero_copy", EXECUTION, "ncclep buffers", releases=RELEASES[2:]),
    MoEField("moe_dispatch_fwd_dtype", EXECUTION, "dispatch wire dtype (mxfp8: as fp8 training, the export "
             "holds the high-precision weights)", releases=RELEASES[3:]),
    MoEField("moe_combine_bwd_dtype", EXECUTION, "combine gradient wire dtype", releases=RELEASES[3:]),
    MoEField("moe_paged_stash", EXECUTION, "activation memory", releases=RELEASES[1:]),
    MoEField("moe_paged_stash_page_size", EXECUTION, "activation memory", releases=RELEASES[1:]),
    MoEField("moe_paged_stash_buffer_size_factor_cuda", EXECUTION, "activation memory", releases=RELEASES[1:]),
    MoEField("moe_paged_stash_buffer_size_factor_cpu", EXECUTION, "activation memory", releases=RELEASES[1:]),
    MoEField("inference_moe_token_dispatcher_type", EXECUTION, "inference dispatcher", releases=RELEASES[1:]),
    MoEField("inference_moe_disable_fused_quant_kernels", EXECUTION, "inference kernels"),
    MoEField("expert_model_parallel_size", EXECUTION, "expert parallelism (torch_dist saves global experts)"),
    MoEField("expert_tensor_parallel_size", EXECUTION, "expert tensor parallelism (a GLU-interleaved fc1 saved "
             "at a size > 1 is refused: its saved row order depends on the size)"),
    MoEField("expert_tensor_parallel_num_weight_shards", EXECUTION, "weight sharding", releases=RELEASES[2:]),
    MoEField("expert_gtp_weight_remat_size", EXECUTION, "weight sharding", args=("",), releases=RELEASES[2:]),
    MoEField("overlap_moe_expert_parallel_comm", EXECUTION, "communication overlap"),
    MoEField("overlap_dispatch_backward_with_experts_wgrad", EXECUTION, "communication overlap",
             releases=RELEASES[1:]),
)
# fmt: on
BY_NAME = {row.name: row for row in TABLE}


def _is_on(value, off) -> bool:
    """Whether a saved value means "used" (True never counts as the off value 1, nor False as 0)."""
    return value is not None and not any(
        isinstance(value, bool) == isinstance(o, bool) and value == o for o in off if o is not None)


def row_changes(row: MoEField, get) -> bool:
    """Whether the row's saved value makes the forward differ from megatron's plain routing."""
    return row.changes(get) if row.changes is not None else _is_on(get(row.name), row.off)


def row_problem(row: MoEField, get) -> Optional[str]:
    """The one-line problem of a row's saved value for a conversion ("... [--flag]: why"), or None."""
    if row.handling == REFUSED:
        value = get(row.name)
        return f"{row.where} [{row.label}={value!r:.30}]: {row.why}" if _is_on(value, row.off) else None
    if row.check is not None:
        problem = row.check(get)
        return f"{problem} [{row.label}]" if problem else None
    return None


def conversion_problems(source) -> list:
    """Every setting of `source` (saved args, a config or a provider) that an HF export cannot carry
    exactly, one sentence each naming its flag (groups are reported once)."""
    get = getter(source)
    seen, problems = set(), []
    for row in TABLE:
        problem = row_problem(row, get)
        if problem and problem.rpartition(" [")[0] not in seen:
            seen.add(problem.rpartition(" [")[0])
            problems.append(problem)
    return problems


def bridge_problems(source) -> list:
    """conversion_problems plus every carried or folded setting the Bridge MoE export does not
    write (its HF config is hf_moe_fields'), when the provider has it on."""
    get = getter(source)
    problems = conversion_problems(source)
    for row in TABLE:
        if row.handling in (CARRIED, FOLDED) and not row.bridge:
            value = get(row.name)
            if row_changes(row, get) and not any(f"[{row.label}" in p for p in problems):
                problems.append(f"{row.label}={value!r:.30}: the Megatron-Bridge MoE export does not carry it")
    return problems


def fields_of_release(release: str) -> Tuple[str, ...]:
    """The table's field names that exist in `release` (one of RELEASES)."""
    return tuple(row.name for row in TABLE if release in row.releases)
