"""The gradient-spike scaler's rule and state: plain tensor code, no torch.distributed, no megatron.

Where it acts: the norm parameters at the Post-LN / Pre-LN boundary of a Mix-LN model (by default
the two norms of the last Post-LN layer and the two of the first Pre-LN layer), on the fully
reduced gradient of each step. The adapter that finds those gradients inside Megatron's
`finalize_model_grads` lives in grads_hook.py; this module only sees flat fp32 vectors.

The rule, per element i of a target tensor, at committed step t (t = steps seen so far):

    m_i        running momentum of |g_i|: an EMA with coefficient `beta`, started at 0
    mhat_i     = m_i / (1 - beta**t)              (bias-corrected, so early steps are meaningful)
    spike_i    = t >= warmup_steps and mhat_i > 0 and |g_i| > threshold * mhat_i
    g_i       <- sign(g_i) * mhat_i               where spike_i; every other element is untouched
    m_i       <- beta * m_i + (1 - beta) * |g_i|  with the *scaled* g_i, so a spike never
                                                  inflates the momentum that judges the next one
    t         <- t + 1

Details that follow from it:
  * Nothing is scaled during the first `warmup_steps` steps (the momentum still learns), and an
    element whose momentum is exactly 0 (it never had a gradient) is never scaled: there is no
    scale to compare it with.
  * A target tensor with any non-finite element leaves its state (momentum and step) untouched and
    its gradient unchanged on that step (the optimizer then skips the step under fp16 loss scaling,
    or the run has a real problem under bf16). Validity is judged per target tensor, never per
    step across tensors, so the decisions do not depend on how pipeline stages split the targets.
  * Gradients may still carry the fp16 loss scale: `scale` divides them before the comparison and
    multiplies the replacement, so the state is always in unscaled units.
  * Known property of this rule: a *lasting* 50x jump of an element's gradient is held at the old
    momentum for as long as it lasts (the momentum is only fed scaled values). That is the intent
    for the boundary norms, where such jumps are instabilities; it is why the default threshold is
    large.

The alternative considered (SPAM, "spike-aware" Adam clipping): keep the optimizer's second moment
v (EMA of g^2, before its update); an element is a spike when g^2 > theta * v with theta = 5000, and
it is clipped to sign(g) * sqrt(theta * v), i.e. to the threshold rather than to the typical size;
SPAM also resets the moments periodically. We keep the Mix-LN authors' first-moment rule instead:
it needs no access to the optimizer's state (which the distributed optimizer shards and which
differs between Adam variants), it runs on the reduced gradient before clipping and the norm
computation, and scaling to the momentum removes the spike's energy rather than keeping
sqrt(5000) ~ 71x of it. `ReferenceSpikeRule` below is the rule as plain Python, element by element:
the tensor code is tested against it.

Settings (arguments > MIXLN_SPIKE_* environment > defaults): see SpikeSettings and
resolve_spike_settings. Targets: "boundary" (default), "all" (both norms of every transformer
layer; the decoder's final norm is not included), or a list of global 1-based layer numbers.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
from typing import Mapping, Optional, Sequence, Tuple, Union

import torch

from .megatron_args import (  # the names the --mixln-spike-* flags export to
    ENV_SPIKE,
    ENV_SPIKE_BETA,
    ENV_SPIKE_TARGETS,
    ENV_SPIKE_THRESHOLD,
    ENV_SPIKE_WARMUP,
)

DEFAULT_THRESHOLD = 50.0  # the Mix-LN authors' value
DEFAULT_BETA = 0.99
DEFAULT_WARMUP_STEPS = 100
DEFAULT_TARGETS = "boundary"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class SpikeConfigError(ValueError):
    """A spike-scaler setting is invalid; the message names it and the accepted values."""


# --------------------------------------------------------------------------------------- settings
def _parse_targets(value, source: str) -> Union[str, Tuple[int, ...]]:
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("boundary", "all"):
            return text
        parts = [p for p in text.replace(" ", "").split(",") if p]
        if not parts:
            raise SpikeConfigError(
                f"spike targets from {source} must be 'boundary', 'all' or a comma list of global "
                f"layer numbers such as '6,7', got {value!r}"
            )
        value = parts
    try:
        layers = tuple(sorted({int(v) for v in value}))
    except (TypeError, ValueError):
        raise SpikeConfigError(
            f"spike targets from {source} must be 'boundary', 'all' or a list of global layer "
            f"numbers, got {value!r}"
        ) from None
    if not layers or layers[0] < 1:
        raise SpikeConfigError(f"spike target layers from {source} are 1-based and non-empty, got {value!r}")
    return layers


@dataclasses.dataclass(frozen=True)
class SpikeSettings:
    """Spike-scaler settings. None means: not given here (the environment, then the default)."""

    enabled: Optional[bool] = None
    threshold: Optional[float] = None
    beta: Optional[float] = None
    warmup_steps: Optional[int] = None
    targets: Optional[Union[str, Sequence[int]]] = None
    log_interval: Optional[int] = None  # None: Megatron-LM's --log-interval when present, else 100

    def __post_init__(self):
        _validate(self, "the arguments")


def _validate(s: SpikeSettings, source: str) -> None:
    if s.threshold is not None:
        if isinstance(s.threshold, bool) or not math.isfinite(float(s.threshold)) or float(s.threshold) < 1:
            raise SpikeConfigError(
                f"spike threshold from {source} must be a finite number >= 1 (default "
                f"{DEFAULT_THRESHOLD:g}: a spike is |g| > threshold * momentum), got {s.threshold!r}"
            )
    if s.beta is not None:
        if isinstance(s.beta, bool) or not 0 <= float(s.beta) < 1:
            raise SpikeConfigError(
                f"spike beta from {source} must lie in [0, 1) (EMA coefficient of |g|, default "
                f"{DEFAULT_BETA}), got {s.beta!r}"
            )
    if s.warmup_steps is not None:
        if isinstance(s.warmup_steps, bool) or int(s.warmup_steps) != s.warmup_steps or s.warmup_steps < 0:
            raise SpikeConfigError(
                f"spike warmup_steps from {source} must be an integer >= 0, got {s.warmup_steps!r}"
            )
    if s.targets is not None:
        _parse_targets(s.targets, source)
    if s.log_interval is not None and (isinstance(s.log_interval, bool) or int(s.log_interval) < 1):
        raise SpikeConfigError(f"spike log_interval from {source} must be >= 1, got {s.log_interval!r}")


def spike_settings_from_env(environ: Optional[Mapping[str, str]] = None) -> SpikeSettings:
    """SpikeSettings from the MIXLN_SPIKE_* variables (empty strings count as unset)."""
    env = os.environ if environ is None else environ

    def get(name):
        value = env.get(name, "")
        return value.strip() or None

    enabled = get(ENV_SPIKE)
    if enabled is not None:
        if enabled.lower() in _TRUE:
            enabled = True
        elif enabled.lower() in _FALSE:
            enabled = False
        else:
            raise SpikeConfigError(f"{ENV_SPIKE} must be 1 or 0, got {enabled!r}")

    def number(name, kind):
        value = get(name)
        if value is None:
            return None
        try:
            return kind(value)
        except ValueError:
            raise SpikeConfigError(f"environment variable {name} must be a number, got {value!r}") from None

    fields = dict(
        enabled=enabled,
        threshold=number(ENV_SPIKE_THRESHOLD, float),
        beta=number(ENV_SPIKE_BETA, float),
        warmup_steps=number(ENV_SPIKE_WARMUP, int),
        targets=get(ENV_SPIKE_TARGETS),
        log_interval=None,
    )
    _validate(types.SimpleNamespace(**fields), "the environment (MIXLN_SPIKE_*)")
    return SpikeSettings(**fields)


@dataclasses.dataclass(frozen=True)
class ResolvedSpikeSettings:
    enabled: bool
    threshold: float
    beta: float
    warmup_steps: int
    targets: Union[str, Tuple[int, ...]]
    log_interval: Optional[int]

    def describe(self) -> str:
        targets = self.targets if isinstance(self.targets, str) else ",".join(map(str, self.targets))
        return (
            f"threshold={self.threshold:g} beta={self.beta:g} warmup_steps={self.warmup_steps} "
            f"targets={targets}"
        )


def resolve_spike_settings(
    settings: Optional[Union[SpikeSettings, Mapping]] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> ResolvedSpikeSettings:
    """Arguments > MIXLN_SPIKE_* environment > defaults. `enabled` defaults to False."""
    if settings is None:
        settings = SpikeSettings()
    elif isinstance(settings, Mapping):
        settings = SpikeSettings(**settings)
    env = spike_settings_from_env(environ)

    def pick(name, default):
        for source in (settings, env):
            value = getattr(source, name)
            if value is not None:
                return value
        return default

    return ResolvedSpikeSettings(
        enabled=bool(pick("enabled", False)),
        threshold=float(pick("threshold", DEFAULT_THRESHOLD)),
        beta=float(pick("beta", DEFAULT_BETA)),
        warmup_steps=int(pick("warmup_steps", DEFAULT_WARMUP_STEPS)),
        targets=_parse_targets(pick("targets", DEFAULT_TARGETS), "the settings"),
        log_interval=settings.log_interval,
    )


def target_layers(targets: Union[str, Tuple[int, ...]], placement) -> Tuple[int, ...]:
    """Global 1-based layer numbers whose norm parameters the scaler watches.

    `placement` is a mixln_megatron.placement.Placement. "boundary" gives () when the model has no
    Post/Pre boundary (P = 0 or P = L): the scaler is then disabled.
    """
    if targets == "boundary":
        return tuple(placement.boundary_layers)
    if targets == "all":
        return tuple(range(1, placement.num_layers + 1))
    bad = [n for n in targets if not 1 <= n <= placement.num_layers]
    if bad:
        raise SpikeConfigError(
            f"spike target layers {bad} are outside 1..{placement.num_layers} (global, 1-based)"
        )
    return tuple(targets)


# --------------------------------------------------------------------------------------- the rule
class SpikeState:
    """Flat state of the rule for K target tensors laid end to end (sizes[k] elements each).

    Two-phase, so that a step the optimizer then skips never changes the state, and so that the
    proposal can run inside a captured CUDA graph: `propose` computes the decisions and writes the
    candidate next state into preallocated `pending_*` tensors (in place, no host sync); `commit`
    copies the candidate into the state (in place, only if a proposal is pending); `discard` drops
    it. Calling `propose` twice before a commit (Megatron's rerun of a step) gives the same result,
    since it always starts from the committed state.

    Statistics of the proposal (`pending_stats`): [number of scaled elements, largest
    |g| / momentum over finite elements with a momentum, number of target tensors skipped as
    non-finite]. After a commit they are in `last_stats`.
    """

    STATS = ("scaled", "max_ratio", "nonfinite")

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
        self.offsets = tuple(int(o) for o in torch.tensor((0,) + self.sizes).cumsum(0).tolist())
        self.numel = self.offsets[-1]
        self.threshold = float(threshold)
        self.beta = float(beta)
        self.warmup_steps = int(warmup_steps)
        device = torch.device("cpu") if device is None else torch.device(device)
        n, k = self.numel, len(self.sizes)
        self.segment_ids = torch.repeat_interleave(
            torch.arange(k, device=device), torch.tensor(self.sizes, device=device)
        )
        self._equal_sizes = len(set(self.sizes)) == 1
        self.momentum = torch.zeros(n, dtype=torch.float32, device=device)
        self.step = torch.zeros(n, dtype=torch.int64, device=device)  # per element; equal within a target
        self.pending_momentum = torch.zeros_like(self.momentum)
        self.pending_step = torch.zeros_like(self.step)
        self.pending_valid = torch.zeros(1, dtype=torch.bool, device=device)
        self.pending_stats = torch.zeros(3, dtype=torch.float32, device=device)
        self.last_stats = torch.zeros(3, dtype=torch.float32, device=device)
        self._zero_k = torch.zeros(k, dtype=torch.float32, device=device)
        self._zero_stats = torch.zeros(3, dtype=torch.float32, device=device)

    @property
    def device(self) -> torch.device:
        return self.momentum.device

    # -- the rule -----------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, grad: torch.Tensor, scale: Optional[torch.Tensor] = None):
        """Decide for one step. `grad`: the reduced gradient of all targets, flat, [numel].

        Returns (spike, replacement): a bool mask and the value (in `grad`'s units, i.e. loss-scaled
        when `scale` is given) that the spiking elements take. Elements outside the mask must be
        left exactly as they are. Writes the candidate state into pending_*; no host sync.
        """
        g = grad.float()
        if scale is not None:
            g = g / scale
        mag = g.abs()
        # Validity per target tensor: any inf/nan makes g * 0 contain a nan.
        poison = g * 0.0
        if self._equal_sizes:
            per_target = poison.view(len(self.sizes), -1).sum(1)
        else:
            per_target = self._zero_k.index_add(0, self.segment_ids, poison)
        valid_t = per_target == 0
        valid = valid_t[self.segment_ids] if len(self.sizes) > 1 else valid_t.expand(self.numel)

        correction = (1.0 - torch.pow(self.beta, self.step)).clamp_min(1e-30)
        mhat = self.momentum / correction
        compared = (mhat > 0) & valid
        spike = (mag > mhat * self.threshold) & compared & (self.step >= self.warmup_steps)
        replacement = torch.sign(g) * mhat
        if scale is not None:
            replacement = replacement * scale

        kept = torch.where(spike, mhat, mag)
        new_momentum = torch.add(self.momentum * self.beta, kept, alpha=1.0 - self.beta)
        torch.where(valid, new_momentum, self.momentum, out=self.pending_momentum)
        torch.add(self.step, valid, out=self.pending_step)

        ratio = torch.where(compared, mag / mhat.clamp_min(1e-30), 0.0).max()
        stats = torch.stack((spike.sum().float(), ratio, (~valid_t).sum().float()))
        self.pending_stats.copy_(stats)
        self.pending_valid.fill_(True)
        return spike, replacement

    @torch.no_grad()
    def apply(self, grad: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """propose + where + commit in one call: the scaled gradient (a new tensor)."""
        spike, replacement = self.propose(grad, scale)
        out = torch.where(spike, replacement.to(grad.dtype), grad)
        self.commit()
        return out

    @torch.no_grad()
    def commit(self) -> None:
        """Make the pending proposal the state (no-op when none is pending). No host sync."""
        torch.where(self.pending_valid, self.pending_momentum, self.momentum, out=self.momentum)
        torch.where(self.pending_valid, self.pending_step, self.step, out=self.step)
        torch.where(self.pending_valid, self.pending_stats, self._zero_stats, out=self.last_stats)
        self.pending_valid.fill_(False)

    @torch.no_grad()
    def discard(self) -> None:
        self.pending_valid.fill_(False)

    # -- per target access (checkpoints) -------------------------------------------------------
    def segment(self, k: int) -> slice:
        return slice(self.offsets[k], self.offsets[k + 1])

    def get_target(self, k: int) -> dict:
        """{'momentum': fp32 cpu tensor, 'step': int} of target k (host sync: for checkpoints)."""
        sl = self.segment(k)
        return {"momentum": self.momentum[sl].detach().cpu().clone(), "step": int(self.step[sl][0].item())}

    @torch.no_grad()
    def set_target(self, k: int, momentum: torch.Tensor, step: int) -> None:
        sl = self.segment(k)
        if momentum.numel() != self.sizes[k]:
            raise ValueError(
                f"spike-scaler state for target {k} has {momentum.numel()} elements, expected {self.sizes[k]}"
            )
        self.momentum[sl].copy_(momentum.reshape(-1).to(torch.float32))
        self.step[sl].fill_(int(step))
        self.pending_valid.fill_(False)


# --------------------------------------------------------------------------------------- reference
class ReferenceSpikeRule:
    """The rule for one target tensor in plain Python floats, element by element.

    The specification the tensor code (SpikeState) and the hook are checked against; slow on
    purpose. `step(grad)` takes a list of floats (unscaled) and returns (new_grad, spike_flags).
    """

    def __init__(self, numel: int, threshold=DEFAULT_THRESHOLD, beta=DEFAULT_BETA, warmup_steps=DEFAULT_WARMUP_STEPS):
        self.threshold, self.beta, self.warmup_steps = float(threshold), float(beta), int(warmup_steps)
        self.momentum = [0.0] * numel
        self.t = 0

    def step(self, grad: Sequence[float]):
        grad = [float(x) for x in grad]
        if not all(math.isfinite(x) for x in grad):
            return list(grad), [False] * len(grad)  # state untouched, gradient untouched
        correction = 1.0 - self.beta ** self.t
        out, flags = [], []
        for i, x in enumerate(grad):
            mhat = self.momentum[i] / correction if self.t > 0 else 0.0
            is_spike = self.t >= self.warmup_steps and mhat > 0 and abs(x) > self.threshold * mhat
            y = math.copysign(mhat, x) if is_spike else x
            self.momentum[i] = self.beta * self.momentum[i] + (1.0 - self.beta) * abs(y)
            out.append(y)
            flags.append(is_spike)
        self.t += 1
        return out, flags
