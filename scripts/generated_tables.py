"""The machinery shared by the generated tables in docs/ (scripts/config_table.py,
moe_table.py, support_matrix.py, ...): markdown cell escaping, and one command line that prints a table, writes it
between a page's markers, or checks that the page is current. Each table module keeps only its
rows and its markers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable


def cell(text) -> str:
    """Table-safe prose: a '|' would split the cell, '<' / '>' would read as HTML."""
    return str(text).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def code(text) -> str:
    """A code span in a table cell: only '|' needs escaping there (markdown shows the rest as is)."""
    return "`" + str(text).replace("|", "\\|") + "`"


def replace_between(text: str, begin: str, end: str, table: str, path: Path) -> str:
    """`text` with what stands between the markers replaced by `table`."""
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: the markers {begin!r} and {end!r} are missing")
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    return f"{head}{begin}\n{table}{end}{tail}"


def table_main(argv, module: str, what: str, render: Callable[[], str], begin: str, end: str) -> int:
    """`python -m <module> [--write FILE | --check FILE]`: print, write or check the table `what`."""
    parser = argparse.ArgumentParser(prog=f"python {module}", description=f"The {what}.")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", metavar="FILE", type=Path, help="replace the table between the markers in FILE")
    action.add_argument("--check", metavar="FILE", type=Path,
                        help="exit 1 when FILE's table differs from the generated one")
    args = parser.parse_args(argv)
    table = render()
    if args.write is None and args.check is None:
        sys.stdout.write(table)
        return 0
    path = args.write or args.check
    text = path.read_text(encoding="utf-8")
    wanted = replace_between(text, begin, end, table, path)
    if args.write is not None:
        path.write_text(wanted, encoding="utf-8")
        return 0
    if wanted != text:
        print(f"{path}: the {what} is stale; run python {module} --write {path}", file=sys.stderr)
        return 1
    return 0
