"""Mix-LN HybridModel torch_dist checkpoints: settings record, resharding, GPT <-> hybrid, HF export.

One torchrun launch (2 processes, gloo; tests/workers/hybrid_ckpt_worker.py) in three steps: it
saves a HybridModel Mix-LN (P = 2, TP2) and GPTModel Mix-LN checkpoints (P = 2 at TP1 and TP2,
P = 0 at TP1) as Megatron-LM does (its own parsed args in the common state); its rank 0 converts
them (`mixln-megatron convert gpt-to-hybrid | hybrid-to-gpt`'s functions) while the other waits;
then it loads the results into the other model kind at TP1 / TP2 and runs Megatron-LM's
--use-checkpoint-args on them.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from mixln_megatron import compat

pytestmark = [pytest.mark.mp, pytest.mark.skipif(not compat.HYBRID_MODEL,
                                                 reason="HybridModel Mix-LN needs megatron-core 0.19+")]

WORKER = os.path.join(os.path.dirname(__file__), "workers", "hybrid_ckpt_worker.py")
ITER = "iter_0000005"
SAVES = [("hyb_tp2", "hybrid", 2, 2), ("gpt2_tp1", "gpt", 2, 1), ("gpt0_tp1", "gpt", 0, 1), ("gpt2_tp2", "gpt", 2, 2)]
# The paper's comparison arms in one model (every layer kind): DeepNorm's norms sit where Post-LN's
# do, Sandwich's output norms are stacked over the sandwich layers in GPTModel and per layer in
# HybridModel.
ARMS = "deepnorm:1,sandwich:2,post:3,pre:4"


def _launch(workdir, jobs, name):
    from harness.testing import torchrun

    path = os.path.join(workdir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(jobs, f)
    torchrun(WORKER, 2, path, workdir, timeout=900, env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hybrid_ckpt"))
    jobs = [{"do": "save", "name": n, "kind": k, "P": p, "tp": tp} for n, k, p, tp in SAVES]
    jobs.append({"do": "save", "name": "gptarms_tp2", "kind": "gpt", "P": None, "tp": 2, "layout": ARMS})
    for name in ("gpt2_tp1", "gpt0_tp1", "gpt2_tp2", "gptarms_tp2"):
        jobs.append({"do": "convert", "name": f"{name}_h", "direction": "gpt-to-hybrid", "path": f"{d}/{name}",
                     "save": f"{d}/{name}_h"})
        jobs.append({"do": "convert", "name": f"{name}_h_g", "direction": "hybrid-to-gpt", "path": f"{d}/{name}_h",
                     "save": f"{d}/{name}_h_g"})
    jobs.append({"do": "convert", "name": "hyb_tp2_g", "direction": "hybrid-to-gpt", "path": f"{d}/hyb_tp2",
                 "save": f"{d}/hyb_tp2_g"})
    conversions = [job["name"] for job in jobs if job["do"] == "convert"]
    jobs += [
        # HybridModel resharding: TP2 -> TP1 (saved again there) -> TP2
        {"do": "load", "name": "hyb_at_tp1", "path": f"{d}/hyb_tp2", "kind": "hybrid", "P": 2, "tp": 1,
         "resave": f"{d}/hyb_tp1"},
        {"do": "load", "name": "hyb_back_at_tp2", "path": f"{d}/hyb_tp1", "kind": "hybrid", "P": 2, "tp": 2},
        # another P: refused, through the content metadata and through the sharded record alone
        {"do": "load", "name": "hyb_p1", "path": f"{d}/hyb_tp2", "kind": "hybrid", "P": 1, "tp": 1},
        {"do": "load", "name": "hyb_p1_record", "path": f"{d}/hyb_tp2", "kind": "hybrid", "P": 1, "tp": 1,
         "content_metadata": False},
        # GPT -> hybrid, loaded into HybridModel Mix-LN
        {"do": "load", "name": "gpt2_tp1_h", "path": f"{d}/gpt2_tp1_h", "kind": "hybrid", "P": 2, "tp": 1},
        {"do": "load", "name": "gpt0_tp1_h", "path": f"{d}/gpt0_tp1_h", "kind": "hybrid", "P": 0, "tp": 1},
        {"do": "load", "name": "gpt2_tp2_h", "path": f"{d}/gpt2_tp2_h", "kind": "hybrid", "P": 2, "tp": 2},
        {"do": "load", "name": "gpt2_tp2_h_at_tp1", "path": f"{d}/gpt2_tp2_h", "kind": "hybrid", "P": 2, "tp": 1},
        {"do": "load", "name": "gptarms_tp2_h", "path": f"{d}/gptarms_tp2_h", "kind": "hybrid", "P": None, "tp": 2,
         "layout": ARMS},
        # hybrid -> GPT, loaded into GPTModel Mix-LN
        {"do": "load", "name": "hyb_tp2_g", "path": f"{d}/hyb_tp2_g", "kind": "gpt", "P": 2, "tp": 2},
        # Megatron-LM's --use-checkpoint-args on the converted checkpoints
        {"do": "megatron_args", "name": "args_h", "path": f"{d}/gpt2_tp1_h"},
        {"do": "megatron_args", "name": "args_h_g", "path": f"{d}/gpt2_tp1_h_g"},
    ]
    _launch(d, jobs, "jobs")
    summaries = {name: torch.load(os.path.join(d, f"{name}.summary.pt"), weights_only=False)  # our own file
                 for name in conversions}
    return d, summaries


def result(d, name):
    return torch.load(os.path.join(d, f"{name}.pt"))


def ranks(d, name):
    return [torch.load(os.path.join(d, f"{name}.rank{r}.pt")) for r in (0, 1)]


def global_tensors(path):
    """{key: full tensor} of every model tensor of a torch_dist checkpoint (read resharded)."""
    from mixln_megatron.convert.torch_dist_reader import TorchDistCheckpoint

    reader = TorchDistCheckpoint(path)
    return {k: reader.read(k, (0,) * len(reader.global_shape(k)), reader.global_shape(k))
            for k in reader.files.tensors}


def assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------------------ the settings record
def test_hybrid_checkpoint_carries_the_settings_record(work):
    from mixln_megatron.convert.dcp_files import DCPFiles

    d, _ = work
    files = DCPFiles(f"{d}/hyb_tp2/{ITER}")
    record = files.read_object("decoder.layers.0.mixln_settings/shard_0_1", "record")[0]
    assert (record["scheme"], record["post_ln_layers"], record["num_layers"]) == ("mixln", 2, 4)  # blocks
    # block k's norms: `*` layer 2k-1 holds N1 (norm_b) when Post-LN, the input norm (norm_a) when Pre-LN
    assert {"decoder.layers.0.mixln_norm_b.weight", "decoder.layers.1.mixln_norm_a.weight",
            "decoder.layers.4.mixln_norm_a.weight", "decoder.layers.5.mixln_norm_b.weight"} <= set(files.tensors)


def test_other_settings_are_refused_naming_both(work):
    d, _ = work
    error = result(d, "hyb_p1")["error"]  # as Megatron-LM loads: the content metadata first
    assert error and "checkpoint has scheme=mixln P=2 of L=4" in error, error
    assert "model has scheme=mixln P=1 of L=4" in error, error
    # Without the metadata: a hybrid block keeps its norms in the layer its kind says (unlike GPT's
    # stacked keys), so block 2 (Post-LN in the checkpoint, Pre-LN in the model) fails on its key.
    error = result(d, "hyb_p1_record")["error"]
    assert error and "decoder.layers.2.mixln_norm_a.weight from model not in state dict" in error, error


def test_hybrid_reshards_tp2_to_tp1_and_back(work):
    d, _ = work
    tp2, at_tp1, back = result(d, "hyb_tp2"), result(d, "hyb_at_tp1"), result(d, "hyb_back_at_tp2")
    assert tp2["error"] is None and at_tp1["error"] is None and back["error"] is None
    # the TP1 save holds exactly the TP2 save's global tensors
    assert_same(global_tensors(f"{d}/hyb_tp2/{ITER}"), global_tensors(f"{d}/hyb_tp1/{ITER}"))
    # back at TP2: every rank's shards and the logits are the original's, bit for bit
    for original, reloaded in zip(ranks(d, "hyb_tp2"), ranks(d, "hyb_back_at_tp2")):
        assert_same(original, reloaded)
    assert torch.equal(back["logits"], tp2["logits"])
    # TP1 computes the same logits up to the order of TP2's partial sums
    diff = (at_tp1["logits"] - tp2["logits"]).abs().max().item()
    assert diff <= 1e-5, diff


# ------------------------------------------------------------------------------ GPT <-> hybrid
@pytest.mark.parametrize("name", ["gpt2_tp1", "gpt0_tp1", "gpt2_tp2", "gptarms_tp2"])
def test_gpt_checkpoint_as_hybrid_gives_the_gpt_logits(work, name):
    d, summaries = work
    gpt, hyb = result(d, name), result(d, f"{name}_h")
    assert gpt["error"] is None and hyb["error"] is None, hyb["error"]
    assert torch.equal(hyb["logits"], gpt["logits"])  # same TP layout: bit-identical
    s = summaries[f"{name}_h"]
    assert (s["source_kind"], s["target_kind"], s["blocks"]) == ("GPTModel", "HybridModel", 4)
    assert s["hybrid_pattern"] == "*-*-*-*-" and s["args"] and s["iteration"] == ITER
    if name == "gpt2_tp2":  # the TP2 source, loaded at TP1 too
        diff = (result(d, "gpt2_tp2_h_at_tp1")["logits"] - gpt["logits"]).abs().max().item()
        assert diff <= 1e-5, diff


@pytest.mark.parametrize("name", ["gpt2_tp1", "gpt0_tp1", "gpt2_tp2", "gptarms_tp2"])
def test_gpt_hybrid_gpt_is_identical(work, name):
    d, _ = work
    assert_same(global_tensors(f"{d}/{name}/{ITER}"), global_tensors(f"{d}/{name}_h_g/{ITER}"))
    from mixln_megatron.convert.dcp_files import DCPFiles

    objects = lambda p: {k for k in DCPFiles(p).objects}  # noqa: E731
    assert objects(f"{d}/{name}/{ITER}") == objects(f"{d}/{name}_h_g/{ITER}")
    # the Mix-LN keys stay (P > 0), the stock keys stay at P = 0
    keys = set(global_tensors(f"{d}/{name}_h/{ITER}"))
    mixln = "decoder.layers.0.mixln_norm_b.weight" in keys
    assert mixln == (name != "gpt0_tp1")
    assert ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in keys) == (name == "gpt0_tp1")
    # a sandwich block's output norms: N_b in its `*` layer, N_d in its `-` layer (block 2: layers 2, 3)
    sandwich = sorted(k for k in keys if "mixln_norm_c" in k or "mixln_norm_d" in k)
    assert sandwich == (["decoder.layers.2.mixln_norm_c.weight", "decoder.layers.3.mixln_norm_d.weight"]
                        if name == "gptarms_tp2" else [])


def test_hybrid_checkpoint_as_gpt_gives_the_hybrid_logits(work):
    d, summaries = work
    hyb, gpt = result(d, "hyb_tp2"), result(d, "hyb_tp2_g")
    assert gpt["error"] is None, gpt["error"]
    assert torch.equal(gpt["logits"], hyb["logits"])
    assert summaries["hyb_tp2_g"]["target_kind"] == "GPTModel"


def test_megatron_lm_takes_the_converted_args(work):
    d, _ = work
    hybrid = json.load(open(f"{d}/args_h.json"))
    assert hybrid.get("error") is None, hybrid
    assert hybrid["num_layers"] == 8 and hybrid["hybrid_layer_pattern"] == "*-*-*-*-"
    assert hybrid["spec"] == ["mixln_megatron.spec", "mixln_hybrid_local_stack_spec"]
    gpt = json.load(open(f"{d}/args_h_g.json"))
    assert gpt.get("error") is None, gpt
    assert gpt["num_layers"] == 4 and gpt["hybrid_layer_pattern"] is None
    assert gpt["spec"] == ["mixln_megatron.spec", "mixln_local_layer_spec"]


def test_refusals_are_one_line_and_leave_nothing(work, tmp_path, capsys, monkeypatch):
    from mixln_megatron.convert.cli import main
    from mixln_megatron.convert.torch_dist_reader import TorchDistCheckpoint

    d, _ = work
    out = tmp_path / "out"
    assert main(["gpt-to-hybrid", "--load", f"{d}/hyb_tp2", "--save", str(out), "--no-progress"]) == 2
    assert "already is a HybridModel checkpoint" in capsys.readouterr().err
    assert main(["hybrid-to-gpt", "--load", f"{d}/gpt2_tp1", "--save", str(out), "--no-progress"]) == 2
    assert "already is a GPTModel checkpoint" in capsys.readouterr().err
    assert main(["gpt-to-hybrid", "--load", f"{d}/gpt2_tp1", "--save", f"{d}/gpt0_tp1", "--no-progress"]) == 2  # not empty
    assert "--overwrite" in capsys.readouterr().err
    # a non-Mix-LN pattern in the args (MoE, MTP, Mamba) is refused with the reason
    real = TorchDistCheckpoint._read_common
    for pattern, why in (("*E*-*-*-", "MoE"), ("*-*-*-*-/*-", "multi-token-prediction"), ("M-*-*-*-", "Mamba")):
        def patched(self, pattern=pattern):
            common = real(self)
            common["args"].hybrid_layer_pattern = pattern
            return common

        monkeypatch.setattr(TorchDistCheckpoint, "_read_common", patched)
        for command in (["hybrid-to-gpt", "--load", f"{d}/hyb_tp2", "--save", str(out), "--no-progress"],
                        ["to-hf", "--load", f"{d}/hyb_tp2", "--save", str(out), "--no-progress"]):
            assert main(command) == 2
            err = capsys.readouterr().err
            assert why in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(out) and not [e for e in os.listdir(tmp_path) if e.startswith(".out.")]


# ------------------------------------------------------------------------------ HF export
@pytest.mark.parametrize("gpt,hybrid", [("gpt2_tp1", "gpt2_tp1_h"), ("gpt0_tp1", "gpt0_tp1_h"),
                                        ("hyb_tp2_g", "hyb_tp2"), ("gptarms_tp2", "gptarms_tp2_h")])
def test_hf_export_of_a_hybrid_checkpoint_is_the_gpt_export(work, tmp_path, gpt, hybrid):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from mixln_megatron.convert import convert_to_hf

    d, _ = work
    sg = convert_to_hf(f"{d}/{gpt}", str(tmp_path / "g"), progress=False)
    sh = convert_to_hf(f"{d}/{hybrid}", str(tmp_path / "h"), progress=False)
    assert (sg["model_kind"], sh["model_kind"]) == ("gpt", "hybrid")
    assert json.load(open(tmp_path / "g" / "config.json")) == json.load(open(tmp_path / "h" / "config.json"))
    files = [sorted(glob.glob(str(tmp_path / x / "*.safetensors"))) for x in ("g", "h")]
    assert [os.path.basename(f) for f in files[0]] == [os.path.basename(f) for f in files[1]]
    for a, b in zip(*files):
        ta, tb = load_file(a), load_file(b)
        assert_same(ta, tb)
        assert open(a, "rb").read() == open(b, "rb").read()  # the files themselves too


def test_inspect_describes_a_hybrid_checkpoint(work, capsys):
    from mixln_megatron.convert.cli import main

    d, _ = work
    assert main(["inspect", "--load", f"{d}/hyb_tp2", "--json"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["model"] == "HybridModel" and info["hybrid_pattern"] == "*-*-*-*-"
    assert info["hybrid_layers"] == 8 and info["transformer_blocks"] == 4
    assert info["post_ln_layers"] == 2 and info["post_ln_blocks"] == [1, 2] and info["norm_keys"] == "mixln"
    assert main(["inspect", "--load", f"{d}/gpt0_tp1"]) == 0
    text = capsys.readouterr().out
    assert "model: GPTModel" in text and "post_ln_layers: 0" in text


# ------------------------------------------------------------------------------ analysis
def test_analysis_reads_a_hybrid_checkpoint_as_its_gpt_network(work, mcore_single):
    """The analysis loader reads a HybridModel checkpoint through convert's reader into the GPT
    model of the same network: the same weights and losses as its hybrid-to-gpt conversion."""
    from mixln_megatron.analysis.loading import load_megatron_checkpoint

    d, _ = work
    hybrid, gpt = load_megatron_checkpoint(f"{d}/hyb_tp2"), load_megatron_checkpoint(f"{d}/hyb_tp2_g")
    assert hybrid.placement.post_ln_layers == gpt.placement.post_ln_layers == 2
    assert hybrid.placement.num_layers == gpt.placement.num_layers == 4
    a, b = hybrid.module.state_dict(), gpt.module.state_dict()
    tensors = [k for k in a if torch.is_tensor(a[k]) and not k.endswith("_extra_state")]
    assert tensors and all(torch.equal(a[k], b[k]) for k in tensors)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        assert torch.equal(hybrid.token_losses(ids, labels), gpt.token_losses(ids, labels))
