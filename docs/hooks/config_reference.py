"""mkdocs hook: replace ``<!-- config-reference -->`` with tables generated from the pydantic models."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

MARKER = "<!-- config-reference -->"


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


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if MARKER not in markdown:
        return markdown
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
        sk.RecoveryConfig,
        sk.RerunConfig,
        sk.ReplicaCheckConfig,
    ]
    return markdown.replace(MARKER, "\n".join(_table(m) for m in models))
