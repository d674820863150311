"""The package's shape, read from its source (AST only, nothing imported): no class over 25 methods, no
import circle among stabilitykit modules (imports made only for type checking included), and the
drivers within their line budget."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import stabilitykit

PACKAGE = Path(stabilitykit.__file__).parent
MAX_METHODS = 25
#: Every driver, the base and their collaborators, and the old import paths that re-export them.
DRIVER_FILES = ["drivers/*.py", "guard.py", "lightning.py", "core.py", "integrations/*.py"]
DRIVER_LINE_BUDGET = 2_200
#: What they hold today: they may not grow.
DRIVER_LINES_NOW = 2_200


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The stabilitykit modules ``name`` imports anywhere in its source (function bodies and
    ``if TYPE_CHECKING:`` blocks included): ``from package import module`` counts as the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
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
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_no_class_has_more_than_25_methods() -> None:
    too_big = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef):
                count = sum(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) for item in node.body)
                if count > MAX_METHODS:
                    too_big[f"{path.relative_to(PACKAGE.parent)}:{node.name}"] = count
    assert not too_big, f"classes over {MAX_METHODS} methods (split out a collaborator with one job): {too_big}"


def test_no_import_circle() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "stabilitykit.engine.step" in graph["stabilitykit.drivers.base"]  # the scan sees imports
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]  # and finds circles
    circles = [sorted(c) for c in _circles(graph)]
    assert not circles, f"import circles among stabilitykit modules (type-level imports included): {circles}"


def _driver_lines() -> dict[str, int]:
    files = sorted({path for pattern in DRIVER_FILES for path in PACKAGE.glob(pattern)})
    return {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in files}


def test_drivers_do_not_grow() -> None:
    lines = _driver_lines()
    assert "drivers/base.py" in lines and "drivers/loop.py" in lines
    assert sum(lines.values()) <= DRIVER_LINES_NOW, f"drivers: {sum(lines.values())} lines, {lines}"


def test_drivers_within_their_line_budget() -> None:
    lines = _driver_lines()
    assert sum(lines.values()) <= DRIVER_LINE_BUDGET, f"drivers: {sum(lines.values())} lines, {lines}"
