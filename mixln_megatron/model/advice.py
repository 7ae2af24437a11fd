"""Launch-time advice: configurations outside what the Mix-LN paper and its authors report stable.

Advice only: nothing here changes a setting. Rank 0 prints one warning at model build when a
rule fires, naming the setting, the reported stable choice and where it was reported.
"""

from __future__ import annotations

from typing import List, Optional

from .placement import Placement

_announced = set()

PAPER = "Mix-LN paper (arXiv 2412.13795)"
AUTHORS_REPLY = (
    "the Mix-LN authors' reply to a 7B-class instability report in their reference repository's "
    "issue tracker"
)
STABLE_WARMUP_FRACTION = 0.10


def findings(
    placement: Placement,
    train_iters: Optional[int] = None,
    warmup_iters: Optional[int] = None,
) -> List[str]:
    """Each finding is one sentence: setting, stable choice, source."""
    out = []
    L, P = placement.num_layers, placement.post_ln_layers
    if L >= 32 and P > 2:
        out.append(
            f"{P} Post-LN layers at {L} layers: the stable 7B setting reported is 2 Post-LN layers "
            f"of 32 (alpha = 0.0625) ({PAPER}, LLaMA-7B; {AUTHORS_REPLY}, where 3 Post-LN layers "
            "at 51 layers trained unstably)"
        )
    if L >= 24 and P == L:
        out.append(
            f"all {L} layers Post-LN (alpha = 1): the paper reports Post-LN diverging at 24 "
            f"layers; Mix-LN used alpha = 0.25 up to 1B ({PAPER})"
        )
    if P > 0 and train_iters and warmup_iters is not None:
        fraction = warmup_iters / train_iters
        if fraction < STABLE_WARMUP_FRACTION:
            out.append(
                f"learning-rate warm-up of {warmup_iters} of {train_iters} iterations "
                f"({fraction:.1%}): the authors recommend warming up over 10% of training with "
                f"Post-LN layers ({AUTHORS_REPLY})"
            )
    return out


def warning_text(items: List[str]) -> Optional[str]:
    if not items:
        return None
    body = "\n".join(f"  - {item}" for item in items)
    return (
        "[mixln_megatron] WARNING: this configuration is outside what was reported stable "
        f"(advice only; settings unchanged):\n{body}"
    )


def advise(placement: Placement, train_iters: Optional[int] = None, warmup_iters: Optional[int] = None) -> Optional[str]:
    """Warning text for this run (the schedule, when known, from the caller: an edge)."""
    return warning_text(findings(placement, train_iters, warmup_iters))


def _rank() -> int:
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def announce(placement: Placement, train_iters: Optional[int] = None, warmup_iters: Optional[int] = None) -> None:
    """Rank 0 prints the placement line (users look for it) and any advice, once per placement.
    Called at the edges (training.hooks.install_training_hooks), never by a layer."""
    if placement in _announced:
        return
    _announced.add(placement)
    if _rank() != 0:
        return
    print(placement.describe(), flush=True)
    text = advise(placement, train_iters, warmup_iters)
    if text:
        print(text, flush=True)
