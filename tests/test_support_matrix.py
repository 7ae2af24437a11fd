"""docs/compatibility.md's support matrix is the one scripts/support_matrix.py generates; the tests
it names exist; every refusal it prints is the line the code raises, on every path that refuses it."""

import re
from argparse import Namespace
from pathlib import Path

import pytest

import support_matrix as sm
from mixln_megatron.errors import MixLNError

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "compatibility.md"


def test_the_documented_matrix_is_current():
    assert sm.main(["--check", str(DOC)]) == 0, (
        "docs/compatibility.md is stale: python scripts/support_matrix.py --write docs/compatibility.md")


def test_a_stale_matrix_is_found_and_rewritten(tmp_path):
    doc = tmp_path / "support-matrix.md"
    doc.write_text(DOC.read_text().replace("| refused |", "| tested on CPU |", 1))
    assert sm.main(["--check", str(doc)]) == 1
    assert sm.main(["--write", str(doc)]) == 0
    assert doc.read_text() == DOC.read_text()


def test_every_row_has_a_status_and_its_evidence():
    assert len({f.name for f in sm.MATRIX}) == len(sm.MATRIX)
    for f in sm.MATRIX:
        assert f.status in (sm.TESTED, sm.REFUSED, sm.GPU), f.name
        assert (f.refuse is not None) == (f.status == sm.REFUSED), f.name
        if f.status == sm.TESTED:
            assert f.tests and f.note, f.name
        if f.status == sm.GPU:
            assert f.note, f"{f.name}: say what is unverified"


def test_every_named_test_exists():
    named = {t for f in sm.MATRIX for t in f.tests}
    assert named
    for node in sorted(named):
        path, _, function = node.partition("::")
        source = (REPO / path).read_text()
        assert re.search(rf"^def {re.escape(function)}\(", source, re.M), f"{node} does not exist"


def test_every_refusal_is_the_line_the_code_raises():
    text = DOC.read_text()
    for f in (f for f in sm.MATRIX if f.status == sm.REFUSED):
        with pytest.raises(MixLNError) as info:
            f.refuse()
        line = str(info.value)
        assert "\n" not in line and line == sm.refusal_line(f)
        assert f"`{line.replace('|', chr(92) + '|')}`" in text, f"{f.name}: the page does not show {line!r}"


@pytest.mark.parametrize("name", ["use_megatron_fsdp", "use_torch_fsdp2"])
def test_the_fsdp_refusals_are_the_same_line_on_the_stock_spec_path(name):
    """The entry point's line (the matrix) is what the stock --spec edge raises too."""
    from mixln_megatron import spec
    from harness import testing as mu
    from mixln_megatron.model.support import MixLNUnsupportedError

    documented = next(sm.refusal_line(f) for f in sm.MATRIX if f.status == sm.REFUSED and f"[{name}=True]" in sm.refusal_line(f))
    with pytest.raises(MixLNUnsupportedError) as info:
        spec.stock_decoder_spec(mu.tiny_config(num_layers=2), "local", args=Namespace(**{name: True}))
    assert str(info.value) == documented
