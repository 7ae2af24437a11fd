"""HybridModel patterns as Mix-LN reads them (model/hybrid_pattern.py), and `placement` on them."""

import pytest

from mixln_megatron import cli
from mixln_megatron.model import hybrid_pattern as hp
from mixln_megatron.model.placement import resolve_placement
from mixln_megatron.model.settings import MixLNSettings
from mixln_megatron.model.support import MixLNUnsupportedError


@pytest.mark.parametrize("pattern, blocks", [
    ("*-", 1), ("*-*-*-*-", 4), ("*-*-|*-*-", 4), ("*-|*-*-*-", 4), ("*-*|-*-*-", 4), ("*|-", 1),
])
def test_strictly_alternating_patterns_count_blocks(pattern, blocks):
    assert hp.pattern_problem(pattern) is None
    assert hp.check_pattern(pattern) == blocks


@pytest.mark.parametrize("pattern, says", [
    ("*--*", "layer 3 is '-' where '*' belongs"),
    ("-*-*", "layer 1 is '-' where '*' belongs"),
    ("*-M-", "layer 3 is 'M' (Mamba)"),
    ("*-E-", "layer 3 is 'E' (MoE)"),
    ("*-G-", "layer 3 is 'G' (gated delta net)"),
    ("*-+-", "layer 3 is '+' (multi-latent attention)"),
    ("*-D-", "layer 3 is 'D' (DeepSeek sparse attention)"),
    ("*-x-", "layer 3 is 'x', not a HybridModel symbol"),
    ("*-*", "has 3 layers, not whole blocks"),
    ("*-*-/*-", "multi-token-prediction"),
    ("", "no hybrid layer pattern"),
    (None, "no hybrid layer pattern"),
])
def test_other_patterns_are_refused_with_the_layer_and_the_reason(pattern, says):
    problem = hp.pattern_problem(pattern)
    assert problem is not None and says in problem
    with pytest.raises(MixLNUnsupportedError, match="strictly alternating|multi-token|no hybrid"):
        hp.check_pattern(pattern)


def test_block_numbers_and_parts():
    assert [hp.block_number(n, hp.part_of_layer(n)) for n in range(1, 9)] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert hp.block_number(7, None) == 7  # a GPT layer is one block
    assert hp.layer_numbers_of_block(3) == (5, 6)
    assert hp.num_blocks(8, hp.ATTENTION) == 4 and hp.num_blocks(8, None) == 8
    with pytest.raises(MixLNUnsupportedError, match="layer 2 is '\\*', but .* must be '-'"):
        hp.block_number(2, hp.ATTENTION)
    with pytest.raises(MixLNUnsupportedError, match="odd number"):
        hp.num_blocks(7, hp.MLP)
    with pytest.raises(ValueError, match="hybrid_part"):
        hp.block_number(1, "mamba")


def test_segments_are_checked_at_their_global_offset():
    hp.check_segment(list("-*-"), pp_layer_offset=3)  # layers 4, 5, 6
    with pytest.raises(MixLNUnsupportedError, match="layer 4 is '\\*'"):
        hp.check_segment(list("*-"), pp_layer_offset=3)


def test_pattern_for_splits_stages():
    assert hp.pattern_for(3) == "*-*-*-"
    assert hp.pattern_for(4, [1, 3]) == "*-|*-*-*-"
    with pytest.raises(ValueError):
        hp.pattern_for(4, [1, 2])


def test_the_placement_counts_blocks_as_gpt_counts_layers():
    settings = MixLNSettings(alpha="0.25")
    gpt = resolve_placement(8, settings)
    hybrid = resolve_placement(hp.check_pattern("*-" * 8), settings)
    assert gpt.record() == hybrid.record() and hybrid.post_ln_layers == 2


def test_placement_command_shows_the_hybrid_layers(capsys):
    assert cli.main(["placement", "--hybrid-layer-pattern", "*-*-|*-*-", "--mixln-post-ln-layers", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[mixln_megatron] scheme=mixln L=4 P=1")
    assert out[1] == "HybridModel layers (1-based): 1, 2 Post-LN, of 8"
    assert cli.main(["placement", "--hybrid-layer-pattern", "*-M-"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "layer 3 is 'M' (Mamba)" in err[0]
