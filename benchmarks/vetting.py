"""What vetting a torch_dist checkpoint's `.metadata` costs at 70B- and 405B-like sizes, against DCP's own read.

    python benchmarks/vetting.py            # the three sizes of the table (405B-like: ~4 GiB RAM, minutes)
    python benchmarks/vetting.py --quick    # the smallest size only (seconds)
    python benchmarks/vetting.py --sizes 80,8,16 --workdir DIR --keep

For each layout (layers, TP, DP) it synthesizes the DCP `Metadata` that Megatron-LM's distributed
optimizer writes with `--ckpt-format torch_dist` (`synthesize`): per layer six tensors (QKV, output
projection, fc1, fc2 and the two norms), stacked over the layers as megatron-core does, the bf16
weights split TP ways and the fp32 main params and both Adam moments split TP x DP ways, every
chunk with its storage entry in one `.distcp` per rank (sparse files of the right size, so the
file checks run as on a real checkpoint). The pickle is written as `.metadata` in a temp folder.

Each measurement runs in a fresh child process (its own peak RSS from os.wait4) and prints:
  chunks, .metadata size, DCP's FileSystemReader.read_metadata (the unguarded read Megatron-LM
  does), the project's vetting of the same folder (convert.vet.vet_iteration_dir: the allow-list
  unpickler, the metadata checks, every file it names), their ratio, and the peak RSS of each.
The target is ratio <= 1.5 at the 70B- and 405B-like sizes.
Last line: RESULT <layout>=<ratio> ...
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SIZES = ((80, 8, 1), (80, 8, 16), (126, 8, 64))
# (hidden, ffn, qkv rows) of the model a layer count stands for (Llama-2/3 70B and 3.1 405B)
DIMS = {80: (8192, 28672, 10240), 126: (16384, 53248, 18432)}
OPTIMIZER_STATES = ("fp32_param", "exp_avg", "exp_avg_sq")


def _layer_tensors(layers: int):
    """(key, global size, split dim) of the six stacked per-layer tensors."""
    hidden, ffn, qkv = DIMS.get(layers, (4096, 11008, 6144))
    prefix = "decoder.layers."
    return [(prefix + "self_attention.linear_qkv.weight", (layers, qkv, hidden), 1),
            (prefix + "self_attention.linear_proj.weight", (layers, hidden, hidden), 2),
            (prefix + "mlp.linear_fc1.weight", (layers, 2 * ffn, hidden), 1),
            (prefix + "mlp.linear_fc2.weight", (layers, hidden, ffn), 2),
            (prefix + "self_attention.linear_qkv.layer_norm_weight", (layers, hidden), 1),
            (prefix + "mlp.linear_fc1.layer_norm_weight", (layers, hidden), 1)]


def _splits(total: int, parts: int):
    step = -(-total // parts)
    return [(i * step, min(step, total - i * step)) for i in range(parts) if i * step < total]


def synthesize(layers: int, tp: int, dp: int):
    """(DCP Metadata, {file name: bytes it must hold}) of the distributed optimizer's torch_dist layout."""
    import math

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    state, storage, planner, file_end = {}, {}, {}, {}

    def add(key, size, split_dim, parts, dtype, writer):
        chunks = []
        for layer in range(size[0]):
            for part, (start, length) in enumerate(_splits(size[split_dim], parts)):
                offsets = [layer] + [0] * (len(size) - 1)
                sizes = [1] + list(size[1:])
                offsets[split_dim], sizes[split_dim] = start, length
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                name = f"__{writer(part)}_0.distcp"
                nbytes = math.prod(sizes) * dtype.itemsize
                storage[MetadataIndex(key, torch.Size(offsets), len(chunks))] = _StorageInfo(
                    name, file_end.get(name, 0), nbytes)
                file_end[name] = file_end.get(name, 0) + nbytes
                chunks.append(chunk)
        state[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), chunks)
        planner[key] = (key,)

    for key, size, split_dim in _layer_tensors(layers):
        add(key, size, split_dim, tp, torch.bfloat16, lambda part: (part * dp))  # the replica-0 rank of each TP rank
        for name in OPTIMIZER_STATES:
            add(f"optimizer.state.{name}.{key}", size, split_dim, tp * dp, torch.float32, lambda part: part)
    md = Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage,
                  storage_meta=StorageMeta(save_id="synthesized"))
    return md, file_end


def write_checkpoint(folder: str, layers: int, tp: int, dp: int) -> dict:
    """A torch_dist iteration folder (`.metadata`, metadata.json, sparse .distcp files); returns its facts."""
    import json

    md, files = synthesize(layers, tp, dp)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    chunks = sum(len(e.chunks) for e in md.state_dict_metadata.values())
    del md
    with open(os.path.join(folder, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, f)
    for name, size in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.truncate(size)  # sparse: the size is what the checks look at
    return {"chunks": chunks, "files": len(files), "metadata_bytes": os.path.getsize(os.path.join(folder, ".metadata"))}


# --------------------------------------------------------------------------- one measurement per child
_CHILD = r'''
import os, sys, time
folder, what = sys.argv[1], sys.argv[2]
import torch.distributed.checkpoint as dcp
from mixln_megatron.convert.vet import vet_iteration_dir
read = (lambda: dcp.FileSystemReader(folder).read_metadata()) if what == "dcp" else (lambda: vet_iteration_dir(folder))
t0, c0 = time.perf_counter(), time.process_time()
read()
print("SECONDS", time.perf_counter() - t0, time.process_time() - c0, flush=True)
os._exit(0)
'''


def measure(folder: str, what: str) -> tuple:
    """(wall s, CPU s, peak RSS MiB) of one read of `folder` (`dcp`: DCP's FileSystemReader.read_metadata;
    `vet`: convert.vet.vet_iteration_dir) in a fresh process, timed after its imports."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: exec at once (nothing of this process's state is used)
        os.close(read_end)
        os.dup2(write_end, 1)
        os.execve(sys.executable, [sys.executable, "-c", _CHILD, folder, what], env)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        out = f.read()
    _, status, usage = os.wait4(pid, 0)  # ru_maxrss of this child alone
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{what} failed on {folder} (exit {os.waitstatus_to_exitcode(status)})")
    wall, cpu = (float(v) for v in next(line for line in out.splitlines() if line.startswith("SECONDS")).split()[1:])
    return wall, cpu, usage.ru_maxrss / 1024


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the smallest layout only")
    parser.add_argument("--sizes", help="layouts as L,TP,DP[;L,TP,DP...] (default: the three of the table)")
    parser.add_argument("--workdir", help="where to write the synthesized folders (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the synthesized folders")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each read, interleaved (the fastest counts)")
    args = parser.parse_args(argv)
    sizes = [tuple(int(v) for v in s.split(",")) for s in args.sizes.split(";")] if args.sizes else \
        list(SIZES[:1] if args.quick else SIZES)
    work = args.workdir or tempfile.mkdtemp(prefix="mixln-vetting-")
    print("times: the fastest of --repeats fresh processes each, DCP and vetting interleaved; CPU seconds "
          "(process_time) beside wall seconds, since a shared machine's wall clock is noisy", flush=True)
    print(f"{'layout (L,TP,DP)':<17} {'chunks':>9} {'files':>5} {'.metadata':>10} | {'DCP read':>14} "
          f"{'vetting':>14} | {'ratio':>11} | {'DCP peak':>8} {'vet peak':>8}", flush=True)
    print(f"{'':<17} {'':>9} {'':>5} {'':>10} | {'wall / CPU s':>14} {'wall / CPU s':>14} | {'wall / CPU':>11} |"
          f" {'RSS MiB':>8} {'RSS MiB':>8}", flush=True)
    results = []
    try:
        for layers, tp, dp in sizes:
            folder = os.path.join(work, f"L{layers}-TP{tp}-DP{dp}")
            facts = write_checkpoint(folder, layers, tp, dp)
            runs = {"dcp": [], "vet": []}
            for _ in range(args.repeats):
                for what in runs:
                    runs[what].append(measure(folder, what))
            (dw, dc, dpeak), (vw, vc, vpeak) = (min(runs[w], key=lambda r: r[1]) for w in ("dcp", "vet"))
            dw, vw = min(r[0] for r in runs["dcp"]), min(r[0] for r in runs["vet"])
            results.append((f"{layers},{tp},{dp}", vw / dw, vc / dc))
            print(f"{f'{layers}, {tp}, {dp}':<17} {facts['chunks']:>9} {facts['files']:>5} "
                  f"{facts['metadata_bytes'] / 1e6:>8.1f}MB | {dw:>6.2f} / {dc:>5.2f} {vw:>6.2f} / {vc:>5.2f} | "
                  f"{vw / dw:>4.2f} / {vc / dc:>4.2f} | {dpeak:>8.0f} {vpeak:>8.0f}", flush=True)
            if not args.keep:
                shutil.rmtree(folder)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print("RESULT " + " ".join(f"{name}={wall:.2f}/{cpu:.2f}" for name, wall, cpu in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
