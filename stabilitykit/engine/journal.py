"""The device journal: one row of named columns per optimizer step, read to the host in one copy.

A row holds ``total`` (pre-clip norm), ``loss``, ``code`` (the step's decision code, see
``engine/decision.py``: 0 taken, else why it was skipped), ``coef`` (clip coefficient),
``threshold``, ``request`` (a rollback request agreed across ranks in this step's all-reduce, 0 for
none: ``recovery/agreement.py``) and then one norm per layer. Rows stay on the device until a logging step (or a
step whose decision the host must know now) reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from stabilitykit.engine.decision import BAD_BATCH, BAD_GRAD, BAD_LOSS, OVERFLOW, REMOTE, SKIP, SPIKE

__all__ = ["COLUMNS", "MAX_JOURNAL_ROWS", "Journal", "Row", "RowInfo", "upgrade_v1_rows", "upgrade_v2_rows"]

#: The scalar columns of a row, in order; the per-layer norms follow.
COLUMNS = ("total", "loss", "code", "coef", "threshold", "request")
TOTAL, LOSS, CODE, COEF, THRESHOLD, REQUEST = range(len(COLUMNS))
#: Rows kept on the device between reads. A log cadence above this reads the journal early (one sync).
MAX_JOURNAL_ROWS = 1024


@dataclass
class RowInfo:
    """What the host knows about a row without reading the device."""

    step: int
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
    code: int  # the decision code (0: taken), see engine/decision.py
    layers: list[float] = field(default_factory=list)
    request: int = 0  # the rollback request agreed in this step's all-reduce (0: none)
    on_time: bool = False  # read before its own optimizer and scheduler step (so the skip was applied there)
    folded: bool = False

    @property
    def skipped(self) -> bool:
        """The step was skipped."""
        return bool(self.code & SKIP)


class Journal:
    """Fixed-size device buffer of step rows plus the host's notes about each."""

    def __init__(self, capacity: int, n_layers: int, device: torch.device) -> None:
        self.capacity = capacity
        self.width = len(COLUMNS) + n_layers
        self.buffer = torch.zeros(capacity, self.width, dtype=torch.float32, device=device)
        self.infos: list[RowInfo] = []

    def __len__(self) -> int:
        return len(self.infos)

    @property
    def full(self) -> bool:
        """No room for another row: the next step must read the journal."""
        return len(self.infos) >= self.capacity

    def write(self, info: RowInfo, scalars: list[Tensor], layer_norms: Tensor | None) -> None:
        """Append one row from 0-d device tensors, one per column of ``COLUMNS`` (no sync)."""
        row = self.buffer[len(self.infos)]
        torch.stack([t.to(row) for t in scalars], out=row[: len(COLUMNS)])
        if layer_norms is not None:
            row[len(COLUMNS) :].copy_(layer_norms)
        self.infos.append(info)

    def rewrite_last(self, scalars: list[Tensor], layer_norms: Tensor | None) -> None:
        """Overwrite the newest row's first ``len(scalars)`` columns and its layer norms while it is still
        held (a step re-measured after it was written; its ``request`` stays)."""
        if self.infos:
            row = self.buffer[len(self.infos) - 1]
            torch.stack([t.to(row) for t in scalars], out=row[: len(scalars)])
            if layer_norms is not None:
                row[len(COLUMNS) :].copy_(layer_norms)

    def _decode(self, values: list[float], info: RowInfo) -> Row:
        total, loss = values[TOTAL], values[LOSS]
        code = round(values[CODE])
        return Row(
            info.step,
            total,
            loss if info.has_loss else None,
            values[COEF],
            values[THRESHOLD],
            code,
            values[len(COLUMNS) :],
            request=round(values[REQUEST]),
            folded=info.folded,
        )

    def read_last(self) -> Row:
        """The newest row, now (one sync); it stays in the journal, marked as taken by the ledger."""
        info = self.infos[-1]
        row = self._decode(self.buffer[len(self.infos) - 1].tolist(), info)
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
        rows = [self._decode(flat[i * width : (i + 1) * width], info) for i, info in enumerate(self.infos)]
        for row in rows:
            row.on_time = row.folded or row.step == current_step
        self.infos = []
        return rows, flat[n * width :]

    def state_dict(self) -> dict[str, Any]:
        """The unread rows (a device tensor) and their notes: a resume loses nothing."""
        return {"rows": self.buffer[: len(self.infos)].clone(), "infos": [vars(i).copy() for i in self.infos]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore unread rows saved by ``state_dict`` (the shape must match)."""
        infos = [RowInfo(**info) for info in state.get("infos", [])]
        rows = state.get("rows")
        if infos:
            if rows is None or len(infos) > self.capacity or rows.shape[1] != self.width:
                raise ValueError("engine state holds a journal of another shape (log cadence or layers changed)")
            self.buffer[: len(infos)].copy_(rows.to(self.buffer))
        self.infos = infos


def upgrade_v1_rows(rows: Tensor, infos: list[dict[str, Any]]) -> Tensor:
    """Unread rows saved by state version 1 (a ``skip`` column of flags: 1 skipped, +2 bad batch,
    +4 spike) with the decision code in that column instead, as the host rule of that version read them."""
    out = rows.clone()
    for i, info in enumerate(infos):
        flags = round(float(rows[i, CODE]))
        code = 0
        if flags & 1:
            grad_bad = not math.isfinite(float(rows[i, TOTAL]))
            loss_bad = bool(info.get("has_loss")) and not math.isfinite(float(rows[i, LOSS]))
            if flags & 2:
                code = SKIP | BAD_BATCH
            elif flags & 4 and not (grad_bad or loss_bad):
                code = SKIP | SPIKE
            else:
                code = SKIP | (BAD_GRAD | (OVERFLOW if info.get("scaler_active") else 0) if grad_bad else 0)
                code |= BAD_LOSS if loss_bad else 0
                code |= REMOTE if code == SKIP else 0
        out[i, CODE] = code
    return out


def upgrade_v2_rows(rows: Tensor) -> Tensor:
    """Unread rows saved by state version 2 (no ``request`` column) with a zero ``request`` column."""
    zeros = torch.zeros(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
    return torch.cat([rows[:, :REQUEST], zeros, rows[:, REQUEST:]], dim=1)
