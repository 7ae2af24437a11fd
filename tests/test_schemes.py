"""The paper's comparison: the arm table (analysis.arms) and benchmarks/schemes.py end to end."""

import json
import math
import os
import sys

import pytest

from harness.testing import run_python
from mixln_megatron.analysis import arms
from mixln_megatron.model.placement import resolve_placement

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("layers, alpha", [(12, 0.25), (24, 0.25), (32, 0.0625), (4, 0.25)])
def test_every_arm_is_a_valid_layout_at_the_depths_the_launchers_use(layers, alpha):
    for arm in arms.ARMS:
        placement = resolve_placement(layers, arm.settings(layers, alpha))
        assert len(placement.kinds) == layers
    p = math.floor(alpha * layers)
    kinds = {arm.name: resolve_placement(layers, arm.settings(layers, alpha)).kinds for arm in arms.ARMS}
    assert kinds["mix_ln"] == ("post",) * p + ("pre",) * (layers - p)
    assert kinds["mix_deepnorm"] == ("deepnorm",) * p + ("pre",) * (layers - p)
    assert kinds["pre_post"][-p:] == ("post",) * p and set(kinds["pre_post"][:-p]) == {"pre"}
    assert set(kinds["sandwich"]) == {"sandwich"} and set(kinds["deepnorm"]) == {"deepnorm"}


def test_the_authors_deepnorm_arm_has_their_constants_and_deepnet_s_has_deepnet_s():
    theirs = resolve_placement(24, arms.ARM_BY_NAME["deepnorm_authors"].settings(24))
    ours = resolve_placement(24, arms.ARM_BY_NAME["deepnorm"].settings(24))
    assert theirs.deepnorm_alpha == 2.8284271247461903 and theirs.deepnorm_beta == pytest.approx(192 ** 0.25)
    assert ours.deepnorm_alpha == pytest.approx(48 ** 0.25) and ours.deepnorm_beta == pytest.approx(192 ** -0.25)


def test_the_arm_cli_prints_exports_the_settings_read_back(capsys):
    from mixln_megatron.model.settings import MixLNSettings

    assert arms.main(["--num-layers", "32", "--mixln-alpha", "0.0625", "mix_deepnorm"]) == 0
    lines = capsys.readouterr().out.splitlines()
    env = dict(line[len("export "):].split("=", 1) for line in lines)
    env = {k: v.strip("'") for k, v in env.items()}
    assert env == {"MIXLN_LAYOUT": "deepnorm:1-2,pre:*", "MIXLN_SCHEME": "mixln"}
    placement = resolve_placement(32, MixLNSettings.from_environ(env))
    assert placement.kinds[:3] == ("deepnorm", "deepnorm", "pre")


def test_one_command_writes_the_table_the_plot_and_every_run(tmp_path):
    """A tiny run of benchmarks/schemes.py: three arms and one MoE arm, 4 layers, 3 steps, one job."""
    out = tmp_path / "out"
    proc = run_python(
        [sys.executable, os.path.join(REPO, "benchmarks", "schemes.py"), "--quick", "--depths", "4", "--steps", "3",
         "--arms", "mix_deepnorm,sandwich,post_every4", "--moe", "mix_ln", "--jobs", "1", "--out", str(out),
         "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("RESULT schemes_ppl_L4_mix_deepnorm=")
    table = (out / "schemes_quick.md").read_text()
    for text in ("`deepnorm:1,pre:2-4`", "`sandwich:1-4`", "`pre:1-3,post:4`", "| 1\\|2 |"):
        assert text in table, table
    assert (out / "schemes_quick.png").stat().st_size > 10_000
    record = json.loads((out / "schemes_quick.json").read_text())
    rows = record["summary"]["rows"]
    assert set(rows) == {"L4_mix_deepnorm", "L4_sandwich", "L4_post_every4", "L4_moe_mix_ln"}
    moe = rows["L4_moe_mix_ln"]  # the MoE arm: in the same table, its own row, its layout
    assert moe["moe"] and not rows["L4_sandwich"]["moe"] and moe["layout"] == "post:1,pre:2-4"
    assert "| 4 | Mix-LN (Post-LN first alpha*L) (MoE) | `post:1,pre:2-4` | 1\\|2 |" in table, table
    assert record["setup"]["moe_arms"] == ["mix_ln"]
    for row in rows.values():
        assert len(row["grad_norm_profiles"]["0"]["mean"]) == 4  # one value per layer at initialisation
    # same seed policy: every arm trained on the same batches from the same seed
    assert {run["seed"] for runs in record["runs"].values() for run in runs} == {1}
    assert proc.stdout.count("valid PPL") == 4
    # a saved run's table prints again without training
    again = run_python([sys.executable, os.path.join(REPO, "benchmarks", "schemes.py"), "--report",
                            str(out / "schemes_quick.json")], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and table.strip() in again.stdout, again.stderr[-2000:]


def test_the_moe_arms_build_megatron_moe_layers_after_a_dense_first_layer(mcore_single):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import schemes

    from mixln_megatron.analysis.models import FreshShape, build_megatron_gpt

    shape = FreshShape(num_layers=4, hidden_size=32, num_attention_heads=2, vocab_size=256, seq_length=16)
    overrides = schemes.moe_overrides(shape)
    lm = build_megatron_gpt(shape, settings=arms.ARM_BY_NAME["mix_ln"].settings(4), config_overrides=overrides)
    mlps = [layer.mlp for layer in lm.layers]
    assert type(mlps[0]).__name__ == "MLP" and all(type(m).__name__ == "MoELayer" for m in mlps[1:])
    assert len(mlps[1].experts.local_experts) == 4 and mlps[1].router.topk == 2
    assert mlps[1].experts.local_experts[0].linear_fc2.weight.shape == (32, shape.ffn // 2)
    assert lm.module.config.moe_token_dispatcher_type == "allgather"
    assert lm.placement.kinds == ("post", "pre", "pre", "pre")
