"""Code comments, docstrings and test docstrings state the rule, not where it was asked for.

The docs' rule (tests/test_doc_consistency.py: no issue, session, pull-request, ticket or commit
numbers) extended to every *.py of the package, the tests, the benchmarks and the scripts, with
the project's other bookkeeping added: the word "item" or "decision" followed by a number, as in a
comment citing an issue's item or a design document's decision. No outside contributor can open
those; the rule itself is what to write.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_doc_consistency import BOOKKEEPING as DOCS_BOOKKEEPING

ROOT = Path(__file__).resolve().parents[1]
TREES = ("mixln_megatron", "tests", "benchmarks", "scripts", "examples")
# The docs' pattern starts with its (?i) flag, so it must come first.
BOOKKEEPING = re.compile(DOCS_BOOKKEEPING.pattern + r"|\b(?:issues|items?|decisions?)\s*#?\d+\b")
# The docs test spells bookkeeping out to show its check can fail.
SPELLED_OUT = {Path(__file__).resolve().with_name("test_doc_consistency.py")}


def python_files():
    for tree in TREES:
        yield from sorted((ROOT / tree).rglob("*.py"))


def bookkeeping(text: str) -> list:
    """(line number, what was found) for every bookkeeping reference in `text`."""
    return [(n, m.group(0)) for n, line in enumerate(text.splitlines(), 1) for m in BOOKKEEPING.finditer(line)]


def test_no_issue_item_or_decision_numbers_in_python():
    found = []
    for path in python_files():
        if path in SPELLED_OUT:
            continue
        found += [f"{path.relative_to(ROOT)}:{n}: {what}"
                  for n, what in bookkeeping(path.read_text(encoding="utf-8", errors="replace"))]
    assert not found, "say the rule instead of where it was asked for:\n" + "\n".join(found)


def test_the_code_check_can_fail():
    """Each kind is found, with its line; an index such as `item[3]` is not bookkeeping."""
    number = "27"  # built here, so that this file passes its own scan
    text = (f'"""Reads stay inside (issue {number}, item {number}).\n\n'
            f'See DESIGN decision {number}; items {number} and 2."""\nx = item[3]\n')
    assert bookkeeping(text) == [(1, f"issue {number}"), (1, f"item {number}"), (3, f"decision {number}"),
                                 (3, f"items {number}")]
