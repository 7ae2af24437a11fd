"""One rank of `mixln-megatron pretrain ARGS` that counts, in its own process, how often it vets a
checkpoint iteration and how often it unpickles a `.metadata` through the allow-list; at exit it
prints `COUNTS {"vettings": n, "metadata_loads": m}` (tests/test_scale_vetting.py).

    python vet_count_worker.py <pretrain args...>     (RANK / LOCAL_RANK / ... from the environment)
"""

import atexit
import json
import runpy
import sys

from mixln_megatron.convert import dcp_files, vet

counts = {"vettings": 0, "metadata_loads": 0}
_load_pickle, _vet_iteration_dir = dcp_files.load_pickle, vet.vet_iteration_dir


def load_pickle(source, what, *args, **kwargs):
    if str(what).endswith(".metadata"):
        counts["metadata_loads"] += 1
    return _load_pickle(source, what, *args, **kwargs)


def vet_iteration_dir(path):
    counts["vettings"] += 1
    return _vet_iteration_dir(path)


dcp_files.load_pickle, vet.vet_iteration_dir = load_pickle, vet_iteration_dir
atexit.register(lambda: print("COUNTS " + json.dumps(counts), flush=True))
sys.argv = ["mixln-megatron-pretrain", *sys.argv[1:]]
runpy.run_module("mixln_megatron.training.pretrain", run_name="__main__")
