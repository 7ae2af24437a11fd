"""`analyze train-health` reads the telemetry JSONL and draws the heatmap and boundary chart."""

import json

import pytest

from mixln_megatron.analysis import train_health


def write_records(path, steps, partial_last_line=False):
    with open(path, "w") as f:
        for step in steps:
            record = {
                "step": step, "num_layers": 4, "post_ln_layers": 1, "scheme": "mixln",
                "layer_grad_norm": [0.1 * step, 0.2, 0.3, 0.4],
                "norm1_grad_norm": [0.01, 0.02, 0.03, 0.04], "norm2_grad_norm": [0.05, 0.06, 0.07, 0.08],
                "post_ln_group_grad_norm": 0.1 * step, "pre_ln_group_grad_norm": 0.5,
                "spike": {"scaled": step % 3, "max_ratio": 1.5},
            }
            f.write(json.dumps(record) + "\n")
        if partial_last_line:
            f.write('{"step": 99, "num_la')


def test_heatmap_and_boundary_chart(tmp_path):
    write_records(tmp_path / "mixln_telemetry.jsonl", [10, 20, 30, 20], partial_last_line=True)
    assert train_health.main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "train_health.json").read_text())
    assert summary["steps"] == [10, 20, 30]  # repeated step (a resume) kept once, partial line ignored
    assert summary["boundary"]["layer1_norm2"] == [0.05] * 3
    assert summary["boundary"]["layer2_norm1"] == [0.02] * 3
    assert summary["spike"]["scaled"] == [1, 2, 0]
    for name in ("train_health_heatmap.png", "train_health_boundary.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


def test_missing_telemetry_says_how_to_enable_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="--mixln-telemetry-interval"):
        train_health.main([str(tmp_path)])


def test_every_boundary_of_a_layout_is_charted(tmp_path):
    """A layout with Post-LN layers 2 and 4 of 5 has two boundaries, 2|3 and 4|5 (model.layout)."""
    with open(tmp_path / "mixln_telemetry.jsonl", "w") as f:
        for step in (1, 2):
            f.write(json.dumps({
                "step": step, "num_layers": 5, "post_ln_layers": 2, "scheme": "mixln",
                "layer_kinds": ["pre", "post", "pre", "deepnorm", "sandwich"],
                "layer_grad_norm": [0.1, 0.2, 0.3, 0.4, 0.5],
                "norm1_grad_norm": [0.01, 0.02, 0.03, 0.04, 0.05], "norm2_grad_norm": [0.6, 0.7, 0.8, 0.9, 1.0],
            }) + "\n")
    assert train_health.main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "train_health.json").read_text())
    assert summary["boundaries"] == [[2, 3], [4, 5]]
    assert sorted(summary["boundary"]) == sorted(f"layer{n}_norm{k}" for n in (2, 3, 4, 5) for k in (1, 2))
    assert summary["boundary"]["layer4_norm2"] == [0.9, 0.9] and "layer1_norm1" not in summary["boundary"]
