"""The gradient-spike scaler (Mix-LN authors: scale gradient elements of the boundary norms whose
magnitude exceeds `threshold` x their running momentum down to that momentum).

  rule.py     the element-wise rule and its state, on plain [targets, elements] tensors
  targets.py  which Mix-LN layers (transformer blocks: a GPT layer, a hybrid `*-` pair) are
              targets, their norm parameters keyed (block, role), the elements each rank owns,
              batched access to them
  scaler.py   SpikeScaler: the per-step work after finalize_model_grads, commit, synchronize
  stats.py    per-step statistics, reduced and reported at the logging interval
  state.py    the state in torch_dist checkpoints (replicated tensors per layer holding target norms)
  hook.py     the adapter on config.finalize_model_grads_func and the install functions
"""

from ...model.settings import (
    DEFAULT_BETA,
    DEFAULT_TARGETS,
    DEFAULT_THRESHOLD,
    DEFAULT_WARMUP_STEPS,
    SpikeConfigError,
    SpikeSettings,
)
from .hook import (
    SpikeGradsHook,
    get_spike_scaler,
    install_finalize_hook,
    install_on_config,
    install_spike_scaler,
    remove_spike_scaler,
    resolve_spike_settings,
)
from .rule import ReferenceSpikeRule, SpikeState
from .scaler import SpikeScaler
from .state import HOLDER_NAME, SpikeStateHolder
from .stats import write_report
from .targets import target_layers

__all__ = [
    "DEFAULT_BETA", "DEFAULT_TARGETS", "DEFAULT_THRESHOLD", "DEFAULT_WARMUP_STEPS", "HOLDER_NAME",
    "ReferenceSpikeRule", "SpikeConfigError", "SpikeGradsHook", "SpikeScaler", "SpikeSettings",
    "SpikeState", "SpikeStateHolder", "get_spike_scaler", "install_finalize_hook", "install_on_config",
    "install_spike_scaler", "remove_spike_scaler", "resolve_spike_settings", "target_layers", "write_report",
]
