"""The base of every config section: unknown fields are an error, a section is immutable.

Each section is defined beside the module that owns what it configures (``ClipConfig`` in
``engine/clipping.py``, ``SpikeConfig`` in ``spikes.py``, ...); ``config.py`` composes them into
``StabilityConfig``. This module imports nothing of the package, so every owner can derive from it
without an import cycle.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class UnknownFieldError(ValueError):
    """A field a section does not have (``.field``: the name as given, so a file reader can point at its line)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class Section(BaseModel):
    """Base for all config models: unknown fields are an error, and a config is immutable.

    A driver reads its config when it is built; a field assigned afterwards would be validated and
    then silently ignored, so assignment raises instead. Derive a changed copy with
    ``config.model_copy(update={...})`` and build a new driver with it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _unknown_fields(cls, data: Any) -> Any:
        """A misspelled field names the closest real one (``max_nrom`` -> did you mean ``max_norm``?)."""
        if isinstance(data, Mapping):
            known = set(cls.model_fields)
            for key in data:
                if isinstance(key, str) and key not in known:
                    close = difflib.get_close_matches(key, sorted(known), n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else f"; fields: {', '.join(sorted(known))}"
                    raise UnknownFieldError(f"{cls.__name__} has no field {key!r}{hint}", key)
        return data
