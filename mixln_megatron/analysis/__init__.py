"""Diagnostics from the Mix-LN paper (arXiv 2412.13795) for megatron-core and Hugging Face models.

  grad_norms   per-layer gradient norms of Pre-LN / Post-LN / Mix-LN (/ LNS) GPTs (Figures 3e, 6a)
  angular      angular distance between the inputs of layers l and l + n (Eq. 8, Figure 5)
  layer_drop   perplexity increase when one layer is bypassed (Eq. 9 with perplexity)
  models       fresh megatron-core GPTs, Megatron torch_dist checkpoints and HF folders behind one
               small interface (token losses, per-layer states, layer bypass), CPU, one process
  textdata     fixed token batches from a text file or the shipped corpus
  cli          `mixln-megatron analyze {grad-norms, angular-distance, layer-drop}` (main(argv))

Importing this package imports nothing heavy; the submodules import torch / megatron.
"""

__all__ = ["angular", "cli", "grad_norms", "layer_drop", "models", "textdata"]
