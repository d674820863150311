"""The shape of a saved driver state, validated as a whole before anything is loaded.

A truncated or hand-edited checkpoint must fail with an error that names the key and the
expected type, and must leave the driver exactly as it was (no half-loaded state). Versioned:
``version`` says which layout a state has; this release reads its own layout and the four before it
(``_upgrade``: a journal column renamed, parts added to the escalation and the spike monitor), and refuses older
development layouts.

Two layers of checks: the schema below (every key, type and list length a state of this
version has, whatever driver saved it), then, given the loading driver's own state as
``reference``, everything whose size that driver fixes (its layers, the clip statistics' shapes,
the journal's row width).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, get_type_hints

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator
from torch import Tensor

from stabilitykit.engine.journal import LEGACY_COLUMNS, Row, RowInfo
from stabilitykit.engine.ledger import Counters
from stabilitykit.recovery.escalation import LrChange
from stabilitykit.recovery.rollback_log import RollbackRecord

if TYPE_CHECKING:
    from stabilitykit.engine.step import StabilityEngine

#: Version of the state a driver saves.
STATE_VERSION = 14  # 11: the journal's snapshot column is ``health`` (10 called it ``verdict``); 12: ``while_bad``;
#: 13: the spike monitor's recent losses (``loss_median_alert``) and held look (``look_confirm_steps``);
#: 14: the escalation's ``initial_loss`` (the first step's loss)
#: The oldest version this release reads: a state of it is upgraded on load (``_upgrade``).
OLDEST_READ = 10


class _State(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, arbitrary_types_allowed=True)

    @model_validator(mode="before")
    @classmethod
    def _not_emptied(cls, data: Any) -> Any:
        """A section emptied to ``{}`` is refused as a whole, naming the keys it should hold."""
        required = [name for name, info in cls.model_fields.items() if info.is_required()]
        if isinstance(data, Mapping) and not data and required:
            shown = ", ".join(required[:4]) + (", ..." if len(required) > 4 else "")
            raise ValueError(f"emptied: it must hold {len(required)} keys ({shown})")
        return data


def schema_of(cls: type) -> type[BaseModel]:
    """The strict schema of a dataclass the state holds, read from the dataclass itself: its fields,
    their types and defaults, and the constraints written on them (``Annotated[int, Ge(0)]``).

    A saved section that mirrors an owner's dataclass (the ledger's counters, the journal's row
    notes and carried rows, recovery's rollback records) is declared once, on the owner; adding a
    field there is all a new key needs.
    Every field is required, defaults or not: ``state_dict()`` writes each one, so a key missing
    (or a section emptied to ``{}``) is a damaged state, not a reason to start a count afresh.
    """
    hints = get_type_hints(cls, include_extras=True)
    spec: dict[str, Any] = {f.name: (hints[f.name], ...) for f in dataclasses.fields(cls)}
    return create_model(cls.__name__, __base__=_State, **spec)


_Counters = schema_of(Counters)
_RowInfo = schema_of(RowInfo)
_Row = schema_of(Row)
_Rollback = schema_of(RollbackRecord)
_LrChange = schema_of(LrChange)


class _Detector(_State):
    """``PredictiveDetector.state_dict()``: one entry per scored series in every list."""

    level: list[float]
    last: list[float]
    abs_dev: list[float]
    cov: list[float]
    var: list[float]
    count: list[Annotated[int, Field(ge=0)]]

    @model_validator(mode="after")
    def _one_length(self) -> _Detector:
        n = len(self.level)
        for key in ("last", "abs_dev", "cov", "var", "count"):
            if len(getattr(self, key)) != n:
                raise ValueError(f"{key!r} holds {len(getattr(self, key))} series, 'level' holds {n}")
        return self

    @property
    def size(self) -> int:
        return len(self.level)


class _Trend(_State):
    fast: float
    slow: float
    count: int = Field(ge=0)
    first_step: int | None
    last_step: int | None


class _Level(_State):
    level: float
    best: float | None
    count: int = Field(ge=0)


class _Median(_State):
    values: list[float]


class _PendingLook(_State):
    held: dict[str, Any] | None
    unconfirmed: int = Field(ge=0)


class _SpikeScore(_State):
    values: list[float]
    window: int = Field(ge=2)

    @model_validator(mode="after")
    def _within_window(self) -> _SpikeScore:
        if len(self.values) > self.window:
            raise ValueError(f"'values' holds {len(self.values)} values, more than its window of {self.window}")
        return self


class _Spikes(_State):
    """``SpikeMonitor.state_dict()``."""

    detector: _Detector
    layer_detector: _Detector | None
    trends: dict[str, _Trend]
    trend_steps: int = Field(ge=0)
    trend_high: list[str]
    loss_trend: _Trend
    spike_score: _SpikeScore
    last_z: list[float] = Field(min_length=2, max_length=2)
    recent: list[float] = Field(min_length=3, max_length=3)
    last_alert_step: int | None
    last_warning_step: int | None
    last_alert_drift: bool
    alerts: int = Field(ge=0)
    loss_drift: float
    level: _Level
    level_alerted: bool
    median: _Median
    median_alerted: bool
    pending_look: _PendingLook
    last_step: int | None

    @model_validator(mode="after")
    def _two_series(self) -> _Spikes:
        if self.detector.size != 2:
            raise ValueError(f"'detector' scores 2 series (grad norm, loss), this one holds {self.detector.size}")
        return self

    @model_validator(mode="after")
    def _consistent_history(self) -> _Spikes:
        """What the monitor's parts saw agrees: every step scored fed the score window a grad norm (the
        window holds the last of them), and a step that brought precursors made or fed a trend."""
        scored, window = self.detector.count[0], self.spike_score.window
        held = len(self.spike_score.values)
        if held < min(scored, window):
            raise ValueError(
                f"'spike_score.values' holds {held} values, but the detector scored {scored} grad norms "
                f"(window {window}): a window cut short"
            )
        if self.trend_steps and not self.trends:
            raise ValueError(f"'trends' is empty, but {self.trend_steps} steps brought precursor signals")
        for name, trend in self.trends.items():
            if trend.count > self.trend_steps:
                raise ValueError(
                    f"'trends.{name}' counts {trend.count} values, more than the {self.trend_steps} steps "
                    "that brought precursor signals"
                )
        missing = sorted(set(self.trend_high) - set(self.trends))
        if missing:
            raise ValueError(f"'trend_high' names {missing} that 'trends' does not hold")
        return self


class _Fp16(_State):
    overflow_steps: list[int]
    warned_at: int


class _Ledger(_State):
    counters: _Counters  # type: ignore[valid-type]
    scheduler_debt: int = Field(ge=0)
    spikes: _Spikes | None
    fp16: _Fp16


class _Journal(_State):
    rows: torch.Tensor
    infos: list[_RowInfo]  # type: ignore[valid-type]
    metric_names: list[str]
    columns: list[str] | None = None  # the built-in columns (absent: saved before ``health`` was added)
    carried: list[_Row]  # type: ignore[valid-type]  # rows decoded on the host

    @model_validator(mode="after")
    def _one_row_per_info(self) -> _Journal:
        rows = self.rows
        if rows.dim() != 2 or rows.shape[0] != len(self.infos):
            raise ValueError(
                f"'rows' must be a 2-d tensor with one row per entry of 'infos' ({len(self.infos)}), "
                f"got shape {tuple(rows.shape)}"
            )
        if not rows.is_floating_point():
            raise ValueError(f"'rows' must be a floating-point tensor, got {rows.dtype}")
        return self


class _Engine(_State):
    step: int = Field(ge=0)
    ledger: _Ledger
    clip: dict[str, torch.Tensor]
    spike_rule: dict[str, torch.Tensor] | None
    rules: dict[str, dict[str, Any]]  # users' skip rules' own state, by name
    journal: _Journal
    layer_names: list[str]
    monitors: dict[str, Any] = Field(default_factory=dict)  # the model monitor's own state (FP8 fallbacks)
    rerun: dict[str, Any] = Field(default_factory=dict)  # transient faults per rank (RerunConfig)

    @model_validator(mode="after")
    def _layer_detector_per_layer(self) -> _Engine:
        spikes = self.ledger.spikes
        layers = spikes.layer_detector if spikes is not None else None
        if layers is not None and layers.size != len(self.layer_names):
            raise ValueError(
                f"'ledger.spikes.layer_detector' scores {layers.size} layers, 'layer_names' has {len(self.layer_names)}"
            )
        return self


class _Escalation(_State):
    level: int = Field(ge=0)
    changes: list[_LrChange]  # type: ignore[valid-type]
    last_action: int | None = Field(ge=0)
    last_onset: int | None = Field(ge=0)
    reviewed: int | None = Field(ge=0)  # the index in 'changes' of the last one whose end was reviewed
    data_bad: bool | None
    skipped: list[Annotated[int, Field(ge=0)]] | None  # (first, end) of the batches being judged
    reference: float | None
    skipped_losses: list[float]
    while_bad: bool  # the batches being skipped are skipped only while they measure bad (the data's cause)
    loss_steps: list[Annotated[int, Field(ge=0)]]
    losses: list[float]
    onsets: list[Annotated[int, Field(ge=0)]]
    initial_loss: float | None  # the first step's loss (None: not taken, not finite, or saved before version 14)

    @model_validator(mode="after")
    def _consistent(self) -> _Escalation:
        if self.reviewed is not None and self.reviewed >= len(self.changes):
            raise ValueError(f"'reviewed' is change {self.reviewed}, 'changes' holds {len(self.changes)}")
        if self.skipped is not None and len(self.skipped) != 2:
            raise ValueError(f"'skipped' must be [first, end], got {len(self.skipped)} values")
        if len(self.losses) != len(self.loss_steps):
            raise ValueError(f"'losses' holds {len(self.losses)} values, 'loss_steps' {len(self.loss_steps)}")
        return self


class _Recovery(_State):
    rollbacks: list[_Rollback]  # type: ignore[valid-type]
    cooldown_until: int = Field(ge=0)
    skip_until: int = Field(ge=0, default=0)
    escalation: _Escalation | None = None


class _Core(_State):  # one optimizer's state; the version is the driver's, stored once beside them
    engine: _Engine
    trace_left: int = Field(ge=0)
    held_steps: int = Field(ge=0)
    recovery: _Recovery | None = None  # only with RecoveryConfig(enabled=True)


class _Invalid(ValueError):
    """A guard-dependent mismatch: where (dotted path) and what."""

    def __init__(self, where: str, what: str) -> None:
        super().__init__(where, what)
        self.where, self.what = where, what


def check_version(state: Mapping[str, Any]) -> None:
    """Refuse a driver's state whose ``version`` is missing (a key dropped is refused as a wrong one is), not
    an int, or not one this release reads. The version is stored once, at this level (``driver_state``)."""
    if "version" not in state:
        raise ValueError(
            f"invalid stabilitykit state at 'version': missing (this release saves {STATE_VERSION}; not saved by a "
            "stabilitykit driver's state_dict()?). Nothing was loaded."
        )
    version = state["version"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise ValueError(
            f"invalid stabilitykit state at 'version': must be an int (this release saves {STATE_VERSION}), "
            f"got {type(version).__name__} {version!r:.60}. Nothing was loaded."
        )
    if version > STATE_VERSION:
        raise ValueError(
            f"stabilitykit state version {version} is newer than this release reads ({STATE_VERSION}); "
            "upgrade stabilitykit to load it"
        )
    if version < OLDEST_READ:
        raise ValueError(
            f"stabilitykit state version {version} was saved by a development build with another layout; this "
            f"release reads versions {OLDEST_READ} to {STATE_VERSION} only. Nothing was loaded."
        )


def validate_state(state: Any, reference: Mapping[str, Any] | None = None) -> None:
    """Raise ``ValueError`` naming the first bad key (dotted path) and what was expected there, in one
    optimizer's state (``optimizers.<i>`` of a driver's state; its version is the driver's: ``check_version``).

    ``reference``: the loading driver's own ``state_dict()``; when given, the sizes it fixes (layer
    names, clip and skip-rule tensor shapes, journal row width, per-layer detector size) must match.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"stabilitykit state must be a mapping (from state_dict()), got {type(state).__name__}")
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
    if reference is not None:
        try:
            _match_reference(state["engine"], reference["engine"])
        except _Invalid as exc:
            raise ValueError(
                f"invalid stabilitykit state at 'engine.{exc.where}': {exc.what}. Nothing was loaded."
            ) from None


def _match_reference(saved: Mapping[str, Any], ours: Mapping[str, Any]) -> None:
    """The sizes the loading engine fixes (``ours``: its own state) against a schema-valid saved engine state.

    Unread journal rows of another width (another log cadence, other recorded metrics) are fine: the
    journal decodes them by their saved column names (``Journal.load_state_dict``)."""
    if list(saved["layer_names"]) != list(ours["layer_names"]):
        raise _Invalid(
            "layer_names",
            f"saved for other layers ({len(saved['layer_names'])}: {list(saved['layer_names'])[:3]}...), "
            f"this guard measures {len(ours['layer_names'])}: {list(ours['layer_names'])[:3]}... "
            "(a different model or grouping)",
        )
    for section in ("clip", "spike_rule"):
        _match_tensors(section, saved.get(section), ours.get(section))
    missing_rules = sorted(set(ours["rules"]) - set(saved["rules"]))
    if missing_rules:
        raise _Invalid("rules", f"no state for the skip rule(s) {missing_rules} this guard runs")
    for section in ("spikes",):
        if saved["ledger"][section] is None and ours["ledger"][section] is not None:
            raise _Invalid(f"ledger.{section}", "null, but this guard runs the spike monitor (a damaged state?)")
    if saved["journal"].get("columns") != ours["journal"].get("columns"):
        raise _Invalid(
            "journal.columns",
            f"{saved['journal'].get('columns')!r:.80} is not this release's row layout "
            f"{ours['journal'].get('columns')} (a damaged state: its unread rows would be misread)",
        )
    saved_rows = saved["journal"]["rows"]
    columns = saved["journal"].get("columns") or LEGACY_COLUMNS
    width = len(columns) + len(saved["journal"].get("metric_names", []))
    layers = len(saved["layer_names"])
    if saved["journal"]["infos"] and saved_rows.shape[1] not in (width, width + layers):
        raise _Invalid(
            "journal.rows",
            f"unread rows are {saved_rows.shape[1]} wide; their {width} named columns make {width} "
            f"(no per-layer norms) or, with a norm for each of the {layers} layers, {width + layers}",
        )
    saved_spikes, our_spikes = saved["ledger"]["spikes"], ours["ledger"]["spikes"]
    if saved_spikes is not None and our_spikes is not None:
        saved_layers, our_layers = saved_spikes.get("layer_detector"), our_spikes.get("layer_detector")
        if saved_layers is None and our_layers is not None:
            raise _Invalid(
                "ledger.spikes.layer_detector", "null, but this guard scores every layer (SpikeConfig.per_layer)"
            )
        if (
            saved_layers is not None
            and our_layers is not None
            and len(saved_layers["level"]) != len(our_layers["level"])
        ):
            raise _Invalid(
                "ledger.spikes.layer_detector",
                f"scores {len(saved_layers['level'])} layers, this guard's scores {len(our_layers['level'])}",
            )


def _match_tensors(section: str, saved: Mapping[str, Any] | None, ours: Mapping[str, Any] | None) -> None:
    """A saved section this engine will load (both non-empty) has its keys, each tensor of its shape.

    This engine keeping no such state (``ours`` empty): the loader ignores what was saved. This
    engine keeping some and the saved section empty or null: refused, as a key dropped is (loading
    it would restart the statistics with no word)."""
    if not ours:
        return
    if not saved:
        raise _Invalid(
            section,
            f"{'emptied' if saved is not None else 'null'}, but this guard's {section} state has keys {sorted(ours)} "
            "(a damaged state, or one saved with another mode)",
        )
    if set(saved) != set(ours):
        missing = sorted(set(ours) - set(saved))
        extra = sorted(set(saved) - set(ours))
        what = f"missing {missing}" if missing else f"unexpected {extra}"
        raise _Invalid(
            section, f"{what}: this guard's {section} state has keys {sorted(ours)} (saved with another mode?)"
        )
    for key, tensor in saved.items():
        expected = ours[key]
        if tuple(tensor.shape) != tuple(expected.shape):
            raise _Invalid(
                f"{section}.{key}",
                f"a tensor of shape {tuple(expected.shape)} expected, got {tuple(tensor.shape)} "
                "(saved for another model or number of parameter tensors?)",
            )


def driver_state(engines: Sequence[StabilityEngine]) -> dict[str, Any]:
    """The one state format every driver saves: the version once, and one state per optimizer."""
    return {"version": STATE_VERSION, "optimizers": [_optimizer_state(engine) for engine in engines]}


def load_driver_state(engines: Sequence[StabilityEngine], state: Mapping[str, Any]) -> None:
    """Restore what ``driver_state`` returned: the version and every optimizer's state are validated before
    any is loaded; an error names the path within the state and says that nothing was loaded."""
    check_version(state)
    state = _upgrade(state)
    states = state.get("optimizers")
    if not isinstance(states, list):
        got = "missing" if states is None else f"got {type(states).__name__}"
        raise ValueError(
            f"invalid stabilitykit state at 'optimizers': a list with one state per optimizer expected ({got}; "
            "not saved by a stabilitykit driver's state_dict()?). Nothing was loaded."
        )
    if len(states) != len(engines):
        raise ValueError(
            f"invalid stabilitykit state at 'optimizers': it holds {len(states)} optimizer state(s), this run "
            f"has {len(engines)} optimizer(s). Nothing was loaded."
        )
    for i, (engine, saved) in enumerate(zip(engines, states, strict=True)):
        try:
            validate_state(saved, reference=_optimizer_state(engine))
        except (TypeError, ValueError) as exc:
            raise ValueError(_within(f"optimizers.{i}", str(exc))) from None
    for engine, saved in zip(engines, states, strict=True):
        _load_optimizer_state(engine, saved)


def _upgrade(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """A state of version 10 to 13 as this version's: in 10 the journal's snapshot column was named ``verdict``
    (in its saved column names and in each row carried on the host); before 12 the escalation had no
    ``while_bad`` (False); before 13 the spike monitor kept no recent losses (``loss_median_alert``: its window
    starts empty, as on a fresh run, and fills in 23 steps) and held no look (``look_confirm_steps``); before 14
    the escalation kept no first-step loss (None: the end of a lowered LR is judged against the best the run
    held alone, as it was). Nothing else changed. The caller's state is not modified; a damaged one is left
    for validation to name."""
    version = state.get("version")
    if version not in (10, 11, 12, 13) or not isinstance(state.get("optimizers"), list):
        return state
    optimizers = [_renamed_health(s) if version == 10 else s for s in state["optimizers"]]
    if version in (10, 11):
        optimizers = [_with_escalation_key(s, "while_bad", False) for s in optimizers]
    optimizers = [_spikes_of_13(s) for s in optimizers] if version < 13 else optimizers
    optimizers = [_with_escalation_key(s, "initial_loss", None) for s in optimizers]
    return {**state, "version": STATE_VERSION, "optimizers": optimizers}


def _spikes_of_13(optimizer: Any) -> Any:
    """One optimizer's state before version 13 with its spike monitor's new parts as a fresh monitor has them."""
    engine = optimizer.get("engine") if isinstance(optimizer, Mapping) else None
    ledger = engine.get("ledger") if isinstance(engine, Mapping) else None
    spikes = ledger.get("spikes") if isinstance(ledger, Mapping) else None
    if not isinstance(engine, Mapping) or not isinstance(ledger, Mapping) or not isinstance(spikes, Mapping):
        return optimizer
    fresh = {"median": {"values": []}, "median_alerted": False, "pending_look": {"held": None, "unconfirmed": 0}}
    return {**optimizer, "engine": {**engine, "ledger": {**ledger, "spikes": {**fresh, **spikes}}}}


def _with_escalation_key(optimizer: Any, key: str, value: Any) -> Any:
    """One optimizer's state whose escalation lacks ``key`` (saved before that key existed) with it set to
    ``value``: ``while_bad`` (12) False, what a skip ahead saved before it had (a fixed count);
    ``initial_loss`` (14) None, not known."""
    recovery = optimizer.get("recovery") if isinstance(optimizer, Mapping) else None
    escalation = recovery.get("escalation") if isinstance(recovery, Mapping) else None
    if not isinstance(recovery, Mapping) or not isinstance(escalation, Mapping) or key in escalation:
        return optimizer
    return {**optimizer, "recovery": {**recovery, "escalation": {**escalation, key: value}}}


def _renamed_health(optimizer: Any) -> Any:
    """One optimizer's version 10 state with its journal's ``verdict`` column named ``health``."""
    engine = optimizer.get("engine") if isinstance(optimizer, Mapping) else None
    journal = engine.get("journal") if isinstance(engine, Mapping) else None
    if not isinstance(engine, Mapping) or not isinstance(journal, Mapping):
        return optimizer
    journal = dict(journal)
    if isinstance(journal.get("columns"), list):
        journal["columns"] = ["health" if c == "verdict" else c for c in journal["columns"]]
    if isinstance(journal.get("carried"), list):
        journal["carried"] = [
            {("health" if k == "verdict" else k): v for k, v in row.items()} if isinstance(row, Mapping) else row
            for row in journal["carried"]
        ]
    return {**optimizer, "engine": {**engine, "journal": journal}}


def _optimizer_state(engine: StabilityEngine) -> dict[str, Any]:
    """One optimizer's state: everything that must survive a resume (plain values, small device tensors)."""
    assert engine.tracing is not None
    state = {
        "engine": engine.state_dict(),
        "trace_left": engine.tracing.left,
        "held_steps": engine.held_steps,
    }
    if engine.recovery is not None:
        state["recovery"] = engine.recovery.state_dict()
    return state


def _load_optimizer_state(engine: StabilityEngine, state: Mapping[str, Any]) -> None:
    """Restore what ``_optimizer_state`` returned (validated already)."""
    assert engine.tracing is not None
    engine.load_state_dict(dict(state["engine"]))
    engine.tracing.left = int(state["trace_left"])
    engine.held_steps = int(state["held_steps"])
    if engine.recovery is not None:  # a resume: snapshots from before it are dropped in any case
        engine.recovery.load_state_dict(dict(state.get("recovery") or {}))
    engine.tracing.attach_for(engine.step)


def _within(prefix: str, message: str) -> str:
    """An optimizer state's error message with the path from the driver's state (``optimizers.<i>.``)."""
    head = "invalid stabilitykit state at '"
    if message.startswith(head):
        return head + prefix + "." + message[len(head) :]
    return f"invalid stabilitykit state at '{prefix}': {message}"


def _json_float(x: float) -> float | str:
    """A float strict JSON can hold: non-finite values as "nan", "inf", "-inf" (``json`` would write NaN)."""
    return x if math.isfinite(x) else str(x)


def to_json(value: Any) -> Any:
    """A driver's state as strict JSON values (tensors become tagged lists; every float32 survives
    exactly; NaN and infinities become the strings "nan", "inf", "-inf", never JSON's invalid NaN)."""
    if isinstance(value, Tensor):
        t = value.detach().cpu()
        data = t.float().reshape(-1).tolist() if t.is_floating_point() else t.reshape(-1).tolist()
        return {
            "__tensor__": [_json_float(x) for x in data] if t.is_floating_point() else data,
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
        }
    if isinstance(value, Mapping):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": str(value)}
    return value


def from_json(value: Any, device: torch.device | None = None) -> Any:
    """Undo ``to_json`` (tensors on ``device``)."""
    if isinstance(value, Mapping):
        if "__tensor__" in value:
            dtype = getattr(torch, value["dtype"])
            data = [float(x) if isinstance(x, str) else x for x in value["__tensor__"]]
            return torch.tensor(data, dtype=dtype, device=device).reshape(value["shape"])
        if "__float__" in value:
            return float(value["__float__"])
        return {k: from_json(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v, device) for v in value]
    return value
