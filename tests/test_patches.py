"""patches/core_r<release>/*.patch apply to Megatron-LM's release branches and do what
patches/README.md says, for each release the plugin supports (0.17, 0.18, 0.19).

Each release's megatron package comes from that release's megatron-core wheel (megatron/core and
megatron/training; the patched files are byte-identical to the release branch, which the patches'
`index` lines pin and a test checks): 0.19 from the main venv, 0.17 / 0.18 from the overlays that
`scripts/compat_env.sh` installs under .compat/ (`make test-compat` does). Without an overlay that
release's wheel-based tests skip, naming the command that installs it. The package is copied into
a temporary tree laid out like a Megatron-LM checkout, made a git repository, and each patch must
pass `git apply --check` and then `git apply` there, as the README instructs.

The patched code is then exercised in subprocesses whose PYTHONPATH puts the temporary tree first:
`megatron` is a namespace package (no __init__.py in the wheel or in a checkout), and
megatron.core / megatron.training are regular packages, so both resolve to the patched copies
(checked), and mixln_megatron, imported from the project, uses the same copies.

A subprocess runs a list of cases and writes one JSON result per case (value or exception), so
each test below only reads results. The same cases run against the unpatched wheel to show what
the patches change. `--spec` is resolved the way each release's pretrain_gpt.py does it: 0.19
through megatron.training.argument_utils.gpt_config_from_args, 0.17 / 0.18 through
gpt_builders.gpt_builder's `import_module(args.spec)` (gpt_builders.py lives at the checkout root
and is not in the wheel, so the runner makes that one call itself).
"""

from __future__ import annotations

import importlib.metadata
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
PATCHES = REPO / "patches"
COMPAT = REPO / ".compat"
# release -> (Megatron-LM release branch, megatron-core wheel the tests take its files from)
RELEASES = {
    "0.17": ("core_r0.17.0", "0.17.1"),
    "0.18": ("core_r0.18.0", "0.18.2"),
    "0.19": ("core_r0.19.0", "0.19.2"),
}
NEWEST = "0.19"
PATCH_FILES = {
    "0001-mixln-cli-flags.patch": ["megatron/training/arguments.py"],
    "0002-fatal-spec-import.patch": ["megatron/core/transformer/spec_utils.py"],
}
ALL_PATCHES = [(rel, name) for rel in RELEASES for name in sorted(PATCH_FILES)]


def _patch(release: str, name: str) -> Path:
    return PATCHES / RELEASES[release][0] / name


def _release_param(release):
    """Older releases belong to the compatibility subset that `make test-compat` runs."""
    marks = () if release == NEWEST else (pytest.mark.compat,)
    return pytest.param(release, marks=marks, id=f"mcore{release}")


def _wheel_megatron_dir(release: str) -> Path:
    """The megatron/ directory of the release's wheel: the main venv's or a .compat overlay."""
    branch, pin = RELEASES[release]
    current = os.environ.get("COMPAT_MEGATRON_RELEASE")
    if current and release != NEWEST and release != current:
        pytest.skip(f"megatron-core {release}'s patches are tested in its own `make test-compat` "
                    f"pass (this pass is {current})")
    searched = [Path(p) for p in sys.path if p] + [COMPAT / release]
    for dist in importlib.metadata.distributions(name="megatron-core", path=[str(p) for p in searched]):
        if dist.version.split("+")[0] == pin:
            megatron = Path(dist.locate_file("megatron")).resolve()
            if (megatron / "training" / "arguments.py").is_file():
                return megatron
    pytest.skip(f"megatron-core {pin} ({branch}) is not installed: its overlay {COMPAT / release} "
                f"is absent; `scripts/compat_env.sh {release}` installs it (`make test-compat` does)")

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
import megatron.core
from megatron.training import arguments as margs
if job["spec_path"] == "config":  # 0.19: pretrain_gpt.py builds a model config from args
    from megatron.training.argument_utils import gpt_config_from_args
results["_files"] = {"arguments": margs.__file__, "spec_utils": spec_utils.__file__}
results["_version"] = megatron.core.__version__

def _spec_name(spec):
    # The --spec object's public name: a function (0.19) or a ModuleSpec (0.17 / 0.18, see
    # the --spec edge mixln_megatron.spec), one of its module attributes.
    import mixln_megatron.spec as mixln_spec

    for name in ("mixln_layer_spec", "mixln_local_layer_spec"):
        if getattr(mixln_spec, name) is spec:
            return f"mixln_megatron.spec.{name}"
    return f"{spec.__module__}.{spec.__qualname__}"

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
        if not case.get("hide_plugin"):  # what the --spec function would build from these args
            from mixln_megatron.spec import settings_for_spec
            st = settings_for_spec(args=args)
            res["settings"] = {n: [getattr(st, n), st.source(n)] for n in ("alpha", "post_ln_layers", "scheme")}
            res["settings"].update({"spike." + n: [getattr(st.spike, n), st.spike.source(n)]
                                    for n in ("enabled", "threshold")})
        if case.get("validate") or case.get("model_config"):
            margs.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
            res["validated"] = True
        if case.get("model_config") and job["spec_path"] == "config":
            spec = gpt_config_from_args(args).transformer_layer_spec
        elif case.get("model_config"):  # 0.17 / 0.18: gpt_builders.gpt_builder's own call
            spec = spec_utils.import_module(args.spec)
        if case.get("model_config"):
            res["spec"] = None if spec is None else _spec_name(spec)
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


def _git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def _make_checkout(root: Path, release: str) -> Path:
    shutil.copytree(_wheel_megatron_dir(release), root / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for cmd in (["init", "-q"], ["config", "user.email", "test@example.invalid"],
                ["config", "user.name", "test"]):
        assert _git(*cmd, cwd=root).returncode == 0
    return root


def _run_cases(tmp: Path, release: str, pythonpath_first: Path) -> dict:
    (tmp / "spec_mods").mkdir(exist_ok=True)
    (tmp / "spec_mods" / f"{BROKEN_SPEC_MODULE}.py").write_text(BROKEN_SPEC_SOURCE)
    cases = tmp / "cases.json"
    out = tmp / "results.json"
    spec_path = "config" if release == "0.19" else "builder"
    cases.write_text(json.dumps({"cases": CASES, "base_argv": BASE_ARGV, "spec_path": spec_path}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    paths = [str(p) for p in (pythonpath_first, tmp / "spec_mods", REPO)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(WORLD_SIZE="1", RANK="0")
    # forked from the tests' preloaded server where the tree is the venv's own (0.19 unpatched);
    # another megatron tree first on PYTHONPATH gets a fresh interpreter (forked_ranks)
    proc = run_python([sys.executable, "-c", _RUNNER, str(cases), str(out)], env=env, cwd=tmp, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    # the subprocess really ran the release under test
    assert results["_version"].split("+")[0] == RELEASES[release][1], results["_version"]
    return results


@pytest.fixture(scope="module", params=[_release_param(r) for r in RELEASES])
def release(request):
    return request.param


@pytest.fixture(scope="module")
def checkout(release, tmp_path_factory):
    """A Megatron-LM-like checkout made of the release wheel's files, with its patches applied."""
    root = _make_checkout(tmp_path_factory.mktemp(f"megatron-lm-{release}"), release)
    checks = {}
    for name in PATCH_FILES:
        check = _git("apply", "--check", str(_patch(release, name)), cwd=root)
        checks[name] = check
        if check.returncode == 0:
            applied = _git("apply", str(_patch(release, name)), cwd=root)
            assert applied.returncode == 0, applied.stderr
    return root, checks, release


@pytest.fixture(scope="module")
def patched(checkout, tmp_path_factory):
    root, _, release = checkout
    return _run_cases(tmp_path_factory.mktemp(f"patched-{release}"), release, root)


@pytest.fixture(scope="module")
def unpatched(release, tmp_path_factory):
    return _run_cases(tmp_path_factory.mktemp(f"unpatched-{release}"), release,
                      _wheel_megatron_dir(release).parent)


def _error_text(res) -> str:
    return "\n".join(f"{e['type']}: {e['message']}" for e in res.get("error", []))


# ---------------------------------------------------------------- the patch files themselves


@pytest.mark.parametrize("release,name", ALL_PATCHES)
def test_patch_header_and_scope(release, name):
    text = _patch(release, name).read_text()
    header, sep, _ = text.partition("\ndiff --git ")
    assert sep, f"{name} is not a git diff"
    branch = RELEASES[release][0]
    assert re.search(rf"Applies to: Megatron-LM release core {re.escape(release)}\.x \(branch "
                     rf"{branch}\b", header), header
    assert "git apply --check" in header
    touched = re.findall(r"^diff --git a/(\S+) b/\1$", text, re.M)
    assert touched == PATCH_FILES[name]
    assert not re.search(r"^(---|\+\+\+) (a|b)/(a|b)/", text, re.M), "doubled path prefix"


def test_every_patch_is_tested_and_documented():
    assert sorted(p.name for p in PATCHES.iterdir() if p.is_dir()) == sorted(
        branch for branch, _ in RELEASES.values())
    assert not list(PATCHES.glob("*.patch")), "patches live in per-release directories"
    readme = (PATCHES / "README.md").read_text()
    for branch, _ in RELEASES.values():
        on_disk = sorted(p.name for p in (PATCHES / branch).glob("*.patch"))
        assert on_disk == sorted(PATCH_FILES), branch
        assert f"{branch}/" in readme
    for name in PATCH_FILES:
        assert name in readme


def _index_blobs(patch: Path) -> tuple[str, str]:
    pre, post = re.search(r"^index ([0-9a-f]{40})\.\.([0-9a-f]{40}) ", patch.read_text(), re.M).groups()
    return pre, post


@pytest.mark.parametrize("release,name", [pytest.param(r, n, marks=_release_param(r).marks)
                                          for r, n in ALL_PATCHES])
def test_release_wheel_file_is_the_branch_file(release, name):
    """The wheel's copy is byte-identical to the release branch's blob named in the patch."""
    (rel_path,) = PATCH_FILES[name]
    wheel_file = _wheel_megatron_dir(release).parent / rel_path
    blob = _git("hash-object", str(wheel_file), cwd=REPO).stdout.strip()
    assert blob == _index_blobs(_patch(release, name))[0], (wheel_file, blob)


@pytest.mark.parametrize("name", sorted(PATCH_FILES))
def test_patch_applies_cleanly_to_the_release(checkout, name):
    root, checks, release = checkout
    assert checks[name].returncode == 0, checks[name].stderr
    # ... and can be taken back out again (the README's undo instruction)
    assert _git("apply", "-R", "--check", str(_patch(release, name)), cwd=root).returncode == 0
    # the result is exactly the post-image the patch names
    (rel_path,) = PATCH_FILES[name]
    blob = _git("hash-object", rel_path, cwd=root).stdout.strip()
    assert blob == _index_blobs(_patch(release, name))[1]


@pytest.mark.parametrize("release", [_release_param(r) for r in RELEASES])
def test_patches_apply_with_patch_p1(release, tmp_path):
    """`patch -p1` works too (for trees that are not git checkouts)."""
    if shutil.which("patch") is None:
        pytest.skip("the patch tool is not installed")
    root = tmp_path / "tree"
    for files in PATCH_FILES.values():
        for rel in files:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(_wheel_megatron_dir(release).parent / rel, root / rel)
    for name in sorted(PATCH_FILES):
        proc = subprocess.run(["patch", "-p1", "--dry-run", "-i", str(_patch(release, name))],
                              cwd=root, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_patched_modules_come_from_the_patched_tree(checkout, patched):
    root, _, _ = checkout
    for path in patched["_files"].values():
        assert Path(path).resolve().is_relative_to(root.resolve()), path


# ---------------------------------------------------------------- 0001: --mixln-* flags


def test_unpatched_parser_rejects_mixln_flags(unpatched):
    assert unpatched["flags"].get("exit") == 2  # argparse: unrecognized arguments


def test_flags_reach_the_spec_without_the_environment(patched):
    res = patched["flags"]
    assert "error" not in res and "exit" not in res, res
    assert res["args"]["mixln_alpha"] == "0.0625"
    # the --spec function reads the flag from Megatron-LM's args, by its name; it wins over a
    # variable inherited from the launcher, and nothing is exported
    assert res["settings"]["alpha"] == ["0.0625", "--mixln-alpha"]
    assert res["settings"]["post_ln_layers"] == [None, "default"]
    assert res["env"] == {"MIXLN_POST_LN_LAYERS": "3"}


def test_without_flags_nothing_changes(patched):
    res = patched["no_flags"]
    assert "error" not in res, res
    assert res["args"]["mixln_alpha"] is None and res["args"]["mixln_post_ln_layers"] is None
    assert res["env"] == {}
    assert res["settings"]["alpha"] == [None, "default"]


def test_both_flags_is_a_clear_error(patched):
    text = _error_text(patched["both_flags"])
    assert "MixLNConfigError" in text
    assert "--mixln-alpha" in text and "--mixln-post-ln-layers" in text and "both" in text


def test_invalid_alpha_is_rejected_at_parse_time(patched):
    text = _error_text(patched["bad_alpha"])
    assert "MixLNConfigError" in text and "1.5" in text


def test_scheme_and_spike_flags_reach_the_spec(patched):
    res = patched["scheme_and_spike"]
    assert "error" not in res, res
    assert res["settings"]["post_ln_layers"] == [1, "--mixln-post-ln-layers"]
    assert res["settings"]["scheme"] == ["mixln+lns", "--mixln-scheme"]
    assert res["settings"]["spike.enabled"] == [True, "--mixln-spike-scaler"]
    assert res["settings"]["spike.threshold"] == [25.0, "--mixln-spike-threshold"]
    assert res["env"] == {}


def test_extra_args_provider_with_the_same_flags_does_not_conflict(patched):
    """The plugin's entry point passes add_mixln_args itself; the patched parser must accept that."""
    res = patched["with_provider"]
    assert "error" not in res and "exit" not in res, res
    assert res["settings"]["post_ln_layers"] == [2, "--mixln-post-ln-layers"]


def test_patched_args_pass_validate_args(patched):
    res = patched["validate"]
    assert res.get("validated") is True, res
    assert res["settings"]["alpha"] == ["0.25", "--mixln-alpha"]


def test_missing_plugin_is_a_clear_error(patched):
    text = _error_text(patched["missing_plugin"])
    assert "ImportError" in text
    assert "0001-mixln-cli-flags" in text and "mixln_megatron" in text


def _flags_the_patch_adds(patch: Path) -> set:
    """The --mixln-* flags patch 0001 adds to Megatron-LM's parser: its added lines hand the parser
    to the plugin's add_mixln_args, so that function's flags, plus any flag the added lines spell out."""
    import argparse

    from mixln_megatron.megatron_args import add_mixln_args

    added = "\n".join(line[1:] for line in patch.read_text().splitlines()
                      if line.startswith("+") and not line.startswith("+++"))
    assert ".add_mixln_args(parser)" in added, f"{patch}: its added lines no longer call add_mixln_args"
    parser = add_mixln_args(argparse.ArgumentParser())
    flags = {s for action in parser._actions for s in action.option_strings if s.startswith("--mixln-")}
    return flags | set(re.findall(r"--mixln-[a-z0-9-]+", added))


@pytest.mark.parametrize("release", list(RELEASES))
def test_readme_names_every_flag_the_patch_adds(release):
    flags = _flags_the_patch_adds(_patch(release, "0001-mixln-cli-flags.patch"))
    named = set(re.findall(r"`(--mixln-[a-z0-9-]+)`", (PATCHES / "README.md").read_text()))
    missing, unknown = sorted(flags - named), sorted(named - flags)
    assert not missing, f"patches/README.md does not name {missing}, which patch 0001 adds: add them"
    assert not unknown, f"patches/README.md names {unknown}, which patch 0001 does not add: remove them"


# ---------------------------------------------------------------- 0002: fatal --spec import


def test_unpatched_bad_spec_is_silently_ignored(unpatched):
    """The bug the patch fixes: every release logs one line and returns no spec (0.19 then trains
    the default Pre-LN layer spec; 0.17 / 0.18 hand None to GPTModel, which fails much later)."""
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
    """Set MEGATRON_LM_DIR to a Megatron-LM checkout (core_r0.17/0.18/0.19) to check it directly;
    the release is recognised from the blob of its megatron/training/arguments.py."""
    path = os.environ.get("MEGATRON_LM_DIR")
    if not path:
        pytest.skip("MEGATRON_LM_DIR is not set (a Megatron-LM core_r0.17/0.18/0.19 checkout)")
    (rel_path,) = PATCH_FILES["0001-mixln-cli-flags.patch"]
    blob = _git("hash-object", str(Path(path) / rel_path), cwd=REPO).stdout.strip()
    found = [r for r in RELEASES if blob in _index_blobs(_patch(r, "0001-mixln-cli-flags.patch"))]
    assert found, f"{path}/{rel_path} is from none of the releases {sorted(RELEASES)}"
    for name in sorted(PATCH_FILES):
        patch = str(_patch(found[0], name))
        proc = _git("apply", "--check", patch, cwd=path)
        if proc.returncode != 0:  # fine if it is already applied there
            undo = _git("apply", "-R", "--check", patch, cwd=path)
            assert undo.returncode == 0, f"{name} neither applies nor is applied: {proc.stderr}"
