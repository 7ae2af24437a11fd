"""Checkpoint conversion: Megatron-LM (torch_dist or legacy per-rank torch) <-> Hugging Face.

    mixln-megatron convert to-hf   --load CKPT_DIR [--iteration N] --save HF_DIR [--dtype ...]
    mixln-megatron convert from-hf --load HF_DIR --save CKPT_DIR --tp N --pp M [--ckpt-format ...]

Python API (same options as the command line, see cli.py):

    from mixln_megatron.convert import convert_to_hf, convert_from_hf
    convert_to_hf("runs/ckpt", "hf/out", dtype="bfloat16")
    convert_from_hf("hf/out", "runs/ckpt2", tp=2, pp=2)

Modules
  mapping           tensor names on both sides (torch_dist keys, legacy module names, HF names)
  shape             the model shape from Megatron args / HF config; what Llama cannot express
  layouts           QKV (per query group), fc1 ([gate; up]) and TP-shard layouts; streaming row ranges
  inspect           what a checkpoint says about its model (args, shape, epsilon, Mix-LN record)
  megatron_reader   open_checkpoint over locate, torch_dist_reader (+ dcp_metadata, zip_chunk),
                    legacy_reader, safe_unpickle
  to_hf             streaming export: config.json (+ auto_map and model code when P > 0),
                    safetensors shards written tensor by tensor, index, generation_config.json
  from_hf           streaming import over hf_folder, hf_roles, megatron_writers, written_args

Both directions write into a temporary directory next to the output and rename it at the end, so a
failed or interrupted conversion leaves nothing behind; an existing non-empty output directory is
refused unless overwrite=True (--overwrite), and even then unless it is a previous export of the same
direction; an output that overlaps the input is always refused (mixln_megatron.safe_output).

This package imports neither megatron nor transformers at import time.
"""

from __future__ import annotations

import os


from ..errors import MixLNError  # noqa: E402  (cli.main prints it in one line, exit 2)


class ConversionError(MixLNError, RuntimeError):
    """A conversion cannot proceed; the message says why and what to do."""


class UnsupportedModelError(ConversionError):
    """The checkpoint's model uses a feature the conversion (or Llama) cannot express."""


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


def convert_to_hf(load: str, save: str, **kwargs) -> dict:
    """Megatron-LM checkpoint -> Hugging Face folder. See to_hf.convert_to_hf for the options."""
    from .to_hf import convert_to_hf as run

    return run(load, save, **kwargs)


def convert_from_hf(load: str, save: str, **kwargs) -> dict:
    """Hugging Face folder -> Megatron-LM checkpoint. See from_hf.convert_from_hf for the options."""
    from .from_hf import convert_from_hf as run

    return run(load, save, **kwargs)


__all__ = ["ConversionError", "UnsupportedModelError", "convert_from_hf", "convert_to_hf", "prepare_output", "staged_output_dir"]
