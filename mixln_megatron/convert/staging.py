"""Where a conversion writes: a temporary directory next to the output, renamed in at the end.

Both directions stage their output this way (mixln_megatron.safe_output does the work), so a failed
or interrupted conversion leaves nothing behind and never replaces what it may not.
"""

from __future__ import annotations

import os

from ..errors import ConversionError


def staged_output_dir(save: str, overwrite: bool = False, kind=None):
    """Yield a fresh temporary directory next to `save`; move it to `save` only on success.

    `kind` (safe_output.HF_FOLDER / MEGATRON_FOLDER) limits what overwrite may replace; the old
    output is deleted only after the new one is renamed in, and any failure (Ctrl-C, SIGTERM)
    removes the temporary directory. See mixln_megatron.safe_output.
    """
    from ..safe_output import staged_dir

    return staged_dir(save, kind, overwrite, ConversionError)


def prepare_output(load: str, save: str, kind, overwrite: bool) -> None:
    """Before any work: refuse an output that overlaps the input or is not ours to replace, and
    clean up what interrupted runs into the same output left behind."""
    from ..safe_output import check_replaceable, check_separate, sweep_stale

    check_separate([load], [save], ConversionError)
    sweep_stale(save)
    check_replaceable(os.path.abspath(save), kind, overwrite, ConversionError)
