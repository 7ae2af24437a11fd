"""Reads stay inside the input and cost what the files hold: the torch_dist / pickle side.

Real checkpoints (a tiny Mix-LN model written by `convert from-hf` as torch_dist and legacy torch,
and its HybridModel made by `convert gpt-to-hybrid`) are copied once per case and damaged the way
an attacker would: a storage entry naming an absolute path or `../../` (pointing at a planted
secret outside the checkpoint), a `.distcp` that is a symlink out, `.metadata` a FIFO or a link to
/dev/zero, a 9-byte memo prefix on `.metadata`, a deflate bomb as common.pt, a byte item longer
than any real one (a sparse file), a tensor whose size its chunks do not hold, overlapping or
negative storage offsets, metadata.json a list or a string, `--ckpt-step ../../etc` / `1/../../x`,
a settings record / common state / args of allowed classes but the wrong shape, a legacy rank file
holding a list, and pickles naming `posix.getcwd` then `posix.system`.

Every case runs the real command (`mixln_megatron.cli.main`) in its own forked child of one runner
process (a real process per case, started from one import of the package: the child's peak RSS
comes from wait4, so each case is measured alone). The contract, per case and command:

  - exit 2 and exactly one stderr line `mixln-megatron convert <cmd>: error: ...` (no traceback,
    no DCP failure text), naming the file where there is one;
  - nothing written at --save and nothing next to it;
  - the planted secret's bytes appear nowhere: not in stdout / stderr, not in any file written;
  - the source checkpoint is byte-for-byte unchanged (tree_hash before and after);
  - peak RSS at most PEAK_BOUND_MIB above the same command on the untouched checkpoint.

benchmarks/untrusted_peaks.py prints every case's peak and what it adds to its baseline.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

import payloads as P  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LINE = re.compile(r"^mixln-megatron convert [a-z][a-z-]*: error: \S")
PEAK_BOUND_MIB = 150  # above the same command on the untouched checkpoint (a bomb adds 256 MiB or more)
CASE_TIMEOUT_S = 90  # a FIFO that blocks would hang forever: killed here, and the case fails
SECRET = b"T27-SECRET-" + os.urandom(8).hex().encode() + b"-OUTSIDE-THE-INPUT"

# ------------------------------------------------------------------------------ the runner
RUNNER = r'''
import json, os, sys, time, traceback, warnings
warnings.simplefilter("ignore")
spec = json.load(open(sys.argv[1]))
from mixln_megatron import cli
# one warm-up on the untouched checkpoint: every lazy import happens here, not inside a measured child
with open(os.devnull, "w") as null:
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = null
    try:
        cli.main(["convert", "inspect", "--load", spec["warmup"]])
    finally:
        sys.stdout, sys.stderr = saved
results = {}
for name, case in spec["cases"].items():
    out, err = case["stdout"], case["stderr"]
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        try:
            rc = cli.main(case["argv"])
        except SystemExit as e:
            rc = e.code
        except BaseException:
            traceback.print_exc()
            rc = 99
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc if isinstance(rc, int) else 1)
    deadline, timed_out = time.time() + spec["timeout"], False
    while True:
        wpid, status, usage = os.wait4(pid, os.WNOHANG)
        if wpid:
            break
        if time.time() > deadline:
            os.kill(pid, 9)
            wpid, status, usage = os.wait4(pid, 0)
            timed_out = True
            break
        time.sleep(0.02)
    results[name] = {"rc": os.waitstatus_to_exitcode(status), "peak_kib": usage.ru_maxrss,
                     "timed_out": timed_out}
print(json.dumps(results))
'''


# ------------------------------------------------------------------------------ the damage
def _distcp(ckpt, it="release"):
    return next(n for n in sorted(os.listdir(os.path.join(ckpt, it))) if n.endswith(".distcp"))


def relpath_absolute(c):
    key = P.extra_state_key(c.ckpt)  # an item gpt-to-hybrid copies as stored bytes
    P.move_storage(c.ckpt, key, relative_path=str(c.secret), offset=0, length=len(SECRET))
    c.file = c.metadata


def relpath_up(c):
    key = P.extra_state_key(c.ckpt)
    P.move_storage(c.ckpt, key, relative_path="../../" + c.secret.name, offset=0, length=len(SECRET))
    c.file = c.metadata


def distcp_symlink_out(c):
    """The real .distcp moved outside (with the secret appended) and linked back: reading through the
    link would work, so only the confinement refuses it."""
    name = _distcp(c.ckpt)
    outside = c.root / ("outside-" + name)
    shutil.move(os.path.join(c.ckpt, "release", name), outside)
    with open(outside, "ab") as f:
        f.write(SECRET)
    os.symlink(str(outside), os.path.join(c.ckpt, "release", name))
    c.file = os.path.join(str(c.ckpt), "release", name)


def metadata_fifo(c):
    os.remove(c.metadata)
    os.mkfifo(c.metadata)
    c.file = c.metadata


def metadata_dev_zero(c):
    os.remove(c.metadata)
    os.symlink("/dev/zero", c.metadata)
    c.file = c.metadata


def memo_prefix(c):
    data = open(c.metadata, "rb").read()
    with open(c.metadata, "wb") as f:
        f.write(P.MEMO_PREFIX + data)
    c.file = c.metadata


def zip_bomb(c):
    target = os.path.join(str(c.ckpt), "release", "common.pt")
    shutil.copyfile(c.bomb, target)
    c.file = target


def huge_byte_item(c):
    """A byte item of 300 MiB (a sparse tail on its .distcp): more than LIMITS["byte item"]."""
    name = _distcp(c.ckpt)
    path = os.path.join(str(c.ckpt), "release", name)
    offset = os.path.getsize(path)
    os.truncate(path, offset + (300 << 20))
    P.move_storage(c.ckpt, P.RECORD_KEY, offset=offset, length=300 << 20)
    c.file = c.metadata


def tensor_bigger_than_its_chunks(c):
    """The final norm's global size claims 2**28 elements (512 MiB in bf16) that its one saved chunk
    of `hidden` elements does not hold: reading it would allocate (and write out) what no file holds."""
    import torch

    md = P.read_metadata(c.ckpt)
    key = next(k for k in md.state_dict_metadata if k.endswith("final_layernorm.weight"))
    md.state_dict_metadata[key].size = torch.Size([1 << 28])
    P.write_metadata(c.ckpt, md)
    c.file = c.metadata


def chunk_of_wrong_rank(c):
    import torch

    md = P.read_metadata(c.ckpt)
    entry = next(e for e in md.state_dict_metadata.values() if hasattr(e, "chunks") and e.chunks)
    entry.chunks[0].offsets = torch.Size([0])  # rank 1 in a tensor of rank 2+
    P.write_metadata(c.ckpt, md)
    c.file = c.metadata


def entry_of_wrong_class(c):
    md = P.read_metadata(c.ckpt)
    key = next(iter(md.state_dict_metadata))
    md.state_dict_metadata[key] = "not tensor metadata"
    P.write_metadata(c.ckpt, md)
    c.file = c.metadata


def overlapping_offsets(c):
    P.overlap_two_items(c.ckpt)
    c.file = c.metadata


def negative_offset(c):
    P.move_storage(c.ckpt, P.RECORD_KEY, offset=-16)
    c.file = c.metadata


def metadata_json_list(c):
    c.file = os.path.join(str(c.ckpt), "release", "metadata.json")
    with open(c.file, "w") as f:
        f.write('["torch_dist"]')


def metadata_json_string(c):
    c.file = os.path.join(str(c.ckpt), "release", "metadata.json")
    with open(c.file, "w") as f:
        f.write('"torch_dist"')


def record_wrong_shape(c):
    P.replace_item(c.ckpt, P.RECORD_KEY, P.torch_bytes(["not a record"]))
    c.file = os.path.join(str(c.ckpt), "release", _distcp(c.ckpt))


def common_state_a_list(c):
    c.file = os.path.join(str(c.ckpt), "release", "common.pt")
    with open(c.file, "wb") as f:
        f.write(P.torch_bytes(["not a common state"]))


def args_wrong_shape(c):
    """args of the right class (argparse.Namespace) with num_layers as text."""
    c.file = os.path.join(str(c.ckpt), "release", "common.pt")
    common = P._trusted_load(c.file)
    common["args"].num_layers = "four"
    with open(c.file, "wb") as f:
        f.write(P.torch_bytes(common))


def iteration_wrong_type(c):
    c.file = os.path.join(str(c.ckpt), "release", "common.pt")
    common = P._trusted_load(c.file)
    common["iteration"] = "7; rm -rf /"
    with open(c.file, "wb") as f:
        f.write(P.torch_bytes(common))


def legacy_rank_a_list(c):
    c.file = os.path.join(str(c.ckpt), "release", "mp_rank_00", "model_optim_rng.pt")
    with open(c.file, "wb") as f:
        f.write(P.torch_bytes([1, 2, 3]))


def legacy_record_wrong_shape(c):
    c.file = os.path.join(str(c.ckpt), "release", "mp_rank_00", "model_optim_rng.pt")
    state = P._trusted_load(c.file)
    state["model"]["decoder.layers.0.mixln_settings"] = ["not a record"]
    with open(c.file, "wb") as f:
        f.write(P.torch_bytes(state))


def getcwd_then_system(c):
    """common.pt (protocol 4, STACK_GLOBAL with memoized module names) naming posix.getcwd then posix.system."""
    c.file = os.path.join(str(c.ckpt), "release", "common.pt")
    with open(c.file, "wb") as f:
        f.write(P.torch_bytes([P.Reduce(os.getcwd, ()), P.Reduce(os.system, (f"touch {c.root / 'RAN'}",))],
                              protocol=4))
    c.names = ("posix.system", "posix.getcwd")
    c.not_names = ("getcwd.system",)


def nothing(c):
    c.file = None


# name -> (base, damage, commands, extra argv)
TD, LEG, HYB = "torch_dist", "torch", "hybrid"
CASES = {
    "relpath-absolute": (TD, relpath_absolute, ("gpt-to-hybrid", "to-hf", "inspect"), ()),
    "relpath-absolute-hybrid": (HYB, relpath_absolute, ("hybrid-to-gpt",), ()),
    "relpath-up": (TD, relpath_up, ("gpt-to-hybrid", "to-hf", "inspect"), ()),
    "relpath-up-hybrid": (HYB, relpath_up, ("hybrid-to-gpt",), ()),
    "distcp-symlink-out": (TD, distcp_symlink_out, ("gpt-to-hybrid", "to-hf", "inspect"), ()),
    "metadata-fifo": (TD, metadata_fifo, ("inspect", "to-hf"), ()),
    "metadata-dev-zero": (TD, metadata_dev_zero, ("inspect", "gpt-to-hybrid"), ()),
    "memo-prefix": (TD, memo_prefix, ("inspect", "to-hf"), ()),
    "zip-bomb-common.pt": (TD, zip_bomb, ("inspect", "to-hf"), ()),
    "byte-item-over-bound": (TD, huge_byte_item, ("inspect",), ()),
    "tensor-bigger-than-chunks": (TD, tensor_bigger_than_its_chunks, ("to-hf",), ()),
    "chunk-of-wrong-rank": (TD, chunk_of_wrong_rank, ("inspect",), ()),
    "entry-of-wrong-class": (TD, entry_of_wrong_class, ("inspect",), ()),
    "overlapping-offsets": (TD, overlapping_offsets, ("to-hf", "inspect", "gpt-to-hybrid"), ()),
    "negative-offset": (TD, negative_offset, ("inspect",), ()),
    "metadata.json-list": (TD, metadata_json_list, ("to-hf", "inspect"), ()),
    "metadata.json-string": (TD, metadata_json_string, ("to-hf", "inspect"), ()),
    "iteration-../../etc": (TD, nothing, ("to-hf", "inspect", "gpt-to-hybrid"), ("--ckpt-step", "../../etc")),
    "iteration-1/../../x": (TD, nothing, ("to-hf", "inspect", "gpt-to-hybrid"), ("--ckpt-step", "1/../../x")),
    "iteration-negative": (TD, nothing, ("inspect",), ("--ckpt-step", "-3")),
    "iteration-huge": (TD, nothing, ("inspect",), ("--ckpt-step", "99999999999")),
    "record-wrong-shape": (TD, record_wrong_shape, ("to-hf", "inspect", "gpt-to-hybrid"), ()),
    "common-state-a-list": (TD, common_state_a_list, ("inspect",), ()),
    "args-wrong-shape": (TD, args_wrong_shape, ("inspect", "to-hf"), ()),
    "iteration-wrong-type": (TD, iteration_wrong_type, ("inspect",), ()),
    "legacy-rank-a-list": (LEG, legacy_rank_a_list, ("to-hf", "inspect"), ()),
    "legacy-record-wrong-shape": (LEG, legacy_record_wrong_shape, ("inspect",), ()),
    "getcwd-then-system": (TD, getcwd_then_system, ("inspect",), ()),
}
BASELINES = {"baseline-" + cmd: (base, nothing, (cmd,), ()) for cmd, base in
             (("inspect", TD), ("to-hf", TD), ("gpt-to-hybrid", TD), ("hybrid-to-gpt", HYB))}
BASELINES["baseline-legacy-inspect"] = (LEG, nothing, ("inspect",), ())
BASELINES["baseline-legacy-to-hf"] = (LEG, nothing, ("to-hf",), ())


def _baseline_of(base: str, cmd: str) -> str:
    """The run of `cmd` on the untouched copy of `base` (legacy cases: the legacy base)."""
    if base == LEG:
        name = "baseline-legacy-" + ("to-hf" if cmd == "to-hf" else "inspect")
        return f"{name}:{name[len('baseline-legacy-'):]}"
    return f"baseline-{cmd}:{cmd}"


class Planted:
    def __init__(self, root, base_dir, bomb):
        self.root = root
        root.mkdir(parents=True)
        self.ckpt = root / "ckpt"
        shutil.copytree(base_dir, self.ckpt, symlinks=True)
        self.metadata = os.path.join(str(self.ckpt), "release", ".metadata")
        self.secret = root / "secret.bin"  # outside the checkpoint: ../../secret.bin from release/
        self.secret.write_bytes(SECRET)
        self.bomb = bomb
        self.file, self.names, self.not_names = None, (), ()


def _argv(cmd, ckpt, out, extra):
    if cmd == "inspect":
        return ["convert", "inspect", "--load", str(ckpt), *extra]
    argv = ["convert", cmd, "--load", str(ckpt), "--save", str(out), *extra]
    return argv + (["--no-progress"] if cmd == "to-hf" else [])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mixln_checkpoints):
    """Plant every case into a copy of its base (conftest.mixln_checkpoints, built once for the run),
    run every (case, command) in the runner; {(case, cmd): result}."""
    top = tmp_path_factory.mktemp("untrusted_reads")
    bases = mixln_checkpoints["torch_dist"].parent  # TD, LEG, HYB are its entries' names
    bomb = str(top / "bomb.pt")
    P.deflate_bomb(str(bases / TD / "release" / "common.pt"), bomb, megabytes=256)

    spec, meta = {"warmup": str(bases / TD), "timeout": CASE_TIMEOUT_S, "cases": {}}, {}
    for name, (base, damage, cmds, extra) in {**BASELINES, **CASES}.items():
        for cmd in cmds:
            key = f"{name}:{cmd}"
            case = Planted(top / "cases" / re.sub(r"[^A-Za-z0-9.-]", "_", key), bases / base, bomb)
            damage(case)
            out_parent = case.root / "outputs"
            out_parent.mkdir()
            out = out_parent / "out"
            spec["cases"][key] = {"argv": _argv(cmd, case.ckpt, out, extra), "stdout": str(case.root / "stdout"),
                                  "stderr": str(case.root / "stderr")}
            meta[key] = (case, out_parent, out, P.tree_hash(case.ckpt), base, cmd)
    spec_file = top / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, HERE]), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(spec_file)], capture_output=True, text=True,
                          timeout=CASE_TIMEOUT_S * 8 + 60 * len(spec["cases"]), env=env, cwd=str(top))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    out = {}
    for key, (case, out_parent, save, before, base, cmd) in meta.items():
        r = dict(results[key])
        r.update(case=case, out_parent=out_parent, out=save, before=before, base=base, cmd=cmd,
                 stdout=open(case.root / "stdout", "rb").read(), stderr=open(case.root / "stderr", "rb").read())
        out[key] = r
    return out


def _written_bytes(folder):
    for dirpath, _, files in os.walk(str(folder)):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.isfile(path) and not os.path.islink(path):
                yield path, open(path, "rb").read()


@pytest.mark.parametrize("key", [f"{n}:{c}" for n, (_, _, cmds, _) in BASELINES.items() for c in cmds])
def test_baselines_succeed(runs, key):
    """The untouched copies work with every command (the damage alone makes the cases fail)."""
    r = runs[key]
    assert r["rc"] == 0, r["stderr"].decode(errors="replace")[-2000:]


@pytest.mark.parametrize("key", [f"{n}:{c}" for n, (_, _, cmds, _) in CASES.items() for c in cmds])
def test_refused_in_one_line(runs, key):
    r = runs[key]
    case = r["case"]
    err = r["stderr"].decode(errors="replace")
    assert not r["timed_out"], f"{key}: still running after {CASE_TIMEOUT_S} s (blocked?)"
    lines = [line for line in err.splitlines() if line.strip()]
    assert r["rc"] == 2, f"{key}: exit {r['rc']}, expected 2; stderr:\n{err[-3000:]}"
    assert len(lines) == 1, f"{key}: expected one stderr line, got {len(lines)}:\n{err[-3000:]}"
    line = lines[0]
    assert LINE.match(line), line
    for word in ("Traceback", 'File "', "CheckpointException", "AttributeError", "MemoryError"):
        assert word not in line, f"{key}: {word!r} in the line: {line}"
    if case.file is not None:
        assert case.file in line, f"{key}: the line does not name {case.file}: {line}"
    for name in case.names:
        assert repr(name) in line, f"{key}: the line does not name {name!r}: {line}"
    for name in case.not_names:
        assert name not in line, f"{key}: the line names {name!r}: {line}"
    assert not (case.root / "RAN").exists()


@pytest.mark.parametrize("key", [f"{n}:{c}" for n, (_, _, cmds, _) in CASES.items() for c in cmds])
def test_nothing_written_nothing_read_outside_source_unchanged(runs, key):
    r = runs[key]
    case = r["case"]
    assert not os.path.lexists(r["out"]), f"{key}: {r['out']} was written"
    assert os.listdir(r["out_parent"]) == [], f"{key}: left next to the output: {os.listdir(r['out_parent'])}"
    assert SECRET not in r["stdout"] and SECRET not in r["stderr"], f"{key}: the secret reached the output"
    for path, data in _written_bytes(r["out_parent"]):
        assert SECRET not in data, f"{key}: the secret was copied into {path}"
    assert P.tree_hash(case.ckpt) == r["before"], f"{key}: the source checkpoint changed"


@pytest.mark.parametrize("key", [f"{n}:{c}" for n, (_, _, cmds, _) in CASES.items() for c in cmds])
def test_peak_memory_bounded(runs, key):
    r = runs[key]
    base = runs[_baseline_of(r["base"], r["cmd"])]
    added = (r["peak_kib"] - base["peak_kib"]) / 1024
    assert added <= PEAK_BOUND_MIB, (f"{key}: peak RSS {r['peak_kib'] / 1024:.0f} MiB, {added:.0f} MiB above the "
                                     f"untouched checkpoint's {base['peak_kib'] / 1024:.0f} MiB")
