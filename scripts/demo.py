"""`make demo` / `python scripts/demo.py`: Mix-LN vs Pre-LN on CPU, through Megatron-LM's loop.

Two pretraining runs of one tiny LLaMA-shaped model (4 layers, hidden 128, RMSNorm, SwiGLU,
RoPE, no biases, untied embeddings, sequence 128) on the shipped Jane Austen corpus, tokenized
with the shipped byte-level BPE (4096 tokens):
  mixln  --mixln-alpha 0.25  (P = floor(0.25 * 4) = 1: layer 1 Post-LN, layers 2-4 Pre-LN)
  preln  --mixln-alpha 0     (every layer Pre-LN: megatron's stock GPT layer)
Same seed, data order and hyper-parameters otherwise. Each run is `python -m
mixln_megatron.training.pretrain --cpu ...` in a subprocess (one gloo process, no torchrun; the two run
side by side with one thread each, or one after the other with --sequential): Megatron-LM's
training loop with our model / data / loss providers, 300 iterations of 16 x 128 tokens, and
validation every 100 iterations and once more at the end on the held-out last 5% of the corpus.
Losses come from the entry point's --loss-log record (per iteration, recorded in our loss
function, not parsed from Megatron's log).

Then the Mix-LN run's final torch_dist checkpoint goes to Hugging Face (dev/demo_hf.py):
`mixln-megatron convert to-hf --tokenizer-model <the shipped tokenizer>`, loaded with
AutoTokenizer / AutoModelForCausalLM, a greedy continuation of a prompt, and the HF perplexity of
the held-out split next to Megatron's (equal on Megatron's own validation windows, checked; close
on the held-out text cut in consecutive windows).

Outputs under --out (default runs/demo):
  data/                  the indexed dataset, prepared on first use (cached by content)
  <run>/train.log        Megatron's full log of each run;  <run>/losses.json its loss record
  mixln/checkpoint/      the Mix-LN run's final checkpoint (torch_dist; staged, renamed in at the end)
  mixln/hf/              its Hugging Face export (tokenizer included)
  losses.json            both records, the commands, timings, the HF step and the final perplexities
  loss_curves.png        training loss and validation perplexity of both runs
A run folder is replaced only when it holds nothing but what the demo writes there; anything
else in it stops the demo before any work, in one line.
The last line printed, once, is `RESULT demo_ppl_mixln=<x> demo_ppl_preln=<y>`: the perplexity of
Megatron's final validation pass (about one pass over the held-out split) of each run.

Time: a few minutes on 2 CPU cores, data preparation included (measured: benchmarks/README.md;
the Hugging Face step adds under a minute, the fewer validation passes take about as much off).
The tokenizer is given to Megatron as `--tokenizer-type
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
from contextlib import ExitStack
from typing import List, Optional, Sequence

from mixln_megatron.errors import MixLNError
from mixln_megatron.safe_output import HF_FOLDER, MEGATRON_FOLDER, OutputKind, check_replaceable, staged_dir, sweep_stale

RUNS = (("mixln", "0.25"), ("preln", "0"))
HF_RUN = "mixln"  # the run whose checkpoint goes to Hugging Face
TELEMETRY_INTERVAL = 10  # per-layer gradient norms every 10 steps (mixln_megatron.training.telemetry)
SEQ_LENGTH, GLOBAL_BATCH, SEED, SPLIT = 128, 16, 1234, "95,5,0"
# 25 x 16 sequences of 128 tokens: about one pass over the held-out 5% of the corpus (515
# paragraphs, ~51K tokens, ~400 sequences). --full-validation would be exact, but it fails in
# megatron-core 0.19.2's evaluate ('int' object is not subscriptable).
EVAL_ITERS = 25
# What a run folder holds after a demo; one holding anything else is not the demo's to replace.
DEMO_RUN = OutputKind(
    "mixln_megatron demo run (train.log, losses.json, ...)",
    required=(),
    allowed=("train.log", "losses.json", "losses.json.tmp", "mixln_telemetry.jsonl", "cache", "checkpoint",
             ".checkpoint.*", "hf", ".hf.*", "train_health*"),
)


class DemoRefused(MixLNError):
    """An output of the demo's is taken by something the demo did not write."""

# A tiny LLaMA-shaped model (about 0.8M non-embedding parameters) and its schedule.
MODEL_FLAGS = (
    "--num-layers", "4",
    "--hidden-size", "128",
    "--ffn-hidden-size", "352",
    "--num-attention-heads", "4",
    "--seq-length", str(SEQ_LENGTH),
    "--max-position-embeddings", str(SEQ_LENGTH),
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
        "--micro-batch-size", str(GLOBAL_BATCH),
        "--global-batch-size", str(GLOBAL_BATCH),
        "--train-iters", str(iters),
        "--lr", "3e-3",
        "--min-lr", "3e-4",
        "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(max(1, iters // 10)),
        "--weight-decay", "0.1",
        "--adam-beta2", "0.95",
        "--clip-grad", "1.0",
        "--seed", str(SEED),
        "--eval-interval", str(eval_interval),
        "--eval-iters", str(EVAL_ITERS),
        "--log-interval", "10",
        "--num-workers", "0",
        "--use-cpu-initialization",
    ]


def data_flags(prefix: str, tokenizer_dir: str, cache_dir: str) -> List[str]:
    return [
        "--data-path", prefix,
        "--split", SPLIT,
        "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", tokenizer_dir,
        "--data-cache-path", cache_dir,  # one per run: the runs go side by side
    ]


_PROGRESS = re.compile(r"iteration\s+(\d+)/\s*(\d+).*?lm loss: ([0-9.E+-]+)")
_VALID = re.compile(r"validation loss at (.*?) \| lm loss value: ([0-9.E+-]+)")


class _Run:
    """One pretraining subprocess: its log goes to a file, its progress lines to stdout."""

    def __init__(self, name: str, cmd: Sequence[str], log_path: str, env: dict, iters: int):
        self.name, self.log_path, self.iters = name, log_path, iters
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
                where, loss = valid.group(1).strip(), float(valid.group(2))
                if where == f"iteration {self.iters}":
                    # Megatron validates at the last iteration when eval-interval divides it, then
                    # once more after training (the pass the result reports): show that one only.
                    continue
                if where.endswith(" on validation set"):
                    where = f"final validation, {where[:-len(' on validation set')]}"
                else:
                    where = f"validation at {where}"
                self._say(f"{where}: loss {loss:.4f}  ppl {math.exp(loss):.2f}")
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
    parser = argparse.ArgumentParser(prog="python scripts/demo.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join("runs", "demo"), help="output directory (default runs/demo)")
    parser.add_argument("--iters", type=int, default=300, help="training iterations per run (default 300)")
    parser.add_argument("--eval-interval", type=int, default=100,
                        help="iterations between validations (default 100; one more after training)")
    parser.add_argument("--sequential", action="store_true",
                        help="run the two trainings one after the other (default: side by side)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per run (default: 1 side by side, all cores when sequential)")
    args = parser.parse_args(argv)
    from demo_hf import DemoMismatch

    try:
        return _demo(args)
    except MixLNError as error:
        from mixln_megatron.cli_parsing import refused

        return refused("demo", error)
    except DemoMismatch as error:
        print(f"demo: error: {error}", file=sys.stderr, flush=True)
        return 1


def _check_run_folders(out: str) -> None:
    """Before any work: each run folder is new, empty, or a previous demo's (DEMO_RUN)."""
    for name, _ in RUNS:
        check_replaceable(os.path.join(out, name), DEMO_RUN, overwrite=True, error=DemoRefused)
    check_replaceable(os.path.join(out, HF_RUN, "checkpoint"), MEGATRON_FOLDER, overwrite=True, error=DemoRefused)
    check_replaceable(os.path.join(out, HF_RUN, "hf"), HF_FOLDER, overwrite=True, error=DemoRefused)


def _remove_previous(path: str) -> None:
    """A previous demo's file (its folder passed _check_run_folders): the new run writes it afresh."""
    if os.path.isfile(path):
        os.remove(path)


def _write_json(path: str, value) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, path)


def _demo(args) -> int:
    t_start = time.time()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    _check_run_folders(out)

    print(f"demo: preparing the Austen corpus under {os.path.join(out, 'data')} (cached after the first run) ...",
          flush=True)
    t0 = time.time()
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron's import-time notes about TE / Apex on CPU
        from mixln_megatron.data.corpus import tokenizer_dir
        from mixln_megatron.data.preprocess import prepare_austen_dataset

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
    checkpoint = os.path.join(out, HF_RUN, "checkpoint")
    sweep_stale(checkpoint, log=lambda line: print(line, flush=True))  # a killed demo's temporaries
    with ExitStack() as staging:
        # Megatron saves into a fresh hidden folder beside `checkpoint`, renamed in once the run is
        # done: an interrupted demo leaves the previous checkpoint as it was.
        staged_checkpoint = staging.enter_context(staged_dir(checkpoint, MEGATRON_FOLDER, True, DemoRefused))
        for name, alpha in RUNS:
            loss_logs[name] = os.path.join(out, name, "losses.json")
            telemetry[name] = os.path.join(out, name, "mixln_telemetry.jsonl")
            _remove_previous(loss_logs[name])  # a failed run must not leave the last one's record to read
            _remove_previous(telemetry[name])  # records are appended
            data = data_flags(prefix, tokenizer_dir(), os.path.join(out, name, "cache"))
            commands[name] = [sys.executable, "-m", "mixln_megatron.training.pretrain", "--cpu", *common, *data,
                              "--mixln-alpha", alpha, "--loss-log", loss_logs[name],
                              "--mixln-telemetry-interval", str(telemetry_interval),
                              "--mixln-telemetry-path", telemetry[name]]
            if name == HF_RUN:
                commands[name] += ["--save", staged_checkpoint, "--save-interval", str(args.iters),
                                   "--ckpt-format", "torch_dist"]
        timings, cpu_seconds = _train(commands, out, env, args)
    records = {}
    for name, _ in RUNS:
        with open(loss_logs[name]) as f:
            records[name] = json.load(f)
        v = final_valid(records[name])
        print(f"demo: {name} finished in {timings[name]:.0f} s: final validation loss {v['loss']:.4f}, "
              f"perplexity {v['ppl']:.2f}", flush=True)
    ppl = {name: final_valid(rec)["ppl"] for name, rec in records.items()}

    from demo_hf import ValidationRun, hf_step
    from mixln_megatron.data.corpus import austen_paragraphs

    validation = ValidationRun(
        data_prefix=prefix, tokenizer_dir=tokenizer_dir(), cache_dir=os.path.join(out, HF_RUN, "cache"), seed=SEED,
        seq_length=SEQ_LENGTH, split=SPLIT, global_batch_size=GLOBAL_BATCH, train_iters=args.iters,
        eval_interval=args.eval_interval, eval_iters=EVAL_ITERS)
    print(f"demo: {HF_RUN} checkpoint {checkpoint} -> Hugging Face ...", flush=True)
    hf = hf_step(checkpoint, os.path.join(out, HF_RUN, "hf"), validation, ppl[HF_RUN],
                 austen_paragraphs(unwrap=True), say=lambda line: print(line, flush=True))
    commands["to_hf"] = hf.pop("command")

    from plots import plot_loss_curves

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
    summary = {
        "runs": {name: {"alpha": alpha, **records[name]} for name, alpha in RUNS},
        "final_valid_ppl": ppl,
        "hugging_face": hf,
        "seconds": {**{k: round(v, 1) for k, v in timings.items()}, "hf_step": hf["seconds"],
                    "total": round(time.time() - t_start, 1), "training_cpu": round(cpu_seconds, 1)},
        "dataset": {"prefix": prefix, **{k: meta.get(k) for k in ("tokens", "documents", "vocab_size")}},
        "commands": commands,
        "train_health_figures": health["figures"],
    }
    _write_json(os.path.join(out, "losses.json"), summary)
    print(f"demo: loss curves {png}; losses {os.path.join(out, 'losses.json')}; total "
          f"{time.time() - t_start:.0f} s wall, {cpu_seconds:.0f} s CPU for the two trainings", flush=True)
    print(f"RESULT demo_ppl_mixln={ppl['mixln']:.3f} demo_ppl_preln={ppl['preln']:.3f}", flush=True)
    return 0


def _train(commands: dict, out: str, env: dict, args):
    """Both pretraining runs; ({run: seconds}, CPU seconds of the two)."""
    timings = {}
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    if args.sequential:
        for name, alpha in RUNS:
            print(f"demo: training {name} (--mixln-alpha {alpha}), {args.iters} iterations ...", flush=True)
            timings[name] = _Run(name, commands[name], os.path.join(out, name, "train.log"), env, args.iters).wait()
    else:
        # Both runs at once, one core each: on a small CPU this beats two threads per run in turn.
        print(f"demo: training {' and '.join(f'{n} (--mixln-alpha {a})' for n, a in RUNS)} side by side, "
              f"{args.iters} iterations each ...", flush=True)
        runs = [_Run(name, commands[name], os.path.join(out, name, "train.log"), env, args.iters)
                for name, _ in RUNS]
        try:
            for run in runs:
                timings[run.name] = run.wait()
        except BaseException:
            for run in runs:  # one run failed (or Ctrl-C): the other one stops too
                if run.proc.poll() is None:
                    run.proc.terminate()
            raise
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    return timings, cpu_seconds


if __name__ == "__main__":
    sys.exit(main())
