"""Megatron-LM vs exported Hugging Face model: logits and greedy generation, on CPU (fp32).

    python benchmarks/hf_parity.py [--workdir DIR] [--formats torch_dist,torch]

For each checkpoint format, benchmarks/workers/hf_parity_worker.py (under torchrun, gloo) trains a tiny
Mix-LN GPT with `mixln-megatron pretrain` (4 layers, P = 2, GQA 4 heads / 2 groups, untied output,
true vocab 250 padded by Megatron to 256) and saves it with Megatron-LM's save_checkpoint:
torch_dist at TP2 x PP2 (4 ranks), legacy torch at TP2 (2 ranks). The worker then loads it with
Megatron-LM's load_checkpoint and records Megatron's logits of an unpadded batch (2 x 16 tokens)
and a greedy loop (full forward per new token, argmax over the true vocabulary, top-2 gap), runs
`convert to-hf`, `convert from-hf` back to the same layout and Megatron's logits of that.
This script then loads the HF folder with trust_remote_code=True and compares:
  max_abs_logit_diff  max |HF - Megatron| over the true vocabulary (fp32)
  generate_match      HF generate(do_sample=False) yields Megatron's tokens, except that a
                      position where Megatron's top-2 logit gap is below 1e-4 may differ (after
                      which the continuations are not comparable)
Last line: RESULT max_abs_logit_diff=<x> generate_match=<true|false> (over all formats).
"""

from __future__ import annotations

import repo_paths  # noqa: F401  (tests/ and scripts/ on sys.path: the harness, the plots)
import argparse
import json
import os
import sys
import tempfile

from harness import testing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "benchmarks", "workers", "hf_parity_worker.py")
GAP_TOLERANCE = 1e-4
LAYOUTS = {"torch_dist": (2, 2), "torch": (2, 1)}


def run_worker(workdir: str, tp: int, pp: int, fmt: str, timeout: int = 900, extra_args=()) -> None:
    """extra_args: more entry-point flags (e.g. --mixln-scheme mixln+lns); the last value wins."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp * pp}",
           WORKER, "--workdir", workdir, "--tp", str(tp), "--pp", str(pp), "--ckpt-format", fmt]
    if extra_args:
        cmd += ["--extra-args", *extra_args]
    proc = testing.run_python(cmd, timeout=timeout, env=env)  # forked ranks inside the test suite
    if proc.returncode != 0 or not os.path.isfile(os.path.join(workdir, "result.json")):
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")


def compare(workdir: str) -> dict:
    """HF (exported folder) vs the Megatron figures the worker recorded in `workdir`."""
    import torch
    from transformers import AutoModelForCausalLM

    ref = torch.load(os.path.join(workdir, "megatron_logits.pt"))
    res = json.load(open(os.path.join(workdir, "result.json")))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(workdir, "hf"), trust_remote_code=True,
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(ref["batch"]).logits
        prompt = torch.tensor([res["prompt"]])
        generated = model.generate(prompt, max_new_tokens=len(res["gaps"]), do_sample=False)[0].tolist()
    diff = float((logits - ref["logits"]).abs().max())
    new_hf, new_meg = generated[len(res["prompt"]):], res["tokens"][len(res["prompt"]):]
    match, first_diff = True, None
    for i, (a, b) in enumerate(zip(new_hf, new_meg)):
        if a != b:
            first_diff = i
            match = res["gaps"][i] < GAP_TOLERANCE  # a near tie may break either way; stop comparing here
            break
    if len(new_hf) != len(new_meg) and first_diff is None:
        match = False
    return {"max_abs_logit_diff": diff, "generate_match": match, "first_difference": first_diff,
            "hf_tokens": generated, "megatron_tokens": res["tokens"], "min_gap": min(res["gaps"]),
            "roundtrip_max_abs_diff": res["roundtrip_max_abs_diff"], "summary": res["summary"],
            "class": type(model).__name__}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--formats", default="torch_dist,torch", help="comma list of torch_dist, torch")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    base = a.workdir or tempfile.mkdtemp(prefix="mixln_hf_parity_")
    worst, all_match = 0.0, True
    for fmt in [f.strip() for f in a.formats.split(",") if f.strip()]:
        tp, pp = LAYOUTS[fmt]
        workdir = os.path.join(base, f"{fmt}_tp{tp}pp{pp}")
        os.makedirs(workdir, exist_ok=True)
        run_worker(workdir, tp, pp, fmt)
        r = compare(workdir)
        worst = max(worst, r["max_abs_logit_diff"])
        all_match &= r["generate_match"]
        print(f"{fmt} TP{tp} x PP{pp}: {r['class']}, max_abs_logit_diff={r['max_abs_logit_diff']:.3g} "
              f"generate_match={r['generate_match']} (first difference at {r['first_difference']}, smallest "
              f"Megatron top-2 gap {r['min_gap']:.3g}); Megatron reloading the from-hf checkpoint: max diff "
              f"{r['roundtrip_max_abs_diff']:.3g}", flush=True)
        print(f"  megatron {r['megatron_tokens']}\n  hf       {r['hf_tokens']}", flush=True)
    print(f"RESULT max_abs_logit_diff={worst:.3g} generate_match={'true' if all_match else 'false'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
