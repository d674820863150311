"""The device journal: one row of named columns per optimizer step, read to the host in one copy.

A row holds ``total`` (pre-clip norm), ``loss``, ``code`` (the step's decision code: 0 taken, else
why it was skipped, decoded by ``rules/registry.py``), ``coef`` (clip coefficient), ``threshold``,
``request`` (a rollback request agreed across ranks in this step's collective, 0 for none:
``recovery/agreement.py``), ``health`` (a snapshot's health, healthy or climbing, agreed the same
way, 0 for none: ``recovery/vetting.py``), then one column per metric a user records (``metric_names``), then one
norm per layer. Rows stay on the device until a logging step (or a step whose decision the host
must know now) reads them.

A saved journal whose shape no longer fits (another log cadence, other recorded metrics on a
resume) is not refused: its rows are decoded by their saved column names and carried on the host
until the next read, so nothing is lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from stabilitykit.fields import NonNegativeInt
from stabilitykit.rules.registry import SKIP

#: The built-in scalar columns of a row, in order; recorded metrics, then the per-layer norms follow.
COLUMNS = ("total", "loss", "code", "coef", "threshold", "request", "health")
TOTAL, LOSS, CODE, COEF, THRESHOLD, REQUEST, HEALTH = range(len(COLUMNS))
#: The built-in columns of a journal saved before the snapshot health column was added (a resume from such a state).
LEGACY_COLUMNS = COLUMNS[:HEALTH]
#: Rows kept on the device between reads. A log cadence above this reads the journal early (one sync).
MAX_JOURNAL_ROWS = 1024


@dataclass
class RowInfo:
    """What the host knows about a row without reading the device."""

    step: NonNegativeInt
    has_loss: bool
    scaler_active: bool
    folded: bool = False  # the ledger has taken this row already (read at its own step)


@dataclass
class Row:
    """One journal row on the host."""

    step: int
    total: float
    loss: float | None
    coef: float
    threshold: float
    code: int  # the decision code (0: taken), see rules/registry.py
    layers: list[float] = field(default_factory=list)
    request: int = 0  # the rollback request agreed in this step's collective (0: none)
    health: int = 0  # a snapshot's health agreed in this step's collective (0: none)
    on_time: bool = False  # read before its own optimizer and scheduler step (so the skip was applied there)
    folded: bool = False
    metrics: dict[str, float] = field(default_factory=dict)  # recorded metrics, agreed across ranks

    @property
    def skipped(self) -> bool:
        """The step was skipped."""
        return bool(self.code & SKIP)


def _decode(
    values: Sequence[float], info: RowInfo, metric_names: Sequence[str], columns: Sequence[str] = COLUMNS
) -> Row:
    width = len(columns) + len(metric_names)
    return Row(
        info.step,
        values[TOTAL],
        values[LOSS] if info.has_loss else None,
        values[COEF],
        values[THRESHOLD],
        round(values[CODE]),
        list(values[width:]),
        request=round(values[REQUEST]),
        health=round(values[HEALTH]) if len(columns) > HEALTH else 0,
        folded=info.folded,
        metrics={name: values[len(columns) + i] for i, name in enumerate(metric_names)},
    )


class Journal:
    """Fixed-size device buffer of step rows plus the host's notes about each."""

    def __init__(self, capacity: int, n_layers: int, device: torch.device, metric_names: Sequence[str] = ()) -> None:
        self.capacity = capacity
        self.n_layers = n_layers
        self.device = device
        self.metric_names = list(metric_names)
        self.width = len(COLUMNS) + len(self.metric_names) + n_layers
        self.buffer = torch.zeros(capacity, self.width, dtype=torch.float32, device=device)
        self.infos: list[RowInfo] = []
        self.carried: list[Row] = []  # rows of a saved journal of another shape, decoded on load
        self._views: list[tuple[Tensor, Tensor] | None] = [None] * capacity  # see ``_row_views``

    def __len__(self) -> int:
        return len(self.infos) + len(self.carried)

    @property
    def full(self) -> bool:
        """No room for another row: the next step must read the journal."""
        return len(self.infos) >= self.capacity

    def relayout(self, metric_names: Sequence[str]) -> None:
        """Columns for ``metric_names`` from now on; rows held so far are carried on the host (one
        sync, only when the columns change: once, at the first step of a run recording metrics)."""
        if list(metric_names) == self.metric_names:
            return
        carried = self.carried + self._held_rows()
        self.metric_names = list(metric_names)
        self.width = len(COLUMNS) + len(self.metric_names) + self.n_layers
        self.buffer = torch.zeros(self.capacity, self.width, dtype=torch.float32, device=self.device)
        self._views = [None] * self.capacity
        self.infos, self.carried = [], carried

    def _held_rows(self) -> list[Row]:
        if not self.infos:
            return []
        flat = self.buffer[: len(self.infos)].tolist()
        return [_decode(values, info, self.metric_names) for values, info in zip(flat, self.infos, strict=True)]

    def _row_views(self, index: int) -> tuple[Tensor, Tensor]:
        """Row ``index``'s scalar and metric columns, and its layer columns: views of the buffer, made once
        per row (slicing costs a few dispatches, every step)."""
        views = self._views[index]
        if views is None:
            row = self.buffer[index]
            split = len(COLUMNS) + len(self.metric_names)
            views = self._views[index] = (row[:split], row[split:])
        return views

    def write(self, info: RowInfo, scalars: list[Tensor], metrics: list[Tensor], layer_norms: Tensor | None) -> None:
        """Append one row from 0-d device tensors: one per column of ``COLUMNS``, one per recorded
        metric (no sync)."""
        head, layers = self._row_views(len(self.infos))
        values = [*scalars, *metrics]
        if len(values) > CODE and values[CODE].dtype != torch.float32:
            values[CODE] = values[CODE].float()  # a stack of one dtype is the fast one (an int32 code is exact)
        if len(values) != head.numel():  # fewer metrics than the columns (not how the engine writes)
            head = head[: len(values)]
        try:  # one stack into the row, which casts each value to the journal's float32
            torch.stack(values, out=head)
        except RuntimeError:  # a value on another device than the journal
            torch.stack([t.to(head) for t in values], out=head)
        if layer_norms is not None:
            layers.copy_(layer_norms)
        self.infos.append(info)

    def drop_last(self, step: int) -> None:
        """Forget the newest row if it is step ``step``'s and still held (the step is written again: a rerun)."""
        if self.infos and self.infos[-1].step == step:
            self.infos.pop()

    def rewrite_last(self, scalars: list[Tensor], layer_norms: Tensor | None) -> None:
        """Overwrite the newest row's first ``len(scalars)`` columns and its layer norms while it is still
        held (a step re-measured after it was written; its ``request`` and metrics stay)."""
        if self.infos:
            row = self.buffer[len(self.infos) - 1]
            torch.stack([t.to(row) for t in scalars], out=row[: len(scalars)])
            if layer_norms is not None:
                row[len(COLUMNS) + len(self.metric_names) :].copy_(layer_norms)

    def read_last(self) -> Row:
        """The newest row, now (one sync); it stays in the journal, marked as taken by the ledger."""
        info = self.infos[-1]
        row = _decode(self.buffer[len(self.infos) - 1].tolist(), info, self.metric_names)
        info.folded = True
        row.on_time = True
        return row

    def read(
        self, extras: list[Tensor] | None = None, current_step: int | None = None
    ) -> tuple[list[Row], list[float]]:
        """Every row since the last read plus ``extras`` (0-d or 1-d tensors, flattened into the tail) in ONE
        copy; the journal empties.

        ``current_step``: the step being decided now, whose row is therefore read on time.
        """
        n = len(self.infos)
        flat_rows = self.buffer[:n].flatten()
        if extras:
            tail = torch.cat([t.detach().reshape(-1).to(flat_rows) for t in extras])
            flat = torch.cat([flat_rows, tail]).tolist()
        else:
            flat = flat_rows.tolist()
        width = self.width
        rows = [
            _decode(flat[i * width : (i + 1) * width], info, self.metric_names) for i, info in enumerate(self.infos)
        ]
        for row in rows:
            row.on_time = row.folded or row.step == current_step
        rows = self.carried + rows
        self.infos, self.carried = [], []
        return rows, flat[n * width :]

    def state_dict(self) -> dict[str, Any]:
        """The unread rows (a device tensor), their notes and the column names: a resume loses nothing."""
        carried = [vars(r).copy() for r in self.carried]
        return {
            "rows": self.buffer[: len(self.infos)].clone(),
            "infos": [vars(i).copy() for i in self.infos],
            "metric_names": list(self.metric_names),
            "columns": list(COLUMNS),
            "carried": carried,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore unread rows saved by ``state_dict``. Rows of another shape (a different log cadence,
        other metrics or layers) are decoded by their saved column names and carried on the host."""
        infos = [RowInfo(**info) for info in state["infos"]]
        carried = [Row(**row) for row in state["carried"]]
        rows = state["rows"]
        names = list(state["metric_names"])
        columns = list(state.get("columns") or LEGACY_COLUMNS)  # absent or None: saved before ``health``
        self.infos = []
        if infos:
            if rows is None or rows.shape[0] < len(infos):
                raise ValueError("engine state holds journal notes without their rows")
            fits = (
                len(infos) < self.capacity
                and names == self.metric_names
                and columns == list(COLUMNS)
                and rows.shape[1] == self.width
            )
            if fits:
                self.buffer[: len(infos)].copy_(rows.to(self.buffer))
                self.infos = infos
            else:
                flat = rows[: len(infos)].double().tolist()
                carried += [_decode(values, info, names, columns) for values, info in zip(flat, infos, strict=True)]
        self.carried = carried
