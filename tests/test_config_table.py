"""docs/configuration.md's table of every setting is the one the settings' field list generates."""

from pathlib import Path

import config_table
from mixln_megatron.model.settings import FIELDS

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_the_documented_table_is_current():
    assert config_table.main(["--check", str(DOC)]) == 0, (
        "docs/configuration.md is stale: python scripts/config_table.py --write docs/configuration.md")


def test_every_flag_and_variable_has_a_row():
    table = config_table.render()
    for _, flag, variable, _, _ in FIELDS:
        assert f"`{flag}`" in table and f"`{variable}`" in table


def test_a_stale_table_is_found_and_rewritten(tmp_path):
    doc = tmp_path / "configuration.md"
    doc.write_text(DOC.read_text().replace("`--mixln-spike-beta`", "`--mixln-spike-momentum`"))
    assert config_table.main(["--check", str(doc)]) == 1
    assert config_table.main(["--write", str(doc)]) == 0
    assert doc.read_text() == DOC.read_text()
