"""The public surface is what ``stabilitykit/__init__.py`` and the documented subpackages export.

Only the public modules below define ``__all__``; every other module is internal (no ``__all__``:
nothing there is promised between releases). Every name a public module exports is named in the
docs (the API page or a guide), so nothing public is undocumented.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import stabilitykit

PACKAGE = Path(stabilitykit.__file__).parent
ROOT = PACKAGE.parent
PUBLIC = {
    "stabilitykit",
    "stabilitykit.drivers.accelerate",
    "stabilitykit.drivers.deepspeed",
    "stabilitykit.drivers.fabric",
    "stabilitykit.drivers.hf",
    "stabilitykit.drivers.lightning",
    "stabilitykit.integrations",
    "stabilitykit.integrations.accelerate",
    "stabilitykit.integrations.deepspeed",
    "stabilitykit.integrations.fabric",
    "stabilitykit.integrations.transformers",
    "stabilitykit.lightning",
    "stabilitykit.monitors",
    "stabilitykit.nn",
    "stabilitykit.precision_eval",
    "stabilitykit.rules",
    "stabilitykit.sinks",
    "stabilitykit.testing",
    "stabilitykit.testing.plugin",
    "stabilitykit.testing.ops",
    "stabilitykit.testing.syncs",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _defines_all(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(
        isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        for node in tree.body
    )


def test_only_public_modules_define_all() -> None:
    defining = {_module_name(p) for p in PACKAGE.rglob("*.py") if _defines_all(p)}
    assert defining - PUBLIC == set(), "internal modules must not define __all__ (or add them to PUBLIC and docs)"
    existing = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    assert (PUBLIC & existing) - defining == set(), "a public module must say what it exports"


def test_every_public_name_is_documented() -> None:
    docs = "\n".join(p.read_text() for p in (ROOT / "docs").rglob("*.md")) + (ROOT / "README.md").read_text()
    missing = []
    for name in sorted(PUBLIC):
        if (
            not (PACKAGE.parent / name.replace(".", "/")).with_suffix(".py").exists()
            and not (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()
        ):
            continue
        module = importlib.import_module(name)
        missing += [
            f"{name}.{item}"
            for item in module.__all__
            if item != "__version__" and not re.search(r"\b" + re.escape(item) + r"\b", docs)
        ]
    assert not missing, f"public but never named in the docs: {missing}"
