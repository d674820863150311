"""The first pass of a step against its recomputation: what differs on each rank, agreed across ranks.

Each rank compares its own loss and its own grad norm (the norm as this rank measured it, before the
step's values are agreed) from the two passes: the same bits (two NaNs are the same), or within
``rtol`` of each other on devices whose reductions are not deterministic. One all-gather of two
flags per rank puts every rank's answer on every rank, read once (a rerun step is rare).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from stabilitykit.distributed import all_gather, is_distributed


def differs(first: Tensor | None, again: Tensor | None, rtol: float) -> Tensor:
    """A 0-d device bool: ``again`` is not the same value as ``first`` (see the module docstring)."""
    if first is None or again is None:  # a step with no loss recorded: nothing to compare
        present = first if first is not None else again
        return torch.zeros((), dtype=torch.bool, device=present.device if present is not None else None)
    a, b = first.detach().double(), again.detach().double()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    if rtol > 0:
        same = same | ((a - b).abs() <= rtol * b.abs())
    return ~same


@dataclass(frozen=True)
class Comparison:
    """Every rank's answer: whose loss and whose grad norm came out otherwise the second time."""

    loss_ranks: list[int]
    grad_ranks: list[int]
    world: int

    @property
    def ranks(self) -> list[int]:
        """The ranks whose first pass differed from the recomputation."""
        return sorted(set(self.loss_ranks) | set(self.grad_ranks))

    @property
    def transient(self) -> bool:
        """Some rank's first pass differed: the machine, not the data or the model."""
        return bool(self.ranks)

    @property
    def rank(self) -> int | None:
        """The one rank to blame: the only one whose loss differed, else the only one whose grads did.

        Grads all-reduced across ranks (DDP) carry one rank's fault to every rank, so a loss that
        differs on one rank names it; when every rank differs alike there is no one to name (None).
        """
        if len(self.loss_ranks) == 1:
            return self.loss_ranks[0]
        if len(self.grad_ranks) == 1:
            return self.grad_ranks[0]
        return None


def compare(first: tuple[Tensor | None, Tensor], again: tuple[Tensor | None, Tensor], rtol: float) -> Comparison:
    """Compare (loss, grad norm) of the two passes on every rank (one all-gather, one read)."""
    here = torch.stack([differs(first[0], again[0], rtol), differs(first[1], again[1], rtol)]).to(torch.int32)
    table = all_gather(here) if is_distributed() else here[None]
    rows = table.tolist()
    return Comparison(
        loss_ranks=[r for r, row in enumerate(rows) if row[0]],
        grad_ranks=[r for r, row in enumerate(rows) if row[1]],
        world=len(rows),
    )
