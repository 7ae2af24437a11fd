"""Why safe_unpickle.py keeps its own unpicklers: torch's weights-only unpickler (the allow-list
passed to add_safe_globals) against ours, on a synthesized 70B-like `.metadata` and on the
hardening payloads of tests/payloads.py.

    .venv/bin/python benchmarks/unpickler_choice.py                 # layout 80,8,1 (seconds)
    .venv/bin/python benchmarks/unpickler_choice.py --layout 80,8,16 --runs 5   # 70B-like (minutes)

Prints the median time of each reader at pickle protocols 2 and 4 (DCP writes 4), then what each
does with every payload: a line `LOADED` under torch's is a payload ours refuses and it does not.
"""

from __future__ import annotations

import repo_paths  # noqa: F401  (tests/ on sys.path: the payloads)
import argparse
import gc
import io
import os
import pickle
import signal
import statistics
import time
import warnings

import torch
import torch.distributed.checkpoint  # noqa: F401  (the classes the allow-list names)
from torch import _weights_only_unpickler

import payloads
import vetting
from mixln_megatron import safe_unpickle

ALLOWED = [c for c in (safe_unpickle._resolve(name) for name in safe_unpickle.ALLOWED) if c is not None]


def torch_load(data: bytes):
    before = list(torch.serialization.get_safe_globals())
    torch.serialization.add_safe_globals(ALLOWED)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _weights_only_unpickler.Unpickler(io.BytesIO(data)).load()
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def ours(data: bytes):
    return safe_unpickle._pure_load(data, "payload")


def verdict(load, data: bytes) -> str:
    try:
        load(data)
        return "LOADED"
    except Exception as exc:  # every refusal counts, whatever its type
        return f"refused ({type(exc).__name__})"


def timed(name: str, load, data: bytes, runs: int) -> None:
    times = []
    for _ in range(runs):
        gc.collect()
        start = time.perf_counter()
        try:
            load(data)
        except Exception as exc:
            print(f"  {name:<44} fails: {type(exc).__name__}: {str(exc)[:80]}")
            return
        times.append(time.perf_counter() - start)
    print(f"  {name:<44} median {statistics.median(times):7.3f} s over {runs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="80,8,1", help="layers,TP,DP of the synthesized .metadata")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    layers, tp, dp = map(int, args.layout.split(","))
    metadata, _ = vetting.synthesize(layers, tp, dp)
    for protocol in (2, 4):
        data = pickle.dumps(metadata, protocol=protocol)
        print(f"protocol {protocol}, layout {args.layout}: {len(data) / 1e6:.1f} MB")
        timed("pickle.loads (no checks)", pickle.loads, data, args.runs)
        timed("safe_unpickle.load_pickle (C fast path)",
              lambda d: safe_unpickle.load_pickle(d, "metadata", limit=1 << 40), data, args.runs)
        timed("safe_unpickle, pure-Python allow-list", ours, data, args.runs)
        timed("torch weights-only unpickler + allow-list", torch_load, data, args.runs)
    cases = {
        "BUILD on a class (argparse.Namespace)": payloads.build_on_class_pickle("argparse", "Namespace", "planted"),
        "BUILD on an enum member (signal.SIGTERM)": b"\x80\x02csignal\nSignals\nK\x0f\x85R}X\x07\x00\x00\x00plantedK\x01sb.",
        "SETITEMS on a class (OrderedDict)": payloads.setitems_on_class_pickle(),
        "memo index 2**27 first": payloads.MEMO_PREFIX + b"N.",
        "BINPUT 5 as first memo write": b"\x80\x02Nq\x05.",
        "global posix.system": payloads.global_pickle("posix", "system", 2),
        "global builtins.exec (protocol 4)": payloads.global_pickle("builtins", "exec", 4),
        "REDUCE os.getcwd": pickle.dumps(payloads.Reduce(os.getcwd, ()), protocol=2),
        "garbage": payloads.garbage(),
        "empty": b"",
    }
    print("payloads: ours / torch's")
    for name, data in cases.items():
        print(f"  {name:<44} {verdict(ours, data)} / {verdict(torch_load, data)}")
    print(f"  afterwards SIGTERM carries the planted attribute: {hasattr(signal.Signals.SIGTERM, 'planted')}")


if __name__ == "__main__":
    main()
