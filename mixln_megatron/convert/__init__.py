"""Checkpoint conversion: Megatron-LM (torch_dist or legacy per-rank torch) <-> Hugging Face.

    mixln-megatron convert to-hf   --load CKPT_DIR [--ckpt-step N] --save HF_DIR [--dtype ...]
    mixln-megatron convert from-hf --load HF_DIR --save CKPT_DIR --tp N --pp M [--ckpt-format ...]
    mixln-megatron convert gpt-to-hybrid | hybrid-to-gpt --load CKPT --save CKPT  (torch_dist, model weights)
    mixln-megatron convert inspect CKPT_DIR

Python API (same options as the command line, see cli.py):

    from mixln_megatron.convert import convert_to_hf, convert_from_hf
    convert_to_hf("runs/ckpt", "hf/out", dtype="bfloat16")
    convert_from_hf("hf/out", "runs/ckpt2", tp=2, pp=2)

Modules (one way each: reader -> role mapping -> writer)
  mapping           tensor names on both sides (torch_dist keys, legacy module names, HF names);
                    the roles of a layer and the HF tensors each becomes (map_roles: once per export)
  shape             the model shape from Megatron args / HF config; what Llama cannot express
  forward_scalars   muP's softmax scale and multipliers and the GLU offset as megatron uses them
                    (its __post_init__ of the saved flags), and the flags that give them back
  hf_config_fields  every config.json field from-hf meets: carried, refused or of no effect, and why
  layouts           QKV (per query group), fc1 ([gate; up]) and TP-shard layouts; import row chunks
  inspect           what a checkpoint says about its model (args, shape, epsilon, Mix-LN record)
  facts             an export's CheckpointFacts, read once: reader, vocabulary, inspect, reader checks
  megatron_reader   open_checkpoint over locate, torch_dist_reader (over dcp_files:
                    torch.distributed.checkpoint with the allow-list) and legacy_reader
  to_hf             facts -> map_roles -> hf_layer_tensors -> streaming safetensors writer; config.json
                    (hf_config_dict, the one builder), the model code unless every layer is pre
                    (layer_kinds for layouts other than Mix-LN's first P: model.layout)
  from_hf           streaming import over hf_folder, hf_roles, megatron_writers, written_args
  staging           the temporary output directory renamed in at the end
  hybrid_keys       a Mix-LN HybridModel's torch_dist keys next to a GPTModel's (pure Python)
  gpt_hybrid        GPTModel <-> HybridModel checkpoints (keys renamed, every Mix-LN norm kept; pre /
                    post layouts only, as HybridModel) over dcp_writer (the lazy
                    torch.distributed.checkpoint writer from_hf uses too)

Every pickle read from a checkpoint goes through mixln_megatron.safe_unpickle (one allow-list).
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


def convert_gpt_to_hybrid(load: str, save: str, **kwargs) -> dict:
    """GPTModel Mix-LN torch_dist checkpoint -> HybridModel (`*-` * L). See gpt_hybrid for the options."""
    from .gpt_hybrid import convert_gpt_to_hybrid as run

    return run(load, save, **kwargs)


def convert_hybrid_to_gpt(load: str, save: str, **kwargs) -> dict:
    """HybridModel Mix-LN (`*-` pairs) torch_dist checkpoint -> GPTModel. See gpt_hybrid for the options."""
    from .gpt_hybrid import convert_hybrid_to_gpt as run

    return run(load, save, **kwargs)


def convert_from_hf(load: str, save: str, **kwargs) -> dict:
    """Hugging Face folder -> Megatron-LM checkpoint. See from_hf.convert_from_hf for the options."""
    from .from_hf import convert_from_hf as run

    return run(load, save, **kwargs)


__all__ = ["ConversionError", "UnsafeCheckpointError", "UnsupportedModelError", "convert_from_hf", "convert_gpt_to_hybrid",
           "convert_hybrid_to_gpt", "convert_to_hf", "prepare_output", "staged_output_dir"]
