"""megatron's torch_dist save hands its write results to the saving process through a
multiprocessing Manager queue (dist_checkpointing/strategies/filesystem_async.py), which the first
save of a process starts with "spawn": a fresh interpreter that imports the launched script again
and torch again to unpickle the results, 3-6 s of the 2 cores for every process that saves. The
workers of tests/test_checkpoint_keys.py, test_parallel.py, test_spike.py and the entry-point
runs of test_pretrain*.py (pretrain_entry.py) start the same
Manager queue by fork instead (torch is already there), before any gloo thread exists. What is
saved and how is unchanged: only the queue's server process starts another way.
"""


def fork_started_write_results_queue() -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import get_write_results_queue

    get_write_results_queue(mp_mode="fork")  # megatron's own switch; a no-op once the queue exists
