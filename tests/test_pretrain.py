"""`mixln-megatron pretrain`: Megatron-LM's training loop with the Mix-LN model, on CPU with gloo.

The training runs are subprocesses (`python -m mixln_megatron.training.pretrain --cpu ...`, under
`python -m torch.distributed.run` for more than one rank): Megatron's global state allows one
pretrain() per process. They go through tests/workers/fork_queue.py, which runs that module as
`-m` does after starting megatron's torch_dist write-results queue by fork (not by a spawned
interpreter that imports the module and torch again: ~3 CPU-seconds per saving process); the
literal command, spawned queue included, saves in test_vet_load.py's clean resume. Losses are
compared per iteration from the entry point's --loss-log record (Megatron's own log line after a
(re)start averages two iterations).
"""

import json
import math
import os
import re
import sys
import types
from argparse import Namespace

import pytest

from harness.testing import run_python, start_python
from harness import testing as mu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "scripts", "demo.py")
# `python -m mixln_megatron.training.pretrain` with the write-results queue started by fork (its docstring)
ENTRY = [os.path.join(REPO, "tests", "workers", "fork_queue.py"), "-m", "mixln_megatron.training.pretrain"]

TINY = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    # Megatron pads the vocabulary to a multiple of this x TP; with the default (128) TP2 pads to
    # 256 and, on loading a TP1 checkpoint, keeps freshly initialised rows (the embedding loads
    # with allow_shape_mismatch), so the loss would jump. 64 x 2 keeps 128 rows at TP1 and TP2.
    "--make-vocab-size-divisible-by", "64",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--position-embedding-type", "rope", "--use-cpu-initialization",
    "--eval-iters", "1", "--eval-interval", "3", "--log-interval", "1", "--num-workers", "0",
    "--train-iters", "6",
]


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def start(args, nproc=1, torchrun=None):
    """Popen of the entry point: under torchrun with `nproc` workers, or as a plain process (the
    default for one process: the entry point makes its one-rank group itself, no launcher)."""
    if torchrun is None:
        torchrun = nproc > 1
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--standalone", *ENTRY, *args]
    else:
        cmd = [sys.executable, *ENTRY, *args]
    proc = start_python(cmd, env=_env(), cwd=REPO, merge_stderr=True)
    proc.cmd = cmd
    return proc


def finish(proc, timeout=400, expect_rc=0):
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != expect_rc:
        raise AssertionError(f"{' '.join(proc.cmd)} exited {proc.returncode}:\n{out[-8000:]}")
    return out


def train(args, nproc=1, timeout=400):
    return finish(start(args, nproc), timeout)


def losses(path):
    with open(path) as f:
        record = json.load(f)
    return record, {t["iteration"]: t["loss"] for t in record["train"]}


def megatron_logged(out):
    """{iteration: lm loss} from Megatron's log lines (log-interval 1)."""
    pat = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
    return {int(m.group(1)): float(m.group(2)) for m in pat.finditer(out)}


# ------------------------------------------------------------------ train, save, resume
@pytest.mark.compat
def test_train_save_resume_equals_uninterrupted(tmp_path):
    """6 iterations at once == 3, torch_dist save, load, 3 more: the two iteration-6 checkpoints
    are bitwise identical (every model, optimizer and RNG tensor and byte item), and the validation
    passes agree. The resume starts from the uninterrupted run's own iteration-3 save (a run that
    saves at 3 and exits writes the same state; that path, --exit-interval, is
    test_pretrain_hybrid.py::test_hybrid_pretrain_equals_gpt_also_across_a_resume's). (Megatron-LM's
    logged loss of the second iteration after any start is the mean of two iterations,
    training_log's `should_reset = not is_first_iteration`: logged losses are no measure of a resume.)"""
    import shutil

    ckpt, ref = tmp_path / "ckpt", tmp_path / "ref"
    mix = ["--cpu", *TINY, "--mixln-alpha", "0.25", "--ckpt-format", "torch_dist",
           "--save-interval", "3"]  # dropout on (Megatron's 0.1 defaults)
    out_full = train([*mix, "--loss-log", str(tmp_path / "full.json"), "--save", str(ref)])
    assert (ref / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert (ref / "iter_0000003" / ".metadata").exists()  # torch_dist layout
    shutil.copytree(ref / "iter_0000003", ckpt / "iter_0000003")  # the state at 3, as a stopped run leaves it
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    out2 = train([*mix, "--loss-log", str(tmp_path / "p2.json"), "--load", str(ckpt), "--save", str(ckpt)])
    assert "loading distributed checkpoint from" in out2 or "successfully loaded checkpoint" in out2

    compared = same_checkpoint(ref / "iter_0000006", ckpt / "iter_0000006")
    assert any("optimizer" in key for key in compared["tensors"]), sorted(compared["tensors"])[:20]
    assert any("rng_state" in key for key in compared["objects"]), sorted(compared["objects"])

    rec_full, full_losses = losses(tmp_path / "full.json")
    rec2, p2 = losses(tmp_path / "p2.json")
    assert sorted(full_losses) == [1, 2, 3, 4, 5, 6] and sorted(p2) == [4, 5, 6]
    assert full_losses[6] < full_losses[1]
    # Validation: periodic at 3 and 6, then the final validation and test passes.
    splits = [(e["split"], e["iteration"]) for e in rec_full["eval"]]
    assert splits == [("valid", 3), ("valid", 6), ("valid", 6), ("test", 6)]
    assert [e["loss"] for e in rec2["eval"]] == pytest.approx([e["loss"] for e in rec_full["eval"][1:]], rel=1e-6)
    # What Megatron-LM logs after the resume: iteration 4 alone, then 5 as the mean of 4 and 5.
    logged = megatron_logged(out2)
    assert logged[4] == pytest.approx(p2[4], rel=2e-6)
    assert logged[5] == pytest.approx((p2[4] + p2[5]) / 2, rel=2e-6)
    # The model that trained is the Mix-LN one: layer 1 of 4 is Post-LN (alpha 0.25).
    assert rec_full["mixln"]["post_ln_layers"] == 1
    assert "Post-LN layers: 1" in out_full


# Items that name the run rather than its state (paths, --exit-interval, --loss-log).
RUN_ITEMS = ("args",)


def same_checkpoint(a, b) -> dict:
    """Assert two torch_dist iteration folders hold the same state: every tensor bit for bit and
    every byte item byte for byte (the project's DCP reader: nothing unpickled), and on releases
    that keep a common.pt (0.17/0.18) the same common state; `RUN_ITEMS` aside. Returns the keys."""
    import torch

    from mixln_megatron.convert.dcp_files import DCPFiles
    from mixln_megatron.safe_unpickle import load_torch

    fa, fb = DCPFiles(str(a)), DCPFiles(str(b))
    assert sorted(fa.tensors) == sorted(fb.tensors) and sorted(fa.objects) == sorted(fb.objects)
    boxes_a = {k: ((0,) * len(m.size), torch.empty(m.size, dtype=m.properties.dtype)) for k, m in fa.tensors.items()}
    boxes_b = {k: ((0,) * len(m.size), torch.empty(m.size, dtype=m.properties.dtype)) for k, m in fb.tensors.items()}
    fa.read(boxes_a)
    fb.read(boxes_b)
    for key in fa.tensors:
        ta, tb = boxes_a[key][1], boxes_b[key][1]
        assert ta.reshape(-1).view(torch.uint8).equal(tb.reshape(-1).view(torch.uint8)), key
    objects = [k for k in fa.objects if k.split("/")[0] not in RUN_ITEMS]
    for key in objects:
        if key.startswith("common_state"):  # 0.19+: the common state (args among it) is a byte item
            ca, cb = (_without_run_items(f.read_object(key, "common state")) for f in (fa, fb))
            assert repr(ca) == repr(cb), key
        else:
            assert fa.read_raw(key) == fb.read_raw(key), key
    common_a, common_b = os.path.join(a, "common.pt"), os.path.join(b, "common.pt")
    assert os.path.exists(common_a) == os.path.exists(common_b)
    if os.path.exists(common_a):
        ca, cb = (_without_run_items(load_torch(p, what=p)) for p in (common_a, common_b))
        assert repr(ca) == repr(cb), "common.pt"
    return {"tensors": list(fa.tensors), "objects": objects}


def _without_run_items(value):
    """The common state with the items that name the run (`RUN_ITEMS`) left out, at any depth."""
    if isinstance(value, dict):
        return {k: _without_run_items(v) for k, v in sorted(value.items(), key=repr) if k not in RUN_ITEMS}
    if isinstance(value, (list, tuple)):
        return [_without_run_items(v) for v in value]
    return value


# ------------------------------------------------------------------ unsupported configurations
def test_unsupported_configurations_are_rejected():
    from mixln_megatron.training.pretrain import MixLNPretrainUnsupported, check_supported_args

    base = dict(use_megatron_fsdp=False, context_parallel_size=1, transformer_impl="local",
                mtp_num_layers=None, num_experts=None)
    check_supported_args(Namespace(**base))
    check_supported_args(Namespace(**{**base, "context_parallel_size": 2, "transformer_impl": "transformer_engine"}))
    with pytest.raises(MixLNPretrainUnsupported, match="Megatron-FSDP"):
        check_supported_args(Namespace(**{**base, "use_megatron_fsdp": True}))
    with pytest.raises(MixLNPretrainUnsupported, match="context parallelism"):
        check_supported_args(Namespace(**{**base, "context_parallel_size": 2}))


def test_entry_point_rejects_megatron_fsdp_and_local_cp_before_starting():
    fsdp = start(["--cpu", *TINY, "--use-megatron-fsdp"], torchrun=False)
    cp = start(["--cpu", *TINY, "--context-parallel-size", "2"], torchrun=False)
    for proc, what in ((fsdp, "Megatron-FSDP (--use-megatron-fsdp) is not supported"),
                       (cp, "context parallelism (--context-parallel-size > 1) is not supported")):
        out = finish(proc, timeout=200, expect_rc=2)
        assert f"[mixln_megatron] ERROR: {what}" in out
        assert "initializing torch distributed" not in out


# ------------------------------------------------------------------ the compile_helpers workaround
def _stand_in_utils(directory, makefile: bool):
    os.makedirs(directory, exist_ok=True)
    if makefile:
        with open(os.path.join(directory, "Makefile"), "w") as f:
            f.write("all:\n")

    def compile_helpers():
        raise AssertionError("the upstream compile step")

    return types.SimpleNamespace(__file__=os.path.join(directory, "utils.py"), compile_helpers=compile_helpers)


def test_prebuilt_helpers_used_only_without_makefile(tmp_path):
    from mixln_megatron.training import pretrain as helpers

    with_makefile = _stand_in_utils(tmp_path / "src", makefile=True)
    original = with_makefile.compile_helpers
    assert helpers.use_prebuilt_dataset_helpers(with_makefile) is False
    assert with_makefile.compile_helpers is original  # a source tree keeps compiling

    wheel_like = _stand_in_utils(tmp_path / "wheel", makefile=False)
    assert helpers.use_prebuilt_dataset_helpers(wheel_like) is True
    assert wheel_like.compile_helpers is not None and wheel_like.compile_helpers.mixln_prebuilt
    wheel_like.compile_helpers()  # imports the prebuilt module instead of running make
    assert helpers.use_prebuilt_dataset_helpers(wheel_like) is True  # idempotent


def test_prebuilt_helpers_not_used_when_they_do_not_import(tmp_path, monkeypatch):
    from mixln_megatron.training import pretrain as helpers

    monkeypatch.setattr(helpers, "HELPERS_MODULE", "megatron.core.datasets.no_such_helpers_module")
    utils = _stand_in_utils(tmp_path / "wheel", makefile=False)
    original = utils.compile_helpers
    assert helpers.use_prebuilt_dataset_helpers(utils) is False
    assert utils.compile_helpers is original


def test_prebuilt_helpers_premise_and_no_patch_at_import(tmp_path):
    """The installed wheel: helpers prebuilt, no Makefile. Importing our module patches nothing."""
    import importlib

    import megatron.core.datasets.utils as real_utils

    from mixln_megatron.training import pretrain as helpers

    assert not getattr(real_utils.compile_helpers, "mixln_prebuilt", False)
    directory = os.path.dirname(real_utils.__file__)
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
        importable = True
    except ImportError:
        importable = False
    expected = importable and not os.path.exists(os.path.join(directory, "Makefile"))
    stand_in = types.SimpleNamespace(__file__=real_utils.__file__, compile_helpers=real_utils.compile_helpers)
    assert helpers.use_prebuilt_dataset_helpers(stand_in) is expected
    assert expected, "megatron-core's wheel layout changed: the compile_helpers workaround no longer applies"


@pytest.mark.compat
def test_one_process_binds_no_port(tmp_path):
    """Without a launcher the entry point's process group has an in-memory store: a MASTER_PORT
    another process holds (as a port picked free can be taken on a busy machine) does not matter."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        env = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(held.getsockname()[1]))
        proc = run_python([sys.executable, *ENTRY, "--cpu", *TINY, "--train-iters", "1", "--eval-iters", "0",
                           "--mixln-post-ln-layers", "1"], env=env, cwd=REPO, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


# ------------------------------------------------------------------ the model provider's spec path
@pytest.mark.parametrize(
    "flags, post_ln",
    [
        (dict(mixln_alpha="0.25"), [True, False, False, False]),
        (dict(mixln_post_ln_layers=2), [True, True, False, False]),
        (dict(mixln_alpha="0"), [False, False, False, False]),
    ],
)
@pytest.mark.compat
def test_model_provider_builds_post_ln_layers_as_configured(mcore_single, monkeypatch, flags, post_ln):
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.training import global_vars

    from mixln_megatron.model.backends import MixLNNorm
    from mixln_megatron.training.providers import model_provider

    # the provider reads the flags from Megatron-LM's global args (main binds its settings instead)
    args = Namespace(
        **{"mixln_alpha": None, "mixln_post_ln_layers": None, "mixln_scheme": None, **flags},
        transformer_impl="local", padded_vocab_size=mu.VOCAB, max_position_embeddings=mu.SEQ,
        fp16_lm_cross_entropy=False, untie_embeddings_and_output_weights=True,
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=10000, use_rope_scaling=False,
        rope_scaling_factor=8.0, rotary_seq_len_interpolation_factor=None,
    )
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    model = model_provider(pre_process=True, post_process=True, config=mu.tiny_config())
    layers = list(model.decoder.layers)
    assert [layer.is_post_ln for layer in layers] == post_ln
    for layer, is_post in zip(layers, post_ln):
        if is_post:
            assert isinstance(layer.input_layernorm, IdentityOp)
            assert isinstance(layer.post_attention_layernorm, MixLNNorm)
            assert isinstance(layer.post_mlp_layernorm, MixLNNorm)
        else:
            assert isinstance(layer.input_layernorm, MixLNNorm)
    assert isinstance(model.decoder.final_layernorm, MixLNNorm)
    ids, labels, pos, mask = mu.batch()
    out = model(ids, pos, mask, labels=labels)
    assert out.shape == labels.shape and bool(out.isfinite().all())


@pytest.mark.compat
def test_model_provider_honours_the_rope_scaling_factor_and_interpolation_the_export_reads(mcore_single, monkeypatch):
    """--rope-scaling-factor and --rotary-seq-len-interpolation-factor reach the model's RoPE
    (Megatron-LM's own builders drop the factor: a model trained with 8.0 would export as 32)."""
    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.training import global_vars

    from mixln_megatron.training.providers import model_provider

    def rope_of(**rope):
        args = Namespace(
            mixln_alpha=None, mixln_post_ln_layers=1, mixln_scheme=None, transformer_impl="local",
            padded_vocab_size=mu.VOCAB, max_position_embeddings=mu.SEQ, fp16_lm_cross_entropy=False,
            untie_embeddings_and_output_weights=True, position_embedding_type="rope", rotary_percent=1.0,
            rotary_base=10000, **{"use_rope_scaling": False, "rope_scaling_factor": 8.0,
                                  "rotary_seq_len_interpolation_factor": None, **rope})
        monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
        return model_provider(pre_process=True, post_process=True, config=mu.tiny_config()).rotary_pos_emb

    dim = mu.tiny_config().kv_channels
    llama32 = rope_of(use_rope_scaling=True, rope_scaling_factor=32.0)
    want = RotaryEmbedding(dim, 1.0, rope_scaling=True, rope_scaling_factor=32.0).inv_freq
    default = RotaryEmbedding(dim, 1.0, rope_scaling=True, rope_scaling_factor=8.0).inv_freq
    assert torch.equal(llama32.inv_freq, want) and not torch.equal(want, default)
    assert rope_of(rotary_seq_len_interpolation_factor=4).seq_len_interpolation_factor == 4


# ------------------------------------------------------------------ model parallel (torchrun, 2 procs)
@pytest.mark.slow
@pytest.mark.mp
def test_pp2_and_tp2_resume_match_single_process(tmp_path):
    """PP2 (Post-LN layers 1-2 on stage 0) trains like TP1; its torch_dist checkpoint resumes at TP2."""
    nodrop = ["--attention-dropout", "0", "--hidden-dropout", "0"]
    mix = ["--cpu", *TINY, *nodrop, "--mixln-post-ln-layers", "2"]
    ref = start([*mix, "--loss-log", str(tmp_path / "ref.json")])
    finish(ref)
    ckpt = tmp_path / "ckpt"
    out_pp = train([*mix, "--pipeline-model-parallel-size", "2", "--loss-log", str(tmp_path / "pp2.json"),
                    "--save", str(ckpt), "--save-interval", "3", "--exit-interval", "3"], nproc=2)
    assert "Post-LN layers: 1, 2" in out_pp
    train([*mix, "--tensor-model-parallel-size", "2", "--loss-log", str(tmp_path / "tp2.json"),
           "--load", str(ckpt)], nproc=2)
    _, ref_losses = losses(tmp_path / "ref.json")
    _, pp2 = losses(tmp_path / "pp2.json")
    rec_tp2, tp2 = losses(tmp_path / "tp2.json")
    assert sorted(pp2) == [1, 2, 3] and sorted(tp2) == [4, 5, 6]
    for it in range(1, 7):
        # Reduction order differs across splits; Adam amplifies it a little (measured ~1e-4).
        got = pp2[it] if it <= 3 else tp2[it]
        assert got == pytest.approx(ref_losses[it], rel=1e-3), (it, got, ref_losses[it])
    assert rec_tp2["mixln"]["post_ln_layers"] == 2
    assert math.isfinite(rec_tp2["eval"][-1]["loss"])


# ------------------------------------------------------------------ the demo, end to end (short)
@pytest.mark.slow
def test_demo_smoke(tmp_path):
    """`python scripts/demo.py` with a few iterations: both runs, PNG, JSON, RESULT line."""
    out = tmp_path / "demo"
    proc = run_python(
        [sys.executable, str(DEMO), "--out", str(out), "--iters", "4", "--eval-interval", "2"],
        capture_output=True, text=True, timeout=600, env=_env(), cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"RESULT demo_ppl_mixln=([0-9.]+) demo_ppl_preln=([0-9.]+)", last)
    assert m, last
    summary = json.loads((out / "losses.json").read_text())
    assert summary["final_valid_ppl"]["mixln"] == pytest.approx(float(m.group(1)), rel=1e-3)
    assert summary["runs"]["mixln"]["mixln"]["post_ln_layers"] == 1
    assert summary["runs"]["preln"]["mixln"]["post_ln_layers"] == 0
    assert [t["iteration"] for t in summary["runs"]["preln"]["train"]] == [1, 2, 3, 4]
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
