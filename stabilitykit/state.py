"""The shape of a saved driver state, validated as a whole before anything is loaded.

A truncated or hand-edited checkpoint must fail with an error that names the key and the
expected type, and must leave the driver exactly as it was (no half-loaded state). Versioned:
``version`` says which layout a state has, so a later release can read today's checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = ["STATE_VERSION", "validate_state"]

#: Version of the state a driver saves; older versions this release knows are read too.
STATE_VERSION = 1


class _State(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, arbitrary_types_allowed=True)


class _Counters(_State):
    skipped_total: int = Field(ge=0)
    clipped_total: int = Field(ge=0)
    nonfinite_total: int = Field(ge=0)
    overflow_total: int = Field(ge=0)
    consecutive: int = Field(ge=0)
    max_norm: float
    last_bad_step: int
    last_bad_reason: str | None
    last_bad_layer: str | None
    skipped_recent: int = Field(ge=0)
    clipped_recent: int = Field(ge=0)
    max_norm_recent: float


class _Ledger(_State):
    counters: _Counters
    scheduler_debt: int = Field(ge=0)
    spikes: dict[str, Any] | None
    fp16: dict[str, Any]


class _RowInfo(_State):
    step: int = Field(ge=0)
    has_loss: bool
    scaler_active: bool
    folded: bool = False


class _Journal(_State):
    rows: torch.Tensor
    infos: list[_RowInfo]


class _Engine(_State):
    step: int = Field(ge=0)
    ledger: _Ledger
    clip: dict[str, torch.Tensor]
    spike_rule: dict[str, torch.Tensor] | None = None
    journal: _Journal
    layer_names: list[str]


class _Core(_State):
    version: int = Field(ge=1)
    engine: _Engine
    trace_left: int = Field(ge=0, default=0)


def validate_state(state: Any) -> None:
    """Raise ``ValueError`` naming the first bad key (dotted path) and what was expected there."""
    if not isinstance(state, Mapping):
        raise TypeError(f"stabilitykit state must be a mapping (from state_dict()), got {type(state).__name__}")
    version = state.get("version")
    if isinstance(version, int) and version > STATE_VERSION:
        raise ValueError(
            f"stabilitykit state version {version} is newer than this release reads ({STATE_VERSION}); "
            "upgrade stabilitykit to load it"
        )
    try:
        _Core.model_validate(dict(state))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "<top level>"
        got = first.get("input")
        shown = "missing" if first["type"] == "missing" else f"got {type(got).__name__} {got!r:.60}"
        raise ValueError(
            f"invalid stabilitykit state at '{where}': {first['msg'].lower()} ({shown}); "
            f"{exc.error_count()} problem(s) in all. Nothing was loaded."
        ) from None
