"""The package's layers import downward only, and no two modules import each other.

The layers, lowest first: utils -> data_generation -> models / vllm_plugin -> train / convert ->
evaluate -> pipeline -> cli -> demo, and benchmarks/ above them all. The top-level 0.3.0 modules
(`config`, `model`, `proposals`, `tiny_models`) sit with the models; `__main__` is the top of the
stack. Every import counts, also one inside a function: a deferred import is still a dependency, it
only hides a cycle until it runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "speculators_vllm016"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
BENCHMARKS = "benchmarks"
BENCHMARKS_ROOT = ROOT.parent / BENCHMARKS

LAYER_OF_SUBPACKAGE = {
    "version": 0,
    "utils": 0,
    "data_generation": 1,
    "models": 2,
    "vllm_plugin": 2,
    "config": 2,
    "model": 2,
    "proposals": 2,
    "tiny_models": 2,
    "train": 3,
    "convert": 3,
    "evaluate": 4,
    # Resumable chains of stages: they call datagen, training and evaluation, and are called by
    # the command lines and the demo.
    "pipeline": 4.5,
    "cli": 5,
    "demo": 6,
    "__main__": 7,
}
# The 0.3.0 top-level modules belong to the models layer: they may import each other.
GROUP = {"config": "models", "model": "models", "proposals": "models", "tiny_models": "models"}
# Modules every layer may import: they hold no concept of their own.
FREE = {PACKAGE, f"{PACKAGE}.version"}


def _module_files(root: Path = ROOT) -> dict[str, Path]:
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imports(
    module: str, path: Path, modules: dict[str, Path], roots: tuple[str, ...] = (PACKAGE,)
) -> set[str]:
    """The modules under `roots` that `module` imports, a `from x import y` naming module x.y if
    it is one."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if not target.startswith(roots):
                continue
            for alias in node.names:
                child = f"{target}.{alias.name}"
                found.add(child if child in modules else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(roots))
    found.discard(module)
    return {name for name in found if name in modules}


def _graph() -> dict[str, set[str]]:
    modules = _module_files()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _graph_with_benchmarks() -> dict[str, set[str]]:
    """The package's modules and the benchmarks', each with what it imports of either."""
    modules = {**_module_files(), **_module_files(BENCHMARKS_ROOT)}
    roots = (PACKAGE, BENCHMARKS)
    return {name: _imports(name, path, modules, roots) for name, path in modules.items()}


def _layer(module: str) -> tuple[str, int] | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return GROUP.get(parts[1], parts[1]), LAYER_OF_SUBPACKAGE[parts[1]]


def test_every_subpackage_has_a_layer():
    unknown = {m.split(".")[1] for m in _graph() if "." in m} - set(LAYER_OF_SUBPACKAGE)
    assert not unknown, f"give these a layer in LAYER_OF_SUBPACKAGE: {sorted(unknown)}"


def test_layers_import_downward_only():
    upward = []
    for module, targets in sorted(_graph().items()):
        here = _layer(module)
        for target in sorted(targets - FREE):
            there = _layer(target)
            if here is None or there is None:
                continue
            (name, level), (target_name, target_level) = here, there
            if target_level > level or (target_level == level and target_name != name):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that run up (or sideways) a layer:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _without_parent_links(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's __init__ re-exporting its children is not a cycle of concepts."""
    return {
        module: {
            t for t in targets if not (t.startswith(module + ".") or module.startswith(t + "."))
        }
        for module, targets in graph.items()
    }


def test_no_import_cycle_between_package_modules():
    cycles = _cycles(_without_parent_links(_graph()))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_benchmarks_import_the_package_never_the_reverse_and_form_no_cycle():
    """benchmarks/ sits above the package: it may import any of it, the package none of it; and
    no benchmark module imports another that (through any chain) imports it back."""
    graph = _graph_with_benchmarks()
    assert any(m.startswith(BENCHMARKS + ".") for m in graph), "no benchmark module found"
    into_benchmarks = [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        if module.startswith(PACKAGE)
        for target in sorted(targets)
        if target.split(".")[0] == BENCHMARKS
    ]
    assert not into_benchmarks, "the package imports benchmarks/:\n" + "\n".join(into_benchmarks)
    cycles = _cycles(_without_parent_links(graph))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ],
)
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert _cycles(graph) == expected
