"""The compatibility layer is the only place that reaches inside torch and the frameworks.

Every read of another object's private attribute, every ``setattr`` on an object that is not the
module's own and every class swap lives in ``stabilitykit/compat/``; a new torch or framework
release that renames an internal then breaks one small module. The scan reads the package's source.
"""

from __future__ import annotations

import ast
from pathlib import Path

import stabilitykit

PACKAGE = Path(stabilitykit.__file__).parent
COMPAT = PACKAGE / "compat"
#: Public API despite the underscore: a namedtuple's field names.
ALLOWED_NAMES = {"_fields"}
#: The sync counter patches ``torch.Tensor`` methods on purpose, for the block it counts (a test tool).
ALLOWED_FILES = {PACKAGE / "testing" / "syncs.py"}


def _own(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in {"self", "cls"}


def _private(name: object) -> bool:
    return isinstance(name, str) and name.startswith("_") and not name.startswith("__") and name not in ALLOWED_NAMES


def _crossings(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """What ``path`` does that only the compatibility layer may do, one line each."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        text = ""
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
            if not (isinstance(node.value, ast.Name) and node.value.id == "torch" and node.attr.startswith("_foreach")):
                text = ast.unparse(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            fn, target = node.func.id, node.args[0]
            if fn in {"getattr", "hasattr"} and len(node.args) > 1 and not _own(target):
                key = node.args[1]
                if isinstance(key, ast.Constant) and _private(key.value):
                    text = ast.unparse(node)
            elif fn in {"setattr", "delattr"} and not _own(target):
                text = ast.unparse(node)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Attribute) and t.attr == "__class__" for t in node.targets
        ):
            text = ast.unparse(node)
        if text:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {text}")
    return found


def test_only_the_compat_layer_reads_private_attributes_or_patches_objects() -> None:
    files = [p for p in PACKAGE.rglob("*.py") if not p.is_relative_to(COMPAT) and p not in ALLOWED_FILES]
    crossings = [line for path in sorted(files) for line in _crossings(path)]
    assert not crossings, "move these into stabilitykit/compat/:\n" + "\n".join(crossings)


def test_the_scan_sees_what_it_forbids(tmp_path: Path) -> None:
    """The scan itself can fail: each forbidden form is caught in a file written to break it."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\n"
        "def f(model, opt, sched, other):\n"
        "    a = model._orig_mod\n"
        "    b = getattr(opt, '_step_supports_amp_scaling', False)\n"
        "    setattr(other, 'step', None)\n"
        "    sched.__class__ = object\n"
        "    torch._foreach_norm([])\n"
        "    return self_ok(a, b)\n"
    )
    found = _crossings(sample, tmp_path)
    assert len(found) == 4, found
