"""docs/training.md's several-nodes command, run as two torchrun agents on one machine.

The fenced block of the page's "Several nodes" section is taken as written: its shell variables
are set as two nodes would set them (NNODES=2, NODE_RANK 0 and 1, one worker each, the rendezvous
on a free local port) and its one placeholder becomes a tiny CPU model on mock data. Both agents
are the real torchrun in fresh processes (a launcher test: nothing forked from the suite's
server). What the page says is checked: the job's world size, the build line on global rank 0
only, Megatron-LM's iteration lines on the last rank, a complete torch_dist checkpoint in the
shared --save folder with both ranks' shards, and a refusal printed once for the whole job.
"""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "training.md"
BIN = Path(sys.executable).parent  # the venv's torchrun
ITERS = 2
TINY = [
    "--cpu", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
    "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", str(ITERS), "--save-interval", str(ITERS),
    "--eval-iters", "1", "--eval-interval", str(ITERS), "--log-interval", "1", "--num-workers", "0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
    "--use-cpu-initialization", "--ckpt-format", "torch_dist",
]


def documented_command() -> str:
    """The page's several-nodes block, continuation lines joined."""
    section = PAGE.read_text(encoding="utf-8").split("## Several nodes", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    return block.replace("\\\n", " ").strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_nodes(tmp_path, extra=(), timeout=600):
    """Both agents of the documented command (the tiny model as its flags, `extra` at its end);
    [(exit status, output)] for node ranks 0 and 1."""
    command = documented_command()
    assert command.count("<model, data and training flags>") == 1, command
    command = command.replace("<model, data and training flags>", " ".join(TINY)) + "".join(f" {a}" for a in extra)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MIXLN_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                          "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH")}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               NNODES="2", GPUS_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               CHECKPOINT_DIR=str(tmp_path / "ckpt"), JOB_ID="test")
    agents = [subprocess.Popen(["bash", "-c", command], env={**env, "NODE_RANK": str(rank)}, cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for rank in (0, 1)]
    try:
        outputs = [agent.communicate(timeout=timeout)[0] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    return [(agent.returncode, out) for agent, out in zip(agents, outputs)]


@pytest.mark.mp
def test_two_nodes_train_and_save_one_checkpoint(tmp_path):
    (rc0, node0), (rc1, node1) = launch_two_nodes(tmp_path)
    assert rc0 == 0 and rc1 == 0, f"node 0 (exit {rc0}):\n{node0[-3000:]}\nnode 1 (exit {rc1}):\n{node1[-3000:]}"
    assert "using world size: 2," in node0
    assert node0.count("[mixln_megatron] scheme=mixln L=4 P=1") == 1 and "[mixln_megatron] scheme" not in node1
    assert re.search(rf"iteration\s+{ITERS}/\s*{ITERS} \|", node1) and not re.search(r"iteration\s+\d+/", node0)

    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    step = ckpt / f"iter_{ITERS:07d}"
    assert {p.name for p in step.glob("*.distcp")} >= {"__0_0.distcp", "__1_0.distcp"}  # both nodes wrote
    from mixln_megatron.convert.inspect import describe_checkpoint
    from mixln_megatron.convert.inspect import open_checkpoint
    from mixln_megatron.convert.vet import vet_checkpoint

    vet_checkpoint(str(ckpt))  # every pickle of the save readable through the allow-list
    assert open_checkpoint(str(step)).args.world_size == 2
    info = describe_checkpoint(str(ckpt))
    assert info["format"] == "torch_dist" and info["iteration"] == ITERS and info["post_ln_layers"] == 1, info


@pytest.mark.mp
def test_a_refusal_is_one_line_for_the_whole_job(tmp_path):
    (rc0, node0), (rc1, node1) = launch_two_nodes(tmp_path, ["--mixln-alpha", "1.5"])
    line = "alpha from --mixln-alpha must lie in [0, 1]"
    assert rc0 != 0 and rc1 != 0, (node0[-2000:], node1[-2000:])
    assert node0.count(line) == 1 and node1.count(line) == 0, (node0[-3000:], node1[-3000:])
    for out in (node0, node1):
        assert re.search(r"exitcode\s*: 2 ", out), out[-2000:]  # each node's worker exited 2
        # the only traceback is torchrun's own failure summary, none from a worker
        assert all(f.endswith("/torchrun") for f in re.findall(r"Traceback \(most recent call last\):\n  File \"([^\"]+)\"", out))
        assert "arguments ----" not in out  # refused before Megatron-LM's argument table
    assert not (tmp_path / "ckpt").exists()
