"""The gradient-spike scaler (Mix-LN authors: scale gradient elements of the boundary norms whose
magnitude exceeds `threshold` x their running momentum down to that momentum): the rule
(rule.py), its targets and checkpoint state (state.py), and the hook (scaler.py).
"""

from ...model.settings import (
    DEFAULT_BETA,
    DEFAULT_TARGETS,
    DEFAULT_THRESHOLD,
    DEFAULT_WARMUP_STEPS,
    SpikeConfigError,
    SpikeSettings,
)
from .rule import ReferenceSpikeRule, SpikeState, write_report
from .scaler import (
    SpikeGradsHook,
    SpikeScaler,
    get_spike_scaler,
    install_finalize_hook,
    install_on_config,
    install_spike_scaler,
    remove_spike_scaler,
    resolve_spike_settings,
)
from .state import HOLDER_NAME, SpikeStateHolder, target_layers
