"""Workaround: Megatron-LM's start-up runs `make` for dataset helpers the wheel ships prebuilt.

Megatron's initialize_megatron -> _compile_dependencies -> megatron.core.datasets.utils.
compile_helpers runs `make` in megatron/core/datasets. The megatron-core wheel ships the compiled
`helpers_cpp` extension there but no Makefile, so `make` fails and the process exits, on GPU
machines as well. The entry point (never an import) replaces compile_helpers with an import of
the prebuilt library, and only when the Makefile is absent and that import succeeds; a source
checkout with a Makefile is left alone. Named in the README.
"""

from __future__ import annotations

import importlib
import os

HELPERS_MODULE = "megatron.core.datasets.helpers_cpp"


def _compile_helpers_prebuilt():
    """Stands in for megatron.core.datasets.utils.compile_helpers: the library is prebuilt."""
    importlib.import_module(HELPERS_MODULE)


_compile_helpers_prebuilt.mixln_prebuilt = True


def use_prebuilt_dataset_helpers(datasets_utils=None) -> bool:
    """Make Megatron use the wheel's prebuilt dataset helpers instead of running `make`.

    Only when the Makefile is absent AND the prebuilt module imports is compile_helpers replaced
    by that import; otherwise nothing changes (a source tree keeps compiling as upstream
    intends). Returns whether the replacement is in place. `datasets_utils` is the module to
    patch (tests pass a stand-in).
    """
    utils = datasets_utils
    if utils is None:
        utils = importlib.import_module("megatron.core.datasets.utils")
    if getattr(utils.compile_helpers, "mixln_prebuilt", False):
        return True
    directory = os.path.dirname(os.path.abspath(utils.__file__))
    if os.path.exists(os.path.join(directory, "Makefile")):
        return False
    try:
        importlib.import_module(HELPERS_MODULE)
    except ImportError:
        return False
    utils.compile_helpers = _compile_helpers_prebuilt
    return True
