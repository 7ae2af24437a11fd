"""safe_unpickle as an attacker sees it: a file may not change the classes it is
allowed to name, number its memo beyond what it wrote, import torch submodules by naming them, or
hide a deflate bomb in a torch.save archive; and a refusal names the globals the file really names.

Real files: the .metadata and common.pt of a checkpoint `convert from-hf` writes, re-pickled or
edited (tests/payloads.py). Whole-command runs (one line, exit 2, peak RSS) of the same damage are
in tests/test_untrusted_reads.py; here the unpickler itself, in-process and in fresh processes.
"""

from __future__ import annotations

import argparse
import collections
import os
import pickle
import shutil
import signal
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

import payloads as P  # noqa: E402
from mixln_megatron.errors import MixLNError, UnsafeCheckpointError  # noqa: E402
from mixln_megatron.safe_unpickle import _archive_globals, load_pickle, load_torch  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A real torch_dist checkpoint of a tiny Mix-LN model (release/.metadata, common.pt, *.distcp)."""
    from mixln_megatron.convert import convert_from_hf
    from test_convert import make_mixln_folder

    root = tmp_path_factory.mktemp("unpickler_base")
    make_mixln_folder(root / "hf")
    convert_from_hf(str(root / "hf"), str(root / "torch_dist"), progress=False)
    return root / "torch_dist"


def _class_state(cls) -> dict:
    return {k: v for k, v in vars(cls).items()}


def _refused(data, match=None, kind=".metadata"):
    with pytest.raises(UnsafeCheckpointError) as e:
        load_pickle(data, "the file", kind)
    assert "\n" not in str(e.value)
    if match:
        assert match in str(e.value), str(e.value)
    return str(e.value)


# ------------------------------------------------------------------------------ real files still load
@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_real_metadata_loads_at_every_protocol(base, protocol):
    """DCP's real Metadata (dataclasses, torch.Size, dtypes, dicts, memo) round-trips through the
    hardened unpickler at every protocol a pickler writes with NEWOBJ (2+)."""
    md = P.read_metadata(base)
    loaded = load_pickle(pickle.dumps(md, protocol=protocol), "md")
    assert loaded == md


# ------------------------------------------------------------------------------ BUILD / SETITEMS targets
def test_build_on_a_class_is_refused_and_changes_nothing():
    before = _class_state(argparse.Namespace)
    message = _refused(P.build_on_class_pickle("argparse", "Namespace", "mixln_t27_planted"), "BUILD")
    assert "Namespace" in message
    assert _class_state(argparse.Namespace) == before
    assert not hasattr(argparse.Namespace, "mixln_t27_planted")
    assert not hasattr(argparse.Namespace(), "mixln_t27_planted")


def test_build_on_a_shared_enum_member_is_refused():
    """signal.Signals(15) is the process-wide SIGTERM member, not something the file created."""
    data = b"\x80\x02csignal\nSignals\nK\x0f\x85R}X\x0b\x00\x00\x00mixln_t27_xK\x01sb."
    _refused(data, "BUILD")
    assert not hasattr(signal.Signals.SIGTERM, "mixln_t27_x")


def test_setitems_on_a_class_is_refused():
    before = _class_state(collections.OrderedDict)
    _refused(P.setitems_on_class_pickle(), "SETITEMS")
    assert _class_state(collections.OrderedDict) == before


def test_build_on_an_instance_the_file_made_still_works():
    ns = argparse.Namespace(a=1)
    assert vars(load_pickle(pickle.dumps(ns, protocol=2), "ns")) == {"a": 1}
    assert not hasattr(argparse.Namespace, "a")


def test_build_on_a_class_through_the_command(base, tmp_path, capsys):
    """convert inspect on a checkpoint whose .metadata BUILDs on argparse.Namespace: one line, exit 2,
    and Namespace (which every later args object uses) is unchanged in this process."""
    from mixln_megatron import cli

    ckpt = tmp_path / "ckpt"
    shutil.copytree(base, ckpt)
    target = ckpt / "release" / ".metadata"
    target.write_bytes(P.build_on_class_pickle("argparse", "Namespace", "__getattr__"))
    before = _class_state(argparse.Namespace)
    capsys.readouterr()
    rc = cli.main(["convert", "inspect", "--load", str(ckpt)])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and str(target) in lines[0] and "BUILD" in lines[0], err
    assert _class_state(argparse.Namespace) == before
    assert "__getattr__" not in vars(argparse.Namespace)


# ------------------------------------------------------------------------------ memo
def test_memo_index_beyond_the_writes_is_refused(base):
    data = open(base / "release" / ".metadata", "rb").read()
    _refused(P.MEMO_PREFIX + data, "memo slot 134217728 after 0 memo writes")
    for op in (b"q\x05", b"p5\n"):  # BINPUT 5 / PUT 5 as the first memo write
        _refused(b"\x80\x02N" + op + b".", "memo slot 5")


def test_memo_prefix_in_a_fresh_process_stays_small(base):
    """CPython's C unpickler would grow its memo to 2**27 slots (1 GiB): peak RSS of a fresh process
    loading the prefixed .metadata stays within 64 MiB of the same process loading the real one."""
    code = r'''
import resource, sys
import torch.distributed.checkpoint
from mixln_megatron.safe_unpickle import load_pickle
data = open(sys.argv[1], "rb").read()
load_pickle(data, "real")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    load_pickle(bytes.fromhex(sys.argv[2]) + data, "prefixed")
    print("LOADED")
except Exception as e:
    print(type(e).__name__)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
'''
    proc = subprocess.run([sys.executable, "-c", code, str(base / "release" / ".metadata"), P.MEMO_PREFIX.hex()],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    outcome, added_mib = proc.stdout.split()[-2:]
    assert outcome == "UnsafeCheckpointError", proc.stdout + proc.stderr
    assert int(added_mib) < 64, f"loading the prefixed .metadata added {added_mib} MiB"


def test_size_bound(monkeypatch):
    from mixln_megatron import input_root

    monkeypatch.setitem(input_root.LIMITS, ".metadata", 100)
    _refused(pickle.dumps(list(range(100)), protocol=2), "more than any real .metadata")


# ------------------------------------------------------------------------------ torch constants
def test_torch_constants_load():
    import torch

    assert load_pickle(P.global_pickle("torch", "float32"), "dtype") is torch.float32
    assert load_pickle(P.global_pickle("torch", "strided", 4), "layout") is torch.strided


LAZY = ("_dynamo", "_inductor", "onnx")


def test_lazy_torch_submodule_is_refused_without_importing_it(base, tmp_path):
    """`torch _dynamo` (and other lazily imported submodules) as a global, in a plain pickle at
    protocols 2 and 4, in a torch.save archive and as a checkpoint's .metadata read by DCPFiles:
    refused naming it, and the submodule is still not imported (one fresh process for all)."""
    args = []
    for sub in LAZY:
        archive = tmp_path / f"common-{sub}.pt"
        P.archive_with_pickle(str(base / "release" / "common.pt"), P.global_pickle("torch", sub), str(archive))
        ckpt = tmp_path / f"ckpt-{sub}"
        (ckpt / "release").mkdir(parents=True)
        for name in os.listdir(base / "release"):
            shutil.copyfile(base / "release" / name, ckpt / "release" / name)
        (ckpt / "release" / ".metadata").write_bytes(P.global_pickle("torch", sub, 4))
        (ckpt / "p2.pkl").write_bytes(P.global_pickle("torch", sub, 2))
        args += [sub, str(archive), str(ckpt)]
    code = r'''
import sys
import torch
from mixln_megatron.safe_unpickle import load_pickle, load_torch
from mixln_megatron.convert.dcp_files import DCPFiles
from mixln_megatron.errors import UnsafeCheckpointError
argv = sys.argv[1:]
for sub, archive, ckpt in zip(argv[0::3], argv[1::3], argv[2::3]):
    mod = "torch." + sub
    before = mod in sys.modules
    outcomes = []
    for fn in (lambda: load_pickle(open(ckpt + "/p2.pkl", "rb").read(), "p2"),
               lambda: load_pickle(open(ckpt + "/release/.metadata", "rb").read(), "p4"),
               lambda: load_torch(archive, "a"), lambda: DCPFiles(ckpt + "/release")):
        try:
            fn()
            outcomes.append("LOADED")
        except UnsafeCheckpointError as e:
            outcomes.append("REFUSED" if repr(mod) in str(e) else "REFUSED-UNNAMED")
    print(sub, before, mod in sys.modules, *outcomes)
'''
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO})
    lines = proc.stdout.strip().splitlines()
    assert lines == [f"{sub} False False" + " REFUSED" * 4 for sub in LAZY], proc.stdout + proc.stderr[-2000:]


# ------------------------------------------------------------------------------ naming the global
@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_refusal_names_getcwd_and_system(base, tmp_path, protocol):
    """A pickle naming posix.getcwd then posix.system (at 4+: STACK_GLOBAL with memoized module
    names, the second reusing the first's memo slot) is refused naming both, never 'getcwd.system'."""
    obj = [P.Reduce(os.getcwd, ()), P.Reduce(os.system, (f"touch {tmp_path / 'RAN'}",))]
    data = pickle.dumps(obj, protocol=protocol)
    names = _archive_globals(data)
    assert names == [P.pickled_global_name(os.getcwd), P.pickled_global_name(os.system)], names
    archive = tmp_path / "common.pt"
    P.archive_with_pickle(str(base / "release" / "common.pt"), data, str(archive))
    with pytest.raises(UnsafeCheckpointError) as e:
        load_torch(str(archive), "common.pt")
    message = str(e.value)
    assert "'posix.system'" in message and "'posix.getcwd'" in message and "getcwd.system" not in message, message
    assert not (tmp_path / "RAN").exists()


def test_archive_globals_memo_model():
    """Every memo write counts (strings or not); GETs push what was stored, whatever it was."""
    import builtins

    obj = {"a": [1, 2], "b": (collections.OrderedDict, collections.OrderedDict), "c": builtins.len}
    names = _archive_globals(pickle.dumps(obj, protocol=4))
    assert names == ["collections.OrderedDict", "builtins.len"], names


# ------------------------------------------------------------------------------ torch.save archives
def test_deflated_archive_is_refused_before_it_is_inflated(base, tmp_path):
    bomb = tmp_path / "bomb.pt"
    size = P.deflate_bomb(str(base / "release" / "common.pt"), str(bomb), megabytes=32)
    assert size < 100_000
    with pytest.raises(UnsafeCheckpointError) as e:
        load_torch(str(bomb), "bomb")
    assert "compressed" in str(e.value) and "torch.save never compresses" in str(e.value)


def test_archive_with_two_pickles_is_refused(base, tmp_path):
    import zipfile

    out = tmp_path / "two.pt"
    shutil.copyfile(base / "release" / "common.pt", out)
    with zipfile.ZipFile(out, "a") as z:
        z.writestr("other/data.pkl", pickle.dumps(1))
    with pytest.raises(MixLNError) as e:
        load_torch(str(out), "two")
    assert "data.pkl" in str(e.value)
