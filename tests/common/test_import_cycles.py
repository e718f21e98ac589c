"""No import circle among the modules of `common/`, nor among those of `usecases/`: a circle makes the import order
matter (a half-initialised module, an `ImportError` that depends on which module was imported first) and hides
which module is the lower layer. Function-level imports count (they only postpone the circle); imports under
`if TYPE_CHECKING:` do not (they never run)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def modules_of(folder: Path) -> dict[str, Path]:
    """Every module of the package in `folder` by its dotted name; a package by its own name."""
    found = {}
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST):
    """The import statements under `node`, wherever they sit, except in the body of an `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        for statement in child.orelse if isinstance(child, ast.If) and _type_checking(child.test) else [child]:
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                yield statement
            else:
                yield from _import_nodes(statement)


def imports_of(module: str, path: Path, known: dict[str, Path]) -> dict[str, int]:
    """The modules of `known` that `module` imports, each with the line of its first import; `from package import
    name` imports the module `package.name` when there is one, else `package`."""
    found: dict[str, int] = {}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            while target and target not in known:  # `import a.b.attr`: the module is the longest known prefix
                target = target.rpartition(".")[0]
            if target and target != module:
                found.setdefault(target, node.lineno)
    return found


def import_graph(folder: Path) -> dict[str, dict[str, int]]:
    """Each module of the package in `folder`, with the modules of that package it imports and where."""
    known = modules_of(folder)
    return {module: imports_of(module, path, known) for module, path in known.items()}


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph[target])))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return components


def one_circle(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    """One closed path through `component`, each step with its line: `a (line 3) -> b (line 9) -> a`."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start: 0}
    while True:
        here = path[-1]
        step = next(target for target in sorted(graph[here]) if target in members)
        if step in seen:
            loop = path[seen[step]:] + [step]
            return " -> ".join(f"{name} (line {graph[name][after]})" for name, after in zip(loop, loop[1:])) + \
                f" -> {step}"
        seen[step] = len(path)
        path.append(step)


@pytest.mark.parametrize("package", ["common", "usecases"])
def test_no_module_imports_itself_through_others(package: str):
    graph = import_graph(ROOT / package)
    found = [one_circle(graph, component) for component in circles(graph)]
    assert not found, f"import circles in {package}/:\n" + "\n".join(found)


def test_the_check_sees_a_function_level_circle_and_ignores_type_checking(tmp_path):
    """The rule bites: a circle closed by an import inside a function is found and named; one closed only under
    `if TYPE_CHECKING:` is not."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def later():\n    from pkg.high import thing\n")
    (package / "high.py").write_text("from . import low\nthing = 1\n")
    (package / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from pkg import hinted\nelse:\n    import pkg.low\n")
    (package / "hinted.py").write_text("from .typed import something\n")
    graph = import_graph(package)
    assert graph["pkg.typed"] == {"pkg.low": 5}
    assert circles(graph) == [["pkg.high", "pkg.low"]]
    assert one_circle(graph, ["pkg.high", "pkg.low"]) == "pkg.high (line 1) -> pkg.low (line 2) -> pkg.high"
