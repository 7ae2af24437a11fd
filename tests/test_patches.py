"""patches/*.patch apply to Megatron-LM core 0.19.x and do what patches/README.md says.

The megatron package shipped in the installed megatron-core 0.19.2 wheel (megatron/core and
megatron/training; identical to Megatron-LM's core_v0.19.0 tag for the patched files) is copied
into a temporary tree laid out like a Megatron-LM checkout, made a git repository, and each patch
must pass `git apply --check` and then `git apply` there, as the README instructs.

The patched code is then exercised in subprocesses whose PYTHONPATH puts the temporary tree first:
`megatron` is a namespace package (no __init__.py in the wheel or in a checkout), and
megatron.core / megatron.training are regular packages, so both resolve to the patched copies
(checked), and mixln_megatron, imported from the project, uses the same copies.

A subprocess runs a list of cases and writes one JSON result per case (value or exception), so
each test below only reads results. The same cases run against the unpatched wheel to show what
the patches change.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PATCHES = REPO / "patches"
PATCH_FILES = {
    "0001-mixln-cli-flags.patch": ["megatron/training/arguments.py"],
    "0002-fatal-spec-import.patch": ["megatron/core/transformer/spec_utils.py"],
}

# A tiny, valid Megatron-LM command line for CPU (the flags of mixln_megatron.cpu).
BASE_ARGV = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "2",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--position-embedding-type", "rope",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--distributed-backend", "gloo", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
    "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
    "--transformer-impl", "local",
]

BROKEN_SPEC_MODULE = "mixln_test_broken_spec"  # a module whose own import fails
BROKEN_SPEC_SOURCE = "import mixln_test_no_such_dependency\nlayer_spec = None\n"

CASES = {
    # patch 0001
    "flags": dict(argv=["--mixln-alpha", "0.0625"], env={"MIXLN_POST_LN_LAYERS": "3"}),
    "no_flags": dict(argv=[], env={}),
    "both_flags": dict(argv=["--mixln-alpha", "0.25", "--mixln-post-ln-layers", "3"], env={}),
    "bad_alpha": dict(argv=["--mixln-alpha", "1.5"], env={}),
    "scheme_and_spike": dict(
        argv=["--mixln-post-ln-layers", "1", "--mixln-scheme", "mixln+lns", "--mixln-spike-scaler",
              "--mixln-spike-threshold", "25"], env={}),
    "with_provider": dict(argv=["--mixln-post-ln-layers", "2"], env={}, provider=True),
    "validate": dict(argv=["--mixln-alpha", "0.25"], env={}, validate=True),
    "missing_plugin": dict(argv=["--mixln-alpha", "0.25"], env={}, hide_plugin=True),
    # patch 0002: --spec resolved the way pretrain_gpt.py 0.19 does it (gpt_config_from_args)
    "spec_ok": dict(argv=["--spec", "mixln_megatron.spec", "mixln_local_layer_spec"], env={},
                    model_config=True),
    "spec_bad_module": dict(argv=["--spec", "mixln_megatron.no_such_spec_module", "mixln_layer_spec"],
                            env={}, model_config=True),
    "spec_bad_name": dict(argv=["--spec", "mixln_megatron.spec", "no_such_layer_spec"], env={},
                          model_config=True),
    "spec_broken_module": dict(argv=["--spec", BROKEN_SPEC_MODULE, "layer_spec"], env={},
                               model_config=True),
}

_RUNNER = r"""
import json, os, sys, traceback
cases_path, out_path = sys.argv[1], sys.argv[2]
with open(cases_path) as f:
    job = json.load(f)
results = {}
import megatron.core.transformer.spec_utils as spec_utils
from megatron.training import arguments as margs
from megatron.training.argument_utils import gpt_config_from_args
results["_files"] = {"arguments": margs.__file__, "spec_utils": spec_utils.__file__}

def describe(exc):
    chain, cur = [], exc
    while cur is not None:
        chain.append({"type": type(cur).__name__, "message": str(cur)})
        cur = cur.__cause__ or cur.__context__
    return chain

for name, case in job["cases"].items():
    for key in [k for k in os.environ if k.startswith("MIXLN_")]:
        del os.environ[key]
    os.environ.update(case["env"])
    sys.argv = ["pretrain_gpt.py"] + job["base_argv"] + case["argv"]
    hidden = {}
    if case.get("hide_plugin"):
        for mod in [m for m in sys.modules if m == "mixln_megatron" or m.startswith("mixln_megatron.")]:
            hidden[mod] = sys.modules[mod]
        sys.modules["mixln_megatron"] = None  # import fails as if the package were not installed
    res = {}
    try:
        provider = None
        if case.get("provider"):
            from mixln_megatron.megatron_args import add_mixln_args as provider
        args = margs.parse_args(extra_args_provider=provider, ignore_unknown_args=False)
        res["args"] = {k: getattr(args, k, "<absent>") for k in (
            "mixln_alpha", "mixln_post_ln_layers", "mixln_scheme", "mixln_spike_scaler",
            "mixln_spike_threshold")}
        if case.get("validate") or case.get("model_config"):
            margs.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
            res["validated"] = True
        if case.get("model_config"):
            cfg = gpt_config_from_args(args)
            spec = cfg.transformer_layer_spec
            res["spec"] = None if spec is None else f"{spec.__module__}.{spec.__qualname__}"
    except SystemExit as exc:
        res["exit"] = exc.code
    except BaseException as exc:
        res["error"] = describe(exc)
    finally:
        if case.get("hide_plugin"):
            del sys.modules["mixln_megatron"]
            sys.modules.update(hidden)
    res["env"] = {k: v for k, v in os.environ.items() if k.startswith("MIXLN_")}
    results[name] = res

with open(out_path, "w") as f:
    json.dump(results, f, default=str)
"""


def _wheel_megatron_dir() -> Path:
    spec = importlib.util.find_spec("megatron.core")  # imports the namespace package only
    assert spec is not None and spec.origin, "megatron-core is not installed"
    return Path(spec.origin).resolve().parents[1]


def _git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def _make_checkout(root: Path) -> Path:
    shutil.copytree(_wheel_megatron_dir(), root / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for cmd in (["init", "-q"], ["config", "user.email", "test@example.invalid"],
                ["config", "user.name", "test"]):
        assert _git(*cmd, cwd=root).returncode == 0
    return root


def _run_cases(tmp: Path, pythonpath_first) -> dict:
    (tmp / "spec_mods").mkdir(exist_ok=True)
    (tmp / "spec_mods" / f"{BROKEN_SPEC_MODULE}.py").write_text(BROKEN_SPEC_SOURCE)
    cases = tmp / "cases.json"
    out = tmp / "results.json"
    cases.write_text(json.dumps({"cases": CASES, "base_argv": BASE_ARGV}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    paths = [str(p) for p in (pythonpath_first, tmp / "spec_mods", REPO) if p is not None]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(WORLD_SIZE="1", RANK="0")
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(cases), str(out)], env=env,
                          cwd=tmp, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A Megatron-LM-like checkout made of the wheel's files, with both patches applied."""
    root = _make_checkout(tmp_path_factory.mktemp("megatron-lm"))
    checks = {}
    for name in PATCH_FILES:
        check = _git("apply", "--check", str(PATCHES / name), cwd=root)
        checks[name] = check
        if check.returncode == 0:
            applied = _git("apply", str(PATCHES / name), cwd=root)
            assert applied.returncode == 0, applied.stderr
    return root, checks


@pytest.fixture(scope="module")
def patched(checkout, tmp_path_factory):
    root, checks = checkout
    for name, check in checks.items():
        assert check.returncode == 0, f"{name} does not apply: {check.stderr}"
    return _run_cases(tmp_path_factory.mktemp("patched"), root)


@pytest.fixture(scope="module")
def unpatched(tmp_path_factory):
    return _run_cases(tmp_path_factory.mktemp("unpatched"), None)


def _error_text(res) -> str:
    return "\n".join(f"{e['type']}: {e['message']}" for e in res.get("error", []))


# ---------------------------------------------------------------- the patch files themselves


@pytest.mark.parametrize("name", sorted(PATCH_FILES))
def test_patch_header_and_scope(name):
    text = (PATCHES / name).read_text()
    header, sep, _ = text.partition("\ndiff --git ")
    assert sep, f"{name} is not a git diff"
    assert re.search(r"Applies to: Megatron-LM release core 0\.19\.x", header), header
    assert "git apply --check" in header
    touched = re.findall(r"^diff --git a/(\S+) b/\1$", text, re.M)
    assert touched == PATCH_FILES[name]
    assert not re.search(r"^(---|\+\+\+) (a|b)/(a|b)/", text, re.M), "doubled path prefix"


def test_every_patch_is_tested_and_documented():
    on_disk = sorted(p.name for p in PATCHES.glob("*.patch"))
    assert on_disk == sorted(PATCH_FILES)
    readme = (PATCHES / "README.md").read_text()
    for name in on_disk:
        assert name in readme


@pytest.mark.parametrize("name", sorted(PATCH_FILES))
def test_patch_applies_cleanly_to_the_release(checkout, name):
    root, checks = checkout
    assert checks[name].returncode == 0, checks[name].stderr
    # ... and can be taken back out again (the README's undo instruction)
    assert _git("apply", "-R", "--check", str(PATCHES / name), cwd=root).returncode == 0


def test_patches_apply_with_patch_p1(tmp_path):
    """`patch -p1` works too (for trees that are not git checkouts)."""
    if shutil.which("patch") is None:
        pytest.skip("the patch tool is not installed")
    root = tmp_path / "tree"
    for files in PATCH_FILES.values():
        for rel in files:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(_wheel_megatron_dir().parent / rel, root / rel)
    for name in sorted(PATCH_FILES):
        proc = subprocess.run(["patch", "-p1", "--dry-run", "-i", str(PATCHES / name)], cwd=root,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_patched_modules_come_from_the_patched_tree(checkout, patched):
    root, _ = checkout
    for path in patched["_files"].values():
        assert Path(path).resolve().is_relative_to(root.resolve()), path


# ---------------------------------------------------------------- 0001: --mixln-* flags


def test_unpatched_parser_rejects_mixln_flags(unpatched):
    assert unpatched["flags"].get("exit") == 2  # argparse: unrecognized arguments


def test_flags_are_parsed_and_exported(patched):
    res = patched["flags"]
    assert "error" not in res and "exit" not in res, res
    assert res["args"]["mixln_alpha"] == "0.0625"
    assert res["env"]["MIXLN_ALPHA"] == "0.0625"
    # the flag wins over a variable inherited from the launcher
    assert "MIXLN_POST_LN_LAYERS" not in res["env"]


def test_without_flags_nothing_changes(patched):
    res = patched["no_flags"]
    assert "error" not in res, res
    assert res["args"]["mixln_alpha"] is None and res["args"]["mixln_post_ln_layers"] is None
    assert res["env"] == {}


def test_both_flags_is_a_clear_error(patched):
    text = _error_text(patched["both_flags"])
    assert "MixLNConfigError" in text
    assert "--mixln-alpha" in text and "--mixln-post-ln-layers" in text and "both" in text


def test_invalid_alpha_is_rejected_at_parse_time(patched):
    text = _error_text(patched["bad_alpha"])
    assert "MixLNConfigError" in text and "1.5" in text


def test_scheme_and_spike_flags_are_exported(patched):
    res = patched["scheme_and_spike"]
    assert "error" not in res, res
    assert res["env"]["MIXLN_POST_LN_LAYERS"] == "1"
    assert res["env"]["MIXLN_SCHEME"] == "mixln+lns"
    assert res["env"]["MIXLN_SPIKE_SCALER"] == "1"
    assert res["env"]["MIXLN_SPIKE_THRESHOLD"] == "25.0"


def test_extra_args_provider_with_the_same_flags_does_not_conflict(patched):
    """The plugin's entry point passes add_mixln_args itself; the patched parser must accept that."""
    res = patched["with_provider"]
    assert "error" not in res and "exit" not in res, res
    assert res["env"]["MIXLN_POST_LN_LAYERS"] == "2"


def test_patched_args_pass_validate_args(patched):
    res = patched["validate"]
    assert res.get("validated") is True, res
    assert res["env"]["MIXLN_ALPHA"] == "0.25"


def test_missing_plugin_is_a_clear_error(patched):
    text = _error_text(patched["missing_plugin"])
    assert "ImportError" in text
    assert "0001-mixln-cli-flags" in text and "mixln_megatron" in text


# ---------------------------------------------------------------- 0002: fatal --spec import


def test_unpatched_bad_spec_is_silently_ignored(unpatched):
    """The bug the patch fixes: the 0.19 wheel logs and trains the default (Pre-LN) layer spec."""
    res = unpatched["spec_bad_module"]
    assert "error" not in res, res
    assert res["spec"] is None


def test_good_spec_still_resolves(patched):
    res = patched["spec_ok"]
    assert "error" not in res, res
    assert res["spec"] == "mixln_megatron.spec.mixln_local_layer_spec"


def test_bad_spec_module_raises(patched):
    res = patched["spec_bad_module"]
    chain = res.get("error")
    assert chain, f"a bad --spec module did not raise: {res}"
    assert chain[0]["type"] == "ImportError"
    assert "mixln_megatron.no_such_spec_module" in chain[0]["message"]
    assert "mixln_layer_spec" in chain[0]["message"]
    # the original ImportError is chained
    assert any(e["type"] == "ModuleNotFoundError" and "no_such_spec_module" in e["message"]
               for e in chain[1:]), chain


def test_bad_spec_name_raises(patched):
    chain = patched["spec_bad_name"].get("error")
    assert chain and chain[0]["type"] == "ImportError", patched["spec_bad_name"]
    assert "no_such_layer_spec" in chain[0]["message"] and "mixln_megatron.spec" in chain[0]["message"]


def test_import_error_inside_the_spec_module_is_reported(patched):
    chain = patched["spec_broken_module"].get("error")
    assert chain and chain[0]["type"] == "ImportError", patched["spec_broken_module"]
    assert BROKEN_SPEC_MODULE in chain[0]["message"]
    assert "mixln_test_no_such_dependency" in chain[0]["message"]
    assert any("mixln_test_no_such_dependency" in e["message"] for e in chain[1:])


# ---------------------------------------------------------------- a real checkout, if given


def test_patches_apply_to_a_megatron_lm_checkout():
    """Set MEGATRON_LM_DIR to a Megatron-LM checkout (core_r0.19.x) to check it directly."""
    path = os.environ.get("MEGATRON_LM_DIR")
    if not path:
        pytest.skip("MEGATRON_LM_DIR is not set (a Megatron-LM core_r0.19.x checkout)")
    for name in sorted(PATCH_FILES):
        proc = _git("apply", "--check", str(PATCHES / name), cwd=path)
        if proc.returncode != 0:  # fine if it is already applied there
            undo = _git("apply", "-R", "--check", str(PATCHES / name), cwd=path)
            assert undo.returncode == 0, f"{name} neither applies nor is applied: {proc.stderr}"
