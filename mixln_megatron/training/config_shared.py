"""Objects the project hangs on a megatron config are shared by every deep copy of that config.

Megatron deep-copies a TransformerConfig while it builds a model and gives the copy to a
submodule (attention when there are fewer query groups than TP ranks, SequentialMLP with its own
ffn size, shared experts). What the training hooks put on the config (finalize wrappers, the
spike scaler, the telemetry, their layer-build callbacks) reaches process groups, parameters and
running state: a real copy would fail (process groups do not pickle) or, worse, fork the state so
that the copy drives another scaler. So a deep copy of the config refers to the same objects.
"""

from __future__ import annotations


class SharedByConfigCopies:
    """Mixin: `copy.deepcopy` returns the object itself (also for a bound method of it)."""

    def __deepcopy__(self, memo):
        return self
