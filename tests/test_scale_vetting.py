"""Vetting a checkpoint at the scale the project is for: a synthesized large `.metadata`, and the
verdict shared by the ranks of a job.

- The distributed optimizer's torch_dist layout (benchmarks/vetting.py's `synthesize`: weights split
  TP ways, fp32 params and both Adam moments TP x DP ways, one .distcp per rank) at a moderate size
  goes through the real vetting path (convert.vet.vet_iteration_dir) on the C-unpickler path, with
  its traced peak memory bounded relative to the file; a fixed .metadata bound below the file's
  size (standing in for a 1T model at DP 256 against the old fixed bound) no longer refuses it,
  since the bound follows the .distcp count; a 9-byte memo prefix on the same file is still refused.
- The C-unpickler path's guards, each on a tiny crafted pickle: a BUILD on a class, an enum member
  or a function it can reach is refused and undone; a memo numbered beyond its writes is refused.
- A 2-rank `pretrain --load --use-checkpoint-args` job (real processes, gloo): one rank vets, each
  process unpickles the `.metadata` at most once; with a payload in `.metadata` every rank exits 2
  with one line naming the file and the global, and the payload never runs.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
import tracemalloc

import pytest

import payloads as P  # noqa: E402
from mixln_megatron.errors import MixLNError, UnsafeCheckpointError

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import vetting  # noqa: E402

pytestmark = [pytest.mark.scale, pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")]
LAYOUT = (40, 8, 4)  # 40 layers, TP8, DP4: 24k chunks, 32 .distcp files, ~3.6 MB of .metadata
PEAK_PER_BYTE = 16  # traced peak of the vetting over the .metadata's size (measured: ~10)


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scale_vetting") / "iter_0000001"
    facts = vetting.write_checkpoint(str(folder), *LAYOUT)
    return folder, facts


# ------------------------------------------------------------------------------ a large .metadata
def test_large_metadata_vetted_on_the_fast_path_within_a_memory_bound(synthesized, monkeypatch):
    from mixln_megatron import input_root, safe_unpickle
    from mixln_megatron.convert.vet import vet_iteration_dir

    folder, facts = synthesized
    assert facts["chunks"] > 20_000 and facts["metadata_bytes"] > 3_000_000, facts
    # the old fixed bound, scaled down to this file (a 1T model's .metadata at DP 256 passes 512 MiB)
    monkeypatch.setitem(input_root.LIMITS, ".metadata", facts["metadata_bytes"] // 2)
    pure = []  # the pure-Python unpickler's loads (a 405B .metadata takes it ~3x DCP's read)
    monkeypatch.setattr(safe_unpickle._AllowListUnpickler, "load", lambda self: pure.append(self) or 1 / 0)
    tracemalloc.start()
    try:
        report = vet_iteration_dir(str(folder))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.pickles == {".metadata": 1}, report.line()
    assert not pure
    assert peak < PEAK_PER_BYTE * facts["metadata_bytes"], \
        f"vetting traced {peak / 2**20:.0f} MiB for {facts['metadata_bytes'] / 2**20:.1f} MiB of .metadata"


def test_memo_prefix_on_a_large_metadata_is_refused_by_the_fast_path(synthesized):
    from mixln_megatron.safe_unpickle import _fast_load

    folder, _ = synthesized
    data = (folder / ".metadata").read_bytes()
    with pytest.raises(UnsafeCheckpointError, match="more memory than a real pickle"):
        _fast_load(P.MEMO_PREFIX + data, "prefixed")


def test_metadata_beyond_the_derived_bound_is_refused(synthesized, tmp_path, monkeypatch):
    from mixln_megatron.convert import dcp_files
    from mixln_megatron.convert.vet import vet_iteration_dir

    folder, facts = synthesized
    monkeypatch.setattr(dcp_files, "METADATA_BYTES_PER_FILE", facts["metadata_bytes"] // (2 * facts["files"]))
    from mixln_megatron import input_root

    monkeypatch.setitem(input_root.LIMITS, ".metadata", 1024)
    with pytest.raises(MixLNError, match="more than any real .metadata"):
        vet_iteration_dir(str(folder))


# ------------------------------------------------------------------------------ the fast path's guards
DCP = "torch.distributed.checkpoint"


def _build_on_global(module: str, name: str, attribute: str) -> bytes:
    """GLOBAL module name, then BUILD (None, {attribute: 1}) on it (protocol 4, as DCP writes)."""
    a = attribute.encode()
    return (b"\x80\x04c" + module.encode() + b"\n" + name.encode() + b"\nN}\x8c" + bytes([len(a)]) + a
            + b"K\x01s\x86b.")


def _build_on_enum_member(attribute: str) -> bytes:
    """_MEM_FORMAT_ENCODING(1) (a shared enum member), then BUILD {attribute: 1} on it."""
    a = attribute.encode()
    return (b"\x80\x04c" + f"{DCP}.metadata\n_MEM_FORMAT_ENCODING\n".encode() + b"K\x01\x85R}\x8c" + bytes([len(a)])
            + a + b"K\x01sb.")


@pytest.mark.parametrize("target", ["class", "enum member", "function"])
def test_fast_path_refuses_and_undoes_a_build_on_what_the_file_did_not_create(target):
    import torch.distributed.checkpoint.metadata as md
    import torch.serialization

    from mixln_megatron.safe_unpickle import _fast_load

    attribute = "mixln_scale_planted"
    obj, data = {
        "class": (md.Metadata, _build_on_global(f"{DCP}.metadata", "Metadata", attribute)),
        "enum member": (md._MEM_FORMAT_ENCODING(1), _build_on_enum_member(attribute)),
        "function": (torch.serialization._get_layout, _build_on_global("torch.serialization", "_get_layout", attribute)),
    }[target]
    before = dict(vars(obj))
    with pytest.raises(UnsafeCheckpointError, match="BUILD"):
        _fast_load(data, "crafted")
    assert dict(vars(obj)) == before and not hasattr(obj, attribute)


def test_fast_path_refuses_a_memo_numbered_beyond_its_writes():
    from mixln_megatron.safe_unpickle import _fast_load

    size = pickle.dumps(__import__("torch").Size([3]), protocol=4)
    with pytest.raises(UnsafeCheckpointError, match="memo"):
        _fast_load(b"\x80\x04N" + b"q\x05" + b"0" + size[2:], "crafted")


# ------------------------------------------------------------------------------ once per job, every rank's line
TRAIN = ["--mixln-post-ln-layers", "1", "--train-iters", "1", "--seq-length", "32", "--micro-batch-size", "1",
         "--global-batch-size", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "127", "--num-workers", "0", "--eval-iters", "0", "--eval-interval", "1000",
         "--log-interval", "1", "--use-cpu-initialization"]
WORKER = os.path.join(HERE, "workers", "vet_count_worker.py")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from mixln_megatron.convert import convert_from_hf

    root = tmp_path_factory.mktemp("scale_vetting_ckpt")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(root / "hf"))
    convert_from_hf(str(root / "hf"), str(root / "torch_dist"), transformer_impl="local", post_ln_layers=1,
                    ckpt_format="torch_dist", progress=False)
    return root / "torch_dist"


def _ranks(ckpt, nproc=2, timeout=600):
    """Every rank as a child of this test (each rank's own exit status and output), the rendezvous
    store hosted here as torchrun's agent hosts it: [(returncode, output)] by rank."""
    import torch

    store = torch.distributed.TCPStore("127.0.0.1", 0, world_size=nproc, is_master=True, wait_for_workers=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
               WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), TORCHELASTIC_USE_AGENT_STORE="True",
               PYTHONPATH=os.pathsep.join([REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    procs = [subprocess.Popen([sys.executable, WORKER, "--cpu", "--load", str(ckpt), "--use-checkpoint-args", *TRAIN],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(nproc)]
    deadline, results = time.monotonic() + timeout, []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        results.append((p.returncode, out, err))
    return results


def _counts(out: str) -> dict:
    return json.loads(next(line for line in out.splitlines() if line.startswith("COUNTS "))[len("COUNTS "):])


@pytest.mark.mp
@pytest.mark.slow
def test_one_rank_vets_and_no_process_reads_the_metadata_twice(checkpoint):
    ranks = _ranks(checkpoint)
    shown = "\n".join(f"rank {r}: exit {rc}\n{out[-3000:]}\n{err[-3000:]}" for r, (rc, out, err) in enumerate(ranks))
    assert [rc for rc, _, _ in ranks] == [0, 0], shown
    counts = [_counts(out) for _, out, _ in ranks]
    assert sum(c["vettings"] for c in counts) == 1, counts
    assert all(c["metadata_loads"] <= 1 for c in counts), counts


@pytest.mark.mp
@pytest.mark.slow  # two pretrain processes: ~1-3 min on 2 shared cores
def test_a_payload_in_metadata_ends_every_rank_with_one_line(checkpoint, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    os.remove(P.target_file("torch_dist-common.pt", ckpt))  # 0.19's layout: the args come from .metadata's items
    marker = tmp_path / "PAYLOAD_RAN"
    payload = P.PAYLOADS["os.system"]
    target = P.plant_payload("torch_dist-.metadata", ckpt, payload.build(str(marker), str(tmp_path)),
                             protocol=payload.protocol)
    ranks = _ranks(ckpt)
    shown = "\n".join(f"rank {r}: exit {rc}\n{out[-2000:]}\n{err[-2000:]}" for r, (rc, out, err) in enumerate(ranks))
    assert not marker.exists(), "the payload RAN"
    assert [rc for rc, _, _ in ranks] == [2, 2], shown
    # once per node: one rank prints the line, the other leaves after it without a word
    lines = [line for _, _, err in ranks for line in err.splitlines() if line.strip() and "CUDA runtime" not in line]
    assert len(lines) == 1 and lines[0].startswith("[mixln_megatron] ERROR: "), shown
    assert "posix.system" in lines[0] and target in lines[0], shown
    counts = [_counts(out) for _, out, _ in ranks]
    assert sum(c["vettings"] for c in counts) == 1, counts
