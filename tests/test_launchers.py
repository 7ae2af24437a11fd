"""The launchers in examples/ hand Megatron-LM arguments that its own parser accepts and validates.

Each launcher is run for real by bash, with `torchrun`, `srun` and `scontrol` replaced by stubs on
PATH: the torchrun stub records the arguments and the environment it was started with (what every
rank would inherit). The Megatron arguments after the script / `-m module` are then parsed in a
fresh subprocess by megatron.training.arguments.parse_args (ignore_unknown_args=False; the
extra_args_provider is mixln_megatron's add_mixln_args for a pretrain_gpt.py launcher that passes
--mixln-* flags, i.e. one relying on patches/*/0001, and the entry point's own add_pretrain_args
for `-m mixln_megatron.training.pretrain`) and checked by validate_args with WORLD_SIZE = nodes x processes
per node of the launch line. Then the --spec is imported and the model config is built
(gpt_config_from_args, as pretrain_gpt.py does; the entry point's transformer config otherwise),
Mix-LN's support check runs on it and the number of Post-LN layers is resolved from the
environment the launcher exported (plus what the --mixln-* flags export).

Differences from a real run, all on CPU (megatron-core 0.19.2, no TransformerEngine, no GPU):
  * mixln_megatron.cpu.enable_training() answers validate_args' GPU-architecture query (asked
    when TP > 1) with 0, i.e. pre-Blackwell, so validate_args also checks that a TP launcher
    exports CUDA_DEVICE_MAX_CONNECTIONS=1 (the shim's own default for it is removed first).
  * Data and tokenizer paths are placeholders and are not touched: validate_args does not open
    them and the tokenizer is not built (HuggingFace tokenizers would need the hub), so when no
    --vocab-size is given, a placeholder padded vocabulary size is set before the model config is
    built. No --mock-data substitution is needed.
  * validate_args asks the GPU's compute capability for --moe-grouped-gemm; the worker answers
    with a Hopper GPU's (9, 0) for that call only.
  * Without TransformerEngine, TransformerConfig rejects apply_rope_fusion (a TE kernel); the
    config check sets it False. Everything else is the launcher's own value.
Not checkable on CPU (for the dense models covered by benchmarks/gpu_check.sh and te_check.sh on a
GPU node; the MoE launcher's model has not run on a GPU): building
the TE layers of mixln_layer_spec, TE-only config checks, NCCL rendezvous, the launchers' tokenizer
and data paths, the alltoall dispatcher, and memory at TP2xPP4xVPP2 (7B) / DP8 (1B) / EP8 (MoE)
scale.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.testing import run_python

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"

# Every launcher in examples/, the environment the test launches it with, and what must come out.
LAUNCHERS = {
    "pretrain_llama7b_mixln.sh": dict(
        env={"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "node001"},
        world_size=16, target="pretrain_gpt.py", post_ln_layers=2, num_layers=32,
        parallel=dict(tp=2, pp=4, vpp=2, dp=2, sequence_parallel=True),
    ),
    "pretrain_moe16b_a2b_mixln.sh": dict(
        env={"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "node001"},
        world_size=16, target="pretrain_gpt.py", post_ln_layers=1, num_layers=28,
        parallel=dict(tp=1, pp=1, vpp=None, dp=16, ep=8, sequence_parallel=False),
        moe=dict(num_experts=64, layer_freq=[0] + [1] * 27, topk=6, dispatcher="alltoall",
                 grouped_gemm=True),
    ),
    "pretrain_llama1b_mixln.sh": dict(
        env={}, world_size=8, target="pretrain_gpt.py", post_ln_layers=6, num_layers=24,
        parallel=dict(tp=1, pp=1, vpp=None, dp=8, sequence_parallel=False),
    ),
    "slurm_llama7b_mixln.sbatch": dict(
        env={"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[001-004]"},
        world_size=32, target="pretrain_gpt.py", post_ln_layers=2, num_layers=32,
        parallel=dict(tp=2, pp=4, vpp=2, dp=4, sequence_parallel=True),
    ),
    # the paper's comparison: one arm (DeepNorm in the first alpha*L = 6 layers) through the 1B launcher
    "compare_schemes.sh": dict(
        env={"ARM": "mix_deepnorm", "MODEL": "1b"}, world_size=8, target="pretrain_gpt.py", post_ln_layers=6,
        num_layers=24, parallel=dict(tp=1, pp=1, vpp=None, dp=8, sequence_parallel=False),
        exports={"MIXLN_LAYOUT": "deepnorm:1-6,pre:*", "MIXLN_SCHEME": "mixln"},
    ),
    # the same arm through the MoE launcher: its alpha*L groups are 1 layer (alpha 0.0625 at 28)
    "compare_schemes.sh[moe16b]": dict(
        script="compare_schemes.sh",
        env={"ARM": "mix_deepnorm", "MODEL": "moe16b"}, world_size=8, target="pretrain_gpt.py",
        post_ln_layers=1, num_layers=28,
        parallel=dict(tp=1, pp=1, vpp=None, dp=8, ep=8, sequence_parallel=False),
        exports={"MIXLN_LAYOUT": "deepnorm:1-1,pre:*", "MIXLN_SCHEME": "mixln"},
        save="/checkpoints/moe16b-mix_deepnorm",
    ),
    "cpu_tiny_mixln.sh": dict(
        env={}, world_size=1, target="-m mixln_megatron.training.pretrain", post_ln_layers=2, num_layers=8,
        backend="local",
        parallel=dict(tp=1, pp=1, vpp=None, dp=1, sequence_parallel=False),
    ),
}



def _script(name: str) -> str:
    """The file a LAUNCHERS entry runs (an entry may run a script with other settings)."""
    return LAUNCHERS[name].get("script", name)


TE_SPEC = "mixln_megatron.spec.mixln_layer_spec"
PREFLIGHT = "import mixln_megatron.spec"  # what the GPU launchers run before torchrun
LOCAL_SPEC = "mixln_megatron.spec.mixln_local_layer_spec"

_STUB_TORCHRUN = r"""#!/usr/bin/env bash
# test stub: record the launch line and the environment the workers would inherit
printf '%s\0' "$@" > "${MIXLN_TEST_CAPTURE}/torchrun.args"
env -0 > "${MIXLN_TEST_CAPTURE}/torchrun.env"
echo call >> "${MIXLN_TEST_CAPTURE}/torchrun.calls"
"""
_STUB_SRUN = r"""#!/usr/bin/env bash
# test stub: record srun's options, then run the command once (as one node would)
opts=()
while [[ $# -gt 0 && $1 == -* ]]; do opts+=("$1"); shift; done
printf '%s\n' "${opts[*]}" >> "${MIXLN_TEST_CAPTURE}/srun.calls"
exec "$@"
"""
_STUB_SCONTROL = r"""#!/usr/bin/env bash
if [[ "$1 $2" == "show hostnames" ]]; then printf 'node%03d\n' 1 2 3 4; exit 0; fi
echo "scontrol stub: unsupported: $*" >&2; exit 2
"""
_STUB_PYTHON = r"""#!/usr/bin/env bash
# test stub for `$PYTHON -m torch.distributed.run ...`: the torchrun stub records it
if [[ "$1" == "-m" && "$2" == "torch.distributed.run" ]]; then shift 2; exec "$(dirname "$0")/torchrun" "$@"; fi
# the arm table of examples/compare_schemes.sh is the real one
if [[ "$1" == "-m" && "$2" == "mixln_megatron.analysis.arms" ]]; then exec "${MIXLN_TEST_PYTHON}" "$@"; fi
# test stub for the launchers' pre-flight `$PYTHON -c 'import ...'`: record it, succeed
printf '%s\0' "$@" >> "${MIXLN_TEST_CAPTURE}/python.calls"
printf '\n' >> "${MIXLN_TEST_CAPTURE}/python.calls"
"""
_STUB_NO_PLUGIN_PYTHON = r"""#!/usr/bin/env bash
echo "ModuleNotFoundError: No module named 'mixln_megatron'" >&2; exit 1
"""

# Runs once per launcher, each in a process of its own (parse_args reads sys.argv; the CPU shims
# and os.environ are global): `python worker.py job result`, forked by run_python from the test
# session's preloaded server (tests/harness/forked_ranks.py), which imported torch and
# megatron-core once; megatron.training and the shims are imported here, in each child.
_WORKER = r"""
import importlib.util, json, os, sys
job_path, out_path = sys.argv[1], sys.argv[2]
with open(job_path) as f:
    job = json.load(f)
import torch
if not torch.cuda.is_available():
    from mixln_megatron import cpu
    cpu.enable_training()
    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)  # only the launcher's export counts
for key in [k for k in os.environ if k.startswith("MIXLN_")]:
    del os.environ[key]
os.environ.update(job["env"])
os.environ.update(WORLD_SIZE=str(job["world_size"]), RANK="0", LOCAL_RANK="0")

from megatron.training import arguments as margs
from megatron.training.argument_utils import gpt_config_from_args
from megatron.core.transformer.spec_utils import import_module
from mixln_megatron.megatron_args import add_mixln_args, apply_mixln_args
from mixln_megatron.spec import settings_for_spec
from mixln_megatron.model.support import check_supported
from mixln_megatron.model.placement import resolve_placement

argv = job["argv"]
entry_point = job["target"] == "-m mixln_megatron.training.pretrain"
if entry_point:
    # the project's entry point: its own extra_args_provider (--mixln-*, --cpu, --loss-log), the
    # CPU flags it adds for --cpu, and its checks, as its main() does
    from mixln_megatron.training import pretrain as ep
    if ep.cpu_requested(argv):
        argv = ep.with_cpu_flags(argv)
    provider = ep.add_pretrain_args
else:
    # stock pretrain_gpt.py; add_mixln_args only when the launcher relies on patch 0001's flags
    provider = add_mixln_args if any(a.startswith("--mixln-") for a in argv) else None
sys.argv = [job["prog"]] + argv
args = margs.parse_args(extra_args_provider=provider, ignore_unknown_args=False)
if entry_point:
    ep.check_supported_args(args)
if provider is not None:
    apply_mixln_args(args)
if args.moe_grouped_gemm and not torch.cuda.is_available():
    # validate_args asks the GPU's compute capability for grouped GEMM (>= 8 needed): answer with
    # a Hopper GPU's, the launchers' target, for that call only
    real_capability = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    try:
        margs.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})  # pretrain_gpt.py's defaults
    finally:
        torch.cuda.get_device_capability = real_capability
else:
    margs.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})

out = dict(
    world_size=args.world_size, tp=args.tensor_model_parallel_size,
    pp=args.pipeline_model_parallel_size, vpp=args.virtual_pipeline_model_parallel_size,
    dp=args.data_parallel_size, ep=args.expert_model_parallel_size,
    sequence_parallel=bool(args.sequence_parallel),
    num_microbatches=args.global_batch_size // (args.micro_batch_size * args.data_parallel_size),
    num_layers=args.num_layers, transformer_impl=args.transformer_impl,
)
spec = import_module(args.spec) if args.spec else None  # the 0.19 wheel returns None on failure
out["spec"] = None if spec is None else f"{spec.__module__}.{spec.__qualname__}"

substituted = {}
if importlib.util.find_spec("transformer_engine") is None and args.apply_rope_fusion:
    args.apply_rope_fusion = False
    substituted["apply_rope_fusion"] = False
if args.padded_vocab_size is None and args.vocab_size is None:
    args.padded_vocab_size = 32128  # the tokenizer is not built here
    substituted["padded_vocab_size"] = 32128
if entry_point:  # its model provider builds the Mix-LN block spec from the transformer config
    from megatron.training.argument_utils import core_transformer_config_from_args
    transformer_config = core_transformer_config_from_args(args)
    out["backend"] = ep.backend_from_args(args)
else:  # pretrain_gpt.py: the --spec object goes into the model config
    model_config = gpt_config_from_args(args)
    transformer_config = model_config.transformer
    out["config_spec_is_mixln"] = model_config.transformer_layer_spec is spec and spec is not None
check_supported(transformer_config)
out["moe"] = None if not transformer_config.num_moe_experts else dict(
    num_experts=transformer_config.num_moe_experts, layer_freq=transformer_config.moe_layer_freq,
    topk=transformer_config.moe_router_topk, dispatcher=transformer_config.moe_token_dispatcher_type,
    grouped_gemm=bool(transformer_config.moe_grouped_gemm),
)
# the settings as each path builds them: the entry point from its flags, the --spec function from
# a patched parser's flags and then the exported MIXLN_* variables
settings = ep.run_settings(args) if entry_point else settings_for_spec(environ=os.environ, args=args)
placement = resolve_placement(args.num_layers, settings)
out["post_ln_layers"] = placement.post_ln_layers
out["placement"] = placement.describe()
# mixln_megatron's launch-time advice (printed at model build) must have nothing to say
from mixln_megatron.model.support import findings
warmup = (int(args.lr_warmup_fraction * args.train_iters) if args.lr_warmup_fraction is not None
          else args.lr_warmup_iters)
out["advice"] = findings(placement, args.train_iters, warmup)
out["substituted"] = substituted
with open(out_path, "w") as f:
    json.dump(out, f)
"""


@pytest.fixture(scope="module")
def run_worker(tmp_path_factory):
    """run_worker(job, result, cwd) -> (exit status, output): _WORKER on one job, in a child of the
    test session's fork server (run_python)."""
    worker = tmp_path_factory.mktemp("launcher_worker") / "worker.py"
    worker.write_text(_WORKER)

    def run(job, result, cwd):
        proc = run_python([sys.executable, str(worker), str(job), str(result)], cwd=str(cwd), timeout=300)
        return proc.returncode, proc.stdout + proc.stderr

    return run


def _launchers_on_disk():
    return sorted(p.name for p in EXAMPLES.iterdir() if p.suffix in (".sh", ".sbatch"))


@pytest.fixture(scope="module")
def stub_bin(tmp_path_factory):
    d = tmp_path_factory.mktemp("stub_bin")
    for name, text in (("torchrun", _STUB_TORCHRUN), ("srun", _STUB_SRUN),
                       ("scontrol", _STUB_SCONTROL), ("python-preflight", _STUB_PYTHON)):
        (d / name).write_text(text)
        (d / name).chmod(0o755)
    return d


def _clean_env() -> dict:
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("MIXLN_", "SLURM_")) and k not in (
            "CUDA_DEVICE_MAX_CONNECTIONS", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
            "WORLD_SIZE", "RANK", "LOCAL_RANK", "NPROC", "TP", "PP", "GPUS_PER_NODE",
            "DATA_PATH", "TOKENIZER_MODEL", "CHECKPOINT_DIR", "SEQ_LENGTH", "TRAIN_ITERS",
            "CONTAINER_IMAGE", "CONTAINER_MOUNTS", "OUT_DIR", "MEGATRON_LM_DIR", "PYTHON",
        )
    }
    return env


def _sbatch_nodes(path: Path) -> str:
    m = re.search(r"^#SBATCH\s+--nodes=(\d+)\s*$", path.read_text(), re.M)
    assert m, f"{path.name}: no '#SBATCH --nodes=N' line"
    return m.group(1)


def _run_launcher(name: str, tmp: Path, stub_bin: Path, python=None, extra_env=None):
    path = EXAMPLES / _script(name)
    capture = tmp / "capture"
    capture.mkdir()
    megatron_lm = tmp / "Megatron-LM"
    megatron_lm.mkdir()
    (megatron_lm / "pretrain_gpt.py").write_text("raise SystemExit('never run by this test')\n")
    env = _clean_env()
    env.update(
        PATH=f"{stub_bin}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHON=python or str(stub_bin / "python-preflight"),
        MEGATRON_LM_DIR=str(megatron_lm),
        DATA_PATH="/data/c4/c4_en_t5_text_document",  # placeholders: neither is opened here
        TOKENIZER_MODEL="/data/tokenizers/t5-base",
        MIXLN_TEST_CAPTURE=str(capture),
        MIXLN_TEST_PYTHON=sys.executable,
        OUT_DIR=str(tmp / "out"),
    )
    if path.suffix == ".sbatch":
        env["SLURM_NNODES"] = _sbatch_nodes(path)
    env.update(LAUNCHERS[name]["env"])
    env.update(extra_env or {})
    proc = subprocess.run(["bash", str(path)], env=env, cwd=tmp, capture_output=True, text=True,
                          timeout=300)
    return proc, capture, megatron_lm


def _read_nul(path: Path) -> list:
    data = path.read_bytes().decode()
    return data.split("\0")[:-1] if data else []


def _preflight_calls(capture: Path) -> list:
    path = capture / "python.calls"
    if not path.exists():
        return []
    return [chunk.split("\0") for chunk in path.read_text().split("\0\n") if chunk]


def _split_torchrun(argv: list):
    """(torchrun options, 'script path' | '-m module', Megatron arguments)."""
    opts = {}
    for i, a in enumerate(argv):
        if a in ("-m", "--module"):
            return opts, f"-m {argv[i + 1]}", argv[i + 2:]
        if not a.startswith("-"):
            return opts, a, argv[i + 1:]
        key, eq, value = a.lstrip("-").partition("=")
        assert eq or key in ("standalone",), (
            f"torchrun option {a!r}: write launcher options as --name=value so they are unambiguous"
        )
        opts[key.replace("_", "-")] = value if eq else True
    raise AssertionError(f"no training script in the torchrun line {argv}")


def test_every_launcher_is_checked():
    assert _launchers_on_disk() == sorted({_script(n) for n in LAUNCHERS}), (
        "add the new launcher to LAUNCHERS in tests/test_launchers.py so its arguments are parsed"
    )


@pytest.mark.parametrize("name", sorted({_script(n) for n in LAUNCHERS}))
def test_bash_syntax(name):
    proc = subprocess.run(["bash", "-n", str(EXAMPLES / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck is not installed (apt-get install shellcheck)")
def test_shellcheck_clean():
    files = [str(EXAMPLES / n) for n in sorted({_script(n) for n in LAUNCHERS})]
    proc = subprocess.run(["shellcheck", "-s", "bash", *files], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_launcher_arguments_parse_and_validate(name, tmp_path, stub_bin, run_worker):
    want = LAUNCHERS[name]
    proc, capture, megatron_lm = _run_launcher(name, tmp_path, stub_bin)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    assert (capture / "torchrun.calls").read_text().count("call") == 1

    opts, target, megatron_argv = _split_torchrun(_read_nul(capture / "torchrun.args"))
    if want["target"] == "pretrain_gpt.py":
        # the launcher checked that the plugin imports before starting torchrun
        assert _preflight_calls(capture) == [["-c", PREFLIGHT]], _preflight_calls(capture)
        assert target == str(megatron_lm / "pretrain_gpt.py")
    else:
        assert target == want["target"]
    world_size = int(opts.get("nnodes", 1)) * int(opts["nproc-per-node"])
    assert world_size == want["world_size"], opts

    env_lines = _read_nul(capture / "torchrun.env")
    launch_env = dict(line.split("=", 1) for line in env_lines if "=" in line)
    passed_env = {k: v for k, v in launch_env.items()
                  if k.startswith("MIXLN_") and k not in ("MIXLN_TEST_CAPTURE", "MIXLN_TEST_PYTHON")}
    if "CUDA_DEVICE_MAX_CONNECTIONS" in launch_env:
        passed_env["CUDA_DEVICE_MAX_CONNECTIONS"] = launch_env["CUDA_DEVICE_MAX_CONNECTIONS"]
    if not any(a.startswith("--mixln-") for a in megatron_argv):
        # Stock pretrain_gpt.py: the settings can only travel as exported MIXLN_* variables.
        assert {"MIXLN_ALPHA", "MIXLN_POST_LN_LAYERS", "MIXLN_LAYOUT"} & set(passed_env), (
            f"{name}: no exported MIXLN_* variable reaches torchrun"
        )
    for key, value in want.get("exports", {}).items():
        assert passed_env.get(key) == value, (key, passed_env)
    if "save" in want:
        assert megatron_argv[megatron_argv.index("--save") + 1] == want["save"]

    job = tmp_path / "job.json"
    result = tmp_path / "result.json"
    job.write_text(json.dumps(dict(
        argv=megatron_argv, env=passed_env, world_size=world_size,
        prog=Path(target.split()[-1]).name, target=target,
    )))
    status, output = run_worker(job, result, tmp_path)
    assert status == 0, f"Megatron-LM rejected the arguments of {name}:\n{output[-4000:]}"
    out = json.loads(result.read_text())
    assert out["world_size"] == want["world_size"]
    for key, value in want["parallel"].items():
        assert out[key] == value, (key, out)
    assert out["num_layers"] == want["num_layers"]
    if "moe" in want:
        assert out["moe"] == want["moe"], out["moe"]
    assert out["post_ln_layers"] == want["post_ln_layers"], out["placement"]
    if want["target"] == "pretrain_gpt.py":
        # the model pretrain_gpt.py builds is Mix-LN: --spec resolved to the plugin's spec
        assert out["config_spec_is_mixln"], out
        assert out["spec"] == (TE_SPEC if out["transformer_impl"] == "transformer_engine"
                               else LOCAL_SPEC)
    else:
        # the entry point ignores --spec (its model provider builds Mix-LN); none is passed
        assert out["spec"] is None
        assert out["backend"] == want["backend"]
    assert set(out["substituted"]) <= {"apply_rope_fusion", "padded_vocab_size"}
    assert out["advice"] == [], out["advice"]  # the settings the paper / its authors report stable


def test_preflight_import_works():
    """The launchers' pre-flight command, run for real: the module behind --spec imports."""
    # A fresh interpreter, not run_python: what this command imports is the point. A child of the
    # fork server starts with torch and megatron.core's submodules imported already, which would
    # hide a module that --spec's import chain uses without importing it; on a node that import
    # fails, and megatron's import_module swallows the error (silent Pre-LN training).
    proc = subprocess.run([sys.executable, "-c", PREFLIGHT], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_sbatch_srun_carries_environment(tmp_path, stub_bin):
    name = "slurm_llama7b_mixln.sbatch"
    proc, capture, _ = _run_launcher(name, tmp_path, stub_bin)
    assert proc.returncode == 0, proc.stderr
    calls = (capture / "srun.calls").read_text().splitlines()
    assert len(calls) == 2, calls  # the per-node import check, then torchrun
    for call in calls:
        assert "--export=ALL" in call.split(), call
        assert "--ntasks-per-node=1" in call.split(), call
    opts, _, _ = _split_torchrun(_read_nul(capture / "torchrun.args"))
    assert opts["rdzv-backend"] == "c10d"
    assert opts["rdzv-endpoint"] == "node001:29500"
    assert opts["rdzv-id"] == "4242"
    assert opts["nnodes"] == _sbatch_nodes(EXAMPLES / name)


def test_sbatch_container_options(tmp_path, stub_bin):
    proc, capture, _ = _run_launcher(
        "slurm_llama7b_mixln.sbatch", tmp_path, stub_bin,
        extra_env={"CONTAINER_IMAGE": "nvcr.io/nvidia/pytorch:25.09-py3",
                   "CONTAINER_MOUNTS": "/data:/data"},
    )
    assert proc.returncode == 0, proc.stderr
    for call in (capture / "srun.calls").read_text().splitlines():
        assert "--container-image=nvcr.io/nvidia/pytorch:25.09-py3" in call.split()
        assert "--container-mounts=/data:/data" in call.split()


@pytest.mark.parametrize("name", sorted(n for n in LAUNCHERS if LAUNCHERS[n]["target"] == "pretrain_gpt.py"))
def test_launcher_stops_when_plugin_is_missing(name, tmp_path, stub_bin):
    """Stock Megatron-LM 0.19 would train Pre-LN after a failed --spec import: the launcher stops."""
    fake = tmp_path / "python-without-plugin"
    fake.write_text(_STUB_NO_PLUGIN_PYTHON)
    fake.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    proc, capture, _ = _run_launcher(name, work, stub_bin, python=str(fake))
    assert proc.returncode != 0
    assert not (capture / "torchrun.calls").exists(), "torchrun started without the plugin"


def test_cpu_launcher_uses_the_entry_points_cpu_mode(tmp_path, stub_bin):
    """--cpu makes mixln_megatron.training.pretrain apply the CPU shims and CPU_MEGATRON_FLAGS."""
    proc, capture, _ = _run_launcher("cpu_tiny_mixln.sh", tmp_path, stub_bin)
    assert proc.returncode == 0, proc.stderr
    _, target, argv = _split_torchrun(_read_nul(capture / "torchrun.args"))
    assert target == "-m mixln_megatron.training.pretrain"
    assert "--cpu" in argv and "--mock-data" in argv
    assert argv[argv.index("--mixln-alpha") + 1] == "0.25"
    assert "--spec" not in argv  # ignored by the entry point, so not passed


def test_cpu_launcher_needs_no_activated_venv():
    """torchrun is not on PATH without an activated venv: the script starts it through $PYTHON,
    which defaults to the checkout's .venv python."""
    text = (EXAMPLES / "cpu_tiny_mixln.sh").read_text()
    commands = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not any(re.search(r"(^|\s)torchrun\s", line) for line in commands), "bare torchrun"
    assert any('"${PYTHON}" -m torch.distributed.run' in line for line in commands)
    block = re.search(r"^REPO_DIR=.*?^fi$", text, re.M | re.S).group(0)  # the script's PYTHON choice
    block = block.replace("${BASH_SOURCE[0]}", str(EXAMPLES / "cpu_tiny_mixln.sh"))
    env = {k: v for k, v in _clean_env().items() if k != "PYTHON"}
    out = subprocess.run(["bash", "-c", block + '\necho "$PYTHON"'], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    venv = EXAMPLES.parent / ".venv" / "bin" / "python"
    assert out == (str(venv) if os.access(venv, os.X_OK) else "python3")



# ------------------------------------------------------------------ headers and the docs' table
STANDARD_VARIABLES = {"HOME", "PATH", "PWD", "USER", "HOSTNAME", "BASH_SOURCE", "RANDOM"}
_READ = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")
_SET = re.compile(r"(?:^|[\s;(])(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\+?=|\bmapfile\s+(?:-\S+\s+)*([A-Za-z_]\w*)")
_DOCUMENTED = re.compile(r"^#   ([A-Z][A-Z0-9_]*)(?:\s|$)")  # `#   NAME  what it is [default]`


def _header_and_body(name: str):
    """The leading comment block (shebang and #SBATCH lines included) and the lines after it,
    comment lines dropped."""
    lines = (EXAMPLES / name).read_text().splitlines()
    n = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    return lines[:n], [line for line in lines[n:] if not line.lstrip().startswith("#")]


def _environment_read(body: list) -> set:
    """The variables the body reads from its environment: read before (or where, as in
    `X=${X:-1}`) the script sets them; the shell's and SLURM's own left out."""
    first_read, first_set = {}, {}
    for i, line in enumerate(body):
        for m in _READ.finditer(line):
            first_read.setdefault(m.group(1), i)
        for m in _SET.finditer(line):
            first_set.setdefault(m.group(1) or m.group(2), i)
    return {v for v, i in first_read.items()
            if first_set.get(v, i) >= i and v not in STANDARD_VARIABLES and not v.startswith("SLURM_")}


@pytest.mark.parametrize("name", _launchers_on_disk())
def test_header_documents_every_variable_the_launcher_reads(name):
    header, body = _header_and_body(name)
    read = _environment_read(body)
    start = next((i for i, line in enumerate(header) if line.startswith("# Environment [default]:")), None)
    assert start is not None, f"{name}: its header has no '# Environment [default]:' list"
    section = []
    for line in header[start + 1:]:
        if not line.startswith("#   "):
            break
        section.append(line)
    documented = {m.group(1) for line in section for m in [_DOCUMENTED.match(line)] if m}
    assert read, f"{name}: no variable read found (the parser is broken)"
    assert not read - documented, (
        f"{name} reads {sorted(read - documented)} but its header does not document them: add a "
        f"'#   NAME  what it is [default]' line to its Environment list")
    assert not documented - read, (
        f"{name}'s header documents {sorted(documented - read)}, which it does not read: remove them")


def test_the_reader_finds_reads_and_skips_what_a_script_sets():
    body = ['A=${A:-1}', 'b=2', 'echo "${b}" "$C" "${HOME}" "${SLURM_JOB_ID}"',
            'mapfile -t N < <(true)', 'echo "${N[0]}"', 'if [[ -z "${D:-}" ]]; then D=3; fi']
    assert _environment_read(body) == {"A", "C", "D"}


def test_launchers_name_the_supported_megatron_range():
    """One range, compat.SUPPORTED (setup.py's requirement): every launcher that runs a checkout's
    pretrain_gpt.py names it, in its header and its MEGATRON_LM_DIR error; no launcher names another."""
    from mixln_megatron import compat

    assert f'"megatron-core{compat.SUPPORTED}"' in (REPO / "setup.py").read_text()
    supported = f"megatron-core {compat.SUPPORTED}"
    for name in _launchers_on_disk():
        text = (EXAMPLES / name).read_text()
        header, body = _header_and_body(name)
        ranges = set(re.findall(r"megatron-core\s*[<>=~!][<>=~!0-9.,]*[0-9]", text))
        assert ranges <= {supported}, f"{name} names {sorted(ranges - {supported})}, not {supported}"
        old = re.findall(r"core[_ ]r?0\.\d+\.x|\(core 0\.\d+", text)
        assert not old, f"{name} names one release ({old}) where {supported} is supported"
        if "MEGATRON_LM_DIR" in _environment_read(body):
            assert supported in " ".join(line.lstrip("# ") for line in header).replace("  ", " "), (
                f"{name}'s header does not say it runs a checkout with {supported}")
            error = [line for line in body if "${MEGATRON_LM_DIR:?" in line]
            assert error and supported in error[0], f"{name}: the MEGATRON_LM_DIR error names no range"


@pytest.mark.parametrize("variable", ["DATA_PATH", "TOKENIZER_MODEL"])
@pytest.mark.parametrize("name", sorted(n for n in LAUNCHERS if LAUNCHERS[n]["target"] == "pretrain_gpt.py"))
def test_launcher_without_data_or_tokenizer_stops_in_one_line(name, variable, tmp_path, stub_bin):
    """No placeholder data path and no hub download by default: the user names the data and the
    tokenizer it was made with, or torchrun never starts."""
    work = tmp_path / "work"
    work.mkdir()
    proc, capture, _ = _run_launcher(name, work, stub_bin, extra_env={variable: ""})
    assert proc.returncode != 0
    assert not (capture / "torchrun.calls").exists(), "torchrun started without " + variable
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{variable}: set {variable} to" in lines[0], proc.stderr


DOC = REPO / "docs" / "training.md"


def _launcher_table() -> dict:
    """docs/training.md's launcher table: script name -> its row."""
    text = DOC.read_text()
    section = text.split("## Launchers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {re.match(r"\| `([^`]+)`", row).group(1): row for row in rows}


def test_docs_launcher_table_lists_every_launcher():
    table = _launcher_table()
    assert sorted(table) == _launchers_on_disk(), (
        f"docs/training.md's launcher table lists {sorted(table)}, examples/ has "
        f"{_launchers_on_disk()}: one row per launcher")
    # compare_schemes.sh: the row names every MODEL the script takes
    models = re.findall(r"^\s+([a-z0-9]+)\) launcher=", (EXAMPLES / "compare_schemes.sh").read_text(), re.M)
    assert models and all(f"`MODEL={m}`" in table["compare_schemes.sh"] for m in models), (
        models, table["compare_schemes.sh"])


def _required(name: str) -> set:
    """The variables a launcher stops without (`${NAME:?...}`); compare_schemes.sh adds its
    launchers' own."""
    text = (EXAMPLES / name).read_text()
    required = set(re.findall(r"\$\{([A-Za-z_]\w*):\?", text))
    for launcher in re.findall(r"launcher=(\S+?);", text):
        required |= _required(launcher)
    return required


def _documented_launches():
    """(where, launcher, the variables the command sets) for every `bash|sbatch examples/X` in the
    docs' shell blocks and in the launchers' header examples."""
    sources = [REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "benchmarks" / "README.md",
               *sorted((REPO / "docs").glob("*.md"))]
    found = []
    for path in sources:
        for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", path.read_text(), re.S):
            found += _launches(path.relative_to(REPO).as_posix(), block.splitlines())
    for name in _launchers_on_disk():
        header, _ = _header_and_body(name)
        found += _launches(f"examples/{name}", [line.lstrip("#") for line in header])
    return found


def _launches(where: str, lines: list) -> list:
    out, exported, current = [], set(), ""
    for raw in lines:
        line = re.sub(r"^\s*\$ ", "", raw).rstrip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        line, current = current + line, ""
        for names in re.findall(r"\bexport\s+((?:[A-Za-z_]\w*=\S*\s*)+)", line):  # export A=1 B=2 ...
            exported |= set(re.findall(r"([A-Za-z_]\w*)=", names))
        m = re.search(r"(?:^|[\s;])((?:[A-Za-z_]\w*=\S*\s+)*)(?:bash|sbatch)\s+examples/(\S+)", line)
        if m:
            assigned = set(re.findall(r"([A-Za-z_]\w*)=", m.group(1)))
            out.append((where, m.group(2), assigned | exported))
    return out


def test_documented_launch_commands_set_every_required_variable():
    """A documented launch command that sets some of a launcher's required variables sets all of
    them (one that sets none is about other variables and assumes an exported environment)."""
    launches = _documented_launches()
    # every launcher's header shows its command, so the parser finds one for each
    assert {launcher for _, launcher, _ in launches} == set(_launchers_on_disk()), launches
    bad = []
    for where, launcher, assigned in launches:
        required = _required(launcher)
        if assigned & required and required - assigned:
            bad.append(f"{where}: `{launcher}` without {sorted(required - assigned)}")
    assert not bad, "launch commands miss variables the launcher stops without: " + "; ".join(bad)
