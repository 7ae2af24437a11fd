"""Payloads are never passed on (issue 27, item 2): gpt-to-hybrid / hybrid-to-gpt write a byte item
only after it passed the allow-list (convert.vet.check_byte_item).

A real Mix-LN torch_dist checkpoint (`convert from-hf`, GPTModel; its HybridModel conversion for
hybrid-to-gpt) gets one `_extra_state` byte item re-pointed (tests/payloads.py's replace_item) at:
a torch.save'd payload (Megatron-LM's torch.load of the item would run it), or TE 2.x's format, a
uint8 tensor whose bytes are a plain pickle payload (TE's set_extra_state runs pickle.loads on it).
The command runs as its own process: exit 2, one line naming the .distcp and the global, no
output, the source unchanged, the marker never created. The TE case with real TE is
tests/test_te_checkpoints.py's (marked te): its checkpoints convert and load.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

import payloads as P  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_ITEM = "decoder.layers.self_attention.linear_qkv._extra_state/shard_1_4"
HYBRID_ITEM = "decoder.layers.2.self_attention.linear_qkv._extra_state/shard_0_1"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from mixln_megatron.convert import convert_from_hf, convert_gpt_to_hybrid
    from test_convert import make_mixln_folder

    root = tmp_path_factory.mktemp("passon")
    make_mixln_folder(root / "hf")
    convert_from_hf(str(root / "hf"), str(root / "gpt"), progress=False)
    convert_gpt_to_hybrid(str(root / "gpt"), str(root / "hybrid"))
    return {"gpt-to-hybrid": (root / "gpt", GPT_ITEM), "hybrid-to-gpt": (root / "hybrid", HYBRID_ITEM)}


def _tree_hash(folder) -> str:
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(folder)):
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            h.update(path.encode())
            h.update(open(path, "rb").read())
    return h.hexdigest()


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _plant(ckpt, key, form, marker):
    payload = P.Reduce(os.system, (f"touch {marker}",))
    if form == "item":  # the item itself: Megatron-LM's torch.load(weights_only=False) runs it
        data = _torch_bytes([payload])
    else:  # TE 2.x: a uint8 tensor holding a plain pickle; TE's set_extra_state pickle.loads it
        inner = bytearray(pickle.dumps({"recipe": None, "extra_fp8_variables": payload}))
        data = _torch_bytes(torch.frombuffer(inner, dtype=torch.uint8))
    P.replace_item(ckpt, key, data)


@pytest.mark.parametrize("command", ["gpt-to-hybrid", "hybrid-to-gpt"])
@pytest.mark.parametrize("form", ["item", "te-inner-pickle"])
def test_converter_refuses_to_pass_a_payload_on(sources, tmp_path, command, form):
    base, key = sources[command]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(base, ckpt)
    marker = tmp_path / "PAYLOAD_RAN"
    _plant(ckpt, key, form, marker)
    if form == "item":  # the planted files are live: plain unpickling runs them
        torch.load(io.BytesIO(P.item_bytes(ckpt, key)), weights_only=False)
    else:
        t = torch.load(io.BytesIO(P.item_bytes(ckpt, key)), weights_only=True)
        pickle.loads(t.numpy().tobytes())
    assert marker.exists()
    marker.unlink()
    before = _tree_hash(ckpt)
    out_parent = tmp_path / "outputs"
    out_parent.mkdir()
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "mixln_megatron.cli", "convert", command, "--load", str(ckpt),
                           "--save", str(out_parent / "out"), "--no-progress"], cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "CUDA runtime" not in line]
    assert not marker.exists(), "the payload RAN"
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(f"mixln-megatron convert {command}: error: "), proc.stderr
    assert "posix.system" in lines[0] and os.path.join(str(ckpt), "release", "__0_0.distcp") in lines[0], lines[0]
    assert key in lines[0], lines[0]
    assert os.listdir(out_parent) == [], os.listdir(out_parent)
    assert _tree_hash(ckpt) == before


def test_clean_items_still_convert_and_are_copied_as_stored(sources, tmp_path):
    """The check reads; the bytes written are the stored ones (a clean TE-style extra state, a uint8
    tensor holding an allow-listed pickle, converts and arrives unchanged)."""
    from mixln_megatron.convert import convert_gpt_to_hybrid
    from mixln_megatron.convert.dcp_files import DCPFiles

    base, key = sources["gpt-to-hybrid"]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(base, ckpt)
    inner = bytearray(pickle.dumps({"recipe": None, "extra_fp8_variables": {"num_gemms": 1}}))
    data = _torch_bytes(torch.frombuffer(inner, dtype=torch.uint8))
    P.replace_item(ckpt, key, data)
    convert_gpt_to_hybrid(str(ckpt), str(tmp_path / "out"))
    out = DCPFiles(str(tmp_path / "out" / "release"))
    assert out.read_raw("decoder.layers.2.self_attention.linear_qkv._extra_state/shard_0_1") == data
