"""Diagnostics from the Mix-LN paper (arXiv 2412.13795) for megatron-core and Hugging Face models
(`mixln-megatron analyze`, docs/commands.md), and the arms of its comparison (`mixln-megatron arms`).

Importing this package imports nothing heavy; the submodules import torch / megatron.
"""
