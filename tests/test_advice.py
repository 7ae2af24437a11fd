"""Launch-time advice fires outside the reported-stable region and stays silent inside it."""

from mixln_megatron.model.support import advise, findings
from mixln_megatron.model.placement import Placement


def test_fires_for_the_reported_unstable_7b_run():
    # 51 layers, 3 Post-LN layers, 2000 warm-up steps of a 100k-step run (the reported case)
    text = advise(Placement(51, 3), train_iters=100_000, warmup_iters=2000)
    assert text is not None and text.count("\n  - ") == 2
    assert "3 Post-LN layers at 51 layers" in text and "2 Post-LN layers of 32" in text
    assert "warm-up of 2000 of 100000 iterations (2.0%)" in text and "10% of training" in text
    assert "arXiv 2412.13795" in text


def test_silent_for_the_paper_7b_setting():
    assert advise(Placement(32, 2), train_iters=10_000, warmup_iters=1000) is None
    assert findings(Placement(12, 3), train_iters=1000, warmup_iters=100) == []


def test_all_post_ln_deep_model_and_short_warmup_alone():
    assert any("diverging at 24" in f for f in findings(Placement(24, 24)))
    only_warmup = findings(Placement(12, 3), train_iters=1000, warmup_iters=10)
    assert len(only_warmup) == 1 and "1.0%" in only_warmup[0]
    # Pre-LN (P = 0) gets no warm-up advice: the advice is about Post-LN layers
    assert findings(Placement(12, 0), train_iters=1000, warmup_iters=0) == []
