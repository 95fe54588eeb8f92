"""The package's layers: no import cycle between modules or between packages, counting every import (inside
functions and under `TYPE_CHECKING` too: each is the same dependency), and each package imports only the layers
below it (docs/DESIGN.md, "Layers")."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "peradapt"

# Bottom to top. A unit (a subpackage, or a top-level module) may import only units listed before it; the root
# package `peradapt` (the public facade: `peradapt.train`, ...) sits on top of everything.
LAYERS = [
    ["errors", "home", "imports", "progress", "seeds"],
    ["settings", "registry"],
    ["config"],
    ["presets"],
    ["options"],
    ["backbones"],
    ["adapters"],
    ["data"],
    ["rundir"],
    ["compute"],
    ["distill", "evaluation"],
    ["methods"],
    ["federation"],
    ["flower"],
    ["commands"],
    ["api"],
    ["cli"],
    ["__main__"],
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports(path: Path, known: set[str]) -> set[str]:
    """The peradapt modules `path` imports, anywhere in it: `from a.b import c` names module a.b.c when that is a
    module, else a.b."""
    name = module_name(path)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if path.name == "__init__.py" else 0)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                found.add(candidate if candidate in known else source)
    return {module for module in found if module in known and module != name}


@functools.cache  # parsing the package takes most of the time: once per session, every case reads the same
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, set(known)) for name, path in known.items()}


def unit(module: str) -> str:
    """The layer unit of a module: its subpackage (or top-level module) under peradapt; the root is `peradapt`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "peradapt"


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def package_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    collapsed: dict[str, set[str]] = {}
    for source, targets in edges.items():
        collapsed.setdefault(unit(source), set()).update(unit(t) for t in targets if unit(t) != unit(source))
    return collapsed


def test_no_module_imports_itself_round_a_circle():
    assert cycles(graph()) == []


def test_no_package_imports_itself_round_a_circle():
    assert cycles(package_edges(graph())) == []


def test_every_unit_has_a_layer():
    units = {unit(module) for module in modules()} - {"peradapt"}
    placed = {name for layer in LAYERS for name in layer}
    assert units == placed


@pytest.mark.parametrize("layer", range(len(LAYERS)))
def test_each_layer_imports_only_the_layers_below_it(layer):
    below = {name for lower in LAYERS[:layer] for name in lower}
    edges = package_edges(graph())
    for name in LAYERS[layer]:
        assert edges.get(name, set()) <= below, f"{name} imports {sorted(edges.get(name, set()) - below)}"


def test_the_checker_sees_a_circle():
    """The cycle finder itself: a circle of three and a self-contained pair are found, a chain is not."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert sorted(cycles(edges)) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": {"c"}}) == []
