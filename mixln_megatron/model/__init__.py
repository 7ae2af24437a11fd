"""The Mix-LN model: settings and where they come from (settings.py, the one reader of MIXLN_*),
the placement rule, the plain-data spec factories (specs.py), the layer, its backends and norms,
the checkpoint record, the unsupported-configuration table and launch-time advice; HybridModel:
its patterns (hybrid_pattern.py, pure Python) and the Mix-LN stack (hybrid.py). Imports nothing
from training/, convert/, dev/ or the Megatron-LM edge (tests/test_import_graph.py)."""
