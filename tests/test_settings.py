"""The settings object: sources, layering, the edges that build it, and who may read MIXLN_*."""

import argparse
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from mixln_megatron.errors import MixLNConfigError
from mixln_megatron.megatron_args import add_mixln_args
from mixln_megatron.model.placement import resolve_placement
from mixln_megatron.model.settings import MixLNSettings, SpikeSettings, TelemetrySettings, layered

PACKAGE = Path(__file__).resolve().parents[1] / "mixln_megatron"


def flags(*argv):
    return MixLNSettings.from_args(add_mixln_args(argparse.ArgumentParser()).parse_args(list(argv)))


def test_each_value_names_its_source():
    s = flags("--mixln-alpha", "0.0625", "--mixln-spike-scaler", "--mixln-telemetry-interval", "5")
    assert s.source("alpha") == "--mixln-alpha"
    assert s.source("post_ln_layers") == "default" and s.source("scheme") == "default"
    assert s.spike.source("enabled") == "--mixln-spike-scaler" and s.spike.source("beta") == "default"
    assert s.telemetry.source("interval") == "--mixln-telemetry-interval"
    env = MixLNSettings.from_environ({"MIXLN_POST_LN_LAYERS": "2", "MIXLN_SPIKE_BETA": "0.9"})
    assert env.source("post_ln_layers") == "MIXLN_POST_LN_LAYERS" and env.post_ln_layers == 2
    assert env.spike.source("beta") == "MIXLN_SPIKE_BETA"
    assert MixLNSettings(alpha=0.25).source("alpha") == "argument"
    assert MixLNSettings().placement_source == "default"


def test_the_build_line_names_the_true_source():
    line = lambda s: resolve_placement(32, s).describe()  # noqa: E731
    assert "alpha=0.0625 (from --mixln-alpha)" in line(flags("--mixln-alpha", "0.0625"))
    assert "alpha=0.0625 (from MIXLN_ALPHA)" in line(MixLNSettings.from_environ({"MIXLN_ALPHA": "0.0625"}))
    ckpt = MixLNSettings.from_checkpoint(SimpleNamespace(mixln_post_ln_layers=2, mixln_scheme="mixln"))
    assert "P=2 alpha=n/a (P given directly) (from the checkpoint)" in line(ckpt)
    assert "alpha=0.25 (default)" in resolve_placement(12, MixLNSettings()).describe()
    assert "(from the arguments)" in line(MixLNSettings(post_ln_layers=2))
    assert "environment" not in line(flags("--mixln-alpha", "0.0625"))


def test_layered_takes_each_group_from_the_highest_layer_that_sets_it():
    top = flags("--mixln-alpha", "0.5", "--mixln-spike-threshold", "30")
    env = MixLNSettings.from_environ({"MIXLN_POST_LN_LAYERS": "3", "MIXLN_SCHEME": "mixln+lns",
                                 "MIXLN_SPIKE_SCALER": "1", "MIXLN_SPIKE_THRESHOLD": "80"})
    s = layered(top, env)
    # alpha and post_ln_layers are one group: the flag's alpha wins, the variable's P is dropped
    assert (s.alpha, s.post_ln_layers, s.source("alpha")) == ("0.5", None, "--mixln-alpha")
    assert (s.scheme, s.source("scheme")) == ("mixln+lns", "MIXLN_SCHEME")
    assert (s.spike.threshold, s.spike.source("threshold")) == (30.0, "--mixln-spike-threshold")
    assert (s.spike.enabled, s.spike.source("enabled")) == (True, "MIXLN_SPIKE_SCALER")
    assert layered(None, None) == MixLNSettings()


def test_settings_are_frozen_and_validated_with_their_source():
    s = flags("--mixln-alpha", "0.25")
    with pytest.raises(Exception):
        s.alpha = "0.5"
    with pytest.raises(MixLNConfigError, match=r"alpha from --mixln-alpha must lie in \[0, 1\]"):
        flags("--mixln-alpha", "1.5")
    with pytest.raises(MixLNConfigError, match="--mixln-alpha 0.25 and --mixln-post-ln-layers 3"):
        flags("--mixln-alpha", "0.25", "--mixln-post-ln-layers", "3")
    with pytest.raises(MixLNConfigError, match="spike threshold from --mixln-spike-threshold"):
        flags("--mixln-spike-threshold", "0.5")
    with pytest.raises(MixLNConfigError, match="MIXLN_TELEMETRY_INTERVAL"):
        MixLNSettings.from_environ({"MIXLN_TELEMETRY_INTERVAL": "often"})
    with pytest.raises(MixLNConfigError, match="post_ln_layers = 5 \\(from MIXLN_POST_LN_LAYERS\\)"):
        resolve_placement(4, MixLNSettings.from_environ({"MIXLN_POST_LN_LAYERS": "5"}))
    assert SpikeSettings(threshold=30, sources={"threshold": "X"}).source("threshold") == "X"
    assert TelemetrySettings(interval=3).source("interval") == "argument"


def test_one_constructor_per_source():
    """Arguments, MIXLN_*, Megatron-LM's flags and a checkpoint (its args or its Mix-LN record)."""
    record = {"format": 1, "scheme": "mixln", "num_layers": 4, "post_ln_layers": 2, "alpha": "0.5"}
    ckpt = MixLNSettings.from_checkpoint(record)
    assert (ckpt.post_ln_layers, ckpt.alpha, ckpt.source("post_ln_layers")) == (2, None, "the checkpoint")
    assert MixLNSettings.from_environ({"MIXLN_SCHEME": "lns"}).source("scheme") == "MIXLN_SCHEME"
    assert MixLNSettings.from_args(SimpleNamespace(mixln_alpha="0.5")).source("alpha") == "--mixln-alpha"
    assert MixLNSettings.from_environ({}) == MixLNSettings() == MixLNSettings.from_args(SimpleNamespace())


def test_checkpoint_args_are_a_source_below_flags():
    ckpt = MixLNSettings.from_checkpoint(SimpleNamespace(mixln_post_ln_layers=2, mixln_alpha=None))
    assert (ckpt.post_ln_layers, ckpt.source("post_ln_layers")) == (2, "the checkpoint")
    assert MixLNSettings.from_checkpoint(SimpleNamespace(num_layers=4)) is None
    assert MixLNSettings.from_checkpoint(None) is None
    resumed = layered(flags(), ckpt)
    assert resolve_placement(4, resumed).source == "the checkpoint"
    assert resolve_placement(4, layered(flags("--mixln-post-ln-layers", "1"), ckpt)).source == "--mixln-post-ln-layers"


def test_the_spec_edge_reads_flags_then_the_given_environment():
    from mixln_megatron.spec import settings_for_spec

    env = {"MIXLN_ALPHA": "0.5", "MIXLN_SPIKE_SCALER": "1"}
    assert settings_for_spec(environ=env, args=SimpleNamespace()).source("alpha") == "MIXLN_ALPHA"
    patched = add_mixln_args(argparse.ArgumentParser()).parse_args(["--mixln-post-ln-layers", "1"])
    s = settings_for_spec(environ=env, args=patched)  # a patched checkout: the flag wins
    assert (s.post_ln_layers, s.alpha, s.source("post_ln_layers")) == (1, None, "--mixln-post-ln-layers")
    assert s.spike.enabled and s.spike.source("enabled") == "MIXLN_SPIKE_SCALER"


def test_only_the_settings_module_reads_mixln_variables():
    """`MIXLN_*` is read in one module; others may only name variables in text (docs, messages)."""
    reader = re.compile(r"(os\.environ|getenv|environ\.get|env\.get)\b[^\n]*")
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ("model/settings.py", "dev/cpu.py", "dev/demo.py", "dev/testing.py"):  # reader; harness; launchers
            continue
        text = path.read_text()
        for match in reader.finditer(text):
            if "MIXLN_" in match.group(0):
                offenders.append(f"{rel}: {match.group(0).strip()}")
        if re.search(r"^\s*[A-Z_]+\s*=\s*[\"']MIXLN_", text, re.M):
            offenders.append(f"{rel}: defines a MIXLN_* name (model/settings.py owns them)")
    assert not offenders, offenders


def test_building_a_model_from_the_spec_installs_nothing(mcore_single):
    from harness.testing import build_gpt, tiny_config
    from mixln_megatron.spec import get_mixln_decoder_block_spec

    config = tiny_config(num_layers=4)
    asks = MixLNSettings(post_ln_layers=1, spike=SpikeSettings(enabled=True), telemetry=TelemetrySettings(interval=1))
    model = build_gpt(config, get_mixln_decoder_block_spec(config, backend="local", settings=asks))
    assert [layer.is_post_ln for layer in model.decoder.layers] == [True, False, False, False]
    assert config.finalize_model_grads_func is None


def test_the_spec_functions_install_what_the_environment_asks(mcore_single):
    from harness.testing import tiny_config
    from mixln_megatron.training.spike import get_spike_scaler
    from mixln_megatron.spec import stock_decoder_spec
    from mixln_megatron.training.telemetry import get_telemetry

    config = tiny_config(num_layers=4)
    env = {"MIXLN_POST_LN_LAYERS": "2", "MIXLN_SPIKE_SCALER": "1", "MIXLN_TELEMETRY_INTERVAL": "3"}
    spec = stock_decoder_spec(config, "local", environ=env, args=SimpleNamespace())
    params = spec.layer_specs[0].params["mixln_settings"]
    assert params.post_ln_layers == 2 and params.source("post_ln_layers") == "MIXLN_POST_LN_LAYERS"
    assert get_spike_scaler(config).layers == (2, 3)
    assert get_telemetry(config).interval == 3
    quiet = tiny_config(num_layers=4)
    stock_decoder_spec(quiet, "local", environ={"MIXLN_POST_LN_LAYERS": "2"}, args=SimpleNamespace())
    assert quiet.finalize_model_grads_func is None
