"""The per-layer layout: the string, its refusals, its sources, its record. Pure Python."""

import argparse
import math
from types import SimpleNamespace

import pytest

from mixln_megatron.errors import MixLNConfigError
from mixln_megatron.megatron_args import add_mixln_args
from mixln_megatron.model import checkpoint, layout
from mixln_megatron.model.placement import Placement, deepnorm_defaults, resolve_placement
from mixln_megatron.model.settings import MixLNSavedSettingsDisagree, MixLNSettings, layered, saved_settings


def kinds(text, n):
    return layout.parse_layout(text, n, "test")


@pytest.mark.parametrize("text, n, expected", [
    ("post:1-2,pre:3-", 6, "post post pre pre pre pre"),
    ("post:1-2,pre:3-6", 6, "post post pre pre pre pre"),
    ("deepnorm:1-2, pre:3-", 4, "deepnorm deepnorm pre pre"),
    ("sandwich:*", 3, "sandwich sandwich sandwich"),
    ("post:every4,pre:*", 9, "pre pre pre post pre pre pre post pre"),
    ("pre:every4,post:*", 8, "post post post pre post post post pre"),  # the authors' post_pre_post_pre
    ("pre:1-2,sandwich:*", 4, "pre pre sandwich sandwich"),  # pre_sandwich
    ("pre:1-3,post:4-", 5, "pre pre pre post post"),  # pre_post
    ("POST:1,Pre:2", 2, "post pre"),
    ("post:3,pre:*", 3, "pre pre post"),
])
def test_layouts_parse_to_one_kind_per_layer(text, n, expected):
    assert kinds(text, n) == tuple(expected.split())


@pytest.mark.parametrize("text, n, match", [
    ("", 4, "is empty"),
    ("post", 4, "without 'kind:layers'"),
    ("postln:1-2,pre:*", 4, "kind is not one of"),
    ("post:0-2,pre:*", 4, "layers are not"),
    ("post:every0,pre:*", 4, "layers are not"),
    ("post:1-2,pre:2-4", 4, "names layer 2 twice"),
    ("post:1-2", 4, "leaves layers 3, 4 of 4 without a kind"),
    ("post:1-9,pre:*", 4, "beyond the model's 4 layers"),
    ("post:3-1,pre:*", 4, "runs backwards"),
    ("post:*,pre:*", 4, "more than one"),
    ("post:every8,pre:*", 4, "names no layer"),
    ("post:1-2;pre:3-4", 4, "layers are not"),
    ("post:a-b,pre:*", 4, "layers are not"),
    ("x" * 5000, 4, "longer than"),
])
def test_bad_layouts_are_one_error_that_names_the_problem_and_the_syntax(text, n, match):
    with pytest.raises(MixLNConfigError, match=match) as err:
        kinds(text, n)
    assert "kind:layers" in str(err.value) and "\n" not in str(err.value)


def test_canonical_text_round_trips():
    for text, n in [("post:every4,pre:*", 12), ("deepnorm:1-2,pre:3-", 8), ("sandwich:*", 1), ("pre:1", 1)]:
        parsed = kinds(text, n)
        assert kinds(layout.layout_text(parsed), n) == parsed
    assert layout.layout_text(kinds("post:every4,pre:*", 8)) == "pre:1-3,post:4,pre:5-7,post:8"


def test_boundaries_are_every_post_to_pre_step():
    assert layout.boundaries(kinds("post:every4,pre:*", 12)) == ((4, 5), (8, 9))
    assert layout.boundaries(kinds("deepnorm:1-2,sandwich:*", 4)) == ((2, 3),)  # sandwich is a Pre-LN kind
    assert layout.boundaries(kinds("pre:1-2,post:*", 4)) == ()  # Pre -> Post is no boundary
    assert layout.boundaries(kinds("sandwich:*", 4)) == ()


def test_a_first_p_layout_is_mix_ln_itself_with_the_same_record():
    by_layout = resolve_placement(12, MixLNSettings(layout="post:1-3,pre:4-"))
    by_alpha = resolve_placement(12, MixLNSettings(alpha=0.25))
    assert by_layout.kinds == by_alpha.kinds and by_layout.is_first_p
    assert by_layout.record() == {**by_alpha.record(), "alpha": None}
    assert by_layout.record()["format"] == 1 and "layout" not in by_layout.record()
    assert checkpoint.mismatch_message(by_alpha.record(), by_layout) is None


def test_deepnorm_constants_default_to_deepnet_and_can_be_overridden():
    p = resolve_placement(32, MixLNSettings(layout="deepnorm:1-2,pre:3-"))
    assert p.deepnorm_alpha == pytest.approx((2 * 32) ** 0.25) and p.deepnorm_beta == pytest.approx((8 * 32) ** -0.25)
    assert deepnorm_defaults(32)[0] == pytest.approx(2.8284271247461903)
    authors = resolve_placement(12, MixLNSettings(layout="deepnorm:1-3,pre:*", deepnorm_alpha="2.8284271247461903",
                                                  deepnorm_beta=str((8 * 12) ** 0.25)))
    assert authors.deepnorm_alpha == 2.8284271247461903 and authors.deepnorm_beta == pytest.approx(96 ** 0.25)
    assert "deepnorm alpha=2.82843" in authors.describe()
    with pytest.raises(MixLNConfigError, match="applies to deepnorm layers, but the layout 'post:1,pre:\\*'"):
        resolve_placement(4, MixLNSettings(layout="post:1,pre:*", deepnorm_alpha="2"))
    with pytest.raises(MixLNConfigError, match="no layout with a deepnorm layer"):
        resolve_placement(4, MixLNSettings(post_ln_layers=1, deepnorm_beta="0.5"))
    for bad in ("0", "-1", "nan", "inf", "x"):
        with pytest.raises(MixLNConfigError, match="deepnorm alpha from the arguments must be"):
            MixLNSettings(layout="deepnorm:*", deepnorm_alpha=bad)


def test_the_build_line_prints_the_layout_its_source_and_every_boundary():
    env = MixLNSettings.from_environ({"MIXLN_LAYOUT": "post:every4,pre:*"})
    line = resolve_placement(12, env).describe()
    assert "layout=pre:1-3,post:4,pre:5-7,post:8,pre:9-11,post:12 (from MIXLN_LAYOUT)" in line
    assert "Post/Pre boundaries: 4|5, 8|9" in line
    assert "Post/Pre boundaries: none" in resolve_placement(4, MixLNSettings(layout="sandwich:*")).describe()


def test_layout_flag_variable_and_argument_are_sources_like_alpha():
    args = add_mixln_args(argparse.ArgumentParser()).parse_args(["--mixln-layout", "sandwich:*",
                                                                  "--mixln-deepnorm-alpha", "2"])
    flags = MixLNSettings.from_args(args)
    assert flags.source("layout") == "--mixln-layout" and flags.source("deepnorm_alpha") == "--mixln-deepnorm-alpha"
    env = MixLNSettings.from_environ({"MIXLN_ALPHA": "0.25"})
    top = layered(flags, env)  # the flag's layout beats the variable's alpha: one group
    assert (top.layout, top.alpha, top.placement_source) == ("sandwich:*", None, "--mixln-layout")
    with pytest.raises(MixLNConfigError, match="MIXLN_ALPHA.*MIXLN_LAYOUT|MIXLN_LAYOUT.*MIXLN_ALPHA"):
        MixLNSettings.from_environ({"MIXLN_ALPHA": "0.25", "MIXLN_LAYOUT": "pre:*"})
    with pytest.raises(MixLNConfigError, match="not both"):
        MixLNSettings(post_ln_layers=2, layout="pre:*")
    with pytest.raises(MixLNConfigError, match="from MIXLN_LAYOUT"):
        MixLNSettings.from_environ({"MIXLN_LAYOUT": "post:1-2;pre"})


def test_lns_refuses_post_ln_kinds_but_scales_sandwich_pre_norms():
    with pytest.raises(MixLNConfigError, match="scheme 'lns'"):
        resolve_placement(4, MixLNSettings(layout="deepnorm:1,pre:*", scheme="lns"))
    p = resolve_placement(4, MixLNSettings(layout="post:1,sandwich:*", scheme="mixln+lns"))
    assert [p.norm_output_scale(layer) for layer in (1, 2, 3, 4)] == [1.0, 1 / math.sqrt(2), 1 / math.sqrt(3), 0.5]


def test_layout_records_are_format_2_and_a_different_layout_is_refused():
    p = resolve_placement(8, MixLNSettings(layout="post:every4,pre:*"))
    record = p.record()
    assert record["format"] == 2 and record["layout"] == "pre:1-3,post:4,pre:5-7,post:8" and record["post_ln_layers"] == 2
    same_count = resolve_placement(8, MixLNSettings(post_ln_layers=2))  # two Post-LN layers, but first
    message = checkpoint.mismatch_message(record, same_count)
    assert "layout=pre:1-3,post:4" in message and "P=2" in message and "MIXLN_LAYOUT" in message
    assert checkpoint.mismatch_message(record, p) is None
    dn = resolve_placement(8, MixLNSettings(layout="deepnorm:1,pre:*"))
    other = resolve_placement(8, MixLNSettings(layout="deepnorm:1,pre:*", deepnorm_alpha="2.8284271247461903"))
    assert "deepnorm alpha=" in checkpoint.mismatch_message(dn.record(), other)


def test_saved_settings_cross_check_layouts_and_resume_from_them():
    p = resolve_placement(8, MixLNSettings(layout="deepnorm:1-2,sandwich:*"))
    record = p.record()
    found = saved_settings(8, record=record, metadata=record,
                           args=SimpleNamespace(mixln_layout="deepnorm:1-2,sandwich:3-"))
    assert found["layout"] == "deepnorm:1-2,sandwich:3-8" and found["post_ln_layers"] == 2
    resumed = resolve_placement(8, MixLNSettings.from_checkpoint(record))
    assert resumed.kinds == p.kinds and resumed.deepnorm_alpha == p.deepnorm_alpha
    assert "(from the checkpoint)" in resumed.describe()
    with pytest.raises(MixLNSavedSettingsDisagree, match="layout deepnorm:1-2,sandwich:3-8.*layout deepnorm:1,"):
        saved_settings(8, record=record, args=SimpleNamespace(mixln_layout="deepnorm:1,sandwich:*"))
    with pytest.raises(MixLNSavedSettingsDisagree, match="deepnorm_alpha"):
        saved_settings(8, record=record, args=SimpleNamespace(mixln_deepnorm_alpha="3"))
    # a first-P layout's record stays Mix-LN's: from_checkpoint gives P, not a layout
    first = resolve_placement(8, MixLNSettings(layout="post:1-2,pre:*")).record()
    assert MixLNSettings.from_checkpoint(first).post_ln_layers == 2


def test_placement_validates_what_it_is_given():
    with pytest.raises(MixLNConfigError, match="one of pre, post, deepnorm, sandwich per layer"):
        Placement(2, 0, kinds=("pre", "postln"))
    with pytest.raises(MixLNConfigError, match="does not count"):
        Placement(2, 0, kinds=("post", "pre"))
    with pytest.raises(MixLNConfigError, match="exactly when a layer is deepnorm"):
        Placement(2, 1, kinds=("deepnorm", "pre"))
