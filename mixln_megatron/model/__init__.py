"""The Mix-LN model (which module does what: CONTRIBUTING.md). Imports nothing from training/,
convert/ or the Megatron-LM edge (tests/test_import_graph.py).
"""
