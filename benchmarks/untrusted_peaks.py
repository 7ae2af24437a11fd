"""Peak memory of `convert` on damaged checkpoints: each case of tests/test_untrusted_reads.py against
the same command on the untouched checkpoint.

    .venv/bin/python benchmarks/untrusted_peaks.py      # ~2-4 min on 2 cores

It runs that test file's baseline checks through pytest (so the cases are planted and run exactly
as the suite does: every (case, command) in its own forked child of one runner process, the peak
RSS from wait4) and prints, per case and command, the exit status, the child's peak RSS and what
it adds to its baseline. The suite bounds the added part (test_peak_memory_bounded); the absolute
peaks are mostly the imports (torch, megatron-core) and depend on the environment.
Last line: RESULT baseline_peak_mib=<min>-<max> case_peak_mib=<min>-<max> most_added_mib=<n> (<case>)
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TEST_FILE = os.path.join(REPO, "tests", "test_untrusted_reads.py")


class KeepRuns:
    """A pytest plugin that keeps the `runs` fixture's value (every case's result) once a test used it."""

    def __init__(self):
        self.runs = None

    def pytest_runtest_call(self, item):
        if self.runs is None and "runs" in getattr(item, "funcargs", {}):
            self.runs = item.funcargs["runs"]


def report(runs) -> str:
    """The table (one line per case and command), then the RESULT line."""
    from test_untrusted_reads import _baseline_of

    lines, added = [], {}
    for key, r in sorted(runs.items()):
        base = runs[_baseline_of(r["base"], r["cmd"])]
        added[key] = (r["peak_kib"] - base["peak_kib"]) / 1024
        lines.append(f"  {key:48s} exit {r['rc']}  peak {r['peak_kib'] / 1024:7.1f} MiB  ({added[key]:+6.1f})")
    baselines = [r["peak_kib"] / 1024 for k, r in runs.items() if k.startswith("baseline-")]
    cases = [r["peak_kib"] / 1024 for k, r in runs.items() if not k.startswith("baseline-")]
    worst = max((k for k in runs if not k.startswith("baseline-")), key=added.get)
    lines.append(f"RESULT baseline_peak_mib={min(baselines):.0f}-{max(baselines):.0f} "
                 f"case_peak_mib={min(cases):.0f}-{max(cases):.0f} most_added_mib={added[worst]:.0f} ({worst})")
    return "\n".join(lines)


def main() -> int:
    import pytest

    sys.path[:0] = [REPO, os.path.dirname(TEST_FILE)]
    keep = KeepRuns()
    rc = pytest.main(["-q", "-p", "no:cacheprovider", f"{TEST_FILE}::test_baselines_succeed"], plugins=[keep])
    if keep.runs is None:
        print(f"untrusted_peaks: the cases did not run (pytest exit {int(rc)})", file=sys.stderr)
        return 2
    print(report(keep.runs))
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
