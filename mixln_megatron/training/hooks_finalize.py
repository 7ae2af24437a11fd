"""What the training hooks share: a wrapper of `config.finalize_model_grads_func`, and taking one
such wrapper back out of the chain.

Both the gradient-spike scaler (training.spike.hook) and the telemetry (training.telemetry) run
after the gradient finalize (DP reduction, TP all-reduce of sequence-parallel norm grads,
embedding sync, 1/num_tokens scaling), so both wrap whatever the config holds there; each wrapper
keeps it as `.original`, which makes the installed hooks a chain that starts at the config.
"""

from __future__ import annotations

from typing import Callable, Optional

from .. import compat
from .config_shared import SharedByConfigCopies


class FinalizeWrapper(SharedByConfigCopies):
    """A `config.finalize_model_grads_func` that runs what it wraps, then `after_finalize`.

    Keeps the call signature of what it wraps; `original` None stands for megatron's own
    finalize_model_grads (Megatron-LM sets that one only inside train(), after the hooks are on).
    A deep copy of the config shares the wrapper (SharedByConfigCopies)."""

    def __init__(self, original: Optional[Callable] = None):
        self.original = original

    def __call__(self, model, *args, **kwargs):
        original = self.original
        if original is None:
            from megatron.core.distributed import finalize_model_grads as original
        result = original(model, *args, **kwargs)
        self.after_finalize(model, args, kwargs)
        return result

    def after_finalize(self, model, args: tuple, kwargs: dict) -> None:
        """The hook's own work, on the finalized gradients; the call's arguments as given."""
        raise NotImplementedError


def unwrap_finalize(config, kind) -> Optional[object]:
    """Take the first wrapper of type `kind` out of the chain of `.original` links that starts at
    `config.finalize_model_grads_func`, leaving the rest as it was; the wrapper, or None."""
    config = getattr(config, "transformer", config)  # Megatron-LM's GPTModelConfig wraps it
    above, hook = None, compat.finalize_chain_head(config)  # 0.17/0.18: under train()'s dispatcher
    while hook is not None and not isinstance(hook, kind):
        above, hook = hook, getattr(hook, "original", None)
    if hook is None:
        return None
    if above is None:
        compat.set_finalize_chain_head(config, hook.original)
    else:
        above.original = hook.original
    return hook
