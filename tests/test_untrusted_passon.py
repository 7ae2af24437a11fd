"""Payloads are never passed on: gpt-to-hybrid / hybrid-to-gpt write a byte item
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
import sys

import pytest

from harness.testing import run_python
import torch

pytest.importorskip("transformers")

import payloads as P  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::FutureWarning")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_ITEM = "decoder.layers.self_attention.linear_qkv._extra_state/shard_1_4"
HYBRID_ITEM = "decoder.layers.2.self_attention.linear_qkv._extra_state/shard_0_1"


@pytest.fixture(scope="module")
def sources(mixln_checkpoints):
    """Each command's source (conftest.mixln_checkpoints, shared by the run; the tests copy it) and its item."""
    return {"gpt-to-hybrid": (mixln_checkpoints["torch_dist"], GPT_ITEM),
            "hybrid-to-gpt": (mixln_checkpoints["hybrid"], HYBRID_ITEM)}


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


# hybrid-to-gpt writes byte items through the same checked copy as gpt-to-hybrid: slow (a
# converter process each).
@pytest.mark.parametrize("command", ["gpt-to-hybrid", pytest.param("hybrid-to-gpt", marks=pytest.mark.slow)])
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
    proc = run_python([sys.executable, "-m", "mixln_megatron.cli", "convert", command, "--load", str(ckpt),
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


# ------------------------------------------------------------------ real TransformerEngine
# A TE GPTModel (real TE 2.x modules built on the CPU; make test-te) saved as Megatron-LM saves it:
# every TE module writes an `_extra_state` byte item (a uint8 tensor holding TE's plain pickle).
# `convert inspect --check` calls it clean, gpt-to-hybrid converts it (every `_extra_state` item
# through the allow-list on the way out), the output loads into the TE HybridModel (TE's
# set_extra_state unpickles each item); a payload in one real item's inner pickle is refused.
TE_L, TE_P = 4, 2


def _te_why():
    from mixln_megatron import compat
    from harness import testing as mu

    return mu.te_missing() or (None if compat.HYBRID_MODEL else "HybridModel Mix-LN needs megatron-core 0.19+")


def _cli(*argv):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p),
           "PYTHONWARNINGS": "ignore"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = run_python([sys.executable, "-m", "mixln_megatron.cli", *argv], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO)
    return proc, [line for line in proc.stderr.splitlines() if line.strip() and "CUDA runtime" not in line]


def _te_megatron_lm_args(kind):
    """Megatron-LM's parsed and validated args of the TE model (what its save_checkpoint writes)."""
    from megatron.training.arguments import parse_args, validate_args

    sys.path.insert(0, os.path.join(REPO, "tests", "workers"))
    import hybrid_ckpt_worker as C

    flags = [*C.MODEL_FLAGS, "--global-batch-size", "4", "--ffn-hidden-size", "128", "--ckpt-format", "torch_dist",
             "--transformer-impl", "transformer_engine", "--spec", "mixln_megatron.spec"]
    flags += ["mixln_layer_spec", "--num-layers", str(TE_L)] if kind == "gpt" else [
        "mixln_hybrid_stack_spec", "--num-layers", str(2 * TE_L), "--hybrid-layer-pattern", "*-" * TE_L]
    argv = list(sys.argv)
    try:
        sys.argv = [argv[0], *flags]
        args = parse_args()
        validate_args(args)
    finally:
        sys.argv = argv
    args.mixln_post_ln_layers = TE_P
    return args


def _te_model(kind):
    from mixln_megatron import cpu
    from harness import testing as mu
    from mixln_megatron.model.specs import get_mixln_decoder_block_spec, get_mixln_hybrid_stack_spec

    with cpu.te_modules():
        if kind == "gpt":
            cfg = mu.tiny_config(num_layers=TE_L)
            return mu.build_gpt(cfg, get_mixln_decoder_block_spec(cfg, backend="te", post_ln_layers=TE_P))
        cfg = mu.tiny_config(num_layers=2 * TE_L)
        spec = get_mixln_hybrid_stack_spec(cfg, backend="te", post_ln_layers=TE_P, hybrid_layer_pattern="*-" * TE_L)
        return mu.build_hybrid(cfg, spec, "*-" * TE_L)


@pytest.fixture(scope="module")
def te_gpt(request, tmp_path_factory):
    """The TE GPTModel's torch_dist checkpoint (DIR/release, as replace_item expects) and its weights."""
    why = _te_why()
    if why:
        pytest.skip(str(why))
    request.getfixturevalue("mcore_single")
    from megatron.core import dist_checkpointing

    from harness import testing as mu

    root = tmp_path_factory.mktemp("te_passon")
    model = _te_model("gpt")
    mu.randomize([model], seed=13)
    os.makedirs(root / "gpt" / "release")
    metadata = {}
    state = {"model": model.sharded_state_dict(metadata=metadata), "args": _te_megatron_lm_args("gpt"),
             "iteration": 0, "checkpoint_version": 3.0}
    dist_checkpointing.save(state, str(root / "gpt" / "release"), content_metadata=metadata)
    (root / "gpt" / "latest_checkpointed_iteration.txt").write_text("release")
    return {"ckpt": root / "gpt", "model": model}


def _te_state(ckpt, key):
    """TE's extra-state tensor of one byte item (megatron saves a ShardedObject as a one-element list)."""
    value = torch.load(io.BytesIO(P.item_bytes(ckpt, key)), weights_only=True)
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _extra_state_items(ckpt):
    from mixln_megatron.convert.dcp_files import DCPFiles

    return sorted(k for k in DCPFiles(str(ckpt / "release")).objects if k.split("/")[0].endswith("._extra_state"))


@pytest.mark.te
def test_real_te_checkpoint_is_clean_converts_and_loads(te_gpt, tmp_path):
    from megatron.core import dist_checkpointing

    from mixln_megatron.convert import convert_gpt_to_hybrid
    from mixln_megatron.convert import vet

    ckpt = te_gpt["ckpt"]
    items = _extra_state_items(ckpt)
    # real TE state: every layer's TE linears and Post-LN norms, each a uint8 tensor holding a pickle
    assert any(k.startswith("decoder.layers.self_attention.linear_qkv._extra_state/") for k in items), items
    assert len(items) >= 2 * TE_L, items
    for key in items:  # TE's own format: a uint8 tensor (empty without FP8 state, as on a CPU)
        value = _te_state(ckpt, key)
        assert isinstance(value, torch.Tensor) and value.dtype == torch.uint8, key

    proc, lines = _cli("convert", "inspect", "--check", "--load", str(ckpt))
    assert proc.returncode == 0 and lines == [], proc.stderr
    assert "clean" in proc.stdout and "byte items" in proc.stdout, proc.stdout

    checked = []
    real_check = vet.check_byte_item

    def counting(raw, key, where):
        checked.append(key)
        return real_check(raw, key, where)

    import mixln_megatron.convert.gpt_hybrid as gh

    original = gh.check_byte_item
    gh.check_byte_item = counting
    try:
        out = tmp_path / "hybrid"
        summary = convert_gpt_to_hybrid(str(ckpt), str(out))
    finally:
        gh.check_byte_item = original
    assert set(items) <= set(checked), sorted(set(items) - set(checked))
    assert summary["objects"] >= len(items)

    proc, lines = _cli("convert", "inspect", "--check", "--load", str(out))
    assert proc.returncode == 0 and lines == [], proc.stderr

    hybrid = _te_model("hybrid")
    path = str(out / "release")
    metadata = dist_checkpointing.load_content_metadata(path)
    loaded = dist_checkpointing.load({"model": hybrid.sharded_state_dict(metadata=metadata)}, path)
    hybrid.load_state_dict(loaded["model"])  # strict: TE's set_extra_state unpickles every item
    # every GPT parameter is the hybrid's: layer i's tensors in hybrid layer 2i (attention) or 2i+1 (MLP)
    want = {k: v for k, v in te_gpt["model"].state_dict().items() if not k.endswith("_extra_state")}
    got = {k: v for k, v in hybrid.state_dict().items() if not k.endswith("_extra_state")}
    assert len(want) > 20 and len(got) == len(want)
    for key, value in want.items():
        if key.startswith("decoder.layers."):
            index, name = key[len("decoder.layers."):].split(".", 1)
            match = [f"decoder.layers.{j}.{name}" for j in (2 * int(index), 2 * int(index) + 1)
                     if f"decoder.layers.{j}.{name}" in got]
            assert len(match) == 1, key
            match = match[0]
        else:
            match = key.replace("decoder.final_layernorm.", "decoder.final_norm.")
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, got[match]), key
        else:  # the layers' Mix-LN settings record (legacy state dicts)
            assert value == got[match], key


@pytest.mark.te
@pytest.mark.parametrize("command", ["inspect", "gpt-to-hybrid"])
def test_payload_in_a_real_te_extra_state_is_refused(te_gpt, tmp_path, monkeypatch, command):
    """One real TE item gets what TE writes with FP8 state (a uint8 tensor holding a plain pickle of
    {"recipe", "extra_fp8_variables"}) with a payload inside. TE 2.20's own set_extra_state refuses
    such a pickle unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 (older TE 2.x pickle.loads it
    unconditionally): with that opt-in it runs the payload, which shows the item is live."""
    from mixln_megatron import cpu

    ckpt = tmp_path / "ckpt"
    shutil.copytree(te_gpt["ckpt"], ckpt)
    key = next(k for k in _extra_state_items(ckpt) if ".linear_qkv._extra_state/" in k)
    real = _te_state(ckpt, key)
    assert isinstance(real, torch.Tensor) and real.dtype == torch.uint8
    marker = tmp_path / "PAYLOAD_RAN"
    inner = bytearray(pickle.dumps({"recipe": None,
                                    "extra_fp8_variables": P.Reduce(os.system, (f"touch {marker}",))}))
    P.replace_item(ckpt, key, _torch_bytes([torch.frombuffer(inner, dtype=torch.uint8)]))  # as megatron saves it
    # live: TE's own set_extra_state on the planted item runs it
    layer = te_gpt["model"].decoder.layers[TE_P].self_attention.linear_qkv
    monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
    with cpu.te_modules():
        try:
            layer.set_extra_state(_te_state(ckpt, key))
        except Exception:  # noqa: BLE001 - after pickle.loads ran: the state is no real FP8 state
            pass
    monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE")
    assert marker.exists()
    marker.unlink()
    before = _tree_hash(ckpt)
    out_parent = tmp_path / "outputs"
    out_parent.mkdir()
    argv = ["convert", "inspect", "--check", "--load", str(ckpt)] if command == "inspect" else [
        "convert", command, "--load", str(ckpt), "--save", str(out_parent / "out"), "--no-progress"]
    proc, lines = _cli(*argv)
    assert not marker.exists(), "the payload RAN"
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(f"mixln-megatron convert {command}: error: "), proc.stderr
    assert "posix.system" in lines[0] and key in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert os.listdir(out_parent) == [] and _tree_hash(ckpt) == before
