"""Checkpoints are untrusted input: no code from a checkpoint ever runs.

Real checkpoints (a tiny Mix-LN model written by `convert from-hf` as torch_dist, with both
common.pt and megatron-core 0.19's `common_state` item, and as legacy per-rank files) are built once;
each test copies one, plants a payload (tests/payloads.py: a pickle reducing to os.system,
subprocess.Popen, builtins.exec / eval, importlib.import_module, or os.system nested inside allowed
containers) or a garbage / truncated / empty version into one file kind, and runs a command that
reads checkpoints: `mixln-megatron convert to-hf`, `mixln-megatron analyze angular-distance`,
`convert.inspect.inspect_checkpoint`, and the --load vetting (`convert.vet.vet_checkpoint`).

The contract: the payload's marker file is never created; a refusal is exit status 2 and one line
`mixln-megatron <command>: error: <message>` naming the file (its path) and, for a payload, the
global as `module.name` the way the pickle spells it (`posix.system` for os.system on Linux); no
traceback; nothing written (no --save directory, nothing new next to it). The Python APIs raise a
MixLNError subclass with that message.

test_payloads_are_live proves the payloads are real: plain unpickling of each planted file does
create the marker. test_untouched_copies_convert proves the copies and the planting mechanism
(re-pointed .distcp items, common.pt removed) leave a checkpoint that converts.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
import zipfile

import pytest
import torch

pytest.importorskip("transformers")

import payloads as P  # noqa: E402
from harness.testing import run_python
from mixln_megatron import cli  # noqa: E402
from mixln_megatron.errors import MixLNError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LINE = re.compile(r"^mixln-megatron [a-z][a-z -]*: error: \S")
TORCH_DIST_PICKLE_KINDS = [k for k in P.PICKLE_KINDS if k.startswith("torch_dist")]


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def bases(mixln_checkpoints):
    """{"torch_dist": dir, "torch": dir}: real checkpoints of a tiny Mix-LN model (P = 2 of 4), built
    once for the run (conftest.mixln_checkpoints); each case plants into its own copy."""
    return {"torch_dist": mixln_checkpoints["torch_dist"], "torch": mixln_checkpoints["torch"]}


class Case:
    """One planted checkpoint copy: where it is, the file to name, the marker, the output paths."""

    def __init__(self, tmp_path, bases, kind):
        self.kind = kind
        self.ckpt = tmp_path / "ckpt"
        shutil.copytree(bases[P.FILE_KINDS[kind][0]], self.ckpt)
        self.marker = tmp_path / "PAYLOAD_RAN"
        self.scratch = tmp_path / "scratch"
        self.scratch.mkdir()
        self.out_parent = tmp_path / "outputs"
        self.out_parent.mkdir()
        self.out = self.out_parent / "hf"
        self.file = None
        self.payload = None

    def plant(self, payload_name, monkeypatch=None):
        self.payload = P.PAYLOADS[payload_name]
        if monkeypatch is not None:
            monkeypatch.syspath_prepend(str(self.scratch))  # for importlib.import_module's module
        obj = self.payload.build(str(self.marker), str(self.scratch))
        self.file = P.plant_payload(self.kind, self.ckpt, obj, nested=self.payload.nested,
                                    protocol=self.payload.protocol)
        return self

    def damage(self, damage):
        self.file = P.plant_damage(self.kind, self.ckpt, damage)
        return self

    def payload_ran(self) -> bool:
        if self.payload is not None and self.payload.name == "subprocess.Popen":
            deadline = time.time() + 0.5  # Popen does not wait for its child
            while time.time() < deadline and not self.marker.exists():
                time.sleep(0.05)
        return self.marker.exists()

    @property
    def global_name(self):
        if self.payload is None or self.kind in P.TEXT_KINDS:
            return None  # JSON / text files are never unpickled: the bytes are just not the format
        return self.payload.global_name


def run_main(capsys, argv):
    """mixln_megatron.cli.main(argv) in-process -> (exit status or None, stderr); an exception that
    escapes is reported as its traceback (never the contract)."""
    import traceback

    capsys.readouterr()
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    except BaseException:  # noqa: BLE001 - the contract allows none: show it in the assertion
        captured = capsys.readouterr()
        return None, captured.err + traceback.format_exc()
    return rc, capsys.readouterr().err


def assert_refused(case, rc, err, written=None):
    """The contract, in order of importance: nothing ran, exit 2, one line naming file and global, nothing written."""
    assert not case.payload_ran(), f"the payload in {case.file} RAN (marker {case.marker} exists)"
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, f"exit status {rc}, expected 2; stderr:\n{err}"
    assert "Traceback" not in err, err
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{err}"
    assert LINE.match(lines[0]), lines[0]
    assert case.file in lines[0], f"the line does not name {case.file}: {lines[0]}"
    if case.global_name:
        assert case.global_name in lines[0], f"the line does not name {case.global_name}: {lines[0]}"
    for path in written or [case.out]:
        assert not os.path.exists(path), f"{path} was written"
    assert os.listdir(case.out_parent) == [], f"left next to the output: {os.listdir(case.out_parent)}"


def assert_raised(case, excinfo_or_none, what):
    assert not case.payload_ran(), f"{what}: the payload in {case.file} RAN (marker {case.marker} exists)"
    assert excinfo_or_none is not None, f"{what} read {case.file} without refusing it"
    error = excinfo_or_none
    assert isinstance(error, MixLNError), f"{what} raised {type(error).__name__}: {error}"
    message = str(error)
    assert case.file in message, f"{what}: the message does not name {case.file}: {message}"
    if case.global_name:
        assert case.global_name in message, f"{what}: the message does not name {case.global_name}: {message}"


def call(fn, *args):
    """fn(*args) -> the exception it raised, or None."""
    try:
        fn(*args)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - the caller checks its type (torch's CheckpointException
        return e  # is a BaseException)
    return None


def to_hf_argv(case):
    return ["convert", "to-hf", "--load", str(case.ckpt), "--save", str(case.out), "--no-progress"]


PAYLOAD_CASES = [(k, p) for k in P.PICKLE_KINDS for p in P.PAYLOADS] + [(k, "os.system") for k in P.TEXT_KINDS]
DAMAGE_CASES = [(k, d) for k in P.FILE_KINDS for d in P.DAMAGES]


# ------------------------------------------------------------------------------ the fixtures are real
def test_untouched_copies_convert(bases, tmp_path, capsys):
    """Copies convert (exit 0), also after a .distcp item is re-pointed at a copy of its own bytes and
    with common.pt removed (0.19's layout): the planting mechanism alone breaks nothing."""
    for fmt in ("torch_dist", "torch"):
        case = Case(tmp_path / fmt, bases, "legacy-tracker" if fmt == "torch" else "torch_dist-tracker")
        rc, err = run_main(capsys, to_hf_argv(case))
        assert rc == 0, err
    case = Case(tmp_path / "repointed", bases, "torch_dist-common_state-item")
    os.remove(P.target_file("torch_dist-common.pt", case.ckpt))
    for key in (P.RECORD_KEY, P.COMMON_STATE_KEY):
        P.replace_item(case.ckpt, key, P.item_bytes(case.ckpt, key))
    rc, err = run_main(capsys, to_hf_argv(case))
    assert rc == 0, err
    from mixln_megatron.convert.inspect import inspect_checkpoint

    info = inspect_checkpoint(str(case.ckpt))
    assert info.post_ln_layers == 2 and info.args is not None


def _pickle_streams(path, kind, ckpt):
    """The raw pickle stream(s) a planted file holds (a torch.save zip's data.pkl, or the file)."""
    data = P.item_bytes(ckpt, P.ITEM_KEYS[kind]) if kind in P.ITEM_KEYS else open(path, "rb").read()
    if data[:2] == b"PK":
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            return [z.read(n) for n in z.namelist() if n.endswith("data.pkl")]
    return [data]


@pytest.mark.parametrize("kind", P.PICKLE_KINDS)
@pytest.mark.parametrize("payload", list(P.PAYLOADS))
def test_payloads_are_live(bases, tmp_path, monkeypatch, kind, payload):
    """Each planted file names its global in the pickle, and plain unpickling runs it (marker made):
    the refusal tests below can fail."""
    import pickletools

    case = Case(tmp_path, bases, kind).plant(payload, monkeypatch)
    streams = _pickle_streams(case.file, kind, case.ckpt)
    module, _, name = case.global_name.rpartition(".")
    seen = []
    for stream in streams:
        strings = []
        for op, arg, _ in pickletools.genops(stream):
            if op.name == "GLOBAL":
                seen.append(arg.replace(" ", "."))
            elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
                strings.append(arg)
            elif op.name == "STACK_GLOBAL":
                seen.append(f"{strings[-2]}.{strings[-1]}")
    assert f"{module}.{name}" in seen, seen
    if kind == "torch_dist-.metadata":
        pickle.loads(open(case.file, "rb").read())
    elif kind in P.ITEM_KEYS:
        torch.load(io.BytesIO(P.item_bytes(case.ckpt, P.ITEM_KEYS[kind])), weights_only=False)
    else:
        torch.load(case.file, weights_only=False)
    assert case.payload_ran()


# ------------------------------------------------------------------------------ convert to-hf
@pytest.mark.parametrize("kind,payload", PAYLOAD_CASES)
def test_to_hf_refuses_payload(bases, tmp_path, capsys, monkeypatch, kind, payload):
    case = Case(tmp_path, bases, kind).plant(payload, monkeypatch)
    rc, err = run_main(capsys, to_hf_argv(case))
    assert_refused(case, rc, err)


@pytest.mark.parametrize("kind,damage", DAMAGE_CASES)
def test_to_hf_refuses_damaged_file(bases, tmp_path, capsys, kind, damage):
    case = Case(tmp_path, bases, kind).damage(damage)
    rc, err = run_main(capsys, to_hf_argv(case))
    assert_refused(case, rc, err)


@pytest.mark.parametrize("kind,payload", [("torch_dist-.metadata", "os.system"),
                                          ("legacy-model_optim_rng.pt", "importlib.import_module")])
def test_to_hf_refuses_payload_in_a_real_process(bases, tmp_path, kind, payload):
    """The command's own process (`python -m mixln_megatron.cli`): exit 2, one line, no marker; the
    import_module payload's module is importable there (PYTHONPATH)."""
    case = Case(tmp_path, bases, kind).plant(payload)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(case.scratch), REPO]), "PYTHONWARNINGS": "ignore"}
    proc = run_python([sys.executable, "-m", "mixln_megatron.cli", *to_hf_argv(case)], cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=120, env=env)
    assert_refused(case, proc.returncode, proc.stderr)


# ------------------------------------------------------------------------------ inspect_checkpoint
@pytest.mark.parametrize("kind,payload", PAYLOAD_CASES)
def test_inspect_refuses_payload(bases, tmp_path, monkeypatch, kind, payload):
    from mixln_megatron.convert.inspect import inspect_checkpoint

    case = Case(tmp_path, bases, kind).plant(payload, monkeypatch)
    assert_raised(case, call(inspect_checkpoint, str(case.ckpt)), "inspect_checkpoint")


@pytest.mark.parametrize("kind,damage", DAMAGE_CASES)
def test_inspect_refuses_damaged_file(bases, tmp_path, kind, damage):
    from mixln_megatron.convert.inspect import inspect_checkpoint

    case = Case(tmp_path, bases, kind).damage(damage)
    assert_raised(case, call(inspect_checkpoint, str(case.ckpt)), "inspect_checkpoint")


# ------------------------------------------------------------------------------ analyze
# analysis_process (conftest): the one-rank gloo group analyze leaves in this process, torn down after
ANALYZE_CASES = ([(k, "os.system") for k in TORCH_DIST_PICKLE_KINDS]
                 + [(k, "nested-os.system") for k in TORCH_DIST_PICKLE_KINDS]
                 + [(k, "garbage") for k in TORCH_DIST_PICKLE_KINDS + ["torch_dist-metadata.json", "torch_dist-tracker"]])


@pytest.mark.parametrize("kind,what", ANALYZE_CASES)
def test_analyze_refuses(bases, tmp_path, capsys, monkeypatch, analysis_process, kind, what):
    case = Case(tmp_path, bases, kind)
    case.damage(what) if what in P.DAMAGES else case.plant(what, monkeypatch)
    out_dir = case.out_parent / "analysis"
    rc, err = run_main(capsys, ["analyze", "angular-distance", "--load", str(case.ckpt), "--out-dir",
                                str(out_dir), "--tokens", "32", "--seq-length", "16", "--batch-size", "2"])
    assert_refused(case, rc, err, written=[out_dir])


# ------------------------------------------------------------------------------ vetting a --load
VET_CASES = ([(k, p) for k in TORCH_DIST_PICKLE_KINDS for p in ("os.system", "nested-os.system")]
             + [(k, "garbage") for k in TORCH_DIST_PICKLE_KINDS + ["torch_dist-metadata.json"]])


@pytest.mark.compat
@pytest.mark.parametrize("kind,what", VET_CASES)
def test_load_vetting_refuses(bases, tmp_path, monkeypatch, kind, what):
    """convert.vet.vet_checkpoint (what `mixln-megatron pretrain --load` and `convert inspect --check`
    run before Megatron-LM reads a checkpoint) reads every pickle on every release, runs none, and
    refuses each planted file naming it (the .metadata case uses 0.19's layout, no common.pt); the
    --spec edge's release check (convert.vet.check_load_dir) never runs one either."""
    from mixln_megatron.convert import vet

    case = Case(tmp_path, bases, kind)
    if kind == "torch_dist-.metadata":
        os.remove(P.target_file("torch_dist-common.pt", case.ckpt))
    case.damage(what) if what in P.DAMAGES else case.plant(what, monkeypatch)
    error = call(vet.vet_checkpoint, str(case.ckpt))
    assert_raised(case, error, "vet_checkpoint")
    error = call(vet.check_load_dir, str(case.ckpt))
    assert not case.payload_ran(), f"check_load_dir: the payload in {case.file} RAN"
    from mixln_megatron import compat

    if error is not None and isinstance(error, compat.CheckpointFromNewerRelease):
        # 0.17 / 0.18: a copy without common.pt (0.19's layout) is refused by the release check,
        # which reads no pickle; vet_checkpoint above named the planted file on this release too.
        assert compat.RELEASE < (0, 19) and not os.path.exists(os.path.join(str(case.ckpt), "release", "common.pt"))
    elif error is not None:
        assert_raised(case, error, "check_load_dir")


@pytest.mark.compat
def test_load_vetting_passes_the_clean_copy(bases):
    from mixln_megatron.convert import vet

    for fmt in ("torch_dist", "torch"):
        report = vet.vet_checkpoint(str(bases[fmt]))
        assert "clean" in report.line() and sum(report.pickles.values()) >= 1, report.line()


# ------------------------------------------------------------------------------ common.pt as a plain pickle
TORCH_ADVICE = ("weights_only", "Weights only", "UserWarning", "Warning")


def plant_plain_pickle_common_pt(case, payload_name, protocol=5):
    """common.pt replaced by a bare pickle (not a torch.save file) of the payload, at `protocol`."""
    case.payload = P.PAYLOADS[payload_name]
    obj = case.payload.build(str(case.marker), str(case.scratch))
    case.file = P.target_file("torch_dist-common.pt", case.ckpt)
    with open(case.file, "wb") as f:
        f.write(pickle.dumps(obj, protocol=protocol))
    return case


def test_plain_pickle_common_pt_payload_is_live(bases, tmp_path):
    case = plant_plain_pickle_common_pt(Case(tmp_path, bases, "torch_dist-common.pt"), "os.system")
    with open(case.file, "rb") as f:
        assert f.read(2) == b"\x80\x05"  # protocol 5: torch takes it for its pre-1.6 format
        f.seek(0)
        pickle.load(f)
    assert case.payload_ran()


def test_plain_pickle_common_pt_refusal_names_the_global_not_torch_s_advice(bases, tmp_path):
    """A fresh `python -m mixln_megatron.cli convert to-hf` (warnings on, as a user runs it): exit 2,
    stderr exactly one line naming common.pt and posix.system, no torch warning before it and none
    of torch's advice to load with weights_only=False; the payload never runs."""
    case = plant_plain_pickle_common_pt(Case(tmp_path, bases, "torch_dist-common.pt"), "os.system")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = REPO
    proc = subprocess.run([sys.executable, "-m", "mixln_megatron.cli", *to_hf_argv(case)], cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=300, env=env)
    assert_refused(case, proc.returncode, proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # not even a blank-looking warning line
    for text in TORCH_ADVICE:
        assert text not in proc.stderr + proc.stdout, proc.stderr


@pytest.mark.compat
@pytest.mark.parametrize("payload", ["os.system", "builtins.exec"])
def test_plain_pickle_common_pt_is_refused_by_the_load_vetting_without_warnings(bases, tmp_path, payload):
    """--load's vetting (convert.vet.vet_checkpoint) names the global, emits no warning and never
    passes on torch's advice; a payload-free protocol-5 pickle is refused naming the opcodes that
    torch's weights-only unpickler does not read, in our words."""
    import warnings

    from mixln_megatron.convert import vet

    case = plant_plain_pickle_common_pt(Case(tmp_path, bases, "torch_dist-common.pt"), payload)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = call(vet.vet_checkpoint, str(case.ckpt))
    assert_raised(case, error, "vet_checkpoint")
    assert "\n" not in str(error) and not any(t in str(error) for t in TORCH_ADVICE), error
    assert [str(w.message) for w in caught] == []

    with open(case.file, "wb") as f:
        f.write(pickle.dumps({"iteration": 1, "args": [1, 2]}, protocol=5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = call(vet.vet_checkpoint, str(case.ckpt))
    case.payload = None
    assert_raised(case, error, "vet_checkpoint")
    assert "FRAME" in str(error) and not any(t in str(error) for t in TORCH_ADVICE), error
    assert [str(w.message) for w in caught] == []
