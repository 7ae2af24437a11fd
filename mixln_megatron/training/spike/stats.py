"""The spike scaler's statistics: recorded per committed step on the device, read and reported at
the logging interval.

Per step: the number of scaled elements, the largest |g| / momentum and the number of non-finite
target elements, summed (max for the ratio) over the distributed optimizer's shards and the
pipeline stages (one all-gather per group and report). They go to Megatron-LM's TensorBoard / W&B
writers when the run has them (W&B: one entry per report, see wandb_entry), else to this
package's logger (INFO, from the last rank).
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional, Sequence

import torch

from .. import runtime

logger = logging.getLogger(__name__)

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
    """(scalars, step): the one W&B entry for a report.

    W&B keeps one history row per step and drops every log below its current step; Megatron-LM
    logs each iteration at step=iteration, so rows of iterations before the current one cannot
    have their own steps. The report therefore goes in at the current iteration (never below the
    last row's): the interval's totals as charts (`mixln-spike/interval/*`), and every step's row
    as lists in that same history row (`mixln-spike/steps/*`, index-aligned with
    `mixln-spike/steps/iteration`)."""
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
