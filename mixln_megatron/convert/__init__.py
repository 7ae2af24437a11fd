"""Checkpoint conversion: Megatron-LM (torch_dist or legacy per-rank torch) <-> Hugging Face.

    mixln-megatron convert to-hf   --load CKPT_DIR [--ckpt-step N] --save HF_DIR [--dtype ...]
    mixln-megatron convert from-hf --load HF_DIR --save CKPT_DIR --tp N --pp M [--ckpt-format ...]
    mixln-megatron convert gpt-to-hybrid | hybrid-to-gpt --load CKPT --save CKPT  (torch_dist, model weights)
    mixln-megatron convert inspect CKPT_DIR

Python API (same options as the command line, see cli.py):

    from mixln_megatron.convert import convert_to_hf, convert_from_hf
    convert_to_hf("runs/ckpt", "hf/out", dtype="bfloat16")
    convert_from_hf("hf/out", "runs/ckpt2", tp=2, pp=2)

The modules by stage: CONTRIBUTING.md; the outputs' safety (staged, never deleting what they did not
write): docs/commands.md and mixln_megatron.safe_output.

This package imports neither megatron nor transformers at import time.
"""

from __future__ import annotations

from ..errors import ConversionError, UnsafeCheckpointError, UnsupportedModelError


def convert_to_hf(load: str, save: str, **kwargs) -> dict:
    """Megatron-LM checkpoint -> Hugging Face folder. See to_hf.convert_to_hf for the options."""
    from .to_hf import convert_to_hf as run  # heavy: torch, imported when called

    return run(load, save, **kwargs)


def convert_gpt_to_hybrid(load: str, save: str, **kwargs) -> dict:
    """GPTModel Mix-LN torch_dist checkpoint -> HybridModel (`*-` * L). See gpt_hybrid for the options."""
    from .gpt_hybrid import convert_gpt_to_hybrid as run  # heavy: torch, imported when called

    return run(load, save, **kwargs)


def convert_hybrid_to_gpt(load: str, save: str, **kwargs) -> dict:
    """HybridModel Mix-LN (`*-` pairs) torch_dist checkpoint -> GPTModel. See gpt_hybrid for the options."""
    from .gpt_hybrid import convert_hybrid_to_gpt as run  # heavy: torch, imported when called

    return run(load, save, **kwargs)


def convert_from_hf(load: str, save: str, **kwargs) -> dict:
    """Hugging Face folder -> Megatron-LM checkpoint. See from_hf.convert_from_hf for the options."""
    from .from_hf import convert_from_hf as run  # heavy: torch, imported when called

    return run(load, save, **kwargs)


__all__ = ["ConversionError", "UnsafeCheckpointError", "UnsupportedModelError", "convert_from_hf", "convert_gpt_to_hybrid",
           "convert_hybrid_to_gpt", "convert_to_hf"]
