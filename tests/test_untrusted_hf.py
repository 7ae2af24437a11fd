"""Hugging Face folders are untrusted input: reads stay inside the folder, and the index,
config.json, safetensors headers and checkpoint args are checked before they are used.

A real folder is made once with the project's own commands (a tiny Mix-LN model saved by
mixln_megatron.hf.save_hf_folder, `convert from-hf`, then `convert to-hf --max-shard-size 40KB`: an
index and 8 safetensors shards, as a real export writes them). Each test copies it, plants one
damage, and runs `mixln-megatron convert from-hf` or `mixln-megatron analyze ... --hf` (in process
through mixln_megatron.cli.main, or as a child process where memory is measured). The contract:

  - exit status 2 and exactly one stderr line `mixln-megatron <command>: error: ...` naming the file
    (config.json, the index or the shard) and no traceback;
  - nothing written: no --save / --out-dir, nothing next to it;
  - nothing outside the folder read: a secret file planted next to the folder (a valid copy of a
    shard, so following a name to it would convert) is refused by name, and its marker never
    appears in the output;
  - the source folder unchanged (a hash of every name, link target and byte);
  - for the cost cases (a config claiming 10**9 layers or a 10**9 hidden size, a header length of
    2**40 or 2**64-1): the peak RSS of the child process stays under RSS_BOUND_MIB.

Megatron args read from a checkpoint go through the same checks (convert.shape): a field of the
wrong type is one line, and `add_bias_linear=None` reads the same (no bias) in the shape and in the
support check.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import traceback

import pytest
import torch

pytest.importorskip("transformers")

import payloads as P  # noqa: E402
from mixln_megatron import cli  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LINE = re.compile(r"^mixln-megatron [a-z][a-z -]*: error: \S")
INDEX = "model.safetensors.index.json"
SHARD = "model-00002-of-00008.safetensors"
# Importing torch, transformers and megatron-core and refusing the folder takes ~0.5-0.7 GiB here;
# the 10**9-layer config took 10.3 GiB (killed) before the config was checked against the files.
RSS_BOUND_MIB = 1536


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def base(tmp_path_factory, mixln_checkpoints):
    """A real HF export of a tiny Mix-LN model (P = 2 of 4): index + 8 shards, built once, from the
    run's shared torch_dist checkpoint (conftest.mixln_checkpoints)."""
    from mixln_megatron.convert import convert_to_hf

    root = tmp_path_factory.mktemp("untrusted_hf_base")
    convert_to_hf(str(mixln_checkpoints["torch_dist"]), str(root / "hf"), progress=False, max_shard_size="40KB")
    assert len([f for f in os.listdir(root / "hf") if f.endswith(".safetensors")]) == 8
    return root


def folder_hash(path) -> str:
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(str(path))):
        dirnames.sort()
        for name in sorted(filenames + dirnames):
            full = os.path.join(dirpath, name)
            h.update(os.path.relpath(full, str(path)).encode() + b"\0")
            if os.path.islink(full):
                h.update(b"link:" + os.readlink(full).encode())
            elif os.path.isfile(full):
                with open(full, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


class Case:
    """A copy of the base folder, a secret outside it, and where the output would go."""

    def __init__(self, tmp_path, base):
        self.tmp = tmp_path
        self.hf = tmp_path / "hf"
        shutil.copytree(base / "hf", self.hf)
        self.marker = "SECRET-" + os.urandom(8).hex()
        self.secret = tmp_path / "secret.safetensors"  # a valid shard: following a name to it would convert
        from safetensors.torch import load_file, save_file

        save_file(load_file(str(self.hf / SHARD)), str(self.secret), metadata={"secret": self.marker})
        self.out_parent = tmp_path / "outputs"
        self.out_parent.mkdir()
        self.out = self.out_parent / "out"
        self.hash = None

    def planted(self):
        self.hash = folder_hash(self.hf)
        return self

    # the damages
    def index(self, change):
        data = json.loads((self.hf / INDEX).read_text())
        change(data)
        (self.hf / INDEX).write_text(json.dumps(data))
        return self

    def config(self, change):
        data = json.loads((self.hf / "config.json").read_text())
        data = change(data)
        (self.hf / "config.json").write_text(json.dumps(data))
        return self

    def header(self, change, shard=SHARD):
        path = self.hf / shard
        raw = path.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        header = change(header)
        text = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
        return self

    def header_length(self, n, shard=SHARD):
        path = self.hf / shard
        raw = path.read_bytes()
        path.write_bytes(struct.pack("<Q", n) + raw[8:])
        return self

    # the commands
    def from_hf_argv(self):
        return ["convert", "from-hf", "--load", str(self.hf), "--save", str(self.out), "--no-progress"]

    def analyze_argv(self):
        return ["analyze", "angular-distance", "--hf", str(self.hf), "--out-dir", str(self.out), "--tokens", "32",
                "--seq-length", "16", "--batch-size", "2"]


def run_main(capsys, argv):
    """cli.main(argv) in this process -> (exit status, stdout + stderr, stderr); an escaping exception
    is reported with its traceback (never the contract)."""
    capsys.readouterr()
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    except BaseException:  # noqa: BLE001 - the contract allows none: show it in the assertion
        captured = capsys.readouterr()
        return None, captured.out + captured.err + traceback.format_exc(), captured.err + traceback.format_exc()
    captured = capsys.readouterr()
    return rc, captured.out + captured.err, captured.err


RSS_CHILD = ("import resource, sys\nfrom mixln_megatron import cli\nrc = cli.main(sys.argv[1:])\n"
             "print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\nsys.exit(rc)\n")


def run_child(case, argv):
    """The command in a child process -> (exit status, stdout + stderr, stderr, peak RSS in MiB)."""
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", RSS_CHILD, *argv], cwd=str(case.tmp), capture_output=True,
                          text=True, timeout=300, env=env)
    m = re.search(r"PEAK_RSS_KIB (\d+)", proc.stdout)
    assert m, f"no RSS reported (killed?), exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    rss = int(m.group(1)) / 1024
    print(f"peak RSS {rss:.0f} MiB: {' '.join(argv[:2])}")  # shown with pytest -s
    return proc.returncode, proc.stdout + proc.stderr, proc.stderr, rss


def assert_refused(case, rc, output, err, names, says=()):
    """Exit 2, one line naming `names` (and saying `says`), nothing written, no secret, source unchanged."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, f"exit status {rc}, expected 2; output:\n{output}"
    assert "Traceback" not in output, output
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{err}"
    assert LINE.match(lines[0]), lines[0]
    for name in ([names] if isinstance(names, str) else names):
        assert str(name) in lines[0], f"the line does not name {name}: {lines[0]}"
    for text in says:
        assert re.search(text, lines[0]), f"the line does not say {text!r}: {lines[0]}"
    assert case.marker not in output, "the secret outside the folder was read into the output"
    assert not os.path.lexists(case.out), f"{case.out} was written"
    assert os.listdir(case.out_parent) == [], f"left next to the output: {os.listdir(case.out_parent)}"
    assert case.hash is not None and folder_hash(case.hf) == case.hash, "the source folder changed"
    return lines[0]


# ------------------------------------------------------------------------------ the fixtures are real
def test_untouched_copy_converts_and_the_secret_would(base, tmp_path, capsys):
    """A copy converts (exit 0); so does one whose index sends a shard's tensors to the secret copied
    *inside* the folder: the escapes below would succeed if names were followed out of the folder."""
    case = Case(tmp_path, base).planted()
    rc, output, _ = run_main(capsys, case.from_hf_argv())
    assert rc == 0, output
    inside = Case(tmp_path / "inside", base)
    shutil.copy(inside.secret, inside.hf / "copy.safetensors")
    inside.index(lambda d: d["weight_map"].update({k: "copy.safetensors" for k, v in d["weight_map"].items()
                                                   if v == SHARD}))
    rc, output, _ = run_main(capsys, inside.from_hf_argv())
    assert rc == 0, output


# ------------------------------------------------------------------------------ reads stay inside
def _point_shard_at(target):
    def change(d):
        d["weight_map"].update({k: target for k, v in d["weight_map"].items() if v == SHARD})
    return change


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink-out", "subdir-dotdot"])
def test_from_hf_never_reads_outside_the_folder(base, tmp_path, capsys, how):
    case = Case(tmp_path, base)
    if how == "dotdot":
        case.index(_point_shard_at("../secret.safetensors"))
        says = [r"\.\./secret\.safetensors"]
    elif how == "subdir-dotdot":
        os.mkdir(case.hf / "sub")
        case.index(_point_shard_at("sub/../../secret.safetensors"))
        says = [r"plain file names"]
    elif how == "absolute":
        case.index(_point_shard_at(str(case.secret)))
        says = [re.escape(str(case.secret))]
    else:  # the shard itself a symlink to the secret
        os.remove(case.hf / SHARD)
        os.symlink(case.secret, case.hf / SHARD)
        says = ["symlink", "outside"]
    case.planted()
    rc, output, err = run_main(capsys, case.from_hf_argv())
    assert_refused(case, rc, output, err, [case.hf], says)


@pytest.mark.parametrize("link", ["config.json", INDEX])
def test_small_files_as_symlinks_out_are_refused(base, tmp_path, capsys, link):
    case = Case(tmp_path, base)
    outside = tmp_path / ("outside-" + link)
    shutil.move(str(case.hf / link), outside)
    os.symlink(outside, case.hf / link)
    case.planted()
    rc, output, err = run_main(capsys, case.from_hf_argv())
    assert_refused(case, rc, output, err, [case.hf / link], ["symlink", "outside"])


# ------------------------------------------------------------------------------ the index
@pytest.mark.parametrize("damage,says", [
    ("missing", r"weight_map.*missing"),
    ("list", r"weight_map.*JSON array"),
    ("empty", r"weight_map.*empty"),
    ("string", r"weight_map.*JSON string"),
    ("shard-int", r"must be a shard file name, got 7"),
    ("index-list", r"JSON array, expected a JSON object"),
    ("bin-in-safetensors-index", r"not a \.safetensors file"),
])
def test_from_hf_refuses_a_bad_index(base, tmp_path, capsys, damage, says):
    case = Case(tmp_path, base)
    if damage == "index-list":
        (case.hf / INDEX).write_text("[1, 2]")
    else:
        def change(d):
            if damage == "missing":
                del d["weight_map"]
            elif damage == "list":
                d["weight_map"] = list(d["weight_map"])
            elif damage == "empty":
                d["weight_map"] = {}
            elif damage == "string":
                d["weight_map"] = "model-00001-of-00008.safetensors"
            elif damage == "shard-int":
                d["weight_map"][next(iter(d["weight_map"]))] = 7
            else:
                d["weight_map"][next(iter(d["weight_map"]))] = "pytorch_model.bin"
        case.index(change)
    case.planted()
    rc, output, err = run_main(capsys, case.from_hf_argv())
    assert_refused(case, rc, output, err, [case.hf / INDEX], [says])


# ------------------------------------------------------------------------------ config.json
def _set(key, value):
    def change(d):
        d[key] = value
        return d
    return change


CONFIG_DAMAGES = {
    "whole-list": (lambda d: list(d), r"JSON array, expected a JSON object"),
    "hidden-string": (_set("hidden_size", "abc"), r"hidden_size must be a positive integer.*got 'abc'"),
    "hidden-null": (_set("hidden_size", None), r"hidden_size must be a positive integer, got null"),
    "hidden-missing": (lambda d: {k: v for k, v in d.items() if k != "hidden_size"}, r"hidden_size.*missing"),
    "hidden-1e9-float": (_set("hidden_size", 1e9), r"hidden_size must be a positive integer.*got 1000000000\.0"),
    "hidden-bool": (_set("hidden_size", True), r"hidden_size must be a positive integer.*got True"),
    "layers-1e9-float": (_set("num_hidden_layers", 1e9), r"num_hidden_layers must be a positive integer"),
    "layers-negative": (_set("num_hidden_layers", -4), r"num_hidden_layers must be a positive integer"),
    "layers-more-than-files": (_set("num_hidden_layers", 6), r"num_hidden_layers 6.*4 decoder layers"),
    "layers-fewer-than-files": (_set("num_hidden_layers", 3), r"num_hidden_layers 3.*4 decoder layers"),
    "heads-not-dividing": (_set("num_key_value_heads", 3), r"not a multiple of num_key_value_heads 3"),
    "vocab-too-large": (_set("vocab_size", 1 << 30), r"vocab_size must be a positive integer \(at most 16777216"),
    "eps-string": (_set("rms_norm_eps", "tiny"), r"rms_norm_eps must be a number"),
    "rope-theta-list": (_set("rope_parameters", {"rope_theta": [1], "rope_type": "default"}),
                        r"rope_theta must be a number"),
    "rope-parameters-string": (_set("rope_parameters", "default"), r"rope_parameters must be an object or null"),
    "post-ln-string": (_set("post_ln_layers", "two"), r"post_ln_layers must be an integer"),
    "tie-string": (_set("tie_word_embeddings", "no"), r"tie_word_embeddings must be true or false"),
    "intermediate-wrong": (_set("intermediate_size", 128), r"does not match its config\.json.*gate_proj"),
}


@pytest.mark.parametrize("damage", list(CONFIG_DAMAGES))
def test_from_hf_refuses_a_bad_config(base, tmp_path, capsys, damage):
    change, says = CONFIG_DAMAGES[damage]
    case = Case(tmp_path, base).config(change).planted()
    rc, output, err = run_main(capsys, case.from_hf_argv())
    names = [case.hf] if damage in ("intermediate-wrong",) else [case.hf / "config.json"]
    assert_refused(case, rc, output, err, names, [says])


@pytest.mark.parametrize("key", ["num_hidden_layers", pytest.param("hidden_size", marks=pytest.mark.slow)])
def test_from_hf_config_of_a_billion_is_one_line_at_bounded_memory(base, tmp_path, key):
    """num_hidden_layers 10**9 built a 10.3 GiB tensor plan before: now one line, peak RSS bounded."""
    case = Case(tmp_path, base).config(_set(key, 1000000000)).planted()
    rc, output, err, rss = run_child(case, case.from_hf_argv())
    assert_refused(case, rc, output, err, [case.hf / "config.json"], [rf"{key} must be a positive integer"])
    assert rss < RSS_BOUND_MIB, f"peak RSS {rss:.0f} MiB >= {RSS_BOUND_MIB} MiB"


# ------------------------------------------------------------------------------ safetensors headers
def _first_tensor(header):
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _last_tensor(header):
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _second_tensor(header):
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    return names[1]


def _offsets_missing(h):
    del h[_first_tensor(h)]["data_offsets"]
    return h


def _offsets_string(h):
    h[_first_tensor(h)]["data_offsets"] = "0,16"
    return h


def _offsets_floats(h):
    b, e = h[_first_tensor(h)]["data_offsets"]
    h[_first_tensor(h)]["data_offsets"] = [float(b), float(e)]
    return h


def _overlapping(h):
    """The second tensor starts inside the first (its size kept: only the overlap is wrong)."""
    first, second = _first_tensor(h), _second_tensor(h)
    b, e = h[second]["data_offsets"]
    shift = h[first]["data_offsets"][1] // 2
    h[second]["data_offsets"] = [b - shift, e - shift]
    return h


def _past_the_end(h):
    """The last tensor claims 1000x its size: its data would lie past the end of the file."""
    last = _last_tensor(h)
    b, e = h[last]["data_offsets"]
    h[last]["shape"] = [h[last]["shape"][0] * 1000] + h[last]["shape"][1:]
    h[last]["data_offsets"] = [b, b + (e - b) * 1000]
    return h


def _size_mismatch(h):
    h[_first_tensor(h)]["shape"][0] += 1
    return h


def _shape_strings(h):
    h[_first_tensor(h)]["shape"] = ["64"]
    return h


def _dtype_unknown(h):
    h[_first_tensor(h)]["dtype"] = "Q7"
    return h


def _metadata_list(h):
    h["__metadata__"] = ["format", "pt"]
    return h


HEADER_DAMAGES = {
    "header-list": (lambda h: list(h), r"header is a JSON array, expected a JSON object"),
    "offsets-missing": (_offsets_missing, r"data_offsets. must be \[begin, end\].*got None"),
    "offsets-string": (_offsets_string, r"data_offsets. must be \[begin, end\].*got '0,16'"),
    "offsets-floats": (_offsets_floats, r"data_offsets. must be \[begin, end\]"),
    "overlapping": (_overlapping, r"overlaps the tensor before it"),
    "past-the-end": (_past_the_end, r"truncated"),
    "size-mismatch": (_size_mismatch, r"need"),
    "shape-strings": (_shape_strings, r"shape. must be a list of non-negative integers"),
    "dtype-unknown": (_dtype_unknown, r"dtype 'Q7', not a safetensors dtype"),
    "metadata-list": (_metadata_list, r"__metadata__. must be an object of strings"),
    "not-json": (None, r"header is not valid JSON"),
}


@pytest.mark.parametrize("damage", list(HEADER_DAMAGES))
def test_from_hf_refuses_a_bad_safetensors_header(base, tmp_path, capsys, damage):
    change, says = HEADER_DAMAGES[damage]
    case = Case(tmp_path, base)
    if change is None:
        raw = (case.hf / SHARD).read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        (case.hf / SHARD).write_bytes(raw[:8] + b"\xff" * n + raw[8 + n:])
    else:
        case.header(change)
    case.planted()
    rc, output, err = run_main(capsys, case.from_hf_argv())
    assert_refused(case, rc, output, err, [case.hf / SHARD], [says])


@pytest.mark.parametrize("length", [2 ** 40, 2 ** 64 - 1, pytest.param(2 ** 20, marks=pytest.mark.slow)])
def test_from_hf_header_length_is_checked_before_reading(base, tmp_path, length):
    """2**40 was a MemoryError, 2**64-1 an OverflowError; 2**20 is within the bound but past the file."""
    case = Case(tmp_path, base).header_length(length).planted()
    rc, output, err, rss = run_child(case, case.from_hf_argv())
    says = r"truncated: its header length field says" if length == 2 ** 20 else r"more than safetensors allows"
    assert_refused(case, rc, output, err, [case.hf / SHARD], [says, str(length)])
    assert rss < RSS_BOUND_MIB, f"peak RSS {rss:.0f} MiB >= {RSS_BOUND_MIB} MiB"


def test_shard_that_is_a_fifo_is_refused(base, tmp_path, capsys):
    case = Case(tmp_path, base)
    os.remove(case.hf / SHARD)
    os.mkfifo(case.hf / SHARD)
    case.planted()
    rc, output, err = run_main(capsys, case.from_hf_argv())
    assert_refused(case, rc, output, err, [case.hf / SHARD], ["not a regular file"])


# ------------------------------------------------------------------------------ analyze --hf
def _bin_payload_folder(case):
    """The folder's weights replaced by one pytorch_model.bin whose pickle calls os.system."""
    for f in os.listdir(case.hf):
        if f.endswith(".safetensors") or f == INDEX:
            os.remove(case.hf / f)
    marker = case.tmp / "PAYLOAD_RAN"
    payload = P.PAYLOADS["os.system"]
    torch.save(payload.build(str(marker), str(case.tmp)), case.hf / "pytorch_model.bin", pickle_protocol=2)
    return marker, payload.global_name


def test_analyze_hf_refuses_a_bin_payload_with_our_line(base, tmp_path, capsys, analysis_process):
    case = Case(tmp_path, base)
    marker, global_name = _bin_payload_folder(case)
    case.planted()
    rc, output, err = run_main(capsys, case.analyze_argv())
    assert not marker.exists(), "the payload ran"
    line = assert_refused(case, rc, output, err, [case.hf / "pytorch_model.bin", global_name], ["allow"])
    assert line.startswith("mixln-megatron analyze angular-distance: error:")


def test_from_hf_refuses_a_bin_payload(base, tmp_path, capsys):
    case = Case(tmp_path, base)
    marker, global_name = _bin_payload_folder(case)
    case.planted()
    rc, output, err = run_main(capsys, case.from_hf_argv())
    assert not marker.exists(), "the payload ran"
    assert_refused(case, rc, output, err, [case.hf / "pytorch_model.bin", global_name])


@pytest.mark.parametrize("damage", ["overlapping", "dotdot", "hidden-string", "intermediate-wrong"])
def test_analyze_hf_refuses_a_damaged_folder(base, tmp_path, capsys, analysis_process, damage):
    case = Case(tmp_path, base)
    if damage == "overlapping":
        case.header(_overlapping)
        names, says = [case.hf / SHARD], [r"overlaps the tensor before it"]
    elif damage == "dotdot":
        case.index(_point_shard_at("../secret.safetensors"))
        names, says = [case.hf], [r"\.\./secret\.safetensors"]
    elif damage == "hidden-string":
        case.config(_set("hidden_size", "abc"))
        names, says = [case.hf / "config.json"], [r"hidden_size must be a positive integer"]
    else:
        case.config(_set("intermediate_size", 128))
        names, says = [case.hf], [r"does not match its config\.json.*gate_proj"]
    case.planted()
    rc, output, err = run_main(capsys, case.analyze_argv())
    assert_refused(case, rc, output, err, names, says)


def test_analyze_hf_tokenizer_file_linked_out_is_refused(base, tmp_path, capsys, analysis_process):
    """transformers' tokenizer loader opens files of the folder by itself: none may point outside."""
    case = Case(tmp_path, base)
    os.symlink(case.secret, case.hf / "tokenizer.json")
    case.planted()
    rc, output, err = run_main(capsys, case.analyze_argv())
    assert_refused(case, rc, output, err, [case.hf / "tokenizer.json"], ["symlink", "outside"])


def test_analyze_hf_hidden_size_of_a_billion_is_one_line_at_bounded_memory(base, tmp_path):
    case = Case(tmp_path, base).config(_set("hidden_size", 1000000000)).planted()
    rc, output, err, rss = run_child(case, case.analyze_argv())
    assert_refused(case, rc, output, err, [case.hf / "config.json"], [r"hidden_size must be a positive integer"])
    assert rss < RSS_BOUND_MIB, f"peak RSS {rss:.0f} MiB >= {RSS_BOUND_MIB} MiB"


def test_analyze_hf_untouched_copy_still_loads(base, tmp_path):
    """The loader that validates first gives the model transformers' own from_pretrained gives."""
    from transformers import AutoModelForCausalLM

    from mixln_megatron.analysis.loading import load_hf_model
    from mixln_megatron.hf import register_auto_classes

    case = Case(tmp_path, base)
    lm = load_hf_model(str(case.hf))
    register_auto_classes()
    ref = AutoModelForCausalLM.from_pretrained(str(case.hf), dtype=torch.float32, local_files_only=True)
    ids = torch.arange(12).view(1, 12) % 97
    with torch.no_grad():
        assert torch.equal(lm.module(input_ids=ids).logits, ref(input_ids=ids).logits)


# ------------------------------------------------------------------------------ checkpoint args
@pytest.fixture(scope="module")
def legacy_ckpt(mixln_checkpoints):
    """The run's shared legacy checkpoint of the same model (conftest.mixln_checkpoints); copied before changes."""
    return mixln_checkpoints["torch"]


def _ckpt_with_args(legacy_ckpt, tmp_path, **changes):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(legacy_ckpt, ckpt)
    f = ckpt / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)  # our own fixture file
    for k, v in changes.items():
        setattr(state["args"], k, v)
    torch.save(state, f)
    return ckpt


BAD_ARGS = [
    ("hidden_size", "abc", r"hidden_size.*'abc'"),
    ("hidden_size", None, r"hidden_size"),
    ("num_layers", 1e9, r"num_layers.*1000000000"),
    ("num_layers", 10 ** 9, r"num_layers.*1000000000|num_layers.*4096"),
    ("num_attention_heads", 3, r"not a multiple of num_attention_heads 3|num_attention_heads"),
    ("swiglu", "yes", r"swiglu.*'yes'"),
    ("normalization", 3, r"normalization.*3"),
    ("layernorm_epsilon", "x", r"layernorm_epsilon.*'x'"),
]


@pytest.mark.parametrize("field,value,says", BAD_ARGS)
def test_to_hf_refuses_bad_checkpoint_args(legacy_ckpt, tmp_path, capsys, field, value, says):
    """End to end: one line naming the field (whichever reader sees it first), nothing written."""
    ckpt = _ckpt_with_args(legacy_ckpt, tmp_path, **{field: value})
    out = tmp_path / "outputs" / "hf"
    (tmp_path / "outputs").mkdir()
    before = folder_hash(ckpt)
    rc, output, err = run_main(capsys, ["convert", "to-hf", "--load", str(ckpt), "--save", str(out),
                                        "--no-progress"])
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in output, output
    assert LINE.match(lines[0]) and re.search(says, lines[0]), lines[0]
    assert os.listdir(tmp_path / "outputs") == [] and folder_hash(ckpt) == before


GOOD_ARGS = dict(num_layers=2, hidden_size=64, num_attention_heads=4, normalization="RMSNorm", swiglu=True,
                 position_embedding_type="rope", add_bias_linear=False)


@pytest.mark.parametrize("field,value,says", BAD_ARGS[:4] + [
    ("num_attention_heads", 3, r"hidden_size 64 is not a multiple of num_attention_heads 3"),
    ("swiglu", "yes", r"swiglu must be true or false, got 'yes'"),
    ("normalization", 3, r"normalization must be a string, got 3"),
    ("layernorm_epsilon", "x", r"layernorm_epsilon must be a number"),
    ("ffn_hidden_size", 2.5, r"ffn_hidden_size must be a positive integer.*got 2\.5"),
    ("padded_vocab_size", "128", r"padded_vocab_size must be a positive integer.*got '128'"),
    ("rotary_percent", 0.0, r"rotary_percent must be a number in \(0, 1"),
    ("add_bias_linear", "no", r"add_bias_linear must be true or false, got 'no'"),
])
def test_args_readers_check_each_field(field, value, says):
    """convert.shape's readers on their own (the ones analysis and inspect use too): one ConversionError."""
    from argparse import Namespace

    from mixln_megatron.convert import ConversionError
    from mixln_megatron.convert.shape import args_shape, shape_from_megatron_args

    args = Namespace(**{**GOOD_ARGS, field: value})
    if value is None:
        says = rf"{field} is missing"
    elif field == "num_layers":
        says = r"num_layers must be a positive integer"
    for reader in (args_shape, lambda a: shape_from_megatron_args(a, 97)):
        with pytest.raises(ConversionError, match=says):
            reader(args)


def test_add_bias_linear_none_reads_the_same_in_shape_and_support_check(legacy_ckpt, tmp_path, capsys):
    """None is falsy to Megatron-LM and "off" to model.support: no bias, in both readers. The
    checkpoint (saved without biases) converts; with add_qkv_bias the support check calls it qkv-only."""
    from argparse import Namespace

    from mixln_megatron.convert import UnsupportedModelError
    from mixln_megatron.convert.shape import args_shape, check_megatron_args_supported

    args = Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, add_bias_linear=None,
                     normalization="RMSNorm", swiglu=True, position_embedding_type="rope")
    assert args_shape(args).add_bias_linear is False
    check_megatron_args_supported(args)
    with pytest.raises(UnsupportedModelError, match="qkv-only bias"):
        check_megatron_args_supported(Namespace(**vars(args), add_qkv_bias=True))
    assert args_shape(Namespace(num_layers=2, hidden_size=64, num_attention_heads=4)).add_bias_linear is True
    ckpt = _ckpt_with_args(legacy_ckpt, tmp_path, add_bias_linear=None)
    rc, output, _ = run_main(capsys, ["convert", "to-hf", "--load", str(ckpt), "--save", str(tmp_path / "hf"),
                                      "--no-progress"])
    assert rc == 0, output
