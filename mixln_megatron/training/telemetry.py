"""Training-health telemetry: per-layer gradient norms every N steps (what is logged and where:
docs/configuration.md). It wraps `config.finalize_model_grads_func` around everything already
there (the spike scaler included), so it sees the gradients the optimizer receives. Off (N = 0):
zero cost.

Rows are per transformer block (a HybridModel's `*` and `-` layers together), columns the
block's parameters and its norms by role (layer.norm_parameters()), so the same network logs the
same numbers in both model kinds. Squared sums are formed like megatron's grad norm:
TP-duplicated parameters once, TP-sharded ones summed over TP, stages over PP; under the
distributed optimizer each rank adds only the shard it owns, summed over its optimizer instance
(not the whole DP group: with k instances that would be sqrt(k) too large). MoE experts: summed
over expert-TP x EP x PP, owned shards over their expert-DP instance. At most two all-reduces of
an [L, 5] vector per logged step, four with experts.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import List, Optional

import torch

from .. import compat
from ..model.layer import MixLNTransformerLayer
from . import runtime
from .runtime import FinalizeWrapper, SharedByConfigCopies, owned_range, shard_group, unwrap_finalize

logger = logging.getLogger(__name__)

JSONL_NAME = "mixln_telemetry.jsonl"


COLUMNS = 5  # per block: all its parameters, then norm1 .. norm4 (norm3 / norm4: sandwich only)


def norm_columns(layer) -> dict:
    """{id(parameter): column} of the layer's norms' parameters: column k the block's norm k
    (role normk.*): 1 its first, 2 its second, 3 and 4 a sandwich layer's output norms N_b, N_d;
    a hybrid layer holds one of the first two."""
    return {id(p): int(role[len("norm")]) for role, p in layer.norm_parameters()}


def is_expert_parameter(param) -> bool:
    """An MoE expert's parameter: megatron marks them allreduce=False (reduced over the expert
    data-parallel group; each EP rank holds other experts)."""
    return not getattr(param, "allreduce", True)


class GradTelemetry(SharedByConfigCopies):
    """Computes and logs per-layer gradient norms every `interval` finalize calls."""

    def __init__(self, interval: int, path: Optional[str] = None):
        if interval < 1:
            raise ValueError("GradTelemetry needs interval >= 1 (0 means: do not install it)")
        self.interval = interval
        self.path = path
        self.calls = 0
        self.records: List[dict] = []  # the logged records of this process (also in the JSONL)
        self.seconds = 0.0  # own time, for the overhead report
        self._plan = None

    # -- setup -----------------------------------------------------------------------------
    def _build_plan(self, model_chunks) -> None:
        from megatron.core import parallel_state as ps  # heavy

        tp_rank = ps.get_tensor_model_parallel_rank()
        etp_rank = ps.get_expert_tensor_parallel_rank()
        items, num_layers, placement, groups = [], None, None, {False: set(), True: set()}
        for chunk in model_chunks:
            for layer in chunk.modules():
                if not isinstance(layer, MixLNTransformerLayer) or getattr(layer, "is_mtp_layer", False):
                    continue
                placement = layer.placement
                num_layers = placement.num_layers
                norms = norm_columns(layer)
                for param in layer.parameters():
                    if not param.requires_grad:
                        continue
                    expert = is_expert_parameter(param)
                    rank = etp_rank if expert else tp_rank
                    duplicate = not getattr(param, "tensor_model_parallel", False) and rank != 0
                    lo, hi = owned_range(chunk, param)
                    groups[expert].add(shard_group(chunk, param))
                    # One row per block: a hybrid block's `*` and `-` layers add to the same row.
                    items.append((layer.block_number - 1, norms.get(id(param)), param, lo, hi, duplicate, expert))
        if placement is None:
            raise ValueError("mixln telemetry: the model has no Mix-LN layers")
        if any(len(g) > 1 for g in groups.values()):
            raise NotImplementedError("mixln telemetry: Mix-LN parameters in different data-parallel shard groups")
        kept = [it for it in items if not it[5] and it[4] > it[3]]  # skip TP duplicates, empty shards
        device = kept[0][2].main_grad.device if kept else (items[0][2].device if items else torch.device("cpu"))
        # Dense parameters and MoE experts (expert parallelism) are reduced over different groups.
        self._plan = dict(
            parts=[self._part([it for it in kept if it[6] == expert], expert, groups[expert], device)
                   for expert in (False, True) if any(it[6] == expert for it in items)],
            num_layers=num_layers, placement=placement, device=device,
        )

    @staticmethod
    def _part(kept: list, expert: bool, groups: set, device) -> dict:
        """The index tensors of one reduction group's parameters (dense, or MoE experts)."""
        with_norm = [i for i, it in enumerate(kept) if it[1] is not None]
        return dict(
            slices=[(param, lo, hi) for _, _, param, lo, hi, _, _ in kept],
            rows=torch.tensor([row * COLUMNS for row, *_ in kept], dtype=torch.long, device=device),
            norm_select=torch.tensor(with_norm, dtype=torch.long, device=device),
            norm_rows=torch.tensor([kept[i][0] * COLUMNS + kept[i][1] for i in with_norm], dtype=torch.long,
                                   device=device),
            expert=expert, shards=next(iter(groups)) if groups else None,  # the ranks the owned shards split over
        )

    # -- per call --------------------------------------------------------------------------
    @torch.no_grad()
    def after_finalize(self, model_chunks) -> Optional[dict]:
        self.calls += 1
        if self.calls % self.interval:
            return None
        started = time.perf_counter()
        if self._plan is None:
            self._build_plan(model_chunks)
        plan = self._plan
        total = torch.zeros(plan["num_layers"], COLUMNS, dtype=torch.float64, device=plan["device"])
        for part in plan["parts"]:
            sq = torch.zeros(plan["num_layers"] * COLUMNS, dtype=torch.float64, device=plan["device"])
            if part["slices"]:
                # Two kernels per group (foreach norm, then one scatter-add), not 3 per tensor.
                grads = [param.main_grad.view(-1)[lo:hi] for param, lo, hi in part["slices"]]
                squares = torch.stack(torch._foreach_norm(grads)).double().pow(2)
                sq.index_add_(0, part["rows"], squares)
                sq.index_add_(0, part["norm_rows"], squares[part["norm_select"]])
            sq = sq.view(plan["num_layers"], COLUMNS)
            self._reduce(sq, part["shards"], part["expert"])
            total += sq
        record = self._record(total.sqrt().tolist())
        self.seconds += time.perf_counter() - started
        return record

    @staticmethod
    def _reduce(sq: torch.Tensor, shards, expert: bool = False) -> None:
        from megatron.core import parallel_state as ps  # heavy

        if not torch.distributed.is_initialized():
            return
        # TP shards and PP stages; MoE experts: expert-TP shards, the EP ranks' experts, PP stages
        group = ps.get_expert_tensor_model_pipeline_parallel_group() if expert else ps.get_model_parallel_group()
        torch.distributed.all_reduce(sq, group=group)
        if shards is not None and torch.distributed.get_world_size(shards) > 1:
            torch.distributed.all_reduce(sq, group=shards)  # the owned shards of one optimizer instance

    def _record(self, norms: list) -> dict:
        placement = self._plan["placement"]
        P = placement.post_ln_layers
        post_rows = [layer - 1 for layer in placement.post_ln_layer_numbers]  # post and deepnorm
        pre_rows = [row for row in range(placement.num_layers) if row not in set(post_rows)]

        def group(rows):
            return math.sqrt(sum(norms[r][0] ** 2 for r in rows)) if rows else None

        record = {
            "step": _iteration_or(self.calls),
            "num_layers": placement.num_layers,
            "post_ln_layers": P,
            "scheme": placement.scheme,
            "layer_kinds": list(placement.kinds),  # row l-1 is block l's kind (pre, post, deepnorm, sandwich)
            "layer_grad_norm": [r[0] for r in norms],
            "norm1_grad_norm": [r[1] for r in norms],
            "norm2_grad_norm": [r[2] for r in norms],
            "post_ln_group_grad_norm": group(post_rows),
            "pre_ln_group_grad_norm": group(pre_rows),
        }
        if "sandwich" in placement.kinds:  # N_b / N_d of sandwich layers (0 in the other rows)
            record["norm3_grad_norm"] = [r[3] for r in norms]
            record["norm4_grad_norm"] = [r[4] for r in norms]
        self.records.append(record)
        return record


class TelemetryHook(FinalizeWrapper):
    """The finalize_model_grads_func wrapper: the original finalize, then the telemetry."""

    def __init__(self, telemetry: GradTelemetry, original=None):
        super().__init__(original)
        self.telemetry = telemetry

    @property
    def mixln_spike_scaler(self):  # so that spike.get_spike_scaler(config) still finds it
        return getattr(self.original, "mixln_spike_scaler", None)

    def after_finalize(self, model, args: tuple, kwargs: dict) -> None:
        record = self.telemetry.after_finalize(model)
        if record is not None:
            scaler = self.mixln_spike_scaler
            if scaler is not None and hasattr(scaler, "totals"):
                record["spike"] = scaler.totals(reduce=True)  # collective: every rank is here
            write_record(record, self.telemetry.path)


def _iteration_or(fallback: int) -> int:
    """Megatron-LM's current iteration; outside its training loop, the hook's own call count."""
    iteration = runtime.current_iteration()
    return fallback if iteration is None else iteration


def default_path() -> str:
    """<save>/mixln_telemetry.jsonl in a Megatron-LM run, else runs/ (a path in the settings wins)."""
    save = runtime.arg("save")
    return os.path.join(save if save else "runs", JSONL_NAME)


def write_record(record: dict, path: Optional[str] = None) -> None:
    """On the last rank (where Megatron keeps its writers): TensorBoard / W&B, and the JSONL."""
    if not runtime.is_last_rank():
        return
    tensorboard, wandb = runtime.writers()
    step = record["step"]
    scalars = {}
    for i, value in enumerate(record["layer_grad_norm"]):
        scalars[f"mixln/layer_grad_norm/layer{i + 1:03d}"] = value
    for key in ("post_ln_group_grad_norm", "pre_ln_group_grad_norm"):
        if record.get(key) is not None:
            scalars[f"mixln/{key}"] = record[key]
    for key, value in (record.get("spike") or {}).items():
        scalars[f"mixln/spike/{key}"] = value
    if tensorboard is not None:
        for name, value in scalars.items():
            tensorboard.add_scalar(name, value, step)
    if wandb is not None:
        wandb.log(scalars, step)
    path = path or default_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:  # one line per record: a crash leaves at most a partial last line
        f.write(json.dumps(record) + "\n")


def get_telemetry(config) -> Optional[GradTelemetry]:
    hook = compat.finalize_chain_head(getattr(config, "transformer", config))  # 0.17/0.18: under train()'s dispatcher
    return hook.telemetry if isinstance(hook, TelemetryHook) else None


def install_telemetry(config, interval: int, path: Optional[str] = None) -> Optional[GradTelemetry]:
    """Wrap config.finalize_model_grads_func (install the spike scaler first, so that the
    telemetry sees its output). interval 0 installs nothing. Idempotent; remove_telemetry undoes it."""
    if interval <= 0:
        return None
    config = getattr(config, "transformer", config)
    existing = get_telemetry(config)
    if existing is not None:
        return existing
    telemetry = GradTelemetry(interval, path)
    config.finalize_model_grads_func = TelemetryHook(telemetry, getattr(config, "finalize_model_grads_func", None))
    return telemetry


def remove_telemetry(config) -> Optional[GradTelemetry]:
    """Take the telemetry out of config.finalize_model_grads_func, leaving what it wrapped and what
    was wrapped around it since. Returns the removed telemetry, or None."""
    hook = unwrap_finalize(config, TelemetryHook)
    return None if hook is None else hook.telemetry
