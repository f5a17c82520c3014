"""The torchft package imports in layers: no module imports, at import time, one that imports it.

A module cycle works only while every module in it reads the others' names lazily; one
``from x import name`` at the top of the wrong file and the package fails to import, in an
order that depends on which module a script happens to import first. The graph here is read
from the source with :mod:`ast`: every import executed when a module is imported (module
level, class bodies, ``try``/``if`` blocks) except those under ``if TYPE_CHECKING:``, which
a second test adds. Imports inside functions run later and are listed, not judged.

Run as a script to print the graph's cycles and the imports made inside functions.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "torchft"
ROOT = Path(__file__).resolve().parents[1] / "python" / PACKAGE


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package under ``root``, by dotted name (a native extension by
    its ``.pyi`` stub: it imports nothing of the package)."""
    names = {}
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.pyi")]):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    nodes: list[ast.AST], in_function: bool, typing_too: bool
) -> Iterator[tuple[ast.stmt, bool]]:
    """Every import statement in or below ``nodes``, with whether it runs only inside a
    function (TYPE_CHECKING-only imports left out unless ``typing_too``)."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
        elif isinstance(node, ast.If) and _is_type_checking(node.test) and not typing_too:
            yield from _imports(list(node.orelse), in_function, typing_too)
        else:
            inner = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from _imports(list(ast.iter_child_nodes(node)), in_function or inner, typing_too)


def _targets(stmt: ast.stmt, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package's modules an import statement loads by name."""
    if isinstance(stmt, ast.Import):
        return {alias.name for alias in stmt.names if alias.name in modules}
    assert isinstance(stmt, ast.ImportFrom)
    base = stmt.module or ""
    if stmt.level:
        anchor = module.split(".")
        if not is_package:
            anchor.pop()
        anchor = anchor[: len(anchor) - (stmt.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    found = set()
    for alias in stmt.names:
        sub = f"{base}.{alias.name}"
        if sub in modules:
            found.add(sub)  # ``from pkg import submodule``: loads the submodule
        elif base in modules:
            found.add(base)
    return found


def import_graph(
    root: Path = ROOT, *, in_functions: bool = False, typing_too: bool = False
) -> dict[str, set[str]]:
    """Module → the package's modules it imports at import time. With ``in_functions``, the
    imports made inside functions instead; with ``typing_too``, also those made only for
    the type checker."""
    names = module_names(root)
    modules = set(names)
    graph: dict[str, set[str]] = {m: set() for m in names}
    for module, path in names.items():
        tree = ast.parse(path.read_text(), str(path))
        for stmt, in_function in _imports([tree], False, typing_too):
            if in_function == in_functions:
                targets = _targets(stmt, module, path.name == "__init__.py", modules)
                graph[module] |= targets - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _describe(graph: dict[str, set[str]], found: list[list[str]]) -> str:
    return "\n".join(" ; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found)


def test_the_package_has_no_import_cycle() -> None:
    """No torchft module imports, at import time, a module that imports it back."""
    graph = import_graph()
    assert len(graph) > 20, f"found only {len(graph)} modules under {ROOT}"
    found = cycles(graph)
    assert not found, "import cycles:\n" + _describe(graph, found)


def test_annotations_follow_the_same_layers() -> None:
    """Imports made only for the type checker add no cycle either: a lower module that
    needs a higher one's type says what it uses as a Protocol of its own."""
    graph = import_graph(typing_too=True)
    found = cycles(graph)
    assert not found, "import cycles through TYPE_CHECKING imports:\n" + _describe(graph, found)


if __name__ == "__main__":
    sys.setrecursionlimit(10_000)
    top = import_graph()
    for component in cycles(top):
        print("cycle:", ", ".join(component))
        for m in component:
            print(f"  {m} -> {', '.join(sorted(top[m] & set(component)))}")
    for component in cycles(import_graph(typing_too=True)):
        print("cycle counting TYPE_CHECKING imports:", ", ".join(component))
    print("imports made inside functions:")
    for m, targets in sorted(import_graph(in_functions=True).items()):
        if targets:
            print(f"  {m} -> {', '.join(sorted(targets))}")
