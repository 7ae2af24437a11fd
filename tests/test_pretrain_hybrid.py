"""HybridModel pretraining with Mix-LN, on CPU with gloo.

Two ways in, both Megatron-LM's training loop:
  - the project's entry point, `mixln-megatron pretrain --hybrid-layer-pattern "*-*-..."`;
  - Megatron-LM's own hybrid path (pretrain_hybrid.py on 0.19: hybrid_config_from_args imports
    `--spec mixln_megatron.spec mixln_hybrid_local_stack_spec`), tests/workers/hybrid_pretrain_megatron_lm.py.
Runs are subprocesses (one pretrain() per process), compared per iteration from --loss-log
records; helpers and the tiny shape are test_pretrain.py's.
"""

import json
import math
import os
import re
import signal
import sys

import pytest

from harness.testing import start_python
from mixln_megatron import compat
from harness import testing as mu

from test_pretrain import REPO, TINY, _env, finish, losses, start, train

needs_hybrid = pytest.mark.skipif(not compat.HYBRID_MODEL, reason="Mix-LN on HybridModel needs megatron-core 0.19+")

WORKER = os.path.join(REPO, "tests", "workers", "hybrid_pretrain_megatron_lm.py")


def _without_num_layers(flags):
    """TINY less --num-layers: a hybrid run's depth is its pattern's length (Megatron-LM derives it)."""
    i = flags.index("--num-layers")
    return flags[:i] + flags[i + 2:]


HYBRID_TINY = _without_num_layers(TINY)  # 6 iterations, dropout on (Megatron's 0.1 defaults)
BUILD_LINE = "[mixln_megatron] scheme=mixln L=2 P=1 alpha=n/a (P given directly)"


# ------------------------------------------------------------------ the entry point: trains, equals GPT, resumes
@needs_hybrid
@pytest.mark.compat
def test_hybrid_pretrain_equals_gpt_also_across_a_resume(tmp_path):
    """`*-*-` with P = 1 of L = 2 trains the GPTModel Mix-LN network: with the same seed and shape
    every training and validation loss is the GPT run's (same initialisation: Megatron draws the
    weights in the same order and scales the output-layer init by 2L layers x 1 for a hybrid model,
    as by L x 2 for GPT; dropout on). The hybrid run saves at 3, exits, and resumes from its
    torch_dist checkpoint, so iterations 4-6 also show that the resume continues exactly."""
    mix = ["--cpu", *HYBRID_TINY, "--mixln-post-ln-layers", "1"]
    ckpt = tmp_path / "ckpt"
    gpt = start([*mix, "--num-layers", "2", "--loss-log", str(tmp_path / "gpt.json")])
    part1 = start([*mix, "--hybrid-layer-pattern", "*-*-", "--loss-log", str(tmp_path / "p1.json"),
                   "--save", str(ckpt), "--save-interval", "3", "--exit-interval", "3", "--ckpt-format", "torch_dist"])
    out_gpt, out1 = finish(gpt), finish(part1)
    # The resumed run takes the pattern from the checkpoint (--use-checkpoint-args), not the command line.
    out2 = train([*mix, "--loss-log", str(tmp_path / "p2.json"), "--load", str(ckpt), "--use-checkpoint-args",
                  "--ckpt-format", "torch_dist"])
    assert "successfully loaded checkpoint" in out2 or "loading distributed checkpoint from" in out2

    rec_gpt, gpt_losses = losses(tmp_path / "gpt.json")
    rec1, p1 = losses(tmp_path / "p1.json")
    rec2, p2 = losses(tmp_path / "p2.json")
    assert sorted(gpt_losses) == [1, 2, 3, 4, 5, 6] and sorted(p1) == [1, 2, 3] and sorted(p2) == [4, 5, 6]
    hybrid_losses = {**p1, **p2}
    assert all(math.isfinite(v) for v in hybrid_losses.values()) and hybrid_losses[6] < hybrid_losses[1]
    for it in range(1, 7):
        assert hybrid_losses[it] == pytest.approx(gpt_losses[it], rel=1e-6, abs=0), it
    hybrid_evals = [e["loss"] for e in rec1["eval"] + rec2["eval"]]  # valid at 3 | valid at 6, final valid, test
    assert hybrid_evals == pytest.approx([e["loss"] for e in rec_gpt["eval"]], rel=1e-6)
    assert len(hybrid_evals) == 4

    # What trained: HybridModel with 2L = 4 layers, P = 1 block (hybrid layers 1 and 2) Post-LN.
    for record in (rec1, rec2):
        assert record["hybrid_layer_pattern"] == "*-*-" and record["num_layers"] == 4
        assert record["mixln"]["num_layers"] == 2 and record["mixln"]["post_ln_layer_numbers"] == [1]
    assert rec_gpt["hybrid_layer_pattern"] is None and rec_gpt["num_layers"] == 2
    for out in (out1, out2):
        assert out.count(BUILD_LINE + " (from --mixln-post-ln-layers); Post-LN layers: 1") == 1
        assert out.count("> building Mix-LN Hybrid model '*-*-' (backend local)") == 1
    assert "ignoring --num-layers" not in out1
    assert "> building Mix-LN GPT model" in out_gpt and "> building Mix-LN Hybrid model" not in out_gpt

    # The checkpoint is HybridStack's: per-layer keys; block 1 Post-LN (N1 in layer 0 as norm_b, N2
    # in layer 1 as norm_a), block 2 Pre-LN (attention norm in layer 2 as norm_a, MLP norm in 3 as norm_b).
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(ckpt / "iter_0000003")).read_metadata().state_dict_metadata
    norms = sorted(k for k in keys if re.fullmatch(r"decoder\.(layers\.\d+\.mixln_norm_[ab]|final_norm)\.weight", k))
    assert norms == ["decoder.final_norm.weight", "decoder.layers.0.mixln_norm_b.weight",
                     "decoder.layers.1.mixln_norm_a.weight", "decoder.layers.2.mixln_norm_a.weight",
                     "decoder.layers.3.mixln_norm_b.weight"]


# ------------------------------------------------------------------ Megatron-LM's own hybrid path (--spec)
PP2_FLAGS = [*HYBRID_TINY, "--hybrid-layer-pattern", "*-|*-", "--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def megatron_lm_pp2():
    """pretrain_hybrid.py's model path at PP2 (`*-|*-`), settings from MIXLN_POST_LN_LAYERS (stock
    Megatron-LM has no --mixln-* flags): ({rank: RESULT record}, the run's output)."""
    proc = mu.torchrun(WORKER, 2, *PP2_FLAGS, "--spec", "mixln_megatron.spec", "mixln_hybrid_local_stack_spec",
                       env={"MIXLN_POST_LN_LAYERS": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
                       timeout=300)
    records = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return {record["rank"]: record for record in records}, proc.stdout + proc.stderr


@needs_hybrid
@pytest.mark.mp
def test_megatron_lm_hybrid_path_builds_the_mixln_stack_and_trains(megatron_lm_pp2):
    """One build line across both ranks; each stage is the Mix-LN stack with its own blocks (block
    1 Post-LN on stage 0, block 2 Pre-LN and the final norm on stage 1); 6 iterations train."""
    results, out = megatron_lm_pp2
    assert sorted(results) == [0, 1], out[-3000:]
    assert out.count(BUILD_LINE + " (from MIXLN_POST_LN_LAYERS); Post-LN layers: 1") == 1

    def stage(rank):
        (chunk,) = results[rank]["chunks"]
        assert chunk["stack"] == "MixLNHybridStack"
        return chunk["final_norm"], [(l["class"], l["layer_number"], l["hybrid_part"], l["block"], l["is_post_ln"])
                                     for l in chunk["layers"]]

    assert stage(0) == (None, [("MixLNTransformerLayer", 1, "attention", 1, True),
                               ("MixLNTransformerLayer", 2, "mlp", 1, True)])
    assert stage(1) == ("MixLNNorm", [("MixLNTransformerLayer", 3, "attention", 2, False),
                                      ("MixLNTransformerLayer", 4, "mlp", 2, False)])
    trained = {t["iteration"]: t["loss"] for t in results[1]["train"]}
    assert sorted(trained) == [1, 2, 3, 4, 5, 6], results[1]
    assert all(math.isfinite(v) for v in trained.values()) and trained[6] < trained[1]


@needs_hybrid
@pytest.mark.mp
def test_megatron_lm_hybrid_path_trains_the_comparison_arms():
    """pretrain_hybrid.py's model path at PP2 with MIXLN_LAYOUT=deepnorm:1,sandwich:2: block 1
    (stage 0) is DeepNorm, block 2 (stage 1) Sandwich-LN with N_b in its `*` layer and N_d in its
    `-` layer; one build line; 6 iterations train."""
    proc = mu.torchrun(WORKER, 2, *PP2_FLAGS, "--spec", "mixln_megatron.spec", "mixln_hybrid_local_stack_spec",
                       env={"MIXLN_LAYOUT": "deepnorm:1,sandwich:2", "OMP_NUM_THREADS": "1",
                            "PYTHONWARNINGS": "ignore"}, timeout=300)
    out = proc.stdout + proc.stderr
    results = {r["rank"]: r for r in (json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
                                      if line.startswith("RESULT "))}
    assert sorted(results) == [0, 1], out[-3000:]
    assert out.count("[mixln_megatron] scheme=mixln L=2 layout=deepnorm:1,sandwich:2 (from MIXLN_LAYOUT)") == 1
    layers = [(l["layer_number"], l["kind"], l["is_post_ln"], l["sandwich_norms"])
              for rank in (0, 1) for l in results[rank]["chunks"][0]["layers"]]
    assert layers == [(1, "deepnorm", True, []), (2, "deepnorm", True, []),
                      (3, "sandwich", False, ["attn_output_layernorm"]), (4, "sandwich", False, ["mlp_output_layernorm"])]
    trained = {t["iteration"]: t["loss"] for t in results[1]["train"]}
    assert sorted(trained) == [1, 2, 3, 4, 5, 6], results[1]
    assert all(math.isfinite(v) for v in trained.values()) and trained[6] < trained[1]


@needs_hybrid
@pytest.mark.slow
@pytest.mark.mp
def test_megatron_lm_hybrid_path_trains_like_the_entry_point(megatron_lm_pp2, tmp_path):
    """The same PP2 run through `mixln-megatron pretrain` (settings from --mixln-post-ln-layers, the
    model from hybrid_model_provider) gives the same losses at every iteration."""
    results, _ = megatron_lm_pp2
    megatron_lm = {t["iteration"]: t["loss"] for t in results[1]["train"]}
    out = train(["--cpu", *PP2_FLAGS, "--mixln-post-ln-layers", "1", "--loss-log", str(tmp_path / "ep.json")], nproc=2)
    assert out.count(BUILD_LINE + " (from --mixln-post-ln-layers); Post-LN layers: 1") == 1
    _, entry_point = losses(tmp_path / "ep.json")
    assert sorted(entry_point) == sorted(megatron_lm) == [1, 2, 3, 4, 5, 6]
    for it in range(1, 7):
        assert megatron_lm[it] == pytest.approx(entry_point[it], rel=1e-6, abs=0), it


# ------------------------------------------------------------------ patterns Mix-LN does not define
def _error_lines(out):
    return [line for line in out.splitlines() if "[mixln_megatron] ERROR:" in line]


BAD_PATTERNS = [
    ("*-M-", "layer 3 is 'M' (Mamba), which Mix-LN does not support yet"),
    ("**--", "layer 2 is '*' where '-' belongs"),
    ("*-*", "has 3 layers, not whole blocks"),
    ("*-*-/*-", "multi-token-prediction layers ('/')"),
]


@needs_hybrid
@pytest.mark.parametrize("pattern, why", BAD_PATTERNS)
def test_check_hybrid_args_names_the_problem(pattern, why):
    from argparse import Namespace

    from mixln_megatron.training.pretrain import MixLNHybridUnsupported, check_hybrid_args

    with pytest.raises(MixLNHybridUnsupported, match=re.escape(why)):
        check_hybrid_args(Namespace(hybrid_layer_pattern=pattern))
    with pytest.raises(MixLNHybridUnsupported, match=re.escape(why)):  # the deprecated spelling
        check_hybrid_args(Namespace(hybrid_layer_pattern=None, hybrid_override_pattern=pattern))
    check_hybrid_args(Namespace(hybrid_layer_pattern="*-|*-*-"))
    check_hybrid_args(Namespace(hybrid_layer_pattern=None))  # a GPT run


def test_hybrid_needs_a_release_with_hybrid_model(monkeypatch):
    from argparse import Namespace

    from mixln_megatron.training.pretrain import MixLNHybridUnsupported, check_hybrid_args

    monkeypatch.setattr(compat, "HYBRID_MODEL", False)
    with pytest.raises(MixLNHybridUnsupported, match="needs megatron-core 0.19 or newer"):
        check_hybrid_args(Namespace(hybrid_layer_pattern="*-*-"))


@pytest.mark.compat
@pytest.mark.skipif(compat.HYBRID_MODEL, reason="this release has HybridModel (the branch: test_hybrid_needs_a_release_with_hybrid_model)")
def test_entry_point_on_a_release_without_hybrid_model_is_one_line():
    out = finish(start(["--cpu", *HYBRID_TINY, "--hybrid-layer-pattern", "*-*-"], torchrun=False), timeout=200,
                 expect_rc=2)
    (line,) = _error_lines(out)
    assert line.startswith("[mixln_megatron] ERROR: Mix-LN on HybridModel needs megatron-core 0.19 or newer")
    assert "initializing torch distributed" not in out


@needs_hybrid
def test_bad_pattern_is_one_line_and_exit_2_before_anything_is_built():
    procs = [start(["--cpu", *HYBRID_TINY, "--hybrid-layer-pattern", pattern], torchrun=False)
             for pattern, _ in BAD_PATTERNS[:2]]
    for proc, (pattern, why) in zip(procs, BAD_PATTERNS[:2]):
        out = finish(proc, timeout=200, expect_rc=2)
        (line,) = _error_lines(out)
        assert line.startswith(f"[mixln_megatron] ERROR: the hybrid pattern {pattern!r}: {why}")
        assert "initializing torch distributed" not in out and "building" not in out


@needs_hybrid
@pytest.mark.mp
def test_bad_pattern_is_printed_once_across_ranks():
    """Two ranks under `python -m torch.distributed.run`, through the tests' forked ranks
    (dev/forked_ranks.py stands in for torchrun: torchrun's environment and rendezvous, the first
    rank to fail gets the others a SIGTERM, status 1 as torchrun's): the line once across the
    ranks, the first rank to leave left with exit status 2, nothing was built. Torchrun's own
    failure summary of such a refusal (`Root Cause ... exitcode : 2`, no rank's traceback) is
    checked with the real torchrun in test_errors.py::test_the_line_survives_when_rank_0_is_the_slow_one
    (the same errors.report / refusal path)."""
    from harness import forked_ranks

    proc = start_python(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "mixln_megatron.training.pretrain", "--cpu", *HYBRID_TINY, "--hybrid-layer-pattern", "*-M-"],
        env=_env(), cwd=REPO)
    stdout, stderr = proc.communicate(timeout=200)
    out = stdout + stderr
    assert proc.returncode != 0, out[-3000:]
    assert len(_error_lines(out)) == 1, out[-3000:]
    assert "initializing torch distributed" not in out and "building" not in out, out[-3000:]
    if isinstance(proc, forked_ranks.Started):
        assert proc.returncode == 1, proc.returncode  # torchrun's own status when a worker failed
        # Whichever rank left first (errors.report: the line is printed before any rank of the
        # node exits) left with 2, torchrun's Root Cause; each other rank refused too (2) or was
        # stopped by the launcher's SIGTERM after that first exit.
        assert proc.first_failure == 2, (proc.first_failure, out[-3000:])
        statuses = proc.exit_statuses
        assert len(statuses) == 2 and 2 in statuses, statuses
        assert set(statuses) <= {2, -signal.SIGTERM}, statuses
    else:  # a fresh torchrun (an environment the fork server cannot serve): its own summary
        assert "exitcode  : 2" in out.split("Root Cause")[1], out[-3000:]
