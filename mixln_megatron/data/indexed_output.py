"""Where preprocessing writes: `<prefix>.bin/.idx`, published only when complete.

The data goes to hidden temporaries in the output directory, renamed at the end with the .idx
last, so no new pair exists before all was written; with --overwrite the old .idx goes first, so
no mixed old/new pair can exist either. A SIGKILLed run leaves only temporaries (or, killed
between the renames, a lone .bin), which the next run into that prefix removes.
"""

from __future__ import annotations

import os
import sys
from typing import Tuple

from ..safe_output import sweep_stale
from .report import PreprocessError

def output_paths(prefix: str) -> Tuple[str, str]:
    return prefix + ".bin", prefix + ".idx"


def check_output(prefix: str, overwrite: bool) -> None:
    if prefix.endswith((".bin", ".idx")):
        raise PreprocessError(
            f"--output-prefix {prefix!r} ends in .bin/.idx: give the prefix only (it gets both)"
        )
    if os.path.isdir(prefix):
        raise PreprocessError(f"--output-prefix {prefix!r} is a directory; give a prefix such as {prefix}/data")
    if not overwrite:
        existing = [p for p in output_paths(prefix) if os.path.lexists(p)]
        if existing:
            raise PreprocessError(
                f"output {' and '.join(existing)} already exists; use --overwrite to replace it"
            )


def sweep_stale_output(prefix: str) -> None:
    """Remove what killed runs into `prefix` left; a run killed between its two renames left its
    .idx temporary and a lone <prefix>.bin, which goes too (a .bin without .idx is unusable)."""
    handled = sweep_stale(prefix, suffixes=(".bin", ".idx"))
    bin_path, idx_path = output_paths(prefix)
    half = [n for n in handled if n.endswith(".idx") and n[:-4] + ".bin" not in handled]
    if half and os.path.exists(bin_path) and not os.path.lexists(idx_path):
        os.remove(bin_path)
        print(f"[mixln_megatron] removed {bin_path}: the run that wrote it was killed before its .idx", file=sys.stderr)


def remove_if_present(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def publish(tmp_bin: str, tmp_idx: str, prefix: str, overwrite: bool) -> None:
    """Rename the finished temporaries to <prefix>.bin/.idx. The .idx goes last, so a failure
    in between leaves at most a lone .bin; with overwrite the old .idx goes first."""
    bin_path, idx_path = output_paths(prefix)
    check_output(prefix, overwrite)
    if overwrite:
        remove_if_present(idx_path)
    os.replace(tmp_bin, bin_path)
    try:
        os.replace(tmp_idx, idx_path)
    except BaseException:
        remove_if_present(bin_path)
        raise


def import_indexed_dataset():
    """megatron-core's indexed dataset writer, without its import-time notes on a CPU machine
    (no Transformer Engine / Apex / CUDA runtime), which say nothing about preprocessing."""
    import logging
    import warnings

    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    finally:
        log.setLevel(level)
    return DType, IndexedDatasetBuilder
