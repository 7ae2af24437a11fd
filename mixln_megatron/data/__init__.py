"""Data: the shipped assets (corpus), tokenizers, and offline preprocessing to Megatron datasets.

Importing this package imports none of its modules (so `python -m mixln_megatron.data.preprocess`
runs the module once); megatron, torch and transformers are imported only when a dataset is
written or a Hugging Face tokenizer directory is loaded.
"""
