"""Checkpoint conversion: Megatron-LM (torch_dist or legacy per-rank torch) <-> Hugging Face.

    mixln-megatron convert to-hf   --load CKPT_DIR [--iteration N] --save HF_DIR [--dtype ...]
    mixln-megatron convert from-hf --load HF_DIR --save CKPT_DIR --tp N --pp M [--ckpt-format ...]

Python API (same options as the command line, see cli.py):

    from mixln_megatron.convert import convert_to_hf, convert_from_hf
    convert_to_hf("runs/ckpt", "hf/out", dtype="bfloat16")
    convert_from_hf("hf/out", "runs/ckpt2", tp=2, pp=2)

Modules
  mapping         model shape from Megatron args / HF config, what Llama cannot express, name maps,
                  QKV (per query group) and fc1 ([gate; up]) layouts, vocabulary padding.
  megatron_reader read torch_dist (without process groups, sub-box reads of one layer at a time)
                  and legacy per-rank checkpoints, plus their args / Mix-LN settings record.
  to_hf           streaming export: config.json (+ auto_map and model code when P > 0),
                  safetensors shards written tensor by tensor, index, generation_config.json.
  from_hf         streaming import: torch_dist written lazily chunk by chunk, or legacy files.

Both directions write into a temporary directory next to the output and rename it at the end, so a
failed or interrupted conversion leaves nothing behind; an existing non-empty output directory is
refused unless overwrite=True (--overwrite).

This package imports neither megatron nor transformers at import time.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile


class ConversionError(RuntimeError):
    """A conversion cannot proceed; the message says why and what to do."""


class UnsupportedModelError(ConversionError):
    """The checkpoint's model uses a feature the conversion (or Llama) cannot express."""


@contextlib.contextmanager
def staged_output_dir(save: str, overwrite: bool = False):
    """Yield a fresh temporary directory next to `save`; move it to `save` only on success.

    A non-empty existing `save` is refused unless `overwrite`; with it, the old directory is
    replaced only after the new one is complete. Any failure (or Ctrl-C) removes the temporary
    directory, so no partial output is ever left behind.
    """
    save = os.path.abspath(save)
    if os.path.exists(save):
        if not os.path.isdir(save):
            raise ConversionError(f"output path {save} exists and is not a directory")
        if os.listdir(save) and not overwrite:
            raise ConversionError(
                f"output directory {save} exists and is not empty; choose another --save or pass "
                "--overwrite to replace it"
            )
    parent = os.path.dirname(save)
    created = None  # the topmost parent directory this call creates (removed again on failure)
    probe = parent
    while not os.path.exists(probe):
        created, probe = probe, os.path.dirname(probe)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(save)}.tmp-", dir=parent)
    try:
        yield tmp
        if os.path.exists(save):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(save)}.old-", dir=parent)
            os.rename(save, os.path.join(old, "x"))
            os.rename(tmp, save)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, save)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None and not any(files for _, _, files in os.walk(created)):
            shutil.rmtree(created, ignore_errors=True)
        raise


def convert_to_hf(load: str, save: str, **kwargs) -> dict:
    """Megatron-LM checkpoint -> Hugging Face folder. See to_hf.convert_to_hf for the options."""
    from .to_hf import convert_to_hf as run

    return run(load, save, **kwargs)


def convert_from_hf(load: str, save: str, **kwargs) -> dict:
    """Hugging Face folder -> Megatron-LM checkpoint. See from_hf.convert_from_hf for the options."""
    from .from_hf import convert_from_hf as run

    return run(load, save, **kwargs)


__all__ = ["ConversionError", "UnsupportedModelError", "convert_from_hf", "convert_to_hf", "staged_output_dir"]
