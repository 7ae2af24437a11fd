"""Our Pre-LN submodules against megatron's stock layer-spec builders, flag by flag.

Every argument of megatron's TE and local layer-submodule builders is enumerated from its
signature: a release with a new flag fails `test_every_builder_flag_is_handled` until
backends.BUILDER_FLAGS says how it is filled. For each flag, a config with the flag on must give
our Pre-LN layer exactly megatron's stock submodules built with that flag (same classes, same
params), or be rejected by mixln_megatron.model.support with a reason.

TransformerEngine is not installed here: its classes are replaced by distinct stand-in classes,
and megatron's TE spec provider is made available, so the TE builder runs on the CPU.
"""

import dataclasses
import functools
import inspect

import pytest

from harness import testing as mu


def _stand_in_te(monkeypatch):
    import megatron.core.extensions.transformer_engine as te_ext
    import megatron.core.extensions.transformer_engine_spec_provider as provider
    import megatron.core.models.gpt.gpt_layer_specs as specs

    from mixln_megatron.model import backends

    names = ["TELayerNormColumnParallelLinear", "TEColumnParallelLinear", "TERowParallelLinear",
             "TEDotProductAttention", "TENorm", "_TENormWithResidual", "TELinear", "TEActivationOp"]
    for name in names:
        cls = type(name, (), {})
        monkeypatch.setattr(te_ext, name, cls, raising=False)
        monkeypatch.setattr(provider, name, cls, raising=False)
    monkeypatch.setattr(te_ext, "HAVE_TE", True)
    monkeypatch.setattr(provider, "is_te_min_version", lambda *a, **k: True)
    monkeypatch.setattr(specs, "TESpecProvider", provider.TESpecProvider)
    monkeypatch.setattr(backends, "have_te", lambda: True)


def _plain(obj):
    """A comparable form of a spec tree: classes by identity, partials and dataclasses by value."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(obj, functools.partial):
        return ("partial", obj.func, tuple(_plain(a) for a in obj.args),
                tuple(sorted((k, _plain(v)) for k, v in obj.keywords.items())))
    if isinstance(obj, ModuleSpec) or (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        return (type(obj), tuple((f.name, _plain(getattr(obj, f.name))) for f in dataclasses.fields(obj)))
    if isinstance(obj, dict):
        return tuple(sorted((k, _plain(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return tuple(_plain(v) for v in obj)
    return obj


def _on_value(flag, default):
    """The value that turns `flag` on."""
    if flag == "normalization":
        return "LayerNorm"
    if flag == "kitchen_attention_backend":
        return "fa"
    if flag == "num_experts":
        return 4
    return True if isinstance(default, bool) or default is None else default


@pytest.mark.parametrize("backend", ["te", "local"])
def test_every_builder_flag_is_handled(backend):
    from mixln_megatron.model import backends

    params = set(inspect.signature(backends.builder(backend)).parameters)
    handled = set(backends.BUILDER_FLAGS[backend])
    assert params - handled == set(), f"megatron's {backend} builder has flags Mix-LN does not handle"
    assert handled - params == set(), f"flags handled for {backend} that megatron's builder lacks"


def _cases():
    from mixln_megatron.model import backends

    for backend in ("te", "local"):
        for flag, how in backends.BUILDER_FLAGS[backend].items():
            yield pytest.param(backend, flag, id=f"{backend}-{flag}")


@pytest.mark.parametrize("backend, flag", list(_cases()))
def test_pre_ln_submodules_equal_megatron_stock_spec_for_each_flag(monkeypatch, backend, flag):
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from mixln_megatron.model import backends, support
    from mixln_megatron.model.backends import MixLNNorm

    if backend == "te":
        _stand_in_te(monkeypatch)
    how = backends.BUILDER_FLAGS[backend][flag]
    if how.field is None:  # never passed: megatron ignores it (deprecated)
        return
    fields = {f.name for c in (TransformerConfig, MLATransformerConfig) for f in dataclasses.fields(c)}
    assert how.field in fields, f"{flag}: {how.field} is not a TransformerConfig field"
    default = inspect.signature(backends.builder(backend)).parameters[flag].default
    value = _on_value(flag, default)
    cfg = mu.tiny_config(num_layers=2)
    setattr(cfg, how.field, value)  # after __post_init__: only the spec builders read it here

    rejected = support.problems(cfg, support.LAYER, backend=backend, post_ln=True)
    if support.problems(cfg, support.LAYER, backend=backend, post_ln=False):
        # rejected for every layer: the model is never built, nothing to compare
        with pytest.raises(support.MixLNUnsupportedError, match=r"\[" + how.field):
            support.check_supported(cfg, backend=backend)
        return
    stock_kwargs = {flag: value}
    if backend == "local":
        stock_kwargs.setdefault("normalization", cfg.normalization)
    try:
        stock = backends.builder(backend)(**stock_kwargs)
    except Exception as exc:  # megatron itself refuses it here (e.g. kitchen not installed)
        with pytest.raises(type(exc)):
            backends.layer_submodules(backend, config=cfg)
        assert rejected, f"{flag}: megatron refuses it and Post-LN layers must reject it too"
        return
    ours = backends.layer_submodules(backend, config=cfg)
    if backend == "local":  # by design: megatron's local norm refuses sequence parallelism
        stock = dataclasses.replace(stock, input_layernorm=MixLNNorm, pre_mlp_layernorm=MixLNNorm)
    assert _plain(ours) == _plain(stock)


def test_qk_l2_norm_reaches_both_layer_kinds(mcore_single):
    """qk_l2_norm used to be silently off: the spec's IdentityOp q/k norms won over L2Norm."""
    from megatron.core.transformer.torch_norm import L2Norm

    from mixln_megatron.spec import get_mixln_decoder_block_spec

    cfg = mu.tiny_config(num_layers=2, qk_l2_norm=True)
    model = mu.build_gpt(cfg, get_mixln_decoder_block_spec(cfg, backend="local", post_ln_layers=1))
    kinds = [layer.is_post_ln for layer in model.decoder.layers]
    assert kinds == [True, False]
    for layer in model.decoder.layers:
        assert isinstance(layer.self_attention.q_layernorm, L2Norm)
        assert isinstance(layer.self_attention.k_layernorm, L2Norm)


def test_te_activation_func_reaches_the_te_mlp(monkeypatch):
    """use_te_activation_func with SwiGLU used to leave MLPSubmodules.activation_func None."""
    import megatron.core.extensions.transformer_engine_spec_provider as provider

    from mixln_megatron.model import backends

    _stand_in_te(monkeypatch)
    cfg = mu.tiny_config(num_layers=2)
    cfg.use_te_activation_func = True
    subs = backends.layer_submodules("te", config=cfg)
    assert subs.mlp.keywords["submodules"].activation_func is provider.TEActivationOp
