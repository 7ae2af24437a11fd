"""The gradient-spike scaler's rule, its state (plain tensor code on [targets, elements]
matrices: no torch.distributed, no megatron) and its per-step statistics.

The rule, per element i of a target tensor (t_i = the steps element i has seen so far):

    m_i        running momentum of |g_i|: an EMA with coefficient `beta`, started at 0
    mhat_i     = m_i / (1 - beta**t_i)            (bias-corrected, so early steps are meaningful)
    spike_i    = t_i >= warmup_steps and mhat_i > 0 and |g_i| > threshold * mhat_i
    g_i       <- sign(g_i) * mhat_i               where spike_i; every other element is untouched
    m_i       <- beta * m_i + (1 - beta) * |g_i|  with the *scaled* g_i, so a spike never
                                                  inflates the momentum that judges the next one
    t_i       <- t_i + 1

An element with momentum 0 is never scaled (nothing to compare with); a non-finite one keeps its
state and gradient. Being elementwise, a distributed-optimizer rank decides for its own shard
without communication. `scale` (fp16 loss scale) divides g before the comparison and multiplies
the replacement, so the state is in unscaled units. A *lasting* jump is held at the old momentum
while it lasts: the intent for the boundary norms, hence the large threshold.

Considered instead, SPAM's rule (spike when g^2 > 5000 * v, Adam's second moment, clipped to the
threshold): it needs the optimizer's sharded, variant-specific state and keeps ~71x of the spike;
the Mix-LN authors' first-moment rule needs neither. `ReferenceSpikeRule` is the rule in plain
Python, the specification the tensor code is tested against.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, List, Optional, Sequence

import torch

from ...model.settings import DEFAULT_BETA, DEFAULT_THRESHOLD, DEFAULT_WARMUP_STEPS
from .. import runtime

logger = logging.getLogger(__name__)


class SpikeState:
    """State of the rule for K target tensors, as rows of [K, n] matrices (n = the largest size;
    a smaller target at the start of its row, zero padding, which never spikes). Everything is per
    element, so a caller may decide for any subset (`owned`) and the rest stays untouched.

    Two-phase, so that a step the optimizer skips never changes the state and the proposal can
    run inside a captured CUDA graph: `propose_in_place` writes the decisions into the gradient
    buffer and the candidate state into `pending_*` (in place, no host sync); `commit` makes it the
    state, `discard` drops it. Proposing twice (Megatron's rerun) starts from the committed state.
    `pending_stats`: [scaled elements, largest |g| / momentum, non-finite elements]. A fixed
    number of whole-matrix ops, whatever K is.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        threshold: float = DEFAULT_THRESHOLD,
        beta: float = DEFAULT_BETA,
        warmup_steps: int = DEFAULT_WARMUP_STEPS,
        device=None,
    ):
        if not sizes or min(sizes) < 1:
            raise ValueError(f"SpikeState needs at least one non-empty target, got sizes {list(sizes)}")
        self.sizes = tuple(int(s) for s in sizes)
        self.shape = (len(self.sizes), max(self.sizes))
        self.threshold = float(threshold)
        self.beta = float(beta)
        # At step 0 there is no momentum to compare with, whatever warmup_steps says.
        self.warmup_steps = max(int(warmup_steps), 1)
        device = torch.device("cpu") if device is None else torch.device(device)
        # momentum and step share one tensor (and so do their pending copies): one op commits both.
        # float32 holds step counts exactly up to 2**24 (16.7M steps).
        self._state = torch.zeros((2,) + self.shape, dtype=torch.float32, device=device)
        self._pending = torch.zeros_like(self._state)
        self.momentum, self.step = self._state[0], self._state[1]
        self.pending_momentum, self.pending_step = self._pending[0], self._pending[1]
        self.pending_stats = torch.zeros(3, dtype=torch.float32, device=device)
        self._stat_slots = self.pending_stats.unbind(0)  # views made once: no indexing per step

    @property
    def device(self) -> torch.device:
        return self.momentum.device

    # -- the rule -----------------------------------------------------------------------------
    def propose_in_place(
        self,
        grad: torch.Tensor,
        scale: Optional[torch.Tensor] = None,
        owned: Optional[torch.Tensor] = None,
    ):
        """Decide for one step on `grad`, the fp32 [K, n] buffer of reduced gradients, replacing
        its spiking elements in place. `scale`: the loss scale `grad` carries, or None; `owned`: a
        [K, n] bool mask of the elements to decide for (None: all). Returns (spike, replacement),
        the latter in `grad`'s units; the candidate state goes to pending_*, no host sync."""
        spike, replacement = self._decide(grad if scale is None else grad / scale, scale, owned)
        torch.where(spike, replacement, grad, out=grad)
        return spike, replacement

    def _decide(self, g: torch.Tensor, scale, owned):
        """The rule on unscaled fp32 gradients g; `scale` only multiplies the replacement back."""
        mag = g.abs()
        finite = mag < math.inf  # False for inf and nan
        valid = finite & owned if owned is not None else finite
        mhat = self.momentum / torch.rsub(torch.pow(self.beta, self.step), 1.0).clamp_min_(1e-30)
        compared = (mhat > 0) & valid
        spike = (mag > mhat * self.threshold) & compared & (self.step >= self.warmup_steps)
        replacement = torch.copysign(mhat, g)  # a spike has |g| > 0: sign(g) * mhat
        if scale is not None:
            replacement.mul_(scale)
        kept = torch.where(spike, mhat, mag)
        new_momentum = torch.lerp(self.momentum, kept, 1.0 - self.beta)  # beta*m + (1-beta)*kept
        torch.where(valid, new_momentum, self.momentum, out=self.pending_momentum)
        torch.add(self.step, valid, out=self.pending_step)
        scaled, max_ratio, nonfinite = self._stat_slots
        torch.sum(spike, dim=(0, 1), dtype=torch.float32, out=scaled)
        torch.amax(torch.where(compared, mag / mhat, 0.0), dim=(0, 1), out=max_ratio)
        bad = ~finite if owned is None else owned & ~finite
        torch.sum(bad, dim=(0, 1), dtype=torch.float32, out=nonfinite)
        return spike, replacement

    def commit(self, stats_into: Optional[torch.Tensor] = None) -> None:
        """Make the pending proposal the state; its statistics go to `stats_into` (a [3] tensor;
        None: dropped). No host sync. (No grad-mode switch: the state never requires grad.)"""
        self._state.copy_(self._pending)
        if stats_into is not None:
            stats_into.copy_(self.pending_stats)
        self.pending_stats.zero_()

    def discard(self) -> None:
        self._pending.copy_(self._state)
        self.pending_stats.zero_()

    # -- per target access (checkpoints) -------------------------------------------------------
    def get_target(self, k: int) -> dict:
        """{'momentum': fp32, 'step': int64} cpu tensors of target k (host sync: for checkpoints)."""
        n = self.sizes[k]
        return {
            "momentum": self.momentum[k, :n].detach().cpu().clone(),
            "step": self.step[k, :n].detach().cpu().to(torch.int64),
        }

    @torch.no_grad()
    def set_target(self, k: int, momentum: torch.Tensor, step) -> None:
        n = self.sizes[k]
        if momentum.numel() != n:
            raise ValueError(f"spike-scaler state for target {k} has {momentum.numel()} elements, expected {n}")
        self.momentum[k, :n].copy_(momentum.reshape(-1).to(torch.float32))
        self.step[k, :n].copy_(torch.as_tensor(step).reshape(-1).to(torch.float32).expand(n))
        self.discard()  # a proposal made before the load is void

# --------------------------------------------------------------------------------------- reference
class ReferenceSpikeRule:
    """The rule for one target tensor in plain Python floats, the specification SpikeState is
    checked against. `step(grad)`: a list of unscaled floats -> (new_grad, spike_flags)."""

    def __init__(self, numel: int, threshold=DEFAULT_THRESHOLD, beta=DEFAULT_BETA, warmup_steps=DEFAULT_WARMUP_STEPS):
        self.threshold, self.beta, self.warmup_steps = float(threshold), float(beta), int(warmup_steps)
        self.momentum = [0.0] * numel
        self.steps = [0] * numel

    def step(self, grad: Sequence[float]):
        out, flags = [], []
        for i, x in enumerate(float(v) for v in grad):
            t = self.steps[i]
            if not math.isfinite(x):  # this element's state is untouched, its gradient too
                out.append(x)
                flags.append(False)
                continue
            mhat = self.momentum[i] / (1.0 - self.beta ** t) if t > 0 else 0.0
            is_spike = t >= self.warmup_steps and mhat > 0 and abs(x) > self.threshold * mhat
            y = math.copysign(mhat, x) if is_spike else x
            self.momentum[i] = self.beta * self.momentum[i] + (1.0 - self.beta) * abs(y)
            self.steps[i] = t + 1
            out.append(y)
            flags.append(is_spike)
        return out, flags


# --------------------------------------------------------------------------------------- statistics
# Per step: scaled elements, largest |g| / momentum, non-finite elements; summed (max for the
# ratio) over shards and stages at each report, then to TensorBoard / W&B or else the log.
DEFAULT_LOG_INTERVAL = 100


def reduce_rows(rows: torch.Tensor, groups: Sequence) -> torch.Tensor:
    """[.., 3] statistics summed (counts) / maxed (ratio) over each process group."""
    if rows.shape[0] == 0:  # every rank has recorded the same number of steps: all skip alike
        return rows
    for group in groups:
        parts = [torch.empty_like(rows) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, rows.contiguous(), group=group)
        stacked = torch.stack(parts)
        rows = torch.stack([stacked[..., 0].sum(0), stacked[..., 1].amax(0), stacked[..., 2].sum(0)], dim=-1)
    return rows


class StepStats:
    """A ring of per-step statistics since the last report, and the totals before it."""

    def __init__(self):
        self._ring: Optional[torch.Tensor] = None
        self._slots: List[torch.Tensor] = []  # the ring's rows, as views made once
        self.iterations: List[int] = []
        self.reported_totals = [0.0, 0.0, 0.0]  # reduced over shards and stages
        self.local_totals = [0.0, 0.0, 0.0]  # this rank's own counts
        self.last_report: Optional[List[dict]] = None

    def slot_for(self, iteration: int, size: int, device: Callable) -> Optional[torch.Tensor]:
        """The ring's [3] row for one committed step's statistics, which the caller fills on the
        device (None when the ring is full). `device()` is asked only when the ring is (re)made."""
        if len(self._slots) < size:
            self._ring = torch.zeros(size, 3, dtype=torch.float32, device=device())
            self._slots = list(self._ring.unbind(0))
        index = len(self.iterations)
        if index >= len(self._slots):
            return None
        self.iterations.append(iteration)
        return self._slots[index]

    def _pending_rows(self, device) -> torch.Tensor:
        n = len(self.iterations)
        return self._ring[:n].clone() if n else torch.zeros(0, 3, device=device)

    def report(self, groups: Sequence) -> List[dict]:
        """Reduce the steps since the last report and write them. Host sync and collectives: every
        rank of the groups calls it at the same step."""
        if not self.iterations or self._ring is None:
            return []
        local = self._pending_rows(None)
        _add(self.local_totals, local.tolist())
        values = reduce_rows(local, groups).tolist()
        _add(self.reported_totals, values)
        report = [
            {"iteration": it, "scaled": int(v[0]), "max_ratio": float(v[1]), "nonfinite": int(v[2])}
            for it, v in zip(self.iterations, values)
        ]
        self.iterations = []
        self.last_report = report
        write_report(report)
        return report

    def totals(self, groups: Sequence, reduce: bool, device) -> dict:
        """Totals over committed steps (host sync; collectives over `groups` when reduce)."""
        rows = self._pending_rows(device)
        if reduce:
            rows = reduce_rows(rows, groups)
        scaled, ratio, nonfinite = self.reported_totals if reduce else self.local_totals
        for s, r, f in rows.tolist():
            scaled, ratio, nonfinite = scaled + s, max(ratio, r), nonfinite + f
        return {"scaled": int(scaled), "max_ratio": float(ratio), "nonfinite": int(nonfinite)}


def _add(totals: list, rows) -> None:
    for scaled, ratio, nonfinite in rows:
        totals[0] += scaled
        totals[1] = max(totals[1], ratio)
        totals[2] += nonfinite


STEP_COLUMNS = (("scaled", "scaled-elements"), ("max_ratio", "max-ratio"), ("nonfinite", "nonfinite-elements"))


def write_report(report: List[dict]) -> None:
    tensorboard, wandb = runtime.writers()
    if tensorboard is not None:  # TensorBoard takes any step, in any order: one point per step
        for row in report:
            for field, name in STEP_COLUMNS:
                tensorboard.add_scalar(f"mixln-spike/{name}", row[field], row["iteration"])
    if wandb is not None and report:
        wandb.log(*wandb_entry(report))
    if tensorboard is None and wandb is None and report and runtime.is_last_rank():
        logger.info(
            "mixln spike scaler: iterations %d-%d: %d elements scaled (per step %s), largest "
            "|g|/momentum %.3g, %d non-finite target gradient elements left alone",
            report[0]["iteration"], report[-1]["iteration"], sum(r["scaled"] for r in report),
            [r["scaled"] for r in report], max(r["max_ratio"] for r in report),
            sum(r["nonfinite"] for r in report),
        )


def wandb_entry(report: List[dict]) -> tuple:
    """(scalars, step): the one W&B entry for a report, at the current iteration (W&B drops logs
    below its current step): the interval's totals (`mixln-spike/interval/*`) and every step's
    row as lists (`mixln-spike/steps/*`, index-aligned with `mixln-spike/steps/iteration`)."""
    step = max(report[-1]["iteration"], runtime.current_iteration() or 0)
    scalars = {
        "mixln-spike/interval/scaled-elements": sum(row["scaled"] for row in report),
        "mixln-spike/interval/max-ratio": max(row["max_ratio"] for row in report),
        "mixln-spike/interval/nonfinite-elements": sum(row["nonfinite"] for row in report),
        "mixln-spike/interval/steps": len(report),
        "mixln-spike/steps/iteration": [row["iteration"] for row in report],
    }
    for field, name in STEP_COLUMNS:
        scalars[f"mixln-spike/steps/{name}"] = [row[field] for row in report]
    return scalars, step
