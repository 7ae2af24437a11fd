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

from ..errors import ConversionError, UnsafeCheckpointError, UnsupportedModelError
from .staging import prepare_output, staged_output_dir


def convert_to_hf(load: str, save: str, **kwargs) -> dict:
    """Megatron-LM checkpoint -> Hugging Face folder. See to_hf.convert_to_hf for the options."""
    from .to_hf import convert_to_hf as run

    return run(load, save, **kwargs)


def convert_from_hf(load: str, save: str, **kwargs) -> dict:
    """Hugging Face folder -> Megatron-LM checkpoint. See from_hf.convert_from_hf for the options."""
    from .from_hf import convert_from_hf as run

    return run(load, save, **kwargs)


__all__ = ["ConversionError", "UnsafeCheckpointError", "UnsupportedModelError", "convert_from_hf", "convert_to_hf", "prepare_output", "staged_output_dir"]
