"""The Mix-LN model: settings and where they come from, the placement rule, the layer, its backends
and norms, the checkpoint record, the unsupported-configuration table and launch-time advice."""
