"""The package's layout holds: the config sits below what it configures, and recovery's classes stay small.

Read from the source with ``ast``: every import statement counts, at module level, under
``TYPE_CHECKING`` or inside a function, and importing ``a.b.c`` counts as importing the packages
``a`` and ``a.b`` too (their ``__init__`` runs first).
"""

from __future__ import annotations

import ast
from pathlib import Path

import stabilitykit

PACKAGE = Path(stabilitykit.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (any import statement), with their parent packages."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                target = known(name) if name.startswith("stabilitykit") else None
                if target is None:
                    continue
                parts = target.split(".")
                targets |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        edges[module] = {t for t in targets if t != module and not module.startswith(t + ".")}
    return edges


def _reaches(edges: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(edges[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += edges.get(module, ())
    return seen


def test_the_config_and_recovery_are_on_no_import_circle() -> None:
    edges = _imports(_modules())
    circled = [
        m
        for m in edges
        if (m == "stabilitykit.config" or m.startswith("stabilitykit.recovery")) and m in _reaches(edges, m)
    ]
    assert circled == [], f"on an import circle: {circled}"
    assert "stabilitykit.recovery.controller" not in _reaches(edges, "stabilitykit.config")


def test_no_recovery_class_has_more_than_25_methods() -> None:
    sizes = {}
    for path in (PACKAGE / "recovery").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                sizes[f"{path.name}:{node.name}"] = sum(
                    isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) for item in node.body
                )
    assert "controller.py:Recovery" in sizes
    assert {name: n for name, n in sizes.items() if n > 25} == {}
