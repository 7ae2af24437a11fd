"""`python -m mixln_megatron.training.pretrain <args>` as tests/test_pretrain.py's start() launches it
(for test_pretrain.py, test_pretrain_layout.py, test_pretrain_hybrid.py, test_compat.py):

    python tests/workers/pretrain_entry.py <args>

runs the entry point's module as __main__ the way `-m` does (runpy, the working directory first on
sys.path, the same argv), after one thing: megatron's torch_dist write-results queue
(dist_checkpointing/strategies/filesystem_async.get_write_results_queue) is started by fork. The
first save of a process otherwise starts that Manager queue with "spawn", a fresh interpreter
that imports the entry point's module and torch again (~3 CPU-seconds per saving process, measured
on the 2-core CI machine). What is saved and how is unchanged: only the queue's server process
starts another way, as megatron's own persistent async worker starts it (mp_mode="fork"). The
literal command with the spawned queue still saves in the default suite: test_vet_load.py's clean
resume. Nothing but the standard library at module level.
"""

import os
import runpy
import sys

if __name__ == "__main__":
    from fork_queue import fork_started_write_results_queue  # this script's folder is sys.path[0]

    fork_started_write_results_queue()  # before any gloo thread exists
    sys.path[0] = os.getcwd()  # as `python -m` has it
    runpy.run_module("mixln_megatron.training.pretrain", run_name="__main__", alter_sys=True)
