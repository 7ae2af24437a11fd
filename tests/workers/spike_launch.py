"""benchmarks/workers/spike_worker.py (shared with benchmarks/spike.py) as tests/test_spike.py runs
it: the same main() and arguments, with megatron's torch_dist write-results queue started by fork
(tests/workers/fork_queue.py) rather than by a spawned interpreter that imports torch again.

    python -m torch.distributed.run --nproc_per_node=N tests/workers/spike_launch.py <spike_worker arguments>
Nothing but the standard library at module level: this is the script a spawned process would import.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "workers"))
    from fork_queue import fork_started_write_results_queue

    fork_started_write_results_queue()
    import spike_worker

    spike_worker.main()
