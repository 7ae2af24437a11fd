"""mixln_megatron.compat: the supported range, and what differs between megatron-core releases.

Runs on the venv's release (`make test`) and on each older one (`make test-compat`, marker
`compat`). The cross-release checkpoint test runs each side in its own process, with the older
release's overlay (`scripts/compat_env.sh 0.17`) on PYTHONPATH.
"""

import json
import os
import sys

import pytest

from harness.testing import run_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "workers", "release_checkpoint_worker.py")


# ------------------------------------------------------------------ release detection
@pytest.mark.compat
@pytest.mark.parametrize("version, release", [("0.17.1", (0, 17)), ("0.18.2+3f9a1c2", (0, 18)), ("0.19.2", (0, 19)),
                                              ("0.20.0+f989a4a", (0, 20))])
def test_supported_releases(version, release):
    from mixln_megatron import compat

    assert compat.check_release(version) == release


@pytest.mark.compat
@pytest.mark.parametrize("version", ["0.16.1", "0.21.0", "1.0.0+abc"])
def test_unsupported_release_names_the_range(version):
    from mixln_megatron import compat
    from mixln_megatron.errors import MixLNError

    with pytest.raises(compat.UnsupportedMegatronRelease) as info:
        compat.check_release(version)
    message = str(info.value)
    assert "\n" not in message and version.split("+")[0] in message and ">=0.17,<0.21" in message
    assert isinstance(info.value, MixLNError) and not isinstance(info.value, ImportError)


@pytest.mark.compat
def test_release_is_the_imported_megatron():
    """`make test-compat` sets COMPAT_MEGATRON_RELEASE: the overlay, not the venv's wheel, is in use."""
    import megatron.core

    from mixln_megatron import compat

    assert compat.VERSION == megatron.core.__version__.split("+")[0]
    expected = os.environ.get("COMPAT_MEGATRON_RELEASE")
    if expected:
        expected = {"main": "0.20"}.get(expected, expected)  # Megatron-LM main's snapshot
        assert compat.VERSION.startswith(expected + ".")


# ------------------------------------------------------------------ what --spec imports
@pytest.mark.compat
def test_stock_spec_object_builds_mixln_the_way_the_release_uses_it(mcore_single, monkeypatch):
    """As Megatron-LM's builder uses the --spec object: called with the config on 0.19, handed to
    GPTModel uncalled on 0.17/0.18 (then the final norm is Megatron's LayerNormImpl)."""
    import sys as _sys

    from megatron.core.transformer.spec_utils import ModuleSpec

    from mixln_megatron import compat, spec
    from harness import testing
    from mixln_megatron.model.backends import MixLNNorm

    global_vars = _sys.modules.get("megatron.training.global_vars")
    if global_vars is not None:
        monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", None)  # settings from the environment
    monkeypatch.setenv("MIXLN_POST_LN_LAYERS", "2")
    monkeypatch.setenv("MIXLN_SPIKE_SCALER", "1")
    config = testing.tiny_config()
    assert config.finalize_model_grads_func is None
    stock = spec.mixln_local_layer_spec
    if compat.SPEC_GETS_THE_CONFIG:
        assert callable(stock) and not isinstance(stock, ModuleSpec)
        block = stock(config, vp_stage=None)
    else:
        assert isinstance(stock, ModuleSpec) and isinstance(spec.mixln_layer_spec, ModuleSpec)
        block = stock
    model = testing.build_gpt(config, block)
    assert [layer.is_post_ln for layer in model.decoder.layers] == [True, True, False, False]
    assert config.finalize_model_grads_func is not None  # the spike scaler, installed at the edge
    final = model.decoder.final_layernorm
    if compat.SPEC_GETS_THE_CONFIG:
        assert isinstance(final, MixLNNorm)
    else:
        import torch
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        from megatron.core.transformer.transformer_block import LayerNormImpl

        # docs/compatibility.md, "--spec on 0.17 / 0.18": Megatron's LayerNormImpl (torch's RMSNorm without TE and apex)
        expected = torch.nn.RMSNorm if LayerNormImpl is WrappedTorchNorm else LayerNormImpl
        assert not isinstance(final, MixLNNorm) and isinstance(final, expected)
    ids, labels, pos, mask = testing.batch()
    assert bool(model(ids, pos, mask, labels=labels).isfinite().all())


# ------------------------------------------------------------------ the finalize hook under train()
@pytest.mark.compat
def test_pretrain_runs_the_finalize_hooks_every_iteration(tmp_path):
    """3 iterations of Megatron-LM's pretrain() (the entry point): the telemetry hook, installed
    after the spike scaler, writes one record per iteration with the scaler's totals. On 0.17/0.18
    train() overwrites config.finalize_model_grads_func; compat.keep_finalize_hook keeps it."""
    from test_pretrain import TINY, train

    path = tmp_path / "telemetry.jsonl"
    train(["--cpu", *TINY, "--train-iters", "3", "--eval-iters", "0", "--mixln-post-ln-layers", "1",
           "--mixln-spike-scaler", "--mixln-telemetry-interval", "1", "--mixln-telemetry-path", str(path)])
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in records]
    assert len(steps) == 3 and steps == sorted(set(steps)), steps
    assert all("spike" in r for r in records)  # the scaler ran inside the telemetry hook


# ------------------------------------------------------------------ checkpoints across releases
def _worker(overlay, *steps):
    """The worker in its own process with `overlay`'s release first on PYTHONPATH: one result per
    (action, directory) step, in order, all in that one process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and ".compat" not in p]
    env["PYTHONPATH"] = os.pathsep.join(([overlay] if overlay else []) + [REPO, *paths])
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = run_python([sys.executable, WORKER, *map(str, steps)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(steps) // 2, proc.stdout[-3000:]
    return results


def _in_process(action, directory):
    """The same worker step on this process's release (the venv's), in the mcore_single group, on
    one thread as the worker processes run (the losses are compared bit for bit), this process's
    RNG state left as it was."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("release_checkpoint_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            return worker.run(action, str(directory))
    finally:
        torch.set_num_threads(threads)


def test_checkpoint_saved_by_0_17_loads_in_0_19_and_not_back(tmp_path, request):
    """0.17 saves, 0.19 loads it (the same loss); 0.19 saves, 0.17 refuses it in one line. The 0.19
    side runs in this process (the venv's release), the 0.17 side in one process of its own."""
    import megatron.core

    overlay = os.path.join(REPO, ".compat", "0.17")
    if not os.path.isdir(os.path.join(overlay, "megatron")):
        pytest.skip("megatron-core 0.17 overlay absent: run `scripts/compat_env.sh 0.17` (make test-compat does)")
    if not megatron.core.__version__.startswith("0.19."):
        pytest.skip("runs from the 0.19 venv (make test)")
    request.getfixturevalue("mcore_single")
    saved19 = _in_process("save", tmp_path / "by19")
    saved17, refused = _worker(overlay, "save", tmp_path / "by17", "load", tmp_path / "by19")
    loaded19 = _in_process("load", tmp_path / "by17")
    assert saved17["release"].startswith("0.17.") and loaded19["release"].startswith("0.19.")
    assert refused["release"].startswith("0.17.")
    assert loaded19["loss"] == saved17["loss"]  # bit-identical weights
    assert "saved by megatron-core 0.19 or newer" in refused["error"] and "cannot load it" in refused["error"]
    assert not (tmp_path / "by19" / "common.pt").exists() and saved19["release"].startswith("0.19.")
    # The entry point on 0.17 refuses it the same way, before Megatron reads anything.
    from test_pretrain import TINY

    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXLN_") and k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=os.pathsep.join([overlay, REPO]), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = run_python([sys.executable, "-m", "mixln_megatron.training.pretrain", "--cpu", *TINY,
                           "--load", str(tmp_path / "by19")], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "saved by megatron-core 0.19 or newer" in proc.stderr.splitlines()[-1]


# ------------------------------------------------------------------ N: the MLP residual step
@pytest.mark.compat
def test_layer_overrides_the_mlp_residual_step_this_release_calls(mcore_single):
    """0.20 renamed `_forward_post_mlp` to `_apply_mlp_bda_step` and routes a subclass's legacy
    override through a shim that warns; the layer keeps only the name its release calls, so a
    Post-LN forward runs N2 on every release without the shim's DeprecationWarning."""
    import warnings

    from megatron.core.transformer.transformer_layer import TransformerLayer

    from mixln_megatron import compat
    from mixln_megatron.spec import get_mixln_decoder_block_spec
    from harness import testing
    from mixln_megatron.model.layer import MixLNTransformerLayer

    assert hasattr(TransformerLayer, compat.MLP_BDA_HOOK)
    assert compat.MLP_BDA_HOOK in vars(MixLNTransformerLayer)
    other = ({"_forward_post_mlp", "_apply_mlp_bda_step"} - {compat.MLP_BDA_HOOK}).pop()
    assert other not in vars(MixLNTransformerLayer)
    assert (compat.MLP_BDA_HOOK == "_apply_mlp_bda_step") == (compat.RELEASE >= (0, 20))
    config = testing.tiny_config()
    model = testing.build_gpt(config, get_mixln_decoder_block_spec(config, backend="local", post_ln_layers=2))
    calls = []
    for layer in model.decoder.layers:
        if layer.is_post_ln:
            layer.post_mlp_layernorm.register_forward_hook(
                lambda *_, n=layer.layer_number: calls.append(n))
    ids, labels, pos, mask = testing.batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert bool(model(ids, pos, mask, labels=labels).isfinite().all())
    assert not [w for w in caught if "_forward_post_mlp" in str(w.message)]  # no shim on 0.20
    assert sorted(calls) == [1, 2]  # N2 of both Post-LN layers ran


# ------------------------------------------------------------------ one-line refusals at the --spec edge
def _error_lines(text):
    return [line for line in text.splitlines() if line.startswith("[mixln_megatron] ERROR:")]


@pytest.mark.compat
def test_spec_edge_refuses_a_checkpoint_of_a_newer_release_in_one_line(mcore_single, tmp_path, monkeypatch, capsys):
    """The --spec objects run before Megatron-LM reads --load: on 0.17/0.18 a 0.19+ torch_dist
    checkpoint (no common.pt) is refused there, one `[mixln_megatron] ERROR:` line on rank 0,
    instead of Megatron's missing-common.pt traceback on every rank. 0.19+ reads it: no refusal."""
    import argparse

    from mixln_megatron import compat, spec
    from harness import testing

    iteration = tmp_path / "iter_0000005"
    iteration.mkdir()
    (iteration / ".metadata").write_bytes(b"")  # what 0.19 writes: DCP files, no common.pt
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    args = argparse.Namespace(load=str(tmp_path))
    config = testing.tiny_config()
    if compat.RELEASE >= (0, 19):
        spec.stock_layer_spec(config, "local", environ={}, args=args)
        assert not _error_lines(capsys.readouterr().err)
        return
    with pytest.raises(compat.CheckpointFromNewerRelease, match="saved by megatron-core 0.19 or newer"):
        spec.stock_layer_spec(config, "local", environ={}, args=args)
    lines = _error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "cannot load it" in lines[0] and str(iteration) in lines[0]


@pytest.mark.compat
@pytest.mark.parametrize("caller", ["megatron-lm training", "library"])
def test_settings_mismatch_on_resume_is_one_line_first(mcore_single, monkeypatch, capsys, caller):
    """A resume with other Mix-LN settings, found in the content metadata Megatron-LM's load hands
    back: one `[mixln_megatron] ERROR:` line, then, under Megatron-LM's training (its global args
    set), SystemExit(2) (no traceback) on every rank; a library caller (megatron-core's own load,
    the analysis tools) gets MixLNCheckpointMismatch itself, which it may catch."""
    import argparse

    from mixln_megatron import errors
    from harness import testing
    from mixln_megatron.model import checkpoint
    from mixln_megatron.spec import get_mixln_decoder_block_spec

    config = testing.tiny_config()
    model = testing.build_gpt(config, get_mixln_decoder_block_spec(config, backend="local", post_ln_layers=1))
    saved = {checkpoint.METADATA_KEY: {"format": 1, "scheme": "mixln", "num_layers": 4, "post_ln_layers": 2,
                                       "alpha": None}}
    global_vars = pytest.importorskip("megatron.training.global_vars")
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", argparse.Namespace() if caller != "library" else None)
    if caller == "library":
        with pytest.raises(checkpoint.MixLNCheckpointMismatch, match="Mix-LN settings differ"):
            model.sharded_state_dict(metadata=saved)
    else:
        with pytest.raises(SystemExit, match="Mix-LN settings differ") as left:
            model.sharded_state_dict(metadata=saved)
        assert left.value.code == 2 and isinstance(left.value, errors.Refusal)
        assert isinstance(left.value.error, checkpoint.MixLNCheckpointMismatch)
    lines = _error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "P=2 of L=4" in lines[0] and "P=1 of L=4" in lines[0]
