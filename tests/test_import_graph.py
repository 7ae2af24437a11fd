"""The package's layers point down: no import from a lower layer to a higher one, no import cycle,
and nothing of the package imports the test harness or the scripts.

The graph is built with `ast` from the source (imports inside functions count), so it needs no
megatron and imports nothing: `import a.b` and `from a import b` point at the module b when it
is one (a/b.py or a/b/__init__.py), else at a's __init__.
"""

from __future__ import annotations

import ast
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "mixln_megatron"
TOP = PACKAGE.name

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)

    def resolve(name: str):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in modules}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name.split(".")[0] == TOP else None
                if target and target != module:
                    graph[module].add(target)
    return graph


def cycles(graph: dict) -> list:
    """Strongly connected groups of more than one module (Tarjan, iteratively)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def _inside(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


# The package's layers, lowest first, by package (or top-level module). A module may import its
# own layer and any layer below it, never one above. Why each sits where it does:
# - ground floor: the one-line errors, reading untrusted input (confinement, the allow-list),
#   staged output, the commands' parsing, progress and silenced warnings, release differences
#   (compat) and the CPU/gloo harness that megatron code runs inside;
# - model: the Mix-LN network (settings, placement, layers, specs) on megatron-core;
# - hf: the Hugging Face model code, copied into exported folders (it imports nothing of ours);
# - data: corpus -> indexed dataset;
# - convert: checkpoint readers and writers, built on the model's and the HF model's names;
# - training: hooks, telemetry, the spike scaler, the entry point and Megatron-LM's `--mixln-*`
#   flags; it vets a --load checkpoint through convert;
# - bridge: the optional Megatron-Bridge model, on the model, the HF model and the converter;
# - spec: what Megatron-LM imports by name (`--spec mixln_megatron.spec ...`), with the hooks;
# - analysis: the diagnostics, which build models as the --spec edge does;
# - the command line and the package's own lazy re-exports.
PACKAGE_LAYERS = (
    ("ground floor", ("errors", "safe_output", "safe_unpickle", "input_root", "progress", "known_warnings",
                      "cli_parsing", "compat", "cpu")),
    ("model", ("model",)),
    ("hf", ("hf",)),
    ("data", ("data",)),
    ("convert", ("convert",)),
    ("training", ("training", "megatron_args")),
    ("bridge", ("bridge",)),
    ("spec", ("spec",)),
    ("analysis", ("analysis",)),
    ("cli", ("cli", "")),  # "": the package's __init__
)
LAYERS = tuple((name, tuple(f"{TOP}.{p}" if p else TOP for p in parts)) for name, parts in PACKAGE_LAYERS)
# Development code lives outside the package: no package module imports it.
OUTSIDE = ("harness", "tests", "scripts", "benchmarks", "examples")


def layer_of(module: str):
    """The index in LAYERS of the most specific prefix naming `module` (the package itself exactly)."""
    best, length = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            hit = module == p if p == TOP else _inside(module, (p,))
            if hit and len(p) > length:
                best, length = i, len(p)
    return best


def upward_imports(graph: dict) -> list:
    """`module (layer) -> target (layer)` for every import of a higher layer."""
    return sorted(f"{m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})"
                  for m, targets in graph.items() for t in targets
                  if layer_of(m) is not None and layer_of(t) is not None and layer_of(t) > layer_of(m))


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "mixln_megatron.model.layer" in graph["mixln_megatron.model.specs"]
    assert "mixln_megatron.training.hooks" in graph["mixln_megatron"]  # a lazy import in __init__
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(g) for g in found)


def test_every_module_has_a_layer():
    missing = sorted(m for m in import_graph() if layer_of(m) is None)
    assert not missing, f"modules with no layer in PACKAGE_LAYERS: {missing}"


def test_imports_point_down_the_layers():
    """An import of a higher layer fails here, naming both ends and their layers (the model
    importing the converter, compat importing convert, the analysis importing the command line)."""
    upward = upward_imports(import_graph())
    assert not upward, "imports up a layer:\n" + "\n".join(upward)


def test_the_layer_check_catches_an_upward_import():
    assert layer_of("mixln_megatron.compat") == 0 and layer_of("mixln_megatron.model.layer") == 1
    assert layer_of("mixln_megatron") == len(LAYERS) - 1 and layer_of("mixln_megatron.cli") == len(LAYERS) - 1
    assert layer_of("mixln_megatron.cli_parsing") == 0  # a longer name is not inside `cli`
    graph = {"mixln_megatron.model.layer": {"mixln_megatron.convert.shape", "mixln_megatron.compat"},
             "mixln_megatron.compat": {"mixln_megatron.errors"}}
    assert upward_imports(graph) == ["mixln_megatron.model.layer (model) -> mixln_megatron.convert.shape (convert)"]


def outside_imports() -> list:
    """`module -> name` for every import (inside functions too) of development code outside the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{_module_name(path)} -> {n}" for n in names if n.split(".")[0] in OUTSIDE]
    return found


def test_the_package_imports_no_development_code():
    """The test harness (tests/harness), the scripts and the benchmarks are not installed: a package
    module importing them would fail for every user."""
    found = outside_imports()
    assert not found, found
