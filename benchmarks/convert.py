"""Conversion speed and memory: a 1B-shaped Mix-LN torch_dist checkpoint (TP2 x PP2) -> Hugging Face.

    python benchmarks/convert.py [--workdir DIR] [--keep] [--skip-baseline] [--compare-with TREE]

1. Creates (once per --workdir) a synthetic checkpoint the way Megatron-LM lays it out: four
   torchrun ranks (gloo, CPU) build megatron-core's GPTModel with the Mix-LN local spec at TP2 x
   PP2 (24 layers, hidden 2048, ffn 5632, 32 heads, 8 query groups, untied, vocab 32000, P = 6),
   fill the bf16 weights with random values and save them with dist_checkpointing.save into
   DIR/ckpt/iter_0000001 (+ latest_checkpointed_iteration.txt, args and iteration in the common
   state, the Mix-LN record). Model weights only: no optimizer state.
2. Runs `mixln-megatron convert to-hf` (mixln_megatron.convert.cli.main) in a child process and
   takes its peak RSS from os.wait4 (ru_maxrss of that child only), its wall time and the
   checkpoint bytes per second. The child ends with os._exit once the conversion is done: the
   normal interpreter teardown of torch's CUDA build alone touches ~0.12 GiB of extra pages
   (measured on an imports-only child both ways and printed).
3. Converts the exported folder back (from-hf, torch_dist) and reports its peak RSS too.
4. With --compare-with TREE (a source tree of an earlier mixln_megatron, e.g. `git worktree add
   /tmp/old 3397bf7`, the last commit with the hand-written zip-chunk reader), runs that tree's
   to-hf on the same checkpoint in the same run, prints both and their ratios, and checks that
   both wrote byte-identical safetensors.
5. For comparison, loads the same checkpoint whole with torch's DCP-to-torch-save route
   (torch.distributed.checkpoint.format_utils.dcp_to_torch_save) in another child, and measures
   a child that only imports what the converter imports (torch, transformers, the package).

GiB throughout (2**30 bytes); checkpoint_gb counts the model weights (bf16) only.
Last line: RESULT seconds=<s> mb_per_s=<r> peak_rss_gb=<m> checkpoint_gb=<c>
"""

from __future__ import annotations

import repo_paths  # noqa: F401  (tests/ and scripts/ on sys.path: the harness, the plots)
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

SHAPE = dict(num_layers=24, hidden=2048, ffn=5632, heads=32, groups=8, vocab=32000, post_ln=6, seq=4096)
GIB = 2 ** 30


# --------------------------------------------------------------------------- creation (torchrun)
def create_worker(out_dir: str) -> None:
    """Runs under torchrun with 4 ranks: build TP2 x PP2, randomise, save like Megatron-LM."""
    import argparse as ap

    import torch
    from megatron.core import dist_checkpointing

    from harness import testing
    from mixln_megatron.spec import get_mixln_decoder_block_spec

    testing.init_distributed(tp=2, pp=2)
    s = SHAPE
    cfg = testing.tiny_config(
        num_layers=s["num_layers"], hidden=s["hidden"], heads=s["heads"], query_groups=s["groups"], tp=2, pp=2,
        ffn_hidden_size=s["ffn"], params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, bf16=True,
        perform_initialization=False,  # every weight is overwritten below
    )
    spec = get_mixln_decoder_block_spec(cfg, backend="local", post_ln_layers=s["post_ln"])
    model = testing.build_gpt(cfg, spec, vocab=s["vocab"], seq=s["seq"], untie=True)
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02))
    args = ap.Namespace(
        num_layers=s["num_layers"], hidden_size=s["hidden"], ffn_hidden_size=s["ffn"],
        num_attention_heads=s["heads"], group_query_attention=True, num_query_groups=s["groups"],
        kv_channels=s["hidden"] // s["heads"], max_position_embeddings=s["seq"], seq_length=s["seq"],
        normalization="RMSNorm", layernorm_epsilon=1e-5, swiglu=True, add_bias_linear=False, add_qkv_bias=False,
        position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0, rotary_interleaved=False,
        untie_embeddings_and_output_weights=True, vocab_size=s["vocab"], padded_vocab_size=s["vocab"],
        make_vocab_size_divisible_by=128, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
        params_dtype=torch.bfloat16, bf16=True, ckpt_format="torch_dist", mixln_post_ln_layers=s["post_ln"],
        mixln_alpha=None, mixln_scheme=None, transformer_impl="local",
    )
    iter_dir = os.path.join(out_dir, "iter_0000001")
    os.makedirs(iter_dir, exist_ok=True)
    metadata = {}
    state = {"model": model.sharded_state_dict(metadata=metadata), "args": args, "iteration": 1,
             "checkpoint_version": 3.0}
    dist_checkpointing.save(state, iter_dir, content_metadata=metadata)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def create_checkpoint(ckpt_dir: str) -> float:
    if os.path.isfile(os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt")):
        return 0.0
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    t0 = time.time()
    from harness.testing import torchrun

    try:
        torchrun(os.path.abspath(__file__), 4, "--create-worker", ckpt_dir, timeout=None)
    except AssertionError as failed:
        sys.stderr.write(str(failed)[-9000:])
        raise SystemExit("creating the synthetic checkpoint failed")
    return time.time() - t0


def _same_file(a: str, b: str) -> bool:
    import filecmp

    return os.path.isfile(b) and filecmp.cmp(a, b, shallow=False)


# --------------------------------------------------------------------------- measured children
def run_measured(cmd, env=None):
    """(seconds, peak RSS in bytes, stdout) of a child process; RSS from os.wait4 of that child."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.time() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        sys.stderr.write(stdout[-3000:] + stderr[-6000:])
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({proc.returncode})")
    return seconds, usage.ru_maxrss * 1024, stdout


IMPORTS = ("import torch, tqdm, packaging.version; "
           "import mixln_megatron.convert.cli, mixln_megatron.convert.to_hf, mixln_megatron.convert.megatron_reader")
# Each measured child ends with os._exit after flushing: the interpreter's own teardown of this CUDA
# build of torch touches ~0.12 GiB of fresh pages after all work is done (measured on the imports-only
# child both ways and printed), which is not conversion memory.
EXIT = "; import os, sys; sys.stdout.flush(); sys.stderr.flush(); os._exit(rc)"
CONVERT = "import sys; from mixln_megatron.convert.cli import main; rc = main(sys.argv[1:])" + EXIT
BASELINE = ("import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
            "dcp_to_torch_save(sys.argv[1], sys.argv[2]); rc = 0" + EXIT)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "mixln_convert_bench"))
    p.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint for the next run")
    p.add_argument("--skip-baseline", action="store_true", help="do not run dcp_to_torch_save")
    p.add_argument("--skip-from-hf", action="store_true", help="do not time from-hf on the exported folder")
    p.add_argument("--compare-with", default=None, metavar="TREE",
                   help="also run to-hf from this source tree of mixln_megatron (PYTHONPATH) and compare")
    p.add_argument("--create-worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.create_worker:
        create_worker(a.create_worker)
        return 0

    os.makedirs(a.workdir, exist_ok=True)
    ckpt = os.path.join(a.workdir, "ckpt")
    created = create_checkpoint(ckpt)
    iter_dir = os.path.join(ckpt, "iter_0000001")
    ckpt_bytes = sum(os.path.getsize(os.path.join(iter_dir, f)) for f in os.listdir(iter_dir))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    env.setdefault("HF_HUB_OFFLINE", "1")

    from mixln_megatron.convert.inspect import open_checkpoint

    weights = open_checkpoint(ckpt).model_tensor_bytes()
    print(f"checkpoint: {ckpt} ({'created in %.0f s' % created if created else 'reused'}); files "
          f"{ckpt_bytes / GIB:.3f} GiB, model weights {weights / GIB:.3f} GiB (bf16)", flush=True)

    _, imp_full, _ = run_measured([sys.executable, "-c", IMPORTS], env)
    imp_s, imp_rss, _ = run_measured([sys.executable, "-c", IMPORTS + "; rc = 0" + EXIT], env)
    print(f"imports only (what the converter imports): peak_rss_gb={imp_rss / GIB:.3f} ({imp_s:.1f} s); "
          f"{imp_full / GIB:.3f} when the interpreter tears down normally", flush=True)

    out = os.path.join(a.workdir, "hf")
    shutil.rmtree(out, ignore_errors=True)
    seconds, rss, stdout = run_measured(
        [sys.executable, "-c", CONVERT, "to-hf", "--load", ckpt, "--save", out, "--no-progress"], env)
    print(stdout.strip().splitlines()[0] if stdout.strip() else "", flush=True)
    hf_bytes = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))
    print(f"to-hf: {seconds:.1f} s, peak_rss_gb={rss / GIB:.3f} ({(rss - imp_rss) / GIB:.3f} above the imports), "
          f"wrote {hf_bytes / GIB:.3f} GiB of safetensors; above the imports / checkpoint = "
          f"{(rss - imp_rss) / weights:.3f} (target <= 0.125)", flush=True)

    if a.compare_with:
        tree = os.path.abspath(a.compare_with)
        other = os.path.join(a.workdir, "hf_compare")
        shutil.rmtree(other, ignore_errors=True)
        c_env = dict(env, PYTHONPATH=tree + os.pathsep + env.get("PYTHONPATH", ""))
        c_s, c_rss, _ = run_measured(
            [sys.executable, "-c", CONVERT, "to-hf", "--load", ckpt, "--save", other, "--no-progress"], c_env)
        same = all(_same_file(os.path.join(out, f), os.path.join(other, f)) for f in sorted(os.listdir(out))
                   if f.endswith(".safetensors"))
        print(f"to-hf from {tree}: {c_s:.1f} s, peak_rss_gb={c_rss / GIB:.3f} ({(c_rss - imp_rss) / GIB:.3f} above "
              f"the imports); this tree / that tree: seconds {seconds / c_s:.3f} (target <= 1.25), memory above "
              f"the imports {(rss - imp_rss) / max(1, c_rss - imp_rss):.2f}x; safetensors byte-identical: {same}",
              flush=True)
        shutil.rmtree(other, ignore_errors=True)

    if not a.skip_from_hf:
        back = os.path.join(a.workdir, "from_hf")
        shutil.rmtree(back, ignore_errors=True)
        f_s, f_rss, _ = run_measured(
            [sys.executable, "-c", CONVERT, "from-hf", "--load", out, "--save", back, "--tp", "2", "--pp", "2",
             "--no-progress"], env)
        shutil.rmtree(back, ignore_errors=True)
        print(f"from-hf (the exported folder -> torch_dist): {f_s:.1f} s, peak_rss_gb={f_rss / GIB:.3f} "
              f"({(f_rss - imp_rss) / GIB:.3f} above the to-hf imports)", flush=True)

    if not a.skip_baseline:
        target = os.path.join(a.workdir, "baseline.pt")
        b_s, b_rss, _ = run_measured([sys.executable, "-c", BASELINE, iter_dir, target], env)
        os.remove(target)
        print(f"BASELINE dcp_to_torch_save (whole checkpoint in memory): seconds={b_s:.1f} "
              f"peak_rss_gb={b_rss / GIB:.3f} ({(b_rss - imp_rss) / GIB:.3f} above the imports)", flush=True)

    shutil.rmtree(out, ignore_errors=True)
    if not a.keep:
        shutil.rmtree(ckpt, ignore_errors=True)
    mb_per_s = weights / 2**20 / seconds
    print(f"RESULT seconds={seconds:.1f} mb_per_s={mb_per_s:.1f} peak_rss_gb={rss / GIB:.3f} "
          f"checkpoint_gb={weights / GIB:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
