"""The first pass of a step against its recomputation: what differs on each rank, agreed across ranks.

Each rank compares its own loss, its own grads before a data-parallel all-reduce where the driver
measures them (``local.py``: DDP's communication hook) and its grad norm (as this rank measured it,
before the step's values are agreed) from the two passes: the same bits (two NaNs are the same), or within
``rtol`` of each other on devices whose reductions are not deterministic. One all-gather of two
flags per rank puts every rank's answer on every rank, read once (a rerun step is rare).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from stabilitykit.distributed import all_gather, is_distributed


def differs(first: Tensor | None, again: Tensor | None, rtol: float, device: torch.device) -> Tensor:
    """A 0-d device bool: ``again`` is not the same value as ``first`` (see the module docstring)."""
    if first is None or again is None:  # a value not measured (no loss recorded): nothing to compare
        return torch.zeros((), dtype=torch.bool, device=device)
    a, b = first.detach().double(), again.detach().double()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    if rtol > 0:
        same = same | ((a - b).abs() <= rtol * b.abs())
    return ~same


@dataclass(frozen=True)
class Comparison:
    """Every rank's answer: whose loss, local grads and grad norm came out otherwise the second time."""

    loss_ranks: list[int]
    grad_ranks: list[int]
    world: int
    local_ranks: list[int] = field(default_factory=list)  # local grads before the all-reduce (DDP)

    @property
    def ranks(self) -> list[int]:
        """The ranks whose first pass differed from the recomputation."""
        return sorted(set(self.loss_ranks) | set(self.local_ranks) | set(self.grad_ranks))

    @property
    def transient(self) -> bool:
        """Some rank's first pass differed: the machine, not the data or the model."""
        return bool(self.ranks)

    @property
    def rank(self) -> int | None:
        """The one rank to blame: the only one whose loss differed, else the only one whose local grads
        (before the all-reduce) did, else the only one whose grad norm did.

        Grads all-reduced across ranks (DDP) carry one rank's fault to every rank, so a loss or a local
        gradient that differs on one rank names it; when every rank differs alike there is no one to name
        (None).
        """
        if len(self.loss_ranks) == 1:
            return self.loss_ranks[0]
        if len(self.local_ranks) == 1:
            return self.local_ranks[0]
        if len(self.grad_ranks) == 1:
            return self.grad_ranks[0]
        return None


Values = tuple[Tensor | None, Tensor | None, Tensor]


def compare(first: Values, again: Values, rtol: float) -> Comparison:
    """Compare (loss, local grads or None, grad norm) of the two passes on every rank (one all-gather, one read)."""
    device = first[2].device
    here = torch.stack([differs(a, b, rtol, device) for a, b in zip(first, again, strict=True)]).to(torch.int32)
    table = all_gather(here) if is_distributed() else here[None]
    rows = table.tolist()
    return Comparison(
        loss_ranks=[r for r, row in enumerate(rows) if row[0]],
        grad_ranks=[r for r, row in enumerate(rows) if row[2]],
        world=len(rows),
        local_ranks=[r for r, row in enumerate(rows) if row[1]],
    )
