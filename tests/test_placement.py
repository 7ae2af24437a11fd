"""The placement rule and the settings: pure Python, no megatron."""

import math
from fractions import Fraction

import pytest

from mixln_megatron.model.placement import (
    MixLNConfigError,
    MixLNSettings,
    Placement,
    post_ln_count,
    resolve_placement,
)
from mixln_megatron.model.settings import layered


@pytest.mark.parametrize("alpha", ["0", "0.0625", "0.125", "0.25", "0.29", "1/3", "0.5", "0.75", "1"])
@pytest.mark.compat
def test_rule_grid_matches_exact_floor(alpha):
    frac = Fraction(alpha)
    for layers in range(1, 129):
        expected = (frac.numerator * layers) // frac.denominator  # integer floor, no floats
        p = resolve_placement(layers, MixLNSettings(alpha=alpha))
        assert p.post_ln_layers == expected == post_ln_count(alpha, layers)
        assert [p.is_post_ln(l) for l in range(1, layers + 1)] == [l <= expected for l in range(1, layers + 1)]


def test_paper_anchor_values():
    assert post_ln_count(0.0625, 32) == 2
    assert post_ln_count(0.25, 12) == 3
    assert post_ln_count(0.25, 24) == 6
    assert post_ln_count(0, 24) == 0
    assert post_ln_count(1, 24) == 24


def test_no_float_error():
    # 0.29 * 100 == 28.999999999999996 in floats
    assert math.floor(0.29 * 100) == 28
    assert post_ln_count("0.29", 100) == 29
    assert post_ln_count(0.29, 100) == 29  # a float is taken by its shortest repr
    assert post_ln_count(0.1, 30) == 3


def test_recorded_integer_and_alpha_text():
    p = resolve_placement(32, MixLNSettings(alpha=0.0625))
    assert p.post_ln_layers == 2 and p.alpha == "0.0625"
    rec = p.record()
    assert rec["post_ln_layers"] == 2 and rec["num_layers"] == 32 and rec["scheme"] == "mixln"
    assert "L=32 P=2" in p.describe() and "1, 2" in p.describe()
    assert p.boundary_layers == (2, 3)
    assert resolve_placement(4, MixLNSettings(post_ln_layers=4)).boundary_layers == ()


def test_precedence_arguments_env_default():
    env = MixLNSettings.from_environ({"MIXLN_ALPHA": "0.5"})
    assert resolve_placement(8, layered(MixLNSettings(post_ln_layers=1), env)).post_ln_layers == 1
    assert resolve_placement(8, layered(MixLNSettings(), env)).post_ln_layers == 4
    assert resolve_placement(8, layered(MixLNSettings(), env)).source == "MIXLN_ALPHA"
    assert resolve_placement(8, MixLNSettings.from_environ({"MIXLN_POST_LN_LAYERS": "3"})).post_ln_layers == 3
    assert resolve_placement(12, None).post_ln_layers == 3  # default alpha 0.25
    assert resolve_placement(12, None).source == "default"
    assert resolve_placement(24, None).post_ln_layers == 6


def test_deep_model_without_setting_is_an_error():
    with pytest.raises(MixLNConfigError, match="32 layers and no Mix-LN setting") as refused:
        resolve_placement(32, None)
    message = str(refused.value)
    assert "\n" not in message  # one line, naming every way to set it: alpha, P or a layout
    assert all(name in message for name in ("--mixln-alpha", "--mixln-post-ln-layers", "--mixln-layout",
                                            "MIXLN_LAYOUT", "layout="))
    assert resolve_placement(32, MixLNSettings(layout="post:1-2,pre:3-")).post_ln_layers == 2
    assert resolve_placement(32, MixLNSettings.from_environ({"MIXLN_ALPHA": "0.0625"})).post_ln_layers == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(alpha=-0.1), r"\[0, 1\]"),
        (dict(alpha=1.5), r"\[0, 1\]"),
        (dict(alpha=float("nan")), "must be a number"),
        (dict(alpha="nan"), "must be a number"),
        (dict(alpha=float("inf")), "must be a number"),
        (dict(alpha="abc"), "must be a number"),
        (dict(alpha=True), "must be a number"),
        (dict(alpha=0.25, post_ln_layers=2), "not both"),
        (dict(post_ln_layers=-1), ">= 0"),
        (dict(scheme="postln"), "one of"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(MixLNConfigError, match=match):
        MixLNSettings(**kwargs)


def test_post_ln_layers_above_num_layers():
    with pytest.raises(MixLNConfigError, match="exceeds the model's num_layers = 4"):
        resolve_placement(4, MixLNSettings(post_ln_layers=5))


@pytest.mark.parametrize(
    "env, match",
    [
        ({"MIXLN_ALPHA": "a quarter"}, "MIXLN_ALPHA"),
        ({"MIXLN_ALPHA": "NaN"}, "MIXLN_ALPHA"),
        ({"MIXLN_ALPHA": "2"}, "MIXLN_ALPHA"),
        ({"MIXLN_POST_LN_LAYERS": "two"}, "MIXLN_POST_LN_LAYERS"),
        ({"MIXLN_ALPHA": "0.25", "MIXLN_POST_LN_LAYERS": "2"}, "both"),
        ({"MIXLN_SCHEME": "foo"}, "MIXLN_SCHEME"),
    ],
)
def test_bad_environment(env, match):
    with pytest.raises(MixLNConfigError, match=match):
        MixLNSettings.from_environ(env)


def test_empty_env_values_are_unset():
    empty = MixLNSettings.from_environ({"MIXLN_ALPHA": "", "MIXLN_POST_LN_LAYERS": " "})
    assert (empty.alpha, empty.post_ln_layers, empty.scheme) == (None, None, None)
    assert empty.placement_source == "default"


def test_lns_schemes():
    lns = resolve_placement(4, MixLNSettings(scheme="lns"))
    assert lns.post_ln_layers == 0
    assert [lns.norm_output_scale(l) for l in (1, 4)] == [1.0, 0.5]
    both = resolve_placement(4, MixLNSettings(scheme="mixln+lns", post_ln_layers=1))
    assert both.norm_output_scale(1) == 1.0 and both.norm_output_scale(4) == 0.5
    with pytest.raises(MixLNConfigError, match="mixln\\+lns"):
        resolve_placement(4, MixLNSettings(scheme="lns", post_ln_layers=1))
    assert resolve_placement(4, MixLNSettings(post_ln_layers=1)).norm_output_scale(4) == 1.0


def test_layer_number_out_of_range():
    p = Placement(4, 1)
    with pytest.raises(ValueError):
        p.is_post_ln(0)
    with pytest.raises(ValueError):
        p.is_post_ln(5)
