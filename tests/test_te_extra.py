"""The `te` extra asks for the TransformerEngine release the te tests run (scripts/install_te.sh)."""

import ast
import re
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]


def extras() -> dict:
    """setup.py's extras_require, read from its source (setup.py is not run)."""
    tree = ast.parse((REPO / "setup.py").read_text(encoding="utf-8"))
    call = next(node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    return ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))


def test_the_te_extra_is_pinned_to_the_tested_release():
    tested = re.search(r"^TE_VERSION=(\S+)", (REPO / "scripts" / "install_te.sh").read_text(), re.M).group(1)
    (requirement,) = [Requirement(text) for text in extras()["te"]]
    assert requirement.name == "transformer-engine" and "pytorch" in requirement.extras
    assert requirement.specifier and set(requirement.specifier.filter([tested, "2.19.0", "2.21.0", "3.0"])) == {tested}, \
        requirement
