"""Runs gpu_check's two CPU references in a fresh process, as the GPU check's own main process
runs them (the forked one forks right after the imports; a pytest worker that has already run
other tests holds threads that a fork must not inherit).

  agree <workdir>   run_cpu_reference and ForkedReference on the dry-run shape, with torchrun's
                    variables set in this process; writes <workdir>/agree.json.
  refuse <workdir>  the same job with more Post-LN layers than layers: both must fail; writes
                    <workdir>/refuse.json with each one's error text.
"""

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import gpu_check  # noqa: E402
from device_checks import DRY_PARITY_SHAPE  # noqa: E402


def _same_tensors(a, b, where=""):
    """The first difference between two nested dicts of tensors (and plain values), or None."""
    import torch

    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return f"{where}: keys {sorted(a)} vs {sorted(b) if isinstance(b, dict) else b!r}"
        for key in a:
            found = _same_tensors(a[key], b[key], f"{where}.{key}")
            if found:
                return found
        return None
    if torch.is_tensor(a):
        same = torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
        return None if same else f"{where}: tensors differ"
    return None if a == b else f"{where}: {a!r} != {b!r}"


def agree(workdir):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ[name] = "1"  # the reference must not join a process group through them
    fresh = gpu_check.run_cpu_reference(workdir, DRY_PARITY_SHAPE, 2, 7)
    forked = gpu_check.ForkedReference(DRY_PARITY_SHAPE, 2, 7)
    result = forked.result(timeout=600)
    return {"fresh_keys": sorted(fresh), "result_kinds": sorted(fresh["results"]),
            "grads": len(fresh["results"]["fp32"]["grads"]),
            "difference": _same_tensors(fresh, result),
            "forked_folder_left": os.path.exists(forked.workdir)}


def refuse(workdir):
    too_many = DRY_PARITY_SHAPE.layers + 1
    errors = {}
    try:
        gpu_check.run_cpu_reference(workdir, DRY_PARITY_SHAPE, too_many, 7)
    except RuntimeError as error:
        errors["fresh"] = str(error)
    forked = gpu_check.ForkedReference(DRY_PARITY_SHAPE, too_many, 7)
    try:
        forked.result(timeout=600)
    except RuntimeError as error:
        errors["forked"] = str(error)
    errors["forked_folder_left"] = os.path.exists(forked.workdir)
    return errors


if __name__ == "__main__":
    phase, workdir = sys.argv[1], sys.argv[2]
    out = {"agree": agree, "refuse": refuse}[phase](workdir)
    with open(os.path.join(workdir, f"{phase}.json"), "w") as f:
        json.dump(out, f)
