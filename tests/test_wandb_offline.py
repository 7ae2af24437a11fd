"""What Weights & Biases keeps of our reports, read back from a real offline run.

Megatron-LM (with TensorBoard on) logs to W&B every iteration at step=iteration, and W&B drops
any log below its current step. The spike scaler reports the rows of a whole logging interval at
once, and telemetry writes its records mid-iteration; this drives them the way Megatron-LM's
loop does, with the real `wandb` package in offline mode (no network), then reads the run's
`.wandb` file back and checks that every row reached the history.

The `.wandb` file is wandb's transaction log: a 7-byte header (`:W&B`, a 2-byte magic, a version
byte), then records in the LevelDB log layout (32 KiB blocks; each chunk a 7-byte header
crc32c:u32 length:u16 type:u8, type 1 full / 2 first / 3 middle / 4 last; block tails shorter
than a header are zero padding), each record a `wandb.proto.wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import sys
import types
from argparse import Namespace

import pytest
import torch

wandb = pytest.importorskip("wandb")

BLOCK = 32 * 1024
HEADER = 7  # both the file header and each chunk header


def read_records(path: str) -> list:
    """Every Record in a .wandb transaction log."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path} is not a .wandb transaction log"
    records, payload, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # padding at the end of a block
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0:  # zero padding (a preallocated tail)
            pos += left
            continue
        assert kind in (1, 2, 3, 4) and pos + HEADER + length <= len(data), (pos, kind, length)
        payload += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):  # full, or the last chunk of a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            records.append(record)
            payload = b""
    return records


def history(run_dir: str) -> dict:
    """{step: {key: value}} of what W&B kept in the run's history."""
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    rows = {}
    for record in read_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
        rows[record.history.step.num] = row
    return rows


class TensorBoard:  # Megatron-LM logs to W&B only when TensorBoard is on; not under test here
    def __init__(self):
        self.scalars = []

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))


INTERVAL, ITERATIONS, SKIPPED, TELEMETRY_EVERY = 4, 13, (7, 8), 3


def _row(it: int) -> list:
    return [float(it), 100.0 + it, float(it % 2)]  # scaled, max_ratio, nonfinite: one per iteration


def _megatron_globals(tensorboard, wandb_writer, args) -> types.ModuleType:
    """Megatron-LM's global_vars as training.runtime reads them (the real module costs a long
    import and holds nothing more that matters here)."""
    module = types.ModuleType("megatron.training.global_vars")
    module._GLOBAL_ARGS = args
    module.get_tensorboard_writer = lambda: tensorboard
    module.get_wandb_writer = lambda: wandb_writer
    return module


def test_wandb_keeps_every_spike_row_and_telemetry_record(tmp_path, monkeypatch):
    from mixln_megatron.training import telemetry
    from mixln_megatron.training.spike.rule import StepStats

    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
        os.makedirs(tmp_path / name.lower())
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="mixln-test", mode="offline", dir=str(tmp_path / "wandb_dir"),
                     settings=wandb.Settings(console="off", x_disable_stats=True, save_code=False))
    run_dir = os.path.dirname(run.settings.sync_file)
    tensorboard, args = TensorBoard(), Namespace(curr_iteration=0)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", _megatron_globals(tensorboard, wandb, args))
    reported, records = [], []
    try:
        stats = StepStats()
        for it in range(1, ITERATIONS + 1):  # Megatron-LM's train(): train_step, then training_log
            args.curr_iteration = it - 1
            if it % TELEMETRY_EVERY == 0:  # finalize_model_grads: the telemetry record
                record = {"step": it, "layer_grad_norm": [0.5 * it, 0.25 * it],
                          "post_ln_group_grad_norm": float(it), "pre_ln_group_grad_norm": None,
                          "spike": {"scaled": it}}
                telemetry.write_record(record, str(tmp_path / "telemetry.jsonl"))
                records.append(record)
            if it not in SKIPPED:  # the optimizer step committed: the scaler's row for it
                stats.slot_for(it, INTERVAL, lambda: torch.device("cpu")).copy_(torch.tensor(_row(it)))
            if it % INTERVAL == 0:  # the scaler counts optimizer steps, skipped ones too
                reported += stats.report([])
            wandb.log({"lm loss": 1.0 / it}, it)  # training_log, every iteration
    finally:
        wandb.finish()
        wandb.teardown()

    kept = history(run_dir)
    assert sorted(kept) == list(range(1, ITERATIONS + 1))
    assert all(kept[it]["lm loss"] == pytest.approx(1.0 / it) for it in kept)  # Megatron's own rows stay

    # Every spike row, from each report, is in W&B's history (reports at 4, 8 (rows 5, 6 only), 12).
    expected = [it for it in range(1, 3 * INTERVAL + 1) if it not in SKIPPED]
    assert [row["iteration"] for row in reported] == expected
    found, report_steps = {}, []
    for step, row in sorted(kept.items()):
        if "mixln-spike/steps/iteration" not in row:
            continue
        report_steps.append(step)
        steps = row["mixln-spike/steps/iteration"]
        columns = [row[f"mixln-spike/steps/{name}"] for name in ("scaled-elements", "max-ratio", "nonfinite-elements")]
        for i, it in enumerate(steps):
            found[it] = [float(column[i]) for column in columns]
        assert row["mixln-spike/interval/scaled-elements"] == sum(_row(it)[0] for it in steps)
        assert row["mixln-spike/interval/max-ratio"] == max(_row(it)[1] for it in steps)
        assert row["mixln-spike/interval/nonfinite-elements"] == sum(_row(it)[2] for it in steps)
        assert row["mixln-spike/interval/steps"] == len(steps)
    assert found == {it: _row(it) for it in expected}
    assert report_steps == [INTERVAL, 2 * INTERVAL, 3 * INTERVAL]  # at the iteration that reported
    # TensorBoard (any step order) still has one point per step.
    assert sorted(step for name, _, step in tensorboard.scalars if name == "mixln-spike/scaled-elements") == expected

    # Every telemetry record too, at the iteration it was made in.
    for record in records:
        row = kept[record["step"]]
        assert row["mixln/layer_grad_norm/layer001"] == record["layer_grad_norm"][0]
        assert row["mixln/layer_grad_norm/layer002"] == record["layer_grad_norm"][1]
        assert row["mixln/post_ln_group_grad_norm"] == record["post_ln_group_grad_norm"]
        assert row["mixln/spike/scaled"] == record["spike"]["scaled"]
