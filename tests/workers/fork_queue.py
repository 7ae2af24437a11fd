"""megatron's torch_dist save hands its write results to the saving process through a
multiprocessing Manager queue (dist_checkpointing/strategies/filesystem_async.py), which the first
save of a process starts with "spawn": a fresh interpreter that imports the launched script again
and torch again to unpickle the results, 3-6 s of the 2 cores for every process that saves. The
workers of tests/test_checkpoint_keys.py, test_parallel.py and test_spike.py start the same
Manager queue by fork instead (torch is already there), before any gloo thread exists. What is
saved and how is unchanged: only the queue's server process starts another way.
"""


def fork_started_write_results_queue() -> None:
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()
