"""`make demo` / `python -m mixln_megatron.dev.demo`: Mix-LN vs Pre-LN on CPU, through Megatron-LM's loop.

Two pretraining runs of one tiny LLaMA-shaped model (4 layers, hidden 128, RMSNorm, SwiGLU,
RoPE, no biases, untied embeddings, sequence 128) on the shipped Jane Austen corpus, tokenized
with the shipped byte-level BPE (4096 tokens):
  mixln  --mixln-alpha 0.25  (P = floor(0.25 * 4) = 1: layer 1 Post-LN, layers 2-4 Pre-LN)
  preln  --mixln-alpha 0     (every layer Pre-LN: megatron's stock GPT layer)
Same seed, data order and hyper-parameters otherwise. Each run is `python -m
mixln_megatron.training.pretrain --cpu ...` in a subprocess (one gloo process, no torchrun; the two run
side by side with one thread each, or one after the other with --sequential): Megatron-LM's
training loop with our model / data / loss providers, 300 iterations of 16 x 128 tokens, and
validation every 50 iterations on the held-out last 5% of the corpus. Losses come from the entry
point's --loss-log record (per iteration, recorded in our loss function, not parsed from
Megatron's log).

Outputs under --out (default runs/demo):
  data/                  the indexed dataset, prepared on first use (cached by content)
  <run>/train.log        Megatron's full log of each run;  <run>/losses.json its loss record
  losses.json            both records, the commands, timings and the final perplexities
  loss_curves.png        training loss and validation perplexity of both runs
The last line printed is `RESULT demo_ppl_mixln=<x> demo_ppl_preln=<y>`: the perplexity of
Megatron's final validation pass (about one pass over the held-out split) of each run.

Time: under 10 minutes on 2 CPU cores for both runs, data preparation included (see the
project README for measured numbers). The tokenizer is given to Megatron as `--tokenizer-type
HuggingFaceTokenizer --tokenizer-model <shipped tokenizer dir>` (the same vocab.json /
merges.txt): Megatron's GPT2BPETokenizer type asks the Hugging Face Hub for the "gpt2"
tokenizer configuration even when --vocab-file / --merge-file are given, so it cannot run
offline.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import resource
import subprocess
import sys
import threading
import time
import warnings
from typing import List, Optional, Sequence

RUNS = (("mixln", "0.25"), ("preln", "0"))
TELEMETRY_INTERVAL = 10  # per-layer gradient norms every 10 steps (mixln_megatron.training.telemetry)

# A tiny LLaMA-shaped model (about 0.8M non-embedding parameters) and its schedule.
MODEL_FLAGS = (
    "--num-layers", "4",
    "--hidden-size", "128",
    "--ffn-hidden-size", "352",
    "--num-attention-heads", "4",
    "--seq-length", "128",
    "--max-position-embeddings", "128",
    "--normalization", "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
    "--position-embedding-type", "rope",
    "--untie-embeddings-and-output-weights",
    "--attention-dropout", "0",
    "--hidden-dropout", "0",
    "--init-method-std", "0.02",
)


def training_flags(iters: int, eval_interval: int) -> List[str]:
    return [
        "--micro-batch-size", "16",
        "--global-batch-size", "16",
        "--train-iters", str(iters),
        "--lr", "3e-3",
        "--min-lr", "3e-4",
        "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(max(1, iters // 10)),
        "--weight-decay", "0.1",
        "--adam-beta2", "0.95",
        "--clip-grad", "1.0",
        "--seed", "1234",
        "--eval-interval", str(eval_interval),
        # 25 x 16 sequences of 128 tokens: about one pass over the held-out 5% of the corpus
        # (515 paragraphs, ~51K tokens, ~400 sequences). --full-validation would be exact, but it
        # fails in megatron-core 0.19.2's evaluate ('int' object is not subscriptable).
        "--eval-iters", "25",
        "--log-interval", "10",
        "--num-workers", "0",
        "--use-cpu-initialization",
    ]


def data_flags(prefix: str, tokenizer_dir: str, cache_dir: str) -> List[str]:
    return [
        "--data-path", prefix,
        "--split", "95,5,0",
        "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", tokenizer_dir,
        "--data-cache-path", cache_dir,  # one per run: the runs go side by side
    ]


_PROGRESS = re.compile(r"iteration\s+(\d+)/\s*(\d+).*?lm loss: ([0-9.E+-]+)")
_VALID = re.compile(r"validation loss at (.*?) \| lm loss value: ([0-9.E+-]+)")


class _Run:
    """One pretraining subprocess: its log goes to a file, its progress lines to stdout."""

    def __init__(self, name: str, cmd: Sequence[str], log_path: str, env: dict):
        self.name, self.log_path = name, log_path
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        self.t0 = time.time()
        self.log = open(log_path, "w")
        self.log.write(" ".join(cmd) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     text=True, bufsize=1)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _say(self, text: str) -> None:
        with _PRINT_LOCK:
            print(f"  [{self.name}] {text}", flush=True)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        in_advice = False  # inside the launch-time advice block after "[mixln_megatron] WARNING"
        for line in self.proc.stdout:
            self.log.write(line)
            progress, valid = _PROGRESS.search(line), _VALID.search(line)
            if in_advice and line.startswith("  - "):
                self._say(line.rstrip())
                continue
            in_advice = False
            if progress:
                self._say(f"iteration {int(progress.group(1)):4d}/{progress.group(2)}  train loss "
                          f"{float(progress.group(3)):.4f}  ({time.time() - self.t0:5.1f} s)")
            elif valid:
                loss = float(valid.group(2))
                self._say(f"validation at {valid.group(1).strip()}: loss {loss:.4f}  ppl {math.exp(loss):.2f}")
            elif "[mixln_megatron]" in line:
                self._say(line.strip())
                in_advice = "WARNING" in line
        self.t_end = time.time()  # stdout closes when the process ends

    def wait(self) -> float:
        rc = self.proc.wait()
        self.reader.join()
        self.log.close()
        seconds = getattr(self, "t_end", time.time()) - self.t0
        if rc != 0:
            with open(self.log_path) as f:
                sys.stderr.write("".join(f.readlines()[-40:]))
            raise SystemExit(f"demo: the {self.name} run failed (exit {rc}); full log: {self.log_path}")
        return seconds


_PRINT_LOCK = threading.Lock()


def final_valid(record: dict) -> dict:
    valid = [e for e in record.get("eval", []) if e["split"] == "valid"]
    if not valid:
        raise SystemExit("demo: no validation result was recorded")
    return valid[-1]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mixln_megatron.dev.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join("runs", "demo"), help="output directory (default runs/demo)")
    parser.add_argument("--iters", type=int, default=300, help="training iterations per run (default 300)")
    parser.add_argument("--eval-interval", type=int, default=50, help="iterations between validations")
    parser.add_argument("--sequential", action="store_true",
                        help="run the two trainings one after the other (default: side by side)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per run (default: 1 side by side, all cores when sequential)")
    args = parser.parse_args(argv)
    t_start = time.time()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)

    print(f"demo: preparing the Austen corpus under {os.path.join(out, 'data')} (cached after the first run) ...",
          flush=True)
    t0 = time.time()
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron's import-time notes about TE / Apex on CPU
        from ..data import prepare_austen_dataset, tokenizer_dir

        prefix = prepare_austen_dataset(os.path.join(out, "data"))
    meta_path = prefix + ".json"
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
    print(f"demo: dataset {prefix} ({meta.get('tokens', '?')} tokens, {meta.get('documents', '?')} documents, "
          f"vocab {meta.get('vocab_size', '?')}) ready in {time.time() - t0:.1f} s", flush=True)

    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    threads = args.threads or (None if args.sequential else 1)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # each run is its own single-process group
    for var in [v for v in env if v.startswith("MIXLN_")]:
        env.pop(var)  # the flags below are the whole Mix-LN configuration (the entry point reads no MIXLN_*)

    common = [*MODEL_FLAGS, *training_flags(args.iters, args.eval_interval)]
    commands, loss_logs, telemetry = {}, {}, {}
    telemetry_interval = max(1, min(TELEMETRY_INTERVAL, args.iters // 4))  # a few records for short runs
    for name, alpha in RUNS:
        loss_logs[name] = os.path.join(out, name, "losses.json")
        if os.path.exists(loss_logs[name]):
            os.remove(loss_logs[name])
        data = data_flags(prefix, tokenizer_dir(), os.path.join(out, name, "cache"))
        telemetry[name] = os.path.join(out, name, "mixln_telemetry.jsonl")
        commands[name] = [sys.executable, "-m", "mixln_megatron.training.pretrain", "--cpu", *common, *data,
                          "--mixln-alpha", alpha, "--loss-log", loss_logs[name],
                          "--mixln-telemetry-interval", str(telemetry_interval),
                          "--mixln-telemetry-path", telemetry[name]]
        if os.path.exists(telemetry[name]):
            os.remove(telemetry[name])  # records are appended
    timings = {}
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    if args.sequential:
        for name, alpha in RUNS:
            print(f"demo: training {name} (--mixln-alpha {alpha}), {args.iters} iterations ...", flush=True)
            timings[name] = _Run(name, commands[name], os.path.join(out, name, "train.log"), env).wait()
    else:
        # Both runs at once, one core each: on a small CPU this beats two threads per run in turn.
        print(f"demo: training {' and '.join(f'{n} (--mixln-alpha {a})' for n, a in RUNS)} side by side, "
              f"{args.iters} iterations each ...", flush=True)
        runs = [_Run(name, commands[name], os.path.join(out, name, "train.log"), env) for name, _ in RUNS]
        for run in runs:
            timings[run.name] = run.wait()
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    records = {}
    for name, _ in RUNS:
        with open(loss_logs[name]) as f:
            records[name] = json.load(f)
        v = final_valid(records[name])
        print(f"demo: {name} finished in {timings[name]:.0f} s: final validation loss {v['loss']:.4f}, "
              f"perplexity {v['ppl']:.2f}", flush=True)

    from .plots import plot_loss_curves

    png = plot_loss_curves(
        records, os.path.join(out, "loss_curves.png"),
        title=f"Mix-LN (alpha 0.25) vs Pre-LN: 4-layer LLaMA-shaped GPT, Austen corpus, {args.iters} iterations (CPU)",
    )
    # The demo is a script of user commands: the health plots come from the CLI, like the training.
    commands["train_health"] = [sys.executable, "-m", "mixln_megatron.cli", "analyze", "train-health",
                                telemetry["mixln"], "--out-dir", os.path.join(out, "mixln")]
    subprocess.run(commands["train_health"], check=True, env=env)
    with open(os.path.join(out, "mixln", "train_health.json")) as f:
        health = json.load(f)
    ppl = {name: final_valid(rec)["ppl"] for name, rec in records.items()}
    summary = {
        "runs": {name: {"alpha": alpha, **records[name]} for name, alpha in RUNS},
        "final_valid_ppl": ppl,
        "seconds": {**{k: round(v, 1) for k, v in timings.items()}, "total": round(time.time() - t_start, 1),
                    "training_cpu": round(cpu_seconds, 1)},
        "dataset": {"prefix": prefix, **{k: meta.get(k) for k in ("tokens", "documents", "vocab_size")}},
        "commands": commands,
        "train_health_figures": health["figures"],
    }
    with open(os.path.join(out, "losses.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"demo: loss curves {png}; losses {os.path.join(out, 'losses.json')}; total "
          f"{time.time() - t_start:.0f} s wall, {cpu_seconds:.0f} s CPU for the two trainings", flush=True)
    print(f"RESULT demo_ppl_mixln={ppl['mixln']:.3f} demo_ppl_preln={ppl['preln']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
