"""The step record: one optimizer step's named device values, each with its cross-rank reduction.

Everything the step knows and every rank must agree on (the grad norm, finiteness, each skip rule's
flag, a rollback request, the metrics a user records) is ``put`` here under a name with a
reduction; ``agree`` makes them identical on every rank in ONE collective and returns them by name
(float32, or float64 when a value is).
Nothing leaves the device.

The collective: a MAX all-reduce of one packed vector when every reduction can ride a MAX (``max``,
``min`` as the MAX of the negation, ``any``, ``all``), else one all-gather of the packed vector
reduced column by column (``sum``, ``mean``). Which one runs depends on the names and reductions
only, and those are fixed after the first step (``RecordLayout``), so every rank runs the same
collective in the same order. Finiteness is explicit: a ``max``/``min`` column carries its NaN as a
separate flag, because gloo's MAX drops a NaN from a non-zero rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from stabilitykit.distributed import all_gather, all_reduce, is_distributed

#: The cross-rank reductions a value can have.
REDUCTIONS: tuple[str, ...] = ("max", "min", "sum", "mean", "any", "all")
_MAX_FRIENDLY = {"max", "min", "any", "all"}


def check_reduce(name: str, reduce: str) -> None:
    """Refuse an unknown reduction, naming the value."""
    if reduce not in REDUCTIONS:
        raise ValueError(f"record({name!r}, ..., reduce={reduce!r}): reduce must be one of {', '.join(REDUCTIONS)}")


class RecordLayout:
    """The names and reductions of a user's recorded metrics, fixed after the first step.

    A name first recorded after the layout was fixed is refused: its column would change the
    journal's shape and the collective every rank runs.
    """

    def __init__(self) -> None:
        self.columns: dict[str, str] = {}
        self.fixed = False

    def declare(self, name: str, reduce: str, step: int) -> None:
        """Note that ``name`` is recorded with ``reduce`` (checked against the fixed layout)."""
        check_reduce(name, reduce)
        known = self.columns.get(name)
        if known is None:
            if self.fixed:
                raise ValueError(
                    f"metric {name!r} was first recorded at step {step}: record every metric from the first "
                    f"optimizer step on (the step record's layout is fixed after it; known: {sorted(self.columns)}). "
                    "Record a placeholder such as torch.zeros(()) on steps where it has no value."
                )
            self.columns[name] = reduce
        elif known != reduce:
            raise ValueError(f"metric {name!r} is recorded with reduce={reduce!r} but was {known!r} before")

    def fix(self) -> None:
        """No new names from now on."""
        self.fixed = True

    @property
    def names(self) -> list[str]:
        """The recorded metrics' names, in the order they were first recorded."""
        return list(self.columns)


class StepRecord:
    """Named device values of one step and how each is agreed across ranks."""

    def __init__(
        self,
        values: dict[str, Tensor] | None = None,
        reductions: dict[str, str] | None = None,
        flags: list[Tensor] | None = None,
    ) -> None:
        """Empty (``put`` fills it), or holding 0-d ``values`` whose ``reductions`` (the same names, in the same
        order) are known already, as a step's record is built (``reductions`` is shared, not copied)."""
        self.values: dict[str, Tensor] = {} if values is None else values
        self.reductions: dict[str, str] = {} if reductions is None else reductions
        #: The skip rules' flags on this rank, in rule order (``StepInputs.build_record``).
        self.flags: list[Tensor] = [] if flags is None else flags

    def put(self, name: str, value: Tensor, reduce: str) -> None:
        """Hold ``value`` (a 0-d device tensor) under ``name``, agreed with ``reduce``."""
        self.values[name] = value if value.dim() == 0 else value.reshape(())  # no op for a 0-d value
        self.reductions[name] = reduce

    def __getitem__(self, name: str) -> Tensor:
        return self.values[name]

    def agree(self, enabled: bool = True, group: Any | None = None) -> dict[str, Tensor]:
        """Every value made identical on every rank (one collective; none with one process or
        ``enabled=False``). Booleans come back as bools, the rest as float32 (float64 if any value is)."""
        if not enabled or not is_distributed():
            return self.values  # nothing to agree: the values themselves (callers do not change them)
        names = list(self.values)
        if all(self.reductions[n] in _MAX_FRIENDLY for n in names):
            return self._agree_by_max(names, group)
        return self._agree_by_gather(names, group)

    def _dtype(self) -> torch.dtype:
        """float64 when any value is (an fp64 re-measure must not overflow fp32), else float32."""
        return torch.float64 if any(v.dtype == torch.float64 for v in self.values.values()) else torch.float32

    def _agree_by_max(self, names: list[str], group: Any | None) -> dict[str, Tensor]:
        """One MAX all-reduce: ``min`` negated, booleans as 0/1 (``all`` as NOT any(NOT x)), and each
        ``max``/``min`` value's NaN as its own flag."""
        parts: list[Tensor] = []
        dtype = self._dtype()
        for name in names:
            v, how = self.values[name], self.reductions[name]
            if how in ("any", "all"):
                flag = v.bool() if how == "any" else ~v.bool()
                parts.append(flag.to(dtype).reshape(1))
                continue
            x = v.to(dtype)
            x = -x if how == "min" else x
            nan = torch.isnan(x)
            parts.append(torch.stack([nan.to(dtype), torch.where(nan, torch.full_like(x, -math.inf), x)]))
        packed = torch.cat(parts)
        device = packed.device
        if dist.get_backend(group) == "nccl" and device.type != "cuda":  # pragma: no cover - GPU only
            packed = packed.cuda()
        all_reduce(packed, dist.ReduceOp.MAX, group)
        packed = packed.to(device)
        out: dict[str, Tensor] = {}
        i = 0
        for name in names:
            how = self.reductions[name]
            if how in ("any", "all"):
                raised = packed[i] > 0
                out[name] = raised if how == "any" else ~raised
                i += 1
                continue
            value = torch.where(packed[i] > 0, torch.full_like(packed[i + 1], math.nan), packed[i + 1])
            out[name] = -value if how == "min" else value
            i += 2
        return out

    def _agree_by_gather(self, names: list[str], group: Any | None) -> dict[str, Tensor]:
        """One all-gather of the packed values, reduced per column here (NaN propagates)."""
        dtype = self._dtype()
        packed = torch.stack([self.values[n].to(dtype) for n in names])
        device = packed.device
        if dist.get_backend(group) == "nccl" and device.type != "cuda":  # pragma: no cover - GPU only
            packed = packed.cuda()
        table = all_gather(packed, group).to(device)  # (world, columns)
        out: dict[str, Tensor] = {}
        for i, name in enumerate(names):
            col, how = table[:, i], self.reductions[name]
            if how == "any":
                out[name] = (col > 0).any()
            elif how == "all":
                out[name] = (col > 0).all()
            elif how == "max":
                out[name] = col.amax()
            elif how == "min":
                out[name] = col.amin()
            elif how == "sum":
                out[name] = col.sum()
            else:
                out[name] = col.mean()
        return out
