"""The gradient-spike scaler's rule and its state: plain tensor code, no torch.distributed, no
megatron. It only sees [targets, elements] matrices of reduced gradients (targets.py finds them).

The rule, per element i of a target tensor (t_i = the steps element i has seen so far):

    m_i        running momentum of |g_i|: an EMA with coefficient `beta`, started at 0
    mhat_i     = m_i / (1 - beta**t_i)            (bias-corrected, so early steps are meaningful)
    spike_i    = t_i >= warmup_steps and mhat_i > 0 and |g_i| > threshold * mhat_i
    g_i       <- sign(g_i) * mhat_i               where spike_i; every other element is untouched
    m_i       <- beta * m_i + (1 - beta) * |g_i|  with the *scaled* g_i, so a spike never
                                                  inflates the momentum that judges the next one
    t_i       <- t_i + 1

Details that follow from it:
  * Nothing is scaled during the first `warmup_steps` steps (the momentum still learns), and an
    element whose momentum is exactly 0 (it never had a gradient) is never scaled: there is no
    scale to compare it with (scaling it would also freeze it at 0 for good).
  * An element whose gradient is inf or nan keeps its momentum and step and its gradient is left
    as it is (the optimizer then skips the step under fp16 loss scaling; under bf16 Megatron's
    NaN check stops the run). Being elementwise, every decision needs only that element's reduced
    gradient and state, so a distributed-optimizer rank can decide for the shard it owns without
    any communication, and the decisions do not depend on TP/PP/DP layouts.
  * Gradients may still carry the fp16 loss scale: `scale` divides them before the comparison and
    multiplies the replacement, so the state is always in unscaled units.
  * Known property of this rule: a *lasting* 50x jump of an element's gradient is held at the old
    momentum for as long as it lasts (the momentum is only fed scaled values). That is the intent
    for the boundary norms, where such jumps are instabilities; it is why the threshold is large.

The alternative considered (SPAM, "spike-aware" Adam clipping): keep the optimizer's second moment
v (EMA of g^2, before its update); an element is a spike when g^2 > theta * v with theta = 5000, and
it is clipped to sign(g) * sqrt(theta * v), i.e. to the threshold rather than to the typical size;
SPAM also resets the moments periodically. We keep the Mix-LN authors' first-moment rule instead:
it needs no access to the optimizer's state (which the distributed optimizer shards and which
differs between Adam variants), it runs on the reduced gradient before clipping and the norm
computation, and scaling to the momentum removes the spike's energy rather than keeping
sqrt(5000) ~ 71x of it. `ReferenceSpikeRule` below is the rule as plain Python, element by element:
the tensor code is tested against it.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ...model.settings import DEFAULT_BETA, DEFAULT_THRESHOLD, DEFAULT_WARMUP_STEPS


class SpikeState:
    """State of the rule for K target tensors, as rows of [K, n] matrices (n = the largest size).

    A target smaller than n occupies the start of its row; the rest of the row is padding that the
    caller fills with zeros (a zero gradient never spikes and keeps a zero momentum). The norm
    weights the scaler watches all have the hidden size, so in practice there is no padding.

    Everything is per element: the momentum, the step count and the validity (an element whose
    gradient is inf/nan keeps its momentum and step). So a caller may decide for any subset of the
    elements (`owned`, e.g. the shard a distributed-optimizer rank owns): the elements outside it
    are left untouched, and the decisions do not depend on how the elements are split.

    Two-phase, so that a step the optimizer then skips never changes the state, and so that the
    proposal can run inside a captured CUDA graph: `propose_in_place` computes the decisions, writes
    them into the gradient buffer and the candidate next state into preallocated `pending_*` tensors
    (in place, no host sync); `commit` copies the candidate into the state (in place); `discard`
    drops it. Between proposals the pending state equals the committed one, so a commit without a
    proposal changes nothing. Proposing twice before a commit (Megatron's rerun of a step) gives the
    same result, since it always starts from the committed state.

    Statistics of the proposal (`pending_stats`, over the decided elements): [number of scaled
    elements, largest |g| / momentum over finite elements that have a momentum, number of
    non-finite elements]. A commit moves them to `stats_into`; zeros when nothing was proposed.

    The work is a fixed number of whole-matrix tensor ops, whatever K is: the hook's cost per step
    does not grow with the number of targets.
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
        """Decide for one step on `grad`, an fp32 [K, n] buffer of the targets' reduced gradients
        (a target smaller than n at the start of its row, zero padding), which then holds the
        result: the spiking elements replaced, every other element untouched.

        `scale`: the loss scale `grad` carries (fp16), or None. `owned`: a [K, n] bool mask of the
        elements to decide for (None: all); `grad` outside it is ignored and left as it is.
        Returns (spike, replacement): a bool mask and the values, in `grad`'s units, that the
        spiking elements took. Writes the candidate state into pending_*; no host sync, no
        grad-mode switch (neither the buffer nor the state needs grad)."""
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
    """The rule for one target tensor in plain Python floats, element by element.

    The specification the tensor code (SpikeState) and the hook are checked against; slow on
    purpose. `step(grad)` takes a list of floats (unscaled) and returns (new_grad, spike_flags).
    """

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
