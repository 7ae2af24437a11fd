"""The warnings a CPU machine's heavy imports print, which the commands keep off the user's screen.

Importing megatron-core without TransformerEngine, Apex or absl prints about a dozen warnings,
torch logs that no CUDA runtime is found, and TransformerConfig warns about its own default
CUDA-graph scope; none can be acted on, and under a launcher every rank repeats them, burying a
one-line refusal. `quiet_known_warnings()` (called first by the commands' main functions) ignores
exactly these, each by category, message and issuing module; every other warning still shows,
and a user's own -W / PYTHONWARNINGS are kept. Pure Python: importing this imports nothing heavy.
"""

from __future__ import annotations

import logging
import sys
import warnings

# (message regex at the start of the text, module regex of the code that warns); UserWarning.
KNOWN = (
    (r"(Transformer Engine and )?Apex (is|are) not installed", r"megatron\."),
    (r"absl\.logging is not installed", r"megatron\.core\.hyper_comm_grid"),
    (r"Only transformer-engine>=[\d.]+ supports MoE experts", r"megatron\.core\.extensions\."),
    (r"full scope is deprecated", r"megatron\.core\.transformer\.transformer_config"),
)
# torch.utils.cpp_extension logs this when CUDA_HOME exists but no GPU does (a CUDA build of torch on a CPU).
TORCH_LOGGER, TORCH_MESSAGE = "torch.utils.cpp_extension", "No CUDA runtime is found"


class _DropNoCudaRuntime(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TORCH_MESSAGE)


def quiet_known_warnings() -> None:
    """Ignore the known import-time warnings of torch / megatron-core / TE and Apex absence / absl
    for the rest of this process (a command's). Idempotent."""
    logger = logging.getLogger(TORCH_LOGGER)  # the same object torch's module logs through, made now
    if not any(isinstance(f, _DropNoCudaRuntime) for f in logger.filters):
        logger.addFilter(_DropNoCudaRuntime())
    if sys.warnoptions:
        return  # the user chose what to see
    for message, module in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)
