"""The command line of a one-shot worker: `--workdir DIR`, run `main(DIR)` on every rank, exit 1
with the traceback when it raises, and tear megatron's parallel state down either way.

    if __name__ == "__main__":
        from workdir_main import run_workdir_main

        run_workdir_main(main)

Imported by path from the worker's own folder (sys.path[0], as for fork_queue.py).
"""

import argparse
import sys
import traceback

from harness import testing


def run_workdir_main(main) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    try:
        main(args.workdir)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    finally:
        testing.shutdown()
