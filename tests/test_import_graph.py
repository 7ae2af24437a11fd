"""The package's layers point down: no import cycles, and the model knows nothing above it.

The graph is built with `ast` from the source (imports inside functions count), so it needs no
megatron and imports nothing: `import a.b` and `from a import b` point at the module b when it
is one (a/b.py or a/b/__init__.py), else at a's __init__.
"""

from __future__ import annotations

import ast
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "mixln_megatron"
TOP = PACKAGE.name

# What the model layer (mixln_megatron.model, the plain-data spec factories included) must not
# import: training, conversion, development aids, and the Megatron-LM edge above them.
ABOVE_THE_MODEL = (
    "mixln_megatron.training", "mixln_megatron.convert", "mixln_megatron.dev", "mixln_megatron.analysis",
    "mixln_megatron.hf", "mixln_megatron.data", "mixln_megatron.spec", "mixln_megatron.megatron_args",
    "mixln_megatron.cli",
)


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


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "mixln_megatron.model.layer" in graph["mixln_megatron.model.specs"]
    assert "mixln_megatron.training.hooks" in graph["mixln_megatron"]  # a lazy import in __init__
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(g) for g in found)


def test_the_model_imports_nothing_above_it():
    graph = import_graph()
    offenders = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items() if _inside(module, ("mixln_megatron.model",))
        for target in targets if _inside(target, ABOVE_THE_MODEL)
    )
    assert not offenders, offenders


def test_the_release_module_and_errors_stay_below_the_model():
    """compat.py (release differences only) and errors.py sit under the model, which may use
    them: they never reach the model, training or the edge (compat reads a --load directory's
    layout through convert.locate)."""
    graph = import_graph()
    above = ("mixln_megatron.model",) + tuple(p for p in ABOVE_THE_MODEL if p != "mixln_megatron.convert")
    for module in ("mixln_megatron.compat", "mixln_megatron.errors"):
        bad = sorted(t for t in graph[module] if _inside(t, above))
        assert not bad, (module, bad)


# The package's layers, lowest first. A module may import its own layer and any layer below it,
# never one above. Why each sits where it does:
# - foundation: the one-line errors, reading untrusted input (confinement, the allow-list), staged
#   output, release differences (compat), the CPU harness that megatron code runs inside and the
#   tests' process launcher (dev.forked_ranks);
# - model: the Mix-LN network (settings, placement, layers, specs), the HF model code, data prep;
# - training and conversion: hooks, telemetry, the spike scaler, the entry point; checkpoint
#   readers and writers; test builders (dev.testing) that make real models from the model layer;
# - edges: what Megatron-LM imports by name (--spec objects), the Megatron-Bridge model (optional),
#   and the diagnostics built on the above;
# - applications: the command line, the CPU demo (a script of user commands) and the package's
#   own lazy re-exports.
LAYERS = (
    ("foundation", ("mixln_megatron.errors", "mixln_megatron.cli_parsing", "mixln_megatron.progress",
                    "mixln_megatron.known_warnings",
                    "mixln_megatron.input_root", "mixln_megatron.safe_output",
                    "mixln_megatron.safe_unpickle", "mixln_megatron.compat", "mixln_megatron.dev.cpu",
                    "mixln_megatron.dev.forked_ranks")),
    ("model", ("mixln_megatron.model", "mixln_megatron.hf", "mixln_megatron.data", "mixln_megatron.dev.plots")),
    ("training and conversion", ("mixln_megatron.training", "mixln_megatron.convert",
                                 "mixln_megatron.megatron_args", "mixln_megatron.dev.testing")),
    ("edges", ("mixln_megatron.spec", "mixln_megatron.analysis", "mixln_megatron.bridge")),
    ("applications", ("mixln_megatron.cli", "mixln_megatron.dev.demo", "mixln_megatron.dev", "mixln_megatron")),
)


def layer_of(module: str) -> int:
    """The index in LAYERS of the most specific prefix naming `module` (the package itself exactly)."""
    best, length = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            hit = module == p if p == "mixln_megatron" else _inside(module, (p,))
            if hit and len(p) > length:
                best, length = i, len(p)
    return best


def test_every_module_has_a_layer():
    missing = sorted(m for m in import_graph() if layer_of(m) is None)
    assert not missing, f"modules with no layer in LAYERS: {missing}"


def test_imports_point_down_the_layers():
    """An import of a higher layer fails here, naming both ends (issue 28: compat -> convert,
    dev.demo -> analysis and dev.testing -> spec were such imports)."""
    graph = import_graph()
    upward = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})"
                    for m, targets in graph.items() for t in targets
                    if layer_of(m) is not None and layer_of(t) is not None and layer_of(t) > layer_of(m))
    assert not upward, "imports up a layer:\n" + "\n".join(upward)


def test_the_layer_check_catches_an_upward_import():
    assert layer_of("mixln_megatron.compat") < layer_of("mixln_megatron.convert.locate")
    assert layer_of("mixln_megatron.dev.testing") < layer_of("mixln_megatron.spec")
    assert layer_of("mixln_megatron.dev.demo") > layer_of("mixln_megatron.analysis.train_health")
    assert layer_of("mixln_megatron") == len(LAYERS) - 1 and layer_of("mixln_megatron.model.layer") == 1
