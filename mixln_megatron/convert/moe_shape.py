"""The Mixture-of-Experts part of a model's shape: what a conversion carries, read and checked once.

Both directions agree on MoEShape: which layers are MoE (the rest dense), the routed experts
(count, top-k, FFN width), the shared expert (width, sigmoid gate) and how the top-k weights are
normalised. Megatron's default routing (top-k of the logits, softmax over the k) equals a softmax
over all experts renormalised over the k chosen (HF `norm_topk_prob=True`); with
--moe-router-pre-softmax the k weights are not renormalised (`norm_topk_prob=False`).

Routing settings that change what the model computes and that no HF class here expresses are
refused, one line naming the flag. Training-only settings (load balancing, aux / z losses, input
jitter, dispatchers, expert parallelism) carry as nothing: the exported model routes the same.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from ..errors import ConversionError, UnsupportedModelError

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


# (Megatron-LM arg names, flag, "off" test): routing settings no HF class here reproduces.
def _routing_problems(args) -> list:
    def get(*names):
        for n in names:
            v = getattr(args, n, None)
            if v is not None:
                return v
        return None

    problems = []
    score = get("moe_router_score_function")
    if score not in (None, "softmax"):
        problems.append(f"router score function {score!r} [--moe-router-score-function]: the export routes with a "
                        "softmax; convert a softmax-routed model")
    if get("moe_router_enable_expert_bias"):
        problems.append("an expert bias in routing [--moe-router-enable-expert-bias]: HF's top-k router has none")
    if get("moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_limited_devices"):
        problems.append("group-limited routing [--moe-router-num-groups / --moe-router-group-topk]: HF's top-k router "
                        "chooses among all experts")
    factor = get("moe_router_topk_scaling_factor")
    if factor is not None and factor != 1:
        problems.append(f"a top-k scaling factor {factor!r} [--moe-router-topk-scaling-factor]: HF's router does not "
                        "scale the weights")
    capacity = get("moe_expert_capacity_factor")
    if capacity is not None and capacity >= 0:
        problems.append(f"an expert capacity factor {capacity!r} [--moe-expert-capacity-factor]: dropped tokens "
                        "are a training-time layout the HF model does not reproduce; train without token dropping")
    if get("moe_latent_size"):
        problems.append("a latent MoE projection [--moe-latent-size]: the HF MoE block has no latent projection")
    return problems


def moe_shape_of_args(args, num_layers: int, add_bias_linear: bool, where: str) -> Optional[MoEShape]:
    """The MoEShape of saved Megatron-LM args (None for a dense model), every field checked; one
    UnsupportedModelError naming each flag a conversion cannot carry."""
    experts = getattr(args, "num_experts", None)
    if experts is None:
        experts = getattr(args, "num_moe_experts", None)
    if experts is None or experts == 0:
        return None
    experts = _int(where, "num_experts", experts, EXPERTS_BOUND)
    problems = _routing_problems(args)
    if add_bias_linear:
        problems.append("biases on the MoE layers' linears [--disable-bias-linear]: the HF MoE experts have none")
    if problems:
        raise UnsupportedModelError("this checkpoint's MoE layers cannot be converted: " + "; ".join(problems))
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
    return MoEShape(num_experts=experts, topk=topk, expert_ffn=ffn, moe_layers=layers, shared_ffn=shared,
                    shared_gate=gate, norm_topk_prob=not bool(getattr(args, "moe_router_pre_softmax", False)))


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
        return MoEShape(num_experts=experts, topk=_cfg(config, where, "num_experts_per_tok", None, experts),
                        expert_ffn=_cfg(config, where, "intermediate_size"), moe_layers=(True,) * num_layers), problems
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
        if _cfg_bool(config, where, "qkv_bias", True):
            problems.append("qkv_bias (a bias on q, k, v only): the conversion carries attention without biases; "
                            "convert a model with qkv_bias false")
    else:
        shared = config.get("shared_expert_intermediate_size")
        shared = None if shared is None else _int(where, "shared_expert_intermediate_size", shared, 1 << 20)
        gate = _cfg_bool(config, where, "shared_expert_gate", False)
        norm_topk = _cfg_bool(config, where, "norm_topk_prob", True)
        if gate and shared is None:
            raise ConversionError(f"{where}: shared_expert_gate is true without a shared expert")
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    if not any(layers):
        problems.append("no MoE layer (every layer is in mlp_only_layers or off decoder_sparse_step)")
    return MoEShape(num_experts=experts, topk=topk, expert_ffn=expert_ffn, moe_layers=layers, shared_ffn=shared,
                    shared_gate=gate, norm_topk_prob=norm_topk), problems


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
