"""The Mixture-of-Experts part of a model's shape: what a conversion carries, read and checked once.

Both directions agree on MoEShape: which layers are MoE (the rest dense), the routed experts
(count, top-k, FFN width), the shared expert (width, sigmoid gate), how the top-k weights are
normalised and scaled, fp32 routing and GLU-interleaved fc1 rows. What each megatron MoE setting
becomes (carried, folded, refused in one line naming its flag, or training / execution only) is
model.moe_fields.TABLE; this module reads the saved args through it and checks every value.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from ..errors import ConversionError, UnsupportedModelError
from ..model import moe_fields

EXPERTS_BOUND = 1 << 14  # far above any real model (DeepSeek-V3: 256 routed experts)


@dataclasses.dataclass(frozen=True)
class MoEShape:
    num_experts: int
    topk: int
    expert_ffn: int  # each routed expert's FFN width I (fc1 holds [gate; up]: 2I rows)
    moe_layers: Tuple[bool, ...]  # per layer (0-based): MoE (True) or dense
    shared_ffn: Optional[int] = None  # the shared expert's FFN width S; None: no shared expert
    shared_gate: bool = False  # the shared expert's output times sigmoid(h @ gate^T)
    norm_topk_prob: bool = True  # renormalise the k chosen weights (Megatron's default routing)
    # Carried or folded beyond the default routing (one table: model.moe_fields):
    topk_scaling: float = 1.0  # --moe-router-topk-scaling-factor: folded into each routed expert's fc2
    router_fp32: bool = False  # --moe-router-dtype fp32: the router's logits and softmax in fp32
    expert_glu_interleave: Optional[int] = None  # --moe-mlp-glu-interleave-size: fc1 rows in gate/up blocks
    shared_glu_interleave: Optional[int] = None  # moe_shared_expert_glu_interleave_size: the shared fc1's

    @property
    def dense_layers(self) -> Tuple[int, ...]:
        return tuple(i for i, moe in enumerate(self.moe_layers) if not moe)


def _shown(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _int(where: str, name: str, value, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= hi:
        raise ConversionError(f"{where}: {name} must be a positive integer (at most {hi}), got {_shown(value)}")
    return value


def layers_of_freq(freq, num_layers: int, where: str, name: str = "moe_layer_freq") -> Tuple[bool, ...]:
    """Megatron's --moe-layer-freq: an integer N (layer i is MoE when i % N == 0) or one 0/1 per layer."""
    if isinstance(freq, int) and not isinstance(freq, bool):
        if freq < 1:
            raise ConversionError(f"{where}: {name} must be >= 1 or a list of 0/1, got {_shown(freq)}")
        return tuple(i % freq == 0 for i in range(num_layers))
    if isinstance(freq, (list, tuple)):
        if len(freq) != num_layers:
            raise ConversionError(f"{where}: {name} has {len(freq)} entries but the model has {num_layers} layers")
        if any(isinstance(v, bool) or v not in (0, 1) for v in freq):
            raise ConversionError(f"{where}: {name} must hold only 0 and 1, got {_shown(freq)}")
        return tuple(bool(v) for v in freq)
    raise ConversionError(f"{where}: {name} must be an integer or a list of 0/1, got {_shown(freq)}")


def _routing_problems(args) -> list:
    """What an export cannot carry exactly, one sentence per setting naming its flag: the rows of
    the one MoE table (model.moe_fields) that refuse the saved value."""
    return moe_fields.conversion_problems(args)


def _positive_float(where: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConversionError(f"{where}: {name} must be a finite number > 0, got {_shown(value)}")
    return float(value)


def _interleave(where: str, name: str, value, ffn: Optional[int]) -> Optional[int]:
    """A GLU interleave block size: whole blocks of gate and up rows must fit the FFN width."""
    if value is None:
        return None
    value = _int(where, name, value, 1 << 20)
    if ffn is not None and ffn % value:
        raise ConversionError(f"{where}: {name} {value} does not divide the FFN width {ffn}")
    return value


def moe_shape_of_args(args, num_layers: int, add_bias_linear: bool, where: str) -> Optional[MoEShape]:
    """The MoEShape of saved Megatron-LM args (None for a dense model), every field checked; one
    UnsupportedModelError naming each flag a conversion cannot carry (model.moe_fields.TABLE)."""
    experts = moe_fields.num_experts(args)
    if experts is None or experts == 0:
        return None
    experts = _int(where, "num_experts", experts, EXPERTS_BOUND)
    problems = _routing_problems(args)
    if add_bias_linear:
        problems.append("biases on the MoE layers' linears [--disable-bias-linear]: the HF MoE experts have none")
    if problems:
        raise UnsupportedModelError("this checkpoint's MoE layers cannot be converted: " + "; ".join(problems))
    get = moe_fields.getter(args)
    topk = _int(where, "moe_router_topk", getattr(args, "moe_router_topk", None) or 2, experts)
    ffn = getattr(args, "moe_ffn_hidden_size", None)
    ffn = getattr(args, "ffn_hidden_size", None) if ffn is None else ffn
    ffn = _int(where, "moe_ffn_hidden_size", ffn, 1 << 20)
    freq = getattr(args, "moe_layer_freq", None)
    layers = layers_of_freq(1 if freq is None else freq, num_layers, where)
    shared = getattr(args, "moe_shared_expert_intermediate_size", None)
    shared = None if shared is None else _int(where, "moe_shared_expert_intermediate_size", shared, 1 << 20)
    gate = bool(getattr(args, "moe_shared_expert_gate", False))
    if gate and shared is None:
        raise ConversionError(f"{where}: moe_shared_expert_gate is set without a shared expert")
    return MoEShape(
        num_experts=experts, topk=topk, expert_ffn=ffn, moe_layers=layers, shared_ffn=shared, shared_gate=gate,
        norm_topk_prob=moe_fields.norm_topk_prob(get),
        topk_scaling=_positive_float(where, "moe_router_topk_scaling_factor", moe_fields.topk_scaling(get)),
        router_fp32=moe_fields.router_fp32(get),
        expert_glu_interleave=_interleave(where, "moe_mlp_glu_interleave_size", moe_fields.expert_glu_interleave(get),
                                          ffn),
        shared_glu_interleave=_interleave(where, "moe_shared_expert_glu_interleave_size",
                                          moe_fields.shared_glu_interleave(get), shared))


def _cfg(config: dict, where: str, name: str, default=None, hi: int = 1 << 20):
    value = config.get(name)
    if value is None:
        if default is None:
            raise ConversionError(f"{where}: {name} must be a positive integer, got nothing")
        return default
    return _int(where, name, value, hi)


def _cfg_bool(config: dict, where: str, name: str, default: bool) -> bool:
    value = config.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConversionError(f"{where}: {name} must be true or false, got {_shown(value)}")
    return value


def moe_shape_of_hf_config(config: dict, model_type: str, num_layers: int, where: str):
    """(MoEShape, [what Megatron cannot express]) of a mixln_moe / mixtral / qwen2_moe config.json,
    every field checked as untrusted input (one ConversionError naming it)."""
    problems = []
    if model_type == "mixtral":
        experts = _cfg(config, where, "num_local_experts", None, EXPERTS_BOUND)
        moe = MoEShape(num_experts=experts, topk=_cfg(config, where, "num_experts_per_tok", None, experts),
                       expert_ffn=_cfg(config, where, "intermediate_size"), moe_layers=(True,) * num_layers)
        return moe, problems + _megatron_routing_problems(moe, "num_experts_per_tok")
    experts = _cfg(config, where, "num_experts", None, EXPERTS_BOUND)
    topk = _cfg(config, where, "num_experts_per_tok", None, experts)
    expert_ffn = _cfg(config, where, "moe_intermediate_size")
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers
                                          for i in dense) or len(set(dense)) != len(dense):
        raise ConversionError(f"{where}: mlp_only_layers must be distinct layer indices in 0..{num_layers - 1}, got "
                              f"{_shown(dense)}")
    step = 1
    if model_type == "qwen2_moe":  # always a gated shared expert; renormalisation off by default
        step = _cfg(config, where, "decoder_sparse_step", 1, num_layers)
        shared = _cfg(config, where, "shared_expert_intermediate_size")
        gate, norm_topk = True, _cfg_bool(config, where, "norm_topk_prob", False)
    else:
        shared = config.get("shared_expert_intermediate_size")
        shared = None if shared is None else _int(where, "shared_expert_intermediate_size", shared, 1 << 20)
        gate = _cfg_bool(config, where, "shared_expert_gate", False)
        norm_topk = _cfg_bool(config, where, "norm_topk_prob", True)
        if gate and shared is None:
            raise ConversionError(f"{where}: shared_expert_gate is true without a shared expert")
    router_fp32 = False
    if model_type == "mixln_moe":
        router_fp32 = moe_fields.MEGATRON_ROUTER_DTYPE.get(_router_dtype(config, where)) == "fp32"
        problems += _mixln_moe_bias_problems(config, where)
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    if not any(layers):
        problems.append("no MoE layer (every layer is in mlp_only_layers or off decoder_sparse_step)")
    moe = MoEShape(num_experts=experts, topk=topk, expert_ffn=expert_ffn, moe_layers=layers, shared_ffn=shared,
                   shared_gate=gate, norm_topk_prob=norm_topk, router_fp32=router_fp32)
    return moe, problems + _megatron_routing_problems(moe, "norm_topk_prob")


def _router_dtype(config: dict, where: str) -> Optional[str]:
    """mixln_moe's router_dtype (hf.configuration_mixln_moe): null (the model's dtype) or a name of
    model.moe_fields.MEGATRON_ROUTER_DTYPE ("float32")."""
    value = config.get("router_dtype")
    if value is not None and (not isinstance(value, str) or value not in moe_fields.MEGATRON_ROUTER_DTYPE):
        names = " or ".join(f'"{name}"' for name in moe_fields.MEGATRON_ROUTER_DTYPE)
        raise ConversionError(f"{where}: router_dtype must be null or {names}, got {_shown(value)}")
    return value


def _mixln_moe_bias_problems(config: dict, where: str) -> list:
    """Megatron puts a linear bias on every linear, the experts' included, or on none (its
    add_bias_linear); the Mix-LN MoE model's experts have none, so no bias converts."""
    return [f"{name} true: Megatron's --add-bias-linear would put biases on the experts too, which this model's "
            f"experts lack; convert a model with {name} false"
            for name in ("attention_bias", "mlp_bias") if _cfg_bool(config, where, name, False)]


def _megatron_routing_problems(moe: MoEShape, field: str) -> list:
    """Routing an HF model has that megatron refuses to build: top-1 renormalised (its weight is
    always 1) needs megatron's softmax over the one chosen logit, which megatron rejects for top-1
    (it asks for --moe-router-pre-softmax, whose weight is the expert's softmax probability)."""
    if moe.topk == 1 and moe.norm_topk_prob:
        return [f"top-1 routing with the weight renormalised to 1 ({field}): megatron builds top-1 softmax routing "
                "only with --moe-router-pre-softmax, a different weight; no Megatron model computes it"]
    return []


def expert_role(expert: int, which: str) -> str:
    """The conversion role of one routed expert's fc1 / fc2 (`which`: "fc1" or "fc2"; convert.mapping)."""
    return f"experts.{expert}.{which}.weight"


def split_expert_role(role: str):
    """(expert index, its layer's whole-tensor role "experts.fcN.weight") of an expert's role, or None.
    Here, not in convert.mapping, so that the readers and writers use it without going back to the
    mapping (an export maps its roles once)."""
    parts = role.split(".")
    if len(parts) == 4 and parts[0] == "experts" and parts[1].isdigit():
        return int(parts[1]), f"experts.{parts[2]}.weight"
    return None


def moe_role_shapes(moe: MoEShape, hidden: int) -> dict:
    """Global shape of each MoE role of one MoE layer (the experts' as a whole [E, ...] tensor)."""
    e, i = moe.num_experts, moe.expert_ffn
    shapes = {"router.weight": (e, hidden), "experts.fc1.weight": (e, 2 * i, hidden),
              "experts.fc2.weight": (e, hidden, i)}
    if moe.shared_ffn is not None:
        shapes.update({"shared.fc1.weight": (2 * moe.shared_ffn, hidden),
                       "shared.fc2.weight": (hidden, moe.shared_ffn)})
    if moe.shared_gate:
        shapes["shared.gate.weight"] = (1, hidden)
    return shapes
