"""Size of the package and the docs: the figures the restructure's targets are stated in.

python scripts/code_metrics.py  prints modules, lines (settings tables in *_fields.py apart),
imports inside functions, docs pages and words of prose (generated tables and code blocks apart).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mixln_megatron"
GENERATED = re.compile(r"<!-- ([\w-]+):begin.*?<!-- \1:end[^>]*-->", re.S)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def inner_imports(tree: ast.AST) -> int:
    """Import statements inside a function or method body."""
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            count += sum(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(node))
    return count


def package_figures() -> dict:
    files = sorted(PACKAGE.rglob("*.py"))
    lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in files if not p.name.endswith("_fields.py"))
    inner = {p: inner_imports(ast.parse(p.read_text(encoding="utf-8"))) for p in files}
    convert = [p for p in files if p.parent.name == "convert"]
    return {"modules": len(files), "lines (no *_fields.py)": lines, "imports inside functions": sum(inner.values()),
            "convert modules": len(convert), "convert imports inside functions": sum(inner[p] for p in convert)}


def prose_words(text: str) -> int:
    return len(FENCE.sub("", GENERATED.sub("", text)).split())


def docs_figures() -> dict:
    pages = sorted((ROOT / "docs").glob("*.md"))
    return {"docs pages": len(pages), "docs words of prose": sum(prose_words(p.read_text(encoding="utf-8")) for p in pages),
            "docs words in all": sum(len(p.read_text(encoding="utf-8").split()) for p in pages)}


if __name__ == "__main__":
    for name, value in {**package_figures(), **docs_figures()}.items():
        print(f"{name}: {value}")
