"""Benchmarks share the test harness (tests/harness) and the demo's plots (scripts/plots.py):
importing this module puts tests/ and scripts/ on sys.path."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _folder in ("scripts", "tests"):
    if os.path.join(ROOT, _folder) not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, _folder))
