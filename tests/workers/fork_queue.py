"""megatron's torch_dist save hands its write results to the saving process through a
multiprocessing Manager queue (dist_checkpointing/strategies/filesystem_async.py), which the first
save of a process starts with "spawn": a fresh interpreter that imports the launched script again
and torch again to unpickle the results, 3-6 s of the 2 cores for every process that saves. The
test workers start the same Manager queue by fork instead (torch is already there), before any
gloo thread exists. What is saved and how is unchanged: only the queue's server process starts
another way. test_vet_load keeps saving through the spawned queue.

Imported: `fork_started_write_results_queue()` (parallel / checkpoint-keys workers). Run, it
starts the queue, then runs a module or a script as `python` would:

    python tests/workers/fork_queue.py -m MODULE ARGS...   (test_pretrain*'s entry-point runs)
    python tests/workers/fork_queue.py SCRIPT ARGS...      (test_spike: benchmarks/workers/spike_worker.py)

Nothing but the standard library at module level: this is the script a spawned process would import.
"""

import os
import runpy
import sys


def fork_started_write_results_queue() -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import get_write_results_queue

    get_write_results_queue(mp_mode="fork")  # megatron's own switch; a no-op once the queue exists


if __name__ == "__main__":
    fork_started_write_results_queue()
    if sys.argv[1] == "-m":
        module, sys.argv = sys.argv[2], [sys.argv[2], *sys.argv[3:]]
        sys.path[0] = os.getcwd()  # as `python -m` has it
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, sys.argv = sys.argv[1], sys.argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script` has it
        runpy.run_path(script, run_name="__main__")
