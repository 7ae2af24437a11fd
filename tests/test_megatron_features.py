"""The Megatron-LM features a large run turns on, each trained against the plain run with the Mix-LN
layers, the spike scaler (scaling elements) and the telemetry (every step) all on.

Every run is `mixln-megatron pretrain` (Megatron-LM's own training loop) on CPU with gloo; one
launch trains the plain configuration and each feature configuration in turn, in one process
group (tests/workers/features_worker.py resets Megatron-LM's process-wide state between runs), so
the start-up is paid once. Each comparison also checks that the feature was really on: the
Megatron-LM arguments after validation, the model chunks' wrappers and DDP config, the optimizer,
the model config, and how often megatron's activation checkpointing ran.

docs/compatibility.md's support matrix names these tests (scripts/support_matrix.py keeps it current).
"""

import json
import math
import os

import pytest

from harness.testing import torchrun
from test_pretrain import TINY, same_checkpoint

WORKER = os.path.join(os.path.dirname(__file__), "workers", "features_worker.py")
pytestmark = pytest.mark.mp

ITERATIONS = 6
# The spike scaler acts from step 2 (threshold 2 is met by many elements of a tiny model), the
# telemetry logs every step; no evaluation (not what is compared here).
HOOKS = ["--mixln-alpha", "0.5", "--mixln-spike-scaler", "--mixln-spike-threshold", "2",
         "--mixln-spike-warmup-steps", "1", "--mixln-telemetry-interval", "1"]
BASE = ["--cpu", *TINY, *HOOKS, "--eval-iters", "0", "--eval-interval", "1000"]
PP2_VPP2 = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
DISTOPT = ["--use-distributed-optimizer"]
OVERLAP = [*DISTOPT, "--overlap-grad-reduce", "--overlap-param-gather"]
FULL_UNIFORM = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
FULL_BLOCK = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]
SELECTIVE = ["--recompute-granularity", "selective", "--recompute-modules", "mlp", "core_attn"]
# bf16 against fp32: the documented tolerance (bf16 rounds every activation and gradient).
BF16_LOSS_REL = 2e-3
BF16_TELEMETRY_REL = 0.15


def plan_dp2(workdir):
    """Data parallel 2: the optimizer, overlap, checkpointing, recompute and precision runs."""
    ckpt = lambda name: ["--ckpt-format", "torch_dist", "--save", str(workdir / name), "--save-interval", "3"]  # noqa: E731
    return [
        ("plain", [*BASE, *ckpt("ckpt_ddp")]),
        ("distopt", [*BASE, *DISTOPT, *ckpt("ckpt_serial"), "--no-ckpt-fully-parallel-save"]),
        ("overlap", [*BASE, *OVERLAP, *ckpt("ckpt_parallel")]),  # fully parallel save: Megatron-LM's default
        # Resuming the distributed optimizer needs Apex or TE (megatron-core's state_dict of torch's
        # Adam before its first step fails): the fully parallel load resumes the DDP run.
        ("resume", [*BASE, "--ckpt-format", "torch_dist", "--load", str(workdir / "ckpt_ddp"), "--ckpt-step", "3",
                    "--ckpt-fully-parallel-load"]),
        ("full_uniform", [*BASE, *FULL_UNIFORM]),
        ("full_block", [*BASE, *FULL_BLOCK]),
        ("selective", [*BASE, *SELECTIVE]),
        ("bf16", [*BASE, "--bf16"]),
    ]


def plan_pp2_vpp2(workdir):
    """Pipeline 2 x virtual pipeline 2: recompute where each rank holds two chunks."""
    return [("pp_plain", [*BASE, *PP2_VPP2]), ("pp_full_uniform", [*BASE, *PP2_VPP2, *FULL_UNIFORM]),
            ("pp_selective", [*BASE, *PP2_VPP2, *SELECTIVE])]


def plan_tp2_sp_dp2(workdir):
    """Tensor parallel 2 with sequence parallelism x data parallel 2 (4 ranks)."""
    return [("tp_plain", [*BASE, *TP2_SP]), ("tp_distopt", [*BASE, *TP2_SP, *DISTOPT]),
            ("tp_overlap", [*BASE, *TP2_SP, *OVERLAP]), ("tp_full_block", [*BASE, *TP2_SP, *FULL_BLOCK]),
            ("tp_selective", [*BASE, *TP2_SP, *SELECTIVE]), ("tp_bf16", [*BASE, *TP2_SP, "--bf16"])]


def launch(workdir, nproc, plan):
    with open(workdir / "plan.json", "w") as f:
        json.dump([[name, argv] for name, argv in plan], f)
    proc = torchrun(WORKER, nproc, "--workdir", workdir, timeout=900)
    (workdir / "launch.log").write_text(proc.stdout + proc.stderr)
    return Runs(workdir)


class Runs:
    """What each run of a launch left: losses, telemetry records, and what it used."""

    def __init__(self, workdir):
        self.workdir = workdir

    def losses(self, name) -> dict:
        with open(self.workdir / f"{name}.loss.json") as f:
            return {t["iteration"]: t["loss"] for t in json.load(f)["train"]}

    def telemetry(self, name) -> list:
        with open(self.workdir / f"{name}.telemetry.jsonl") as f:
            return [json.loads(line) for line in f]

    def used(self, name) -> dict:
        with open(self.workdir / f"{name}.used.json") as f:
            return json.load(f)

    def assert_identical(self, name, reference):
        """Losses and telemetry records (gradient norms, the spike scaler's counts) bit for bit."""
        assert sorted(self.losses(reference)) == list(range(1, ITERATIONS + 1))
        assert self.losses(name) == self.losses(reference), f"{name} vs {reference}"
        records, expected = self.telemetry(name), self.telemetry(reference)
        assert len(records) == len(expected) == ITERATIONS
        assert records == expected, f"{name} vs {reference}: telemetry differs"

    def assert_hooks_were_on(self, name):
        """The comparison would be empty without them: the scaler scaled elements, telemetry logged."""
        records = self.telemetry(name)
        assert [r["step"] for r in records] == list(range(1, len(records) + 1))
        assert records[-1]["spike"]["scaled"] > 0, records[-1]["spike"]
        assert records[-1]["layer_kinds"] == ["post", "post", "pre", "pre"]


def telemetry_rows(record) -> list:
    return [*record["layer_grad_norm"], *record["norm1_grad_norm"], *record["norm2_grad_norm"],
            record["post_ln_group_grad_norm"], record["pre_ln_group_grad_norm"]]


def assert_close_rows(records, expected, rel, what):
    assert len(records) == len(expected)
    for step, (a, b) in enumerate(zip(records, expected), start=1):
        for x, y in zip(telemetry_rows(a), telemetry_rows(b)):
            assert math.isfinite(x) and abs(x - y) <= rel * abs(y), f"{what} step {step}: {x} vs {y}"


# ------------------------------------------------------------------ default tier: one 2-rank launch
@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("features")
    return launch(workdir, 2, plan_dp2(workdir) + plan_pp2_vpp2(workdir))


def test_plain_run_had_its_hooks_on(dp2):
    dp2.assert_hooks_were_on("plain")
    used = dp2.used("plain")
    assert used["wrappers"] == ["DistributedDataParallel"] and used["inner_optimizers"] == ["FP32Optimizer"]
    assert used["args"]["data_parallel_size"] == 2 and used["checkpoint_calls"] == 0


def test_distributed_optimizer_within_float_rounding_of_ddp(dp2):
    """Sharded optimizer: the same updates; the clipping norm and the telemetry sum each rank's
    shard first, so the sums round differently (a few fp32 ulps)."""
    used = dp2.used("distopt")
    assert used["inner_optimizers"] == ["DistributedOptimizer"] and used["ddp_config"]["use_distributed_optimizer"]
    plain, sharded = dp2.losses("plain"), dp2.losses("distopt")
    assert sharded[1] == plain[1]  # before the first update: the same forward
    assert sharded == pytest.approx(plain, rel=1e-6)
    assert_close_rows(dp2.telemetry("distopt"), dp2.telemetry("plain"), 1e-6, "distopt")
    assert [r["spike"]["scaled"] for r in dp2.telemetry("distopt")] == [r["spike"]["scaled"] for r in dp2.telemetry("plain")]


def test_overlap_grad_reduce_and_param_gather_equal_the_distributed_optimizer(dp2):
    dp2.assert_identical("overlap", "distopt")
    on, off = dp2.used("overlap")["ddp_config"], dp2.used("distopt")["ddp_config"]
    assert on["overlap_grad_reduce"] and on["overlap_param_gather"] and on["use_distributed_optimizer"]
    assert not off["overlap_grad_reduce"] and not off["overlap_param_gather"]


def test_fully_parallel_save_writes_the_serial_save_bit_for_bit(dp2):
    """Megatron-LM's default fully parallel save (each DP rank writes a share) against
    --no-ckpt-fully-parallel-save, of the two bit-identical runs above."""
    assert dp2.used("overlap")["args"]["ckpt_fully_parallel_save"] is True
    assert dp2.used("distopt")["args"]["ckpt_fully_parallel_save"] is False
    compared = same_checkpoint(dp2.workdir / "ckpt_serial" / "iter_0000003", dp2.workdir / "ckpt_parallel" / "iter_0000003")
    assert any("optimizer" in key for key in compared["tensors"]), sorted(compared["tensors"])[:10]
    assert any("spike" in key for key in compared["tensors"] + compared["objects"]), "the scaler's state is not saved"


def test_fully_parallel_load_resumes_bit_for_bit(dp2):
    assert dp2.used("resume")["args"]["ckpt_fully_parallel_load"] is True
    resumed, uninterrupted = dp2.losses("resume"), dp2.losses("plain")
    assert sorted(resumed) == [4, 5, 6]
    assert resumed == {i: uninterrupted[i] for i in (4, 5, 6)}
    after = dp2.telemetry("resume")
    assert [telemetry_rows(r) for r in after] == [telemetry_rows(r) for r in dp2.telemetry("plain")[3:]]


@pytest.mark.parametrize("name, granularity, method", [("full_uniform", "full", "uniform"), ("full_block", "full", "block")])
def test_full_recompute_equals_the_plain_run(dp2, name, granularity, method):
    dp2.assert_identical(name, "plain")
    used = dp2.used(name)
    assert (used["config"]["recompute_granularity"], used["config"]["recompute_method"]) == (granularity, method)
    # uniform, 1 layer per group: every layer of every micro-batch; block 1: the first layer only
    per_step = 4 if method == "uniform" else 1
    assert used["checkpoint_calls"] == ITERATIONS * per_step, used["checkpoint_calls"]


def test_selective_recompute_of_mlp_and_core_attention_equals_the_plain_run(dp2):
    dp2.assert_identical("selective", "plain")
    used = dp2.used("selective")
    assert used["config"]["recompute_granularity"] == "selective"
    assert used["config"]["recompute_modules"] == ["mlp", "core_attn"]
    assert used["checkpoint_calls"] == ITERATIONS * 4 * 2  # each layer's MLP and core attention


def test_recompute_under_pipeline_and_virtual_pipeline_equals_the_plain_run(dp2):
    dp2.assert_hooks_were_on("pp_plain")
    for name in ("pp_full_uniform", "pp_selective"):
        dp2.assert_identical(name, "pp_plain")
        used = dp2.used(name)
        assert used["chunks"] == 2 and used["config"]["virtual_pipeline_model_parallel_size"] == 2
        assert used["checkpoint_calls"] > 0


def test_bf16_trains_with_the_hooks_within_tolerance(dp2):
    used = dp2.used("bf16")
    assert used["wrappers"] == ["DistributedDataParallel", "Float16Module"]
    assert used["config"]["bf16"] and used["config"]["params_dtype"] == "torch.bfloat16"
    dp2.assert_hooks_were_on("bf16")
    plain, bf16 = dp2.losses("plain"), dp2.losses("bf16")
    assert bf16 != plain  # really another precision
    assert bf16 == pytest.approx(plain, rel=BF16_LOSS_REL)
    assert_close_rows(dp2.telemetry("bf16"), dp2.telemetry("plain"), BF16_TELEMETRY_REL, "bf16")


# ------------------------------------------------------------------ slow: TP2 + SP x DP2, 4 ranks
@pytest.mark.slow
def test_tensor_and_sequence_parallel_with_every_feature(tmp_path):
    runs = launch(tmp_path, 4, plan_tp2_sp_dp2(tmp_path))
    runs.assert_hooks_were_on("tp_plain")
    assert runs.used("tp_plain")["config"]["sequence_parallel"] is True
    assert runs.losses("tp_distopt") == pytest.approx(runs.losses("tp_plain"), rel=1e-6)
    runs.assert_identical("tp_overlap", "tp_distopt")
    runs.assert_identical("tp_full_block", "tp_plain")
    runs.assert_identical("tp_selective", "tp_plain")
    assert runs.losses("tp_bf16") == pytest.approx(runs.losses("tp_plain"), rel=BF16_LOSS_REL)
    assert runs.used("tp_overlap")["ddp_config"]["overlap_param_gather"]
    assert runs.used("tp_full_block")["checkpoint_calls"] > 0


# ------------------------------------------------------------------ selective `layernorm` recompute
def test_layernorm_recompute_covers_the_pre_ln_norms_only(mcore_single):
    """megatron's `--recompute-modules layernorm` checkpoints a layer's input and pre-MLP norms;
    a Post-LN layer has neither (its N1 / N2 come after the residual adds) and recomputes no norm.
    (Running it needs TransformerEngine and a GPU: megatron-core's CheckpointWithoutOutput always
    takes its fp8 path, docs/compatibility.md.)"""
    from harness import testing as mu

    config = mu.tiny_config(recompute_granularity="selective", recompute_modules=["layernorm"])
    model = mu.build_gpt(config, mu.mixln_spec(config, post_ln_layers=2, vp_stage=None))
    layers = list(model.decoder.layers)
    assert [layer.kind for layer in layers] == ["post", "post", "pre", "pre"]
    assert [(layer.recompute_input_layernorm, layer.recompute_pre_mlp_layernorm) for layer in layers] == \
        [(False, False), (False, False), (True, True), (True, True)]
