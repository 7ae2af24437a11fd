"""Everything the training hooks install outside their own objects can be taken back:
the optimizer's step wrapper, the finalize wrappers on the config, the layer-built callbacks on the
config and the checkpoint holders on the layers; the settings record only adds its key to the
metadata dict it is given."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mixln_megatron.model.placement import Placement
from mixln_megatron.model.settings import SpikeSettings


@pytest.fixture
def new_optimizer(mcore_single):
    """Makes megatron's own optimizer (get_megatron_optimizer, via dev.testing.TinyTrainer) over a
    one-layer stock GPT in DDP: `step` on its class, returning (success, grad norm, zeros)."""
    from harness.testing import TinyTrainer, build_gpt, mixln_spec, tiny_config

    def make():
        config = tiny_config(num_layers=1, hidden=16, heads=2)
        return TinyTrainer(config, [build_gpt(config, mixln_spec(config, 0, None, stock=True))]).optimizer

    return make


def _steps(optimizer) -> int:
    """Steps the optimizer has taken (its torch optimizer's own count)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])[0].optimizer
    state = next(iter(inner.state.values()), {})
    return int(state.get("step", 0))


def _scaler(driven: list, name: str):
    from mixln_megatron.training.spike import SpikeScaler, resolve_spike_settings

    scaler = SpikeScaler(resolve_spike_settings(SpikeSettings(enabled=True)), Placement(num_layers=4, post_ln_layers=2))
    scaler.after_optimizer_step = lambda success: driven.append(name)
    return scaler


def test_install_remove_install_leaves_only_the_second_scaler_on_the_optimizer(new_optimizer):
    from mixln_megatron.training.spike import install_finalize_hook, remove_spike_scaler

    optimizer, config, driven = new_optimizer(), SimpleNamespace(finalize_model_grads_func=None), []
    old = _scaler(driven, "old")
    install_finalize_hook(config, old)
    old.set_optimizer(optimizer)
    optimizer.step()
    assert driven == ["old"]

    assert remove_spike_scaler(config) is old
    optimizer.step()
    assert driven == ["old"] and _steps(optimizer) == 2
    assert config.finalize_model_grads_func is None
    assert "step" not in vars(optimizer) and old.optimizer is None  # the class's step again

    new = _scaler(driven, "new")
    install_finalize_hook(config, new)
    new.set_optimizer(optimizer)
    optimizer.step()
    assert driven == ["old", "new"]  # was ['old', 'old', 'new']: the first scaler still driven
    assert vars(optimizer)["step"].scaler is new and vars(optimizer)["step"].original.__func__ is type(optimizer).step
    assert remove_spike_scaler(config) is new and "step" not in vars(optimizer)
    assert remove_spike_scaler(config) is None  # nothing left to remove


def test_unwrapping_keeps_what_was_there_and_what_came_after(new_optimizer):
    from mixln_megatron.training.spike import install_finalize_hook, remove_spike_scaler

    optimizer, config, driven = new_optimizer(), SimpleNamespace(finalize_model_grads_func=None), []
    own = optimizer.step  # an instance attribute set by someone else before the scaler
    optimizer.step = own
    first = _scaler(driven, "first")
    install_finalize_hook(config, first)
    first.set_optimizer(optimizer)
    remove_spike_scaler(config)
    assert vars(optimizer)["step"] is own

    second = _scaler(driven, "second")
    install_finalize_hook(config, second)
    second.set_optimizer(optimizer)
    ours = optimizer.step
    optimizer.step = lambda: ours()  # someone wraps the step again after the scaler
    remove_spike_scaler(config)
    optimizer.step()
    assert driven == [] and _steps(optimizer) == 1  # their wrapper stays; ours passes the step through

    third = _scaler(driven, "third")
    install_finalize_hook(config, third)
    third.set_optimizer(optimizer)
    third.set_optimizer(new_optimizer())  # moving to another optimizer lets go of the first
    optimizer.step()
    assert driven == []


def test_finalize_wrappers_come_out_of_the_chain_in_any_order():
    from mixln_megatron.training.spike import SpikeGradsHook, get_spike_scaler, install_finalize_hook, remove_spike_scaler
    from mixln_megatron.training.telemetry import TelemetryHook, get_telemetry, install_telemetry, remove_telemetry

    def user_finalize(*args, **kwargs):
        return None

    config = SimpleNamespace(finalize_model_grads_func=user_finalize)
    scaler = _scaler([], "scaler")
    install_finalize_hook(config, scaler)
    telemetry = install_telemetry(config, interval=2)
    assert get_spike_scaler(config) is scaler and get_telemetry(config) is telemetry
    assert remove_spike_scaler(config) is scaler  # from under the telemetry
    hook = config.finalize_model_grads_func
    assert isinstance(hook, TelemetryHook) and hook.original is user_finalize and get_spike_scaler(config) is None
    assert remove_telemetry(config) is telemetry and config.finalize_model_grads_func is user_finalize

    config = SimpleNamespace(finalize_model_grads_func=None)  # as Megatron-LM leaves it before train()
    install_telemetry(config, interval=1)
    install_finalize_hook(config, scaler)
    assert remove_telemetry(config) is not None
    assert isinstance(config.finalize_model_grads_func, SpikeGradsHook) and config.finalize_model_grads_func.original is None
    remove_spike_scaler(config)
    assert config.finalize_model_grads_func is None and remove_telemetry(config) is None


def test_layer_callbacks_and_holders_are_taken_back(new_optimizer):
    from harness.testing import build_gpt, tiny_config
    from mixln_megatron.model.layer import _ON_LAYER_BUILT
    from mixln_megatron.model.settings import MixLNSettings
    from mixln_megatron.spec import get_mixln_decoder_block_spec
    from mixln_megatron.training.hooks import install_training_hooks
    from mixln_megatron.training.spike import HOLDER_NAME, remove_spike_scaler

    settings = MixLNSettings(post_ln_layers=2, spike=SpikeSettings(enabled=True))
    config = tiny_config(num_layers=4)
    spec = get_mixln_decoder_block_spec(config, backend="local", settings=settings)
    before = dict(vars(config))
    scaler = install_training_hooks(config, settings)["spike_scaler"]
    assert _ON_LAYER_BUILT in vars(config)
    layers = build_gpt(config, spec).decoder.layers
    assert [HOLDER_NAME in layer._modules for layer in layers] == [False, True, True, False]
    optimizer = new_optimizer()
    scaler.set_optimizer(optimizer)
    assert remove_spike_scaler(config) is scaler
    assert "step" not in vars(optimizer)
    assert [HOLDER_NAME in layer._modules for layer in layers] == [False] * 4
    assert vars(config) == before


def test_settings_record_only_adds_its_key_to_the_metadata():
    from mixln_megatron.model.checkpoint import METADATA_KEY, add_settings_record

    placement = Placement(num_layers=4, post_ln_layers=0)  # stock: no ShardedObject, metadata only
    layer = SimpleNamespace(placement=placement, layer_number=2)
    metadata = {"distrib_optim_sharding_type": "dp_reshardable", "other": [1]}
    add_settings_record(layer, {}, "decoder.layers.", metadata)
    assert metadata == {"distrib_optim_sharding_type": "dp_reshardable", "other": [1], METADATA_KEY: placement.record()}
    saved = dict(metadata)
    add_settings_record(layer, {}, "decoder.layers.", metadata)  # a load: read and compared, not written
    assert metadata == saved


@pytest.mark.compat
def test_the_0_17_dispatcher_is_undone_when_the_last_hook_goes(monkeypatch):
    """0.17/0.18's train() assigns megatron.training.training.finalize_model_grads to the config;
    compat.keep_finalize_hook makes that module global a dispatcher to the config's recorded hook.
    Removing the hooks after train() finds them under the dispatcher, and removing the last one
    gives the config and the module megatron's own function back. The dispatcher is plain Python,
    so this runs on every release with the 0.17/0.18 switch set."""
    import megatron.training.training as training

    from mixln_megatron import compat
    from mixln_megatron.training.spike import get_spike_scaler, install_finalize_hook, remove_spike_scaler
    from mixln_megatron.training.telemetry import TelemetryHook, get_telemetry, install_telemetry, remove_telemetry

    monkeypatch.setattr(compat, "TRAIN_KEEPS_FINALIZE_HOOK", False)
    # On 0.17/0.18 earlier tests in the session may have left configs recording hooks (and the
    # dispatcher in place): start this test from megatron's own function and no records.
    megatron_finalize = getattr(training.finalize_model_grads, "original", training.finalize_model_grads)
    monkeypatch.setattr(training, "finalize_model_grads", megatron_finalize)  # put back whatever happens
    monkeypatch.setattr(compat, "_recorded", [0])
    config = SimpleNamespace(finalize_model_grads_func=None)
    scaler = _scaler([], "scaler")
    install_finalize_hook(config, scaler)
    telemetry = install_telemetry(config, interval=1)
    compat.keep_finalize_hook(config)
    dispatcher = training.finalize_model_grads
    assert dispatcher is not megatron_finalize
    config.finalize_model_grads_func = training.finalize_model_grads  # what 0.17/0.18's train() does
    assert get_spike_scaler(config) is scaler and get_telemetry(config) is telemetry
    assert remove_spike_scaler(config) is scaler and get_spike_scaler(config) is None
    assert training.finalize_model_grads is dispatcher and isinstance(config._mixln_finalize_hook, TelemetryHook)
    assert remove_telemetry(config) is telemetry
    assert training.finalize_model_grads is megatron_finalize
    assert config.finalize_model_grads_func is megatron_finalize and "_mixln_finalize_hook" not in vars(config)
