"""The configuration tables, generated from the pydantic models into ``docs/configuration.md``.

The page holds them between ``<!-- config-reference -->`` and ``<!-- /config-reference -->``, so they
read in the Markdown file as on the site. ``python docs/hooks/config_reference.py`` rewrites them
(a test fails while they are stale); as an mkdocs hook, the site is built with freshly generated
tables whatever the file holds.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

MARKER = "<!-- config-reference -->"
END = "<!-- /config-reference -->"
PAGE = Path(__file__).resolve().parent.parent / "configuration.md"


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("NoneType", "None")


def _default(field: Any) -> str:
    if field.default_factory is not None:
        return f"`{field.default_factory.__name__}()`"
    return f"`{field.default!r}`"


def _table(model: type[BaseModel]) -> str:
    lines = [f"### `{model.__name__}`", "", (model.__doc__ or "").strip(), ""]
    lines += ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        desc = (field.description or "").replace("|", "\\|")
        if not desc and isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            desc = f"See [`{field.annotation.__name__}`](#{field.annotation.__name__.lower()})."
        lines.append(f"| `{name}` | `{_type_name(field.annotation)}` | {_default(field)} | {desc} |")
    return "\n".join(lines) + "\n"


def tables() -> str:
    """Every section's table, in the page's order."""
    import stabilitykit as sk

    models = [
        sk.StabilityConfig,
        sk.GradNormConfig,
        sk.ClipConfig,
        sk.SkipConfig,
        sk.SpikeConfig,
        sk.NaNTraceConfig,
        sk.DataGuardConfig,
        sk.Fp16Config,
        sk.PrecisionConfig,
        sk.QKClipConfig,
        sk.MonitorConfig,
        sk.Fp8MonitorConfig,
        sk.RouterConfig,
        sk.RecoveryConfig,
        sk.RerunConfig,
        sk.ReplicaCheckConfig,
    ]
    return "\n".join(_table(m) for m in models)


def render(markdown: str) -> str:
    """``markdown`` with the block between the markers (or after a lone start marker) generated afresh."""
    if MARKER not in markdown:
        return markdown
    head, rest = markdown.split(MARKER, 1)
    tail = rest.split(END, 1)[1] if END in rest else "\n"
    return f"{head}{MARKER}\n\n{tables()}\n{END}{tail}"


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return render(markdown)


if __name__ == "__main__":
    sys.path.insert(0, str(PAGE.parent.parent))
    PAGE.write_text(render(PAGE.read_text()))
    print(f"wrote the configuration tables into {PAGE}")
